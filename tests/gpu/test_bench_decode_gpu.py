"""On a Hopper GPU with torch: the bench's decode rows run whole (gemmspec's output
checked before it is timed, then torch's anchor and DeepGEMM's where importable, every
row in TB/s of the bytes read), and the decode sweep runs on a small shape. Skipped
elsewhere, with a reason."""

from __future__ import annotations

import pytest

from gemmspec import bench
from gemmspec.bench import measure, sweep
from gemmspec.bench.anchors import deepgemm

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")


@pytest.fixture(autouse=True)
def live_deepgemm(monkeypatch):
    monkeypatch.setattr(deepgemm, "DEEPGEMM", deepgemm.load())


@needs_cuda
@pytest.mark.parametrize("name", [
    "decode_ragged_E8_T128_N4096_K7168",
    "decode_masked_E32xM64_N7168_K2048",
    "decode_dsv3_fp8_T64_N7168_K2048",
    "decode_qwen3_bf16_T16_N2048_K768",
    "decode_qwen3_fp8_T16_N2048_K768",
])
def test_decode_row_checks_and_times(name):
    (case,) = [c for c in bench.CASES if c.name == name]
    results = case.measure(1)
    assert results[0].impl == "gemmspec" and results[0].check
    assert any(r.impl.startswith("torch") for r in results)
    assert all(r.unit == "TB/s" and r.work == results[0].work for r in results)
    assert all(r.ms > 0 for r in results if not r.check.startswith("not run"))
    text, _ = bench.report(results, {})
    print(text)


@needs_cuda
def test_small_decode_sweep_runs_every_point():
    small = sweep.Sweep("small", experts=16, top_k=8, n=512, k=512, tokens=(1, 8))
    results, failures = sweep.run_sweep(small, 1)
    assert failures == {}
    for p in sweep.points(small):
        rows = [r for r in results if r.case == p.name]
        assert rows[0].impl == "gemmspec" and rows[0].work == measure.decode_bytes(p.lengths, 512, 512, fp8=True)
        assert rows[1].impl.startswith("torch._scaled_grouped_mm")
    text, summary = sweep.sweep_report(small, results, failures)
    assert [len(p["systems"]) >= 2 for p in summary["points"]] == [True, True]
    print(text)
