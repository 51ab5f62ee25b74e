"""CUDA C++ -> cubin through NVRTC (cuda.core), with a crash-safe on-disk cache.

Compiling needs no GPU: NVRTC and the toolkit headers come from pip wheels
(``nvidia-cuda-nvrtc``, ``nvidia-cuda-runtime``), so cubins can be built, cached and
disassembled on any machine. A cache entry is the raw ELF cubin followed by
`gemmspec.diskcache`'s trailer (magic, the full cache key, the length, a sha256): it is
loaded only when it is a regular file of bounded size owned by this user, its trailer
checks and it records this very key; anything else is ignored and rewritten. The cache
folder is created private (0700).
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import nvrtc
from cuda.core import Program, ProgramOptions
from cuda.core._utils.cuda_utils import CUDAError
from cuda.pathfinder import find_nvidia_binary_utility, find_nvidia_header_directory

from gemmspec.diskcache import cache_enabled, default_cache_dir, read_entry, write_entry
from gemmspec.errors import CompileError, GemmspecError

__all__ = [
    "CompiledCubin",
    "compile_cubin",
    "cuda_include_dirs",
    "default_cache_dir",
    "disassemble",
    "nvrtc_version",
]

_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inl")
# Format 2 records the key; format 1 entries (no key) fail the magic and are recompiled.
_CUBIN_MAGIC = b"GSCUBIN2"
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


@dataclass(frozen=True)
class CompiledCubin:
    """A compiled module: `key` is the cache key, `log` NVRTC's output ("" on a cache hit)."""

    name: str
    cubin: bytes
    key: str
    log: str
    from_cache: bool


@functools.cache
def _toolkit_include_dir() -> str:
    candidates = [find_nvidia_header_directory("cudart")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "include"))
    candidates.append("/usr/local/cuda/include")
    for cand in candidates:
        if cand and os.path.isfile(os.path.join(cand, "cuda_fp8.h")):
            return os.path.abspath(cand)
    raise CompileError(
        "CUDA toolkit headers (cuda_fp8.h) not found; install the nvidia-cuda-runtime "
        "wheel or set CUDA_HOME to a CUDA toolkit"
    )


def cuda_include_dirs() -> list[str]:
    """Directories holding the CUDA toolkit headers (cuda_fp8.h, cuda_bf16.h, ...)."""
    return [_toolkit_include_dir()]


