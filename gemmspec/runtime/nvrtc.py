"""CUDA C++ -> cubin through NVRTC (cuda.core), with a crash-safe on-disk cache.

Compiling needs no GPU: NVRTC and the toolkit headers come from pip wheels
(``nvidia-cuda-nvrtc``, ``nvidia-cuda-runtime``), so cubins can be built, cached and
disassembled on any machine. A cache entry is the raw ELF cubin followed by an
80-byte trailer: magic (format version), the full cache key, the cubin's length and
a sha256 of everything before it. An entry is loaded only when it is a regular file
of bounded size owned by this user, its trailer checks and it records this very key;
anything else is ignored and rewritten. The cache folder is created private (0700).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import re
import shutil
import stat
import subprocess
import tempfile
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cuda.bindings import nvrtc
from cuda.core import Program, ProgramOptions
from cuda.core._utils.cuda_utils import CUDAError
from cuda.pathfinder import find_nvidia_binary_utility, find_nvidia_header_directory

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
_TRAILER_MAGIC = b"GSCUBIN2"
_TRAILER_LEN = len(_TRAILER_MAGIC) + 32 + 8 + 32  # magic, key, cubin length, sha256
# Cubins are at most a few tens of MB; anything larger is not ours.
_MAX_ENTRY_BYTES = 256 << 20
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


def default_cache_dir() -> str:
    """$GEMMSPEC_CACHE_DIR, else ~/.cache/gemmspec."""
    return os.environ.get("GEMMSPEC_CACHE_DIR") or os.path.expanduser("~/.cache/gemmspec")


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


# --- disk cache ------------------------------------------------------------------


def _cache_enabled() -> bool:
    return os.environ.get("GEMMSPEC_NO_CACHE", "").strip().lower() in ("", "0", "false", "no")


def _open_entry(path: str) -> tuple[int, int] | None:
    """(descriptor, size) of `path` if it is a regular file we own, of a size an entry can have."""
    # O_NOFOLLOW: a symlink is never an entry. O_NONBLOCK: opening a FIFO does not wait.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    owned = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
    if not (stat.S_ISREG(st.st_mode) and owned and _TRAILER_LEN < st.st_size <= _MAX_ENTRY_BYTES):
        os.close(fd)
        return None
    return fd, st.st_size


def _read_entry(path: str, key: str) -> bytes | None:
    """The cubin of the entry for `key`; None if absent, foreign, damaged or of another key."""
    opened = _open_entry(path)
    if opened is None:
        return None
    fd, size = opened
    chunks: list[bytes] = []
    try:
        while size > 0:
            chunk = os.read(fd, size)
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse_entry(b"".join(chunks), key)


def _parse_entry(blob: bytes, key: str) -> bytes | None:
    if len(blob) <= _TRAILER_LEN:
        return None
    body, digest = blob[:-32], blob[-32:]
    trailer = body[-(_TRAILER_LEN - 32) :]
    cubin = body[: -len(trailer)]
    magic, stored_key, length = trailer[:8], trailer[8:40], trailer[40:48]
    if magic != _TRAILER_MAGIC or int.from_bytes(length, "little") != len(cubin):
        return None
    if stored_key != bytes.fromhex(key) or hashlib.sha256(body).digest() != digest:
        return None
    return cubin


def _entry_bytes(cubin: bytes, key: str) -> bytes:
    body = cubin + _TRAILER_MAGIC + bytes.fromhex(key) + len(cubin).to_bytes(8, "little")
    return body + hashlib.sha256(body).digest()


def _write_entry(path: str, cubin: bytes, key: str) -> None:
    """Write via a temp file and os.replace, so readers never see a partial entry."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        _warn_not_caching(f"cannot create the cubin cache folder {directory}", e)
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".cubin")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_entry_bytes(cubin, key))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        _warn_not_caching(f"cannot write the cubin cache entry {path}", e)


def _warn_not_caching(what: str, e: OSError) -> None:
    # Say what went wrong (permission, disk full, ...), not just that it did.
    warnings.warn(f"gemmspec: {what}: {e.strerror or e}; not caching", RuntimeWarning, stacklevel=4)


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
    if _cache_enabled():
        entry = os.path.join(cache_dir or default_cache_dir(), f"{name}-{key[:16]}.cubin")
        cached = _read_entry(entry, key)
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
        _write_entry(entry, cubin, key)
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
