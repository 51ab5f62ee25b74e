"""Write emitted programs out as standalone files for other builds.

Every file of every spec is made in memory first (cubins included), and the names
are checked to stay distinct on case-insensitive file systems, before the first
byte is written: an error in any spec leaves the output folder as it was.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ..errors import OutputError
from ..explain import schedule_json
from ..lower.schedule import Schedule
from ..spec import Spec
from .emit import EmittedProgram
from .kernels import include_dir

_ENTRY = re.compile(
    r'extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(?:__cluster_dims__\([^)]*\)\s*)?'
    r"(\w+)\(([^)]*)\)"
)
SHARED_HEADER = "gemmspec_ptx.cuh"
# A stem plus its longest suffix (`_prepass<i>.cubin`, `.schedule.json`) stays well
# under MAX_FILE_NAME_BYTES, which leaves room for a temporary name below 255 bytes.
_MAX_STEM_BYTES = 150
MAX_FILE_NAME_BYTES = 200


def entry_points(source: str) -> list[str]:
    """`extern "C"` kernel declarations found in emitted source."""
    return [
        f'extern "C" __global__ void {name}({" ".join(params.split())});'
        for name, params in _ENTRY.findall(source)
    ]


def _name_hash(spec_name: str) -> str:
    return hashlib.sha256(spec_name.encode("utf-8")).hexdigest()


def file_stem(spec_name: str) -> str:
    """The stem of a spec's files: its name, or a cut of a long name plus a hash of all of it."""
    raw = spec_name.encode("utf-8")
    if len(raw) <= _MAX_STEM_BYTES:
        return spec_name
    head = raw[: _MAX_STEM_BYTES - 17].decode("utf-8", errors="ignore")
    return f"{head}_{_name_hash(spec_name)[:16]}"


def header_guard(spec_name: str) -> str:
    """Include guard of a spec's header; the hash of the exact name keeps `moe` and `MOE` apart."""
    stem = re.sub(r"\W", "_", file_stem(spec_name), flags=re.ASCII)
    return f"GEMMSPEC_{stem.upper()}_{_name_hash(spec_name)[:8].upper()}_H"


@dataclass(frozen=True)
class SpecFiles:
    """What `compile` writes for one spec: file name -> content, nothing written yet."""

    spec: Spec
    files: dict[str, bytes]


def spec_files(
    spec: Spec, schedule: Schedule, program: EmittedProgram, cubins: bool = False
) -> SpecFiles:
    """Every file of one spec: per kernel a .cu (and a .cubin), then the .h and the schedule."""
    stem = file_stem(spec.name)
    files: dict[str, bytes] = {}
    decls: list[str] = []
    for fname, source in program.sources().items():
        if fname.startswith(program.spec):
            fname = stem + fname[len(program.spec) :]
        files[fname] = source.encode("utf-8")
        decls += entry_points(source)
        if cubins:
            from ..runtime.nvrtc import compile_cubin

            kernel = Path(fname).stem
            compiled = compile_cubin(source, name=kernel, include_dirs=[include_dir()])
            files[f"{kernel}.cubin"] = compiled.cubin
    guard = header_guard(spec.name)
    header = "\n".join(
        [
            f"// Entry points emitted by gemmspec for spec '{spec.name}'. Launch order and",
            f"// arguments: {stem}.schedule.json and docs/kernel-abi.md.",
            f"#ifndef {guard}",
            f"#define {guard}",
            f'#include "{SHARED_HEADER}"',
            *sorted(set(decls)),
            f"#endif  // {guard}",
            "",
        ]
    )
    files[f"{stem}.h"] = header.encode("utf-8")
    doc = json.dumps(schedule_json(spec, schedule), indent=2) + "\n"
    files[f"{stem}.schedule.json"] = doc.encode("utf-8")
    return SpecFiles(spec, files)


def check_file_names(planned: Sequence[SpecFiles]) -> None:
    """Refuse file names that clash on a case-insensitive file system, or are too long."""
    owners: dict[str, tuple[str, Spec | None]] = {SHARED_HEADER.casefold(): (SHARED_HEADER, None)}
    for sf in planned:
        for name in sf.files:
            if len(name.encode("utf-8")) > MAX_FILE_NAME_BYTES:
                raise OutputError(
                    f"spec '{sf.spec.name}' would write a file name longer than "
                    f"{MAX_FILE_NAME_BYTES} bytes: {name}"
                )
            folded = name.casefold()
            if folded in owners:
                other_name, other = owners[folded]
                raise OutputError(_clash(sf.spec, name, other, other_name))
            owners[folded] = (name, sf.spec)


def _clash(spec: Spec, name: str, other: Spec | None, other_name: str) -> str:
    where = f"{spec.path}:{spec.line}"
    if other is None:
        return (
            f"spec '{spec.name}' ({where}) would write {name}, which is gemmspec's own "
            f"{other_name} on a case-insensitive file system; rename the spec"
        )
    return (
        f"specs '{other.name}' ({other.path}:{other.line}) and '{spec.name}' ({where}) would write "
        f"files whose names differ only in case ({other_name}, {name}), which collide on "
        "case-insensitive file systems; rename one of the specs"
    )


def write_programs(
    programs: Sequence[tuple[Spec, Schedule, EmittedProgram]], out: Path, cubins: bool = False
) -> list[Path]:
    """Write every spec's files and the shared PTX header into `out`; returns the paths."""
    from ..pipeline import make_output_dir, write_if_changed

    planned = [spec_files(spec, schedule, program, cubins) for spec, schedule, program in programs]
    check_file_names(planned)
    for name in [SHARED_HEADER, *(n for sf in planned for n in sf.files)]:
        if (out / name).is_dir():
            raise OutputError(f"cannot write {out / name}: a directory is in the way", str(out / name))
    make_output_dir(out, "output directory")
    shared = out / SHARED_HEADER
    write_if_changed(shared, (Path(include_dir()) / SHARED_HEADER).read_bytes())
    written = [shared]
    for sf in planned:
        for name, content in sf.files.items():
            write_if_changed(out / name, content)
            written.append(out / name)
    return written


def write_program(
    spec: Spec, schedule: Schedule, program: EmittedProgram, out: Path, cubins: bool = False
) -> list[Path]:
    """`write_programs` for one spec."""
    return write_programs([(spec, schedule, program)], out, cubins)
