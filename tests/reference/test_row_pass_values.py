"""The row passes' reference semantics: rowdot and rowscale on the flat executor (their
operands read through their layouts after every launch) equal the spec's direct
semantics and the formulas written out in numpy, on row counts 0, 1, 127 and 129."""

from __future__ import annotations

import numpy as np
import pytest

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import dim_size, quantize, random_inputs, random_runtime, real_values
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

SPEC = """\
gemm rp {
  dim T
  dim H = 256, F = 200
  tensor dy  : bf16 [T, H]
  tensor w   : bf16 [F, H]
  tensor h   : e4m3 [T, F] scale f32 [1, 128]
  tensor hb  : f16 [T, F] layout strides(264, 1)
  tensor rw  : f32 [T]
  tensor g   : bf16 [T, F]
  tensor drw : f32 [T] = rowdot(g, h)
  tensor dot2 : f32 [T] = rowdot(g, hb)
  tensor dh  : f32 [T, F] = rowscale(g, weight = rw)
  g[t, f] = sum[n] dy[t, n] * w[f, n]
}
"""


@pytest.mark.parametrize("rows", [0, 1, 127, 129])
def test_the_flat_executor_equals_the_direct_semantics_and_numpy(rows):
    (low,) = lower_file(SPEC)
    spec = low.spec
    rng = np.random.default_rng(rows)
    rt = random_runtime(spec, rng, dims={"T": rows})
    data = random_inputs(spec, rt, rng)
    assert not {"g", "drw", "dot2", "dh"} & set(data)  # outputs: the call writes them
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, low.schedule, data, init)
    g = real_values(spec, rt, spec.tensor("dy"), data["dy"]) @ real_values(spec, rt, spec.tensor("w"), data["w"]).T
    gb = quantize(g, "bf16")  # the row passes read g as stored
    h = real_values(spec, rt, spec.tensor("h"), data["h"])
    hb = np.asarray(data["hb"].values, dtype=np.float64)
    rw = np.asarray(data["rw"].values, dtype=np.float64)
    want = {"g": g, "drw": (gb * h).sum(axis=1), "dot2": (gb * hb).sum(axis=1), "dh": rw[:, None] * gb}
    for name, value in want.items():
        value = quantize(value, spec.tensor(name).dtype)  # stored in its type
        assert direct[name].shape == value.shape and flat[name].shape == value.shape
        assert not np.isnan(direct[name]).any() and not np.isnan(flat[name]).any()
        scale = max(np.abs(value).max(initial=0.0), 1e-300)
        assert np.abs(direct[name] - value).max(initial=0.0) <= 1e-12 * scale, name
        assert np.abs(flat[name] - value).max(initial=0.0) <= 1e-12 * scale, name


def test_a_zero_second_factor_dots_to_exact_zeros():
    (low,) = lower_file(SPEC)
    spec = low.spec
    rng = np.random.default_rng(3)
    rt = random_runtime(spec, rng, dims={"T": 5})
    data = random_inputs(spec, rt, rng)
    data["h"] = type(data["h"])(np.zeros_like(data["h"].values), data["h"].scale_grid)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    flat = run_schedule(spec, rt, low.schedule, data, init)
    assert (flat["drw"] == 0).all()
