"""swiglu_grad's reference semantics: the flat executor (steps in the schedule's order)
equals the spec's direct semantics and the formulas written out in numpy, on row counts
0, 1, 127 and 129; the pass runs after the launch and the row pass it reads and before
the launch that reads it."""

from __future__ import annotations

import numpy as np
import pytest
from swiglu_grad_spec import SWIGLU_GRAD_SPEC, SWIGLU_GRAD_WGRAD_SPEC

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import dim_size, quantize, random_inputs, random_runtime, real_values
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule


def test_the_steps_run_writers_first():
    (low,) = lower_file(SWIGLU_GRAD_SPEC)
    s = low.schedule
    # Launches in dependency order: gu (#1), dh_pre (#2), then dx (#0).
    assert [x.statement for x in s.launches] == [1, 2, 0]
    assert s.order == (("launch", 0), ("launch", 1), ("postpass", 0), ("prepass", 0), ("launch", 2))
    assert [(k, i) for k, i, _ in s.steps()] == list(s.order)
    assert s.prepasses[0].kind == "swiglu_grad" and s.prepasses[0].other == "dh"
    assert any(r.startswith("order: launch 0, launch 1, postpass 0, prepass 0, launch 2") for r in s.reasons)


def _numpy_dgu(gu: np.ndarray, dh: np.ndarray) -> np.ndarray:
    g, u = gu[:, 0::2], gu[:, 1::2]
    with np.errstate(over="ignore"):
        sig = 1.0 / (1.0 + np.exp(-g))
    out = np.empty_like(gu)
    out[:, 0::2] = dh * u * sig * (1.0 + g * (1.0 - sig))
    out[:, 1::2] = dh * g * sig
    return out


@pytest.mark.parametrize("rows", [0, 1, 127, 129])
def test_the_flat_executor_equals_the_direct_semantics_and_numpy(rows):
    (low,) = lower_file(SWIGLU_GRAD_SPEC)
    spec = low.spec
    rng = np.random.default_rng(rows)
    rt = random_runtime(spec, rng, dims={"T": rows})
    data = random_inputs(spec, rt, rng)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, low.schedule, data, init)

    def real(name):
        return real_values(spec, rt, spec.tensor(name), data[name])

    gu = real("x") @ real("w").T
    dh = quantize(np.asarray(data["rw"].values)[:, None] * quantize(real("dy") @ real("wd").T, "bf16"), "bf16")
    want = quantize(_numpy_dgu(quantize(gu, "bf16"), dh), "bf16")  # dgu before its quantization
    # dgu in FP8 with [1, 128] scales: within half an e4m3 step (2^-4 relative) of the
    # bf16 values, the scale amax / 448 per block.
    amax = np.abs(want).reshape(rows, 4, 128).max(axis=2, initial=0.0)
    step = np.repeat(np.where(amax / 448 > 0, amax / 448, 1.0), 128, axis=1) * 448 * 2.0**-4
    for got in (direct, flat):
        assert not np.isnan(got["dx"]).any() and got["dx"].shape == (rows, 256)
    dx_want = want @ real("w_t").T
    for name, value in (("gu", quantize(gu, spec.tensor("gu").dtype)), ("dx", None)):
        if value is not None:
            scale = max(np.abs(value).max(initial=0.0), 1e-300)
            assert np.abs(direct[name] - value).max(initial=0.0) <= 1e-12 * scale
            assert np.abs(flat[name] - value).max(initial=0.0) <= 1e-6 * scale
    if rows:
        # dx reads dgu in FP8: compare with the product of its unrounded values, within
        # what the FP8 rounding of dgu allows (each element off by at most half a step).
        bound = (step / 2) @ np.abs(real("w_t")).T
        assert (np.abs(direct["dx"] - dx_want) <= bound + 1e-3 * np.abs(dx_want).max()).all()
        assert np.abs(flat["dx"] - direct["dx"]).max() <= 1e-5 * max(np.abs(direct["dx"]).max(), 1e-300)


def test_swiglu_grad_values_are_the_numpy_formula_rounded_then_quantized():
    from gemmspec.reference.data import swiglu_grad_values

    (low,) = lower_file(SWIGLU_GRAD_SPEC)
    spec = low.spec
    rng = np.random.default_rng(7)
    rt = random_runtime(spec, rng, dims={"T": 9})
    gu = rng.standard_normal((9, 512)) * 3
    dh = rng.standard_normal((9, 256))
    gu[0, :4] = [-200.0, 1.0, 200.0, 2.0]  # e^-g overflowing, and s = 1
    q, grid = swiglu_grad_values(spec, rt, spec.tensor("dgu"), gu, "bf16", dh, "bf16")
    want = quantize(_numpy_dgu(quantize(gu, "bf16"), quantize(dh, "bf16")), "bf16")
    amax = np.abs(want).reshape(9, 4, 128).max(axis=2)
    assert np.array_equal(grid, (amax.astype(np.float32) / np.float32(448)).astype(np.float32))
    deq = q * np.repeat(grid, 128, axis=1)
    assert np.all(np.abs(deq - want) <= np.repeat(grid, 128, axis=1) * 448 * 2.0**-4)
    assert q[0, 0] == 0.0 and q[0, 1] == 0.0  # g = -200: s = 0, both gradients vanish


@pytest.mark.parametrize("counts", [[0, 1, 127, 129], [129, 0, 0, 3]])
def test_the_wgrad_form_equals_the_direct_semantics_and_numpy(counts):
    """swiglu_grad into 128x1 blocks per expert segment: the same bf16 gradients, amax per
    column over each segment's 128-token block, read by a K-grouped WGRAD."""
    from gemmspec.reference.data import expand_scales, swiglu_grad_values

    (low,) = lower_file(SWIGLU_GRAD_WGRAD_SPEC)
    spec = low.spec
    (p,) = [p for p in low.schedule.prepasses if p.kind == "swiglu_grad"]
    assert (p.target_block, p.anchor, p.target_layout) == ((128, 1), "expert", "segment_major(expert) pad 16")
    rng = np.random.default_rng(sum(counts))
    rt = random_runtime(spec, rng, lengths={"expert": counts})
    data = random_inputs(spec, rt, rng)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, low.schedule, data, init)
    q, grid = swiglu_grad_values(spec, rt, spec.tensor("dgu_t"), data["gu"].values, "bf16", data["dh"].values, "bf16")
    dgu = q * expand_scales(spec, rt, spec.tensor("dgu_t"), grid)
    exact = quantize(_numpy_dgu(quantize(data["gu"].values, "bf16"), quantize(data["dh"].values, "bf16")), "bf16")
    # 128x1 blocks: within half an e4m3 step of each column block's amax / 448.
    assert np.all(np.abs(dgu - exact) <= expand_scales(spec, rt, spec.tensor("dgu_t"), grid) * 448 * 2.0**-4)
    xq = real_values(spec, rt, spec.tensor("x"), data["x"])
    offs = np.concatenate([[0], np.cumsum(counts)])
    for e, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        want = dgu[a:b].T @ xq[a:b]
        scale = max(np.abs(want).max(initial=0.0), 1e-300)
        # xq is requantized into 128x1 blocks: within FP8 rounding of x's values.
        assert np.abs(direct["dw"][e] - want).max(initial=0.0) <= 0.1 * scale
        assert np.abs(flat["dw"][e] - direct["dw"][e]).max(initial=0.0) <= 1e-6 * scale
