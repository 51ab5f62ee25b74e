"""scripts/decode_timeline.py re-emits the decode variant's GEMM with timestamps at
anchors in its source: each anchor must still be found once, and the stamped kernel must
still compile, or the probe would stop on the GPU. CPU only (NVRTC)."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.bench import specs
from gemmspec.codegen.kernels import include_dir

pytest.importorskip("torch", reason="the probe script imports torch")
pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "codegen"))
from nvrtc_helper import compile_cubin, disassemble  # noqa: E402


def _probe():
    spec = importlib.util.spec_from_file_location("decode_timeline", ROOT / "scripts" / "decode_timeline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stamped_decode_gemm_keeps_every_anchor_and_compiles():
    probe = _probe()
    exe = gemmspec.build(specs.moe_spec("moe_fp8", n=4096, k=7168, e=8, fp8=True, scales_major_t=True))
    launch = exe.decode.program.launches[0]
    stamped = probe.stamped(launch.source)  # raises SystemExit where an anchor is gone
    assert sorted(set(map(int, re.findall(r"GS_STAMP\((\d)\);", stamped)))) == list(range(8))
    assert "gs_probe_stamps[8] = gs_probe_now()" in stamped and stamped.count("gs_probe_timed_wait(") == 3
    # The producer's way to its first issue (12-15) and the table and maps phases (16-20,
    # this kernel has whole-buffer maps): each placed once.
    assert [stamped.count(f"gs_probe_stamps[{i}]") for i in range(12, 21)] == [1] * 9
    # (printf's arguments go through local memory: no spill check here.)
    cubin, _ = compile_cubin(stamped, [include_dir()], f"{launch.gemm.name}_stamped.cu")
    assert re.search(r"\bQGMMA\b", disassemble(cubin))