@functools.cache
def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC library in use; part of every cache key."""
    err, major, minor = nvrtc.nvrtcVersion()
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise CompileError(f"cannot query the NVRTC version: {err.name}")
    return int(major), int(minor)


# --- options ---------------------------------------------------------------------

# NVRTC flags accepted in `extra_options`, mapped onto ProgramOptions fields
# (cuda.core takes typed fields, not raw flag strings).
_FLAG_OPTIONS = {
    "-lineinfo": "lineinfo",
    "--generate-line-info": "lineinfo",
    "-use_fast_math": "use_fast_math",
    "--use_fast_math": "use_fast_math",
    "-G": "debug",
    "--device-debug": "debug",
    "-restrict": "restrict",
    "--restrict": "restrict",
}


def _program_options(
    name: str, arch: str, include_dirs: Sequence[str], extra_options: Sequence[str]
) -> ProgramOptions:
    fields: dict[str, object] = {}
    macros: list[str | tuple[str, str]] = []
    ptxas: list[str] = []
    for opt in extra_options:
        flag, eq, value = opt.partition("=")
        if opt in _FLAG_OPTIONS:
            fields[_FLAG_OPTIONS[opt]] = True
        elif opt.startswith("-D") and len(opt) > 2:
            macros.append((flag[2:], value) if eq else opt[2:])
        elif flag in ("-maxrregcount", "--maxrregcount") and value.isdigit():
            fields["max_register_count"] = int(value)
        elif flag in ("-Xptxas", "--ptxas-options") and value:
            ptxas.extend(value.split(","))
        else:
            raise CompileError(
                f"unsupported NVRTC option {opt!r}; supported: {sorted(_FLAG_OPTIONS)}, "
                "-DNAME[=VALUE], -maxrregcount=N, -Xptxas=OPT[,OPT]"
            )
    if macros:
        fields["define_macro"] = macros
    if ptxas:
        fields["ptxas_options"] = ptxas
    return ProgramOptions(
        name=f"{name}.cu", arch=arch, include_path=list(include_dirs), std="c++17", **fields
    )


# --- cache key -------------------------------------------------------------------


def _update(h: hashlib._Hash, data: bytes | str) -> None:
    """Length-prefixed update, so concatenations of different parts never collide."""
    raw = data.encode() if isinstance(data, str) else data
    h.update(len(raw).to_bytes(8, "little"))
    h.update(raw)


def _headers_digest(directory: str, recursive: bool) -> bytes:
    h = hashlib.sha256()
    root = Path(directory)
    files = root.rglob("*") if recursive else root.glob("*")
    for path in sorted(p for p in files if p.suffix in _HEADER_SUFFIXES and p.is_file()):
        _update(h, path.relative_to(root).as_posix())
        _update(h, path.read_bytes())
    return h.digest()


@functools.cache
def _toolkit_digest() -> bytes:
    # The toolkit does not change under a running process; hash its top level once.
    return _headers_digest(_toolkit_include_dir(), recursive=False)


def _cache_key(
    source: str, include_dirs: Sequence[str], arch: str, extra_options: Sequence[str]
) -> str:
    h = hashlib.sha256()
    _update(h, "gemmspec-cubin-v1")
    _update(h, source)
    for directory in include_dirs:
        _update(h, _headers_digest(directory, recursive=True))
    _update(h, _toolkit_digest())
    _update(h, arch)
    _update(h, "\0".join(extra_options))
    _update(h, "nvrtc {}.{}".format(*nvrtc_version()))
    return h.hexdigest()


# --- compile ---------------------------------------------------------------------


def compile_cubin(
    source: str,
    *,
    name: str,
    include_dirs: Sequence[str] = (),
    arch: str = "sm_90a",
    extra_options: Sequence[str] = (),
    cache_dir: str | None = None,
) -> CompiledCubin:
    """Compile CUDA C++ to a cubin for `arch`, reusing a cached cubin when one matches.

    The toolkit headers are always on the include path. The cache key covers the
    source, every header under `include_dirs`, the toolkit headers, `arch`,
    `extra_options` and the NVRTC version. Raises CompileError with NVRTC's log.
    """
    if not _NAME_RE.fullmatch(name):
        raise ValueError(f"program name {name!r} must match {_NAME_RE.pattern}")
    include_dirs = [os.path.abspath(d) for d in include_dirs]
    key = _cache_key(source, include_dirs, arch, extra_options)
    entry = None
    if cache_enabled():
        entry = os.path.join(cache_dir or default_cache_dir(), f"{name}-{key[:16]}.cubin")
        cached = read_entry(entry, key, _CUBIN_MAGIC)
        if cached is not None:
            return CompiledCubin(name=name, cubin=cached, key=key, log="", from_cache=True)

    options = _program_options(name, arch, [*include_dirs, *cuda_include_dirs()], extra_options)
    log = _LogSink()
    program = Program(source, code_type="c++", options=options)
    try:
        code = program.compile("cubin", logs=log)
    except CUDAError as e:
        text = str(e)
        nvrtc_log = text.partition("compilation log:")[2].strip() or text
        raise CompileError(f"NVRTC failed to compile {name} for {arch}", nvrtc_log) from e
    finally:
        program.close()
    cubin = bytes(code.code)
    if entry is not None:
        write_entry(entry, cubin, key, _CUBIN_MAGIC, "cubin")
    return CompiledCubin(name=name, cubin=cubin, key=key, log=log.text.strip(), from_cache=False)


class _LogSink:
    """The `logs` object Program.compile writes NVRTC's (warning) log into."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, chunk: str) -> None:
        self.text += chunk


# --- disassembly -----------------------------------------------------------------


def _binary_utility(tool: str) -> str | None:
    return find_nvidia_binary_utility(tool) or shutil.which(tool)


def disassemble(cubin: bytes) -> str:
    """SASS text of a cubin (cuobjdump --dump-sass), to check which instructions were emitted."""
    cuobjdump = _binary_utility("cuobjdump")
    nvdisasm = _binary_utility("nvdisasm")
    if cuobjdump is None or nvdisasm is None:
        raise GemmspecError(
            "disassembly needs cuobjdump and nvdisasm; install the nvidia-cuda-cuobjdump and "
            "nvidia-cuda-nvdisasm wheels or put a CUDA toolkit's bin/ on PATH"
        )
    # cuobjdump runs nvdisasm from PATH.
    env = dict(os.environ)
    env["PATH"] = os.pathsep.join([os.path.dirname(nvdisasm), env.get("PATH", "")])
    with tempfile.TemporaryDirectory(prefix="gemmspec-sass-") as tmp:
        path = os.path.join(tmp, "module.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run(
            [cuobjdump, "--dump-sass", path], capture_output=True, text=True, env=env
        )
    if proc.returncode != 0:
        raise GemmspecError(f"cuobjdump failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout
