"""Every tile `gemmspec tune` tries on the GPU test's specs compiles for sm_90a with NVRTC
(no GPU needed) and keeps its registers: what the H200 then runs is known to build."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.pipeline import lower_file
from gemmspec.runtime import nvrtc
from gemmspec.tune import enumerate_candidates

_PATH = Path(__file__).resolve().parents[1] / "gpu" / "test_tune_gpu.py"
_SPEC = importlib.util.spec_from_file_location("tune_gpu_cases", _PATH)
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)

CANDIDATES = [
    (name, c) for name, text in (("bf16", cases.BF16), ("fp8", cases.FP8)) for c in enumerate_candidates(text).candidates
]


@pytest.mark.slow
@pytest.mark.parametrize("name, candidate", CANDIDATES, ids=[f"{n}-{c.label}" for n, c in CANDIDATES])
def test_candidate_compiles_without_spills(name, candidate, tmp_path):
    x = lower_file(candidate.text)[0]
    program = emit(x.spec, x.schedule)
    for launch in program.launches:
        compiled = nvrtc.compile_cubin(
            launch.source, name=launch.gemm.name, include_dirs=[include_dir()],
            cache_dir=str(tmp_path), extra_options=("-Xptxas=-v",),
        )
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", compiled.log)
        assert spills and all(s == ("0", "0") for s in spills), compiled.log
        if candidate.tile is not None:
            assert (launch.gemm.tile_m, launch.gemm.tile_n) == candidate.tile
