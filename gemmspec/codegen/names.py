"""Names that leave the compiler: file stems, include guards and C symbols.

Every symbol a spec's CUDA defines with external linkage starts with `gs_<spec>_`
(kernels) or `gemmspec_<spec>_` (the host entry points), followed by the launch or
pre-pass it belongs to, so the files of any number of specs link into one program.
The checker keeps spec names C identifiers that never start with `gs_`, which is
what makes the prefixes unambiguous.
"""

from __future__ import annotations

import hashlib
import re

# A stem plus its longest suffix (`_launch<i>_decode.cubin`, `.manifest.json`) stays well
# under MAX_FILE_NAME_BYTES, which leaves room for a temporary name below 255 bytes.
_MAX_STEM_BYTES = 150
MAX_FILE_NAME_BYTES = 200
_PROCEDURAL_PREFIX = "gs_"


def name_hash(spec_name: str) -> str:
    return hashlib.sha256(spec_name.encode("utf-8")).hexdigest()


def file_stem(spec_name: str) -> str:
    """The stem of a spec's files: its name, or a cut of a long name plus a hash of all of it."""
    raw = spec_name.encode("utf-8")
    if len(raw) <= _MAX_STEM_BYTES:
        return spec_name
    head = raw[: _MAX_STEM_BYTES - 17].decode("utf-8", errors="ignore")
    return f"{head}_{name_hash(spec_name)[:16]}"


def header_guard(spec_name: str) -> str:
    """Include guard of a spec's header; the hash of the exact name keeps `moe` and `MOE` apart."""
    stem = re.sub(r"\W", "_", file_stem(spec_name), flags=re.ASCII)
    return f"GEMMSPEC_{stem.upper()}_{name_hash(spec_name)[:8].upper()}_H"


def _tail(procedural: str) -> str:
    """A kernel configuration's procedural name without its `gs_` prefix."""
    return procedural[len(_PROCEDURAL_PREFIX) :] if procedural.startswith(_PROCEDURAL_PREFIX) else procedural


def gemm_symbol(spec_name: str, launch: int, procedural: str) -> str:
    """`gs_<spec>_l<i>_<configuration>`: the configuration still spells tile, threads and stages."""
    return f"gs_{spec_name}_l{launch}_{_tail(procedural)}"


def table_symbol(spec_name: str, launch: int, tag: str = "") -> str:
    """A launch's leaf-table builder; `tag` names a variant whose tiles differ (the table
    counts tiles, so the variant's builder is another kernel and needs its own symbol)."""
    return f"gs_{spec_name}_l{launch}_leaves" + (f"_{tag}" if tag else "")


def check_symbol(spec_name: str) -> str:
    """The offsets check, where it runs as a kernel of its own (codegen/validate.py)."""
    return f"gs_{spec_name}_check"


def prepass_symbol(spec_name: str, index: int, procedural: str) -> str:
    return f"gs_{spec_name}_p{index}_{_tail(procedural)}"


def postpass_symbol(spec_name: str, index: int, procedural: str) -> str:
    return f"gs_{spec_name}_q{index}_{_tail(procedural)}"


def host_prefix(spec_name: str) -> str:
    """Prefix of the host API: `<prefix>_args`, `<prefix>_run`, `<prefix>_workspace_bytes`."""
    return f"gemmspec_{spec_name}"
