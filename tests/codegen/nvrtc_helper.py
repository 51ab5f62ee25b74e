"""Compile-and-disassemble for the kernel tests, through the runtime's NVRTC module.

Each compile uses a fresh cache directory so that NVRTC really runs and its log
carries the ptxas resource report (registers, spills) the tests read.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from gemmspec.runtime import nvrtc


def compile_cubin(source: str, include_dirs: list[str], name: str = "kernel.cu") -> tuple[bytes, str]:
    """Return (cubin bytes, compiler log with the ptxas report) for sm_90a."""
    with tempfile.TemporaryDirectory(prefix="gemmspec-test-") as cache:
        compiled = nvrtc.compile_cubin(
            source,
            name=Path(name).stem,
            include_dirs=include_dirs,
            extra_options=("-Xptxas=-v",),
            cache_dir=cache,
        )
    return compiled.cubin, compiled.log


def disassemble(cubin: bytes) -> str:
    """SASS text (the dev extra installs the cuobjdump and nvdisasm wheels)."""
    return nvrtc.disassemble(cubin)
