"""Compile CUDA source to an sm_90a cubin with NVRTC (cuda.core) and disassemble it.

A test-local helper (CPU only; no GPU needed): the runtime's own NVRTC module is
written elsewhere and may replace this later.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import tempfile
from pathlib import Path


def _cu13_bin() -> Path | None:
    try:
        import nvidia.cu13  # type: ignore[import-not-found]
    except ImportError:
        return None
    for base in nvidia.cu13.__path__:
        cand = Path(base) / "bin"
        if (cand / "cuobjdump").exists():
            return cand
    return None


def cuda_header_dir() -> str:
    from cuda.pathfinder import find_nvidia_header_directory

    found = find_nvidia_header_directory("cudart")
    if found is None:
        raise RuntimeError("CUDA runtime headers not found (pip install nvidia-cuda-runtime)")
    return str(found)


def compile_cubin(
    source: str, include_dirs: list[str], name: str = "kernel.cu"
) -> tuple[bytes, str]:
    """Return (cubin bytes, compiler log) for sm_90a; raises with the log on failure."""
    from cuda.core import Program, ProgramOptions

    opts = ProgramOptions(
        arch="sm_90a",
        std="c++17",
        include_path=[*include_dirs, cuda_header_dir()],
        ptxas_options=["-v"],
        name=name,
    )
    prog = Program(source, code_type="c++", options=opts)
    logs = io.StringIO()
    obj = prog.compile("cubin", logs=logs)
    return bytes(obj.code), logs.getvalue()


def tool_path(tool: str) -> str | None:
    found = shutil.which(tool)
    if found:
        return found
    cu13 = _cu13_bin()
    return str(cu13 / tool) if cu13 and (cu13 / tool).exists() else None


def disassemble(cubin: bytes) -> str:
    """SASS text via cuobjdump --dump-sass (nvdisasm must be on PATH, so prepend its dir)."""
    cuobjdump = tool_path("cuobjdump")
    if cuobjdump is None:
        raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
    env = dict(os.environ)
    env["PATH"] = str(Path(cuobjdump).parent) + os.pathsep + env.get("PATH", "")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(
            [cuobjdump, "--dump-sass", str(path)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
        res = subprocess.run(
            [cuobjdump, "--dump-resource-usage", str(path)],
            capture_output=True,
            text=True,
            env=env,
            check=True,
        )
    return out.stdout + "\n" + res.stdout
