"""Capacity groups: `ragged(T, offsets = OFFS, capacity)` lets the offsets end at or
below T; rows past the last offset are neither read nor written. Both executors of
the reference agree and leave those rows alone (tests/runtime checks the run-time
checks)."""

from __future__ import annotations

import numpy as np
import pytest

from gemmspec.bench import moe_spec
from gemmspec.errors import SpecError
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, random_inputs
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

CAPACITY = moe_spec("capacity_moe", n=72, k=300, e=4, fp8=True, scales_major_t=True, capacity=True)


@pytest.mark.parametrize("lengths", [[0, 1, 127, 129], [0, 0, 0, 0], [5, 0, 0, 300]])
def test_rows_past_the_last_offset_are_untouched(lengths):
    (lowered,) = lower_file(CAPACITY)
    spec, schedule = lowered.spec, lowered.schedule
    used, t = sum(lengths), sum(lengths) + 77  # 77 rows of capacity left over
    offs = np.array([0, *np.cumsum(lengths)], dtype=np.int64)
    rt = Runtime({"T": t}, {"offs": offs})
    rng = np.random.default_rng(1)
    data = random_inputs(spec, rt, rng)
    data.pop("y", None)
    init = {"y": np.full((t, 72), np.nan)}
    direct = run_direct(spec, rt, data, init)["y"]
    flat = run_schedule(spec, rt, schedule, data, init)["y"]
    assert np.isnan(direct[used:]).all() and np.isnan(flat[used:]).all()
    assert not np.isnan(direct[:used]).any()
    np.testing.assert_allclose(flat[:used], direct[:used], rtol=1e-6, atol=1e-6)


def test_only_the_outermost_group_may_be_a_capacity():
    text = """
gemm nested {
  dim T
  dim K = 64, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets, capacity)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets, capacity)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""
    with pytest.raises(SpecError, match="only the outermost ragged group may be a capacity"):
        lower_file(text)
    assert lower_file(text.replace("expert_offsets, capacity)", "expert_offsets)"))
