"""On a Hopper GPU with torch: the bench's scaled LoRA expand row runs whole (its fused
launch checked against the float64 reference and both separate-launch paths before it
is timed, each launch from the same restored y). Skipped elsewhere, with a reason."""

from __future__ import annotations

import pytest

from gemmspec import bench

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")
def test_lora_expand_row_checks_and_times():
    (case,) = bench.selected_cases(["lora_expand"])
    results = case.measure(1)
    assert [r.impl.split(" ")[0] for r in results][:2] == ["gemmspec", "gemmspec"]
    assert "float64 reference (sampled rows)" in results[0].check
    assert all(r.ms > 0 and r.unit == "TB/s" for r in results)
    print("\n".join(f"{r.impl}: {r.ms * 1e3:.1f} us, {r.rate:.2f} TB/s" for r in results))
