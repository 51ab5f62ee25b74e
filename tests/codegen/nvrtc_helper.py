"""Compile-and-disassemble for the kernel tests, through the runtime's NVRTC module.

Each compile uses a fresh cache directory so that NVRTC really runs and its log
carries the ptxas resource report (registers, spills) the tests read.
"""

from __future__ import annotations

import re
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


def assert_spill_free(log: str, sass: str | None = None) -> None:
    """ptxas reported its resources and 0 bytes of spill for every function; with `sass`,
    no local-memory instruction (LDL/STL) either."""
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills, f"no ptxas resource report in log:\n{log}"
    assert all(s == ("0", "0") for s in spills), f"register spills:\n{log}"
    if sass is not None:
        assert not re.search(r"\b(LDL|STL)\b", sass), "local memory traffic in SASS"


def spill_free_sass(source: str, include_dirs: list[str], name: str) -> str:
    """Compile `source` for sm_90a, assert no warning and no spill, return its SASS."""
    cubin, log = compile_cubin(source, include_dirs, name=name)
    assert "warning" not in log, log
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    return sass
