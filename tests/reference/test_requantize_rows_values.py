"""requantize(SOURCE, rows = IDX, weight = W), its values: the reference (float32, as the
kernel computes it) against a numpy formula written out per segment and token block, on
expert counts 0, 1, 127, 129 and with indices outside the source (zero rows); the flat
schedule on flat memory against the direct semantics (random ragged sizes); and the
derived backward of examples/moe_ffn_fp8_train.gspec run by the flat executor against
float64 gradients computed from the forward formula."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmspec.backward import derive_backward
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import (
    Runtime,
    TensorData,
    dim_size,
    element_offsets,
    quantize_real_values,
    random_inputs,
    random_runtime,
    requantize_rows_values,
    requantize_values,
    scale_offsets,
)
from gemmspec.reference.direct import derive, run_direct
from gemmspec.reference.schedule_exec import run_prepass, run_schedule

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"
COUNTS = [0, 1, 127, 129]

SPEC = """\
gemm rows_weight {{
  dim T, S
  dim N = {n}, K = 200
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor dy  : {fp8} [S, N] scale f32 [1, 128]
  tensor x_t : e4m3 [T, K] layout segment_major(expert){pad} scale f32 [128, 1] per expert
  tensor dy_q : {out} [T, N] layout segment_major(expert){pad} scale f32 [128, 1] per expert = requantize(dy{opts})
  tensor dw  : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_t[t, k]
}}
"""


def spec_text(n=264, opts=", rows = dst, weight = rw", pad=" pad 16", fp8="e4m3", out="e4m3") -> str:
    return SPEC.format(n=n, opts=opts, pad=pad, fp8=fp8, out=out)


def formula(q, sx, index, weight, counts, fp8_max, out_type):
    """The pass by its definition, one segment and 128-token block at a time: row t is
    weight[t] * dequantized row index[t] (zero outside the source), each column of a
    block scaled by its amax / FP8 max (1 when zero), float32 throughout."""
    t_rows, c = len(index), q.shape[1]
    vals = np.zeros((t_rows, c), np.float32)
    for t in range(t_rows):
        s = index[t]
        if 0 <= s < q.shape[0]:
            row_scale = np.repeat(sx[s].astype(np.float32), 128)[:c] * np.float32(weight[t])
            vals[t] = q[s].astype(np.float32) * row_scale
    out = np.zeros((t_rows, c))
    grids = []
    start = 0
    for n in counts:
        for b0 in range(start, start + n, 128):
            b1 = min(b0 + 128, start + n)
            amax = np.abs(vals[b0:b1]).max(axis=0)
            sy = (amax / np.float32(fp8_max)).astype(np.float32)
            sy = np.where(sy > 0, sy, np.float32(1))
            r = np.clip(vals[b0:b1] / sy, -fp8_max, fp8_max)
            out[b0:b1] = r.astype(out_type).astype(np.float64)
            grids.append(sy)
        start += n
    return out, np.array(grids).reshape(-1, c)


@pytest.mark.parametrize("counts", [COUNTS, COUNTS[::-1], [129, 0, 1, 127]], ids=["up", "down", "mixed"])
@pytest.mark.parametrize("source_rows", [300, 40])
def test_the_reference_is_the_formula(counts, source_rows):
    (low,) = lower_file(spec_text())
    spec = low.spec
    rng = np.random.default_rng(sum(counts) + source_rows)
    t = sum(counts)
    rt = Runtime({"T": t, "S": source_rows}, {"offs": np.concatenate([[0], np.cumsum(counts)])})
    q = rng.uniform(-448, 448, size=(source_rows, 264)).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    sx = (2.0 ** rng.uniform(-6, 2, size=(source_rows, 3))).astype(np.float32)
    # Every fifth index is outside [0, S): above it, or negative.
    index = rng.integers(0, source_rows, size=t)
    index[::5] = np.where(np.arange(len(index[::5])) % 2, -3, source_rows + 7)
    weight = rng.standard_normal(t).astype(np.float32)
    weight[1::7] = 0.0  # a zero weight gives a zero row too
    got, grid = requantize_rows_values(
        spec, rt, spec.tensor("dy"), TensorData(q, sx), spec.tensor("dy_q"), index, weight
    )
    want, want_grid = formula(q, sx, index, weight, counts, 448.0, ml_dtypes.float8_e4m3fn)
    assert np.array_equal(got, want)
    assert np.array_equal(grid, want_grid)
    outside = (index < 0) | (index >= source_rows)
    assert (got[outside] == 0).all()


def test_without_rows_or_weight_the_rows_are_in_order_with_weight_one():
    (low,) = lower_file(spec_text(opts=", rows = dst"))
    spec = low.spec
    counts = [129, 0, 1, 127]
    rng = np.random.default_rng(5)
    t = sum(counts)
    rt = Runtime({"T": t, "S": t}, {"offs": np.concatenate([[0], np.cumsum(counts)])})
    q = rng.uniform(-448, 448, size=(t, 264)).astype(ml_dtypes.float8_e5m2).astype(np.float64)
    sx = (2.0 ** rng.uniform(-6, 2, size=(t, 3))).astype(np.float32)
    src, dst = spec.tensor("dy"), spec.tensor("dy_q")
    plain, plain_grid = requantize_rows_values(spec, rt, src, TensorData(q, sx), dst, None, None)
    want, want_grid = formula(q, sx, np.arange(t), np.ones(t), counts, 448.0, ml_dtypes.float8_e4m3fn)
    assert np.array_equal(plain, want) and np.array_equal(plain_grid, want_grid)
    # The plain requantize is the same float32 rule, bit for bit.
    same, same_grid = requantize_values(spec, rt, src, TensorData(q, sx), dst)
    assert np.array_equal(same, plain) and np.array_equal(same_grid, plain_grid)
    # The same quantization in float64 differs where a value lands within float32's error
    # of an FP8 rounding midpoint: at most one step.
    real = q * np.repeat(sx.astype(np.float64), 128, axis=1)[:, :264]
    q64, grid64 = quantize_real_values(spec, rt, real, dst)
    assert np.allclose(grid64, plain_grid, rtol=1e-6)
    assert (np.abs(q64 - plain) <= np.abs(plain) * 2**-3 + 2**-9).all()


def test_the_direct_and_flat_prepass_read_the_index_and_weight():
    """Out-of-range indices and the weight through both executors' pre-pass code."""
    (low,) = lower_file(spec_text())
    spec = low.spec
    counts = [0, 1, 127, 129]
    rng = np.random.default_rng(11)
    rt = random_runtime(spec, rng, lengths={"expert": counts}, dims={"S": 50})
    data = random_inputs(spec, rt, rng)
    index = data["dst"].values.copy()
    index[::3] = 50  # outside
    index[1::9] = -1
    data["dst"] = TensorData(index)
    direct = derive(spec, rt, data)["dy_q"]
    flat = {}
    for name in ("dy", "dst", "rw"):
        t = spec.tensor(name)
        flat[name] = np.zeros(int(element_offsets(spec, rt, t).max()) + 1)
        flat[name][element_offsets(spec, rt, t)] = data[name].values
        if t.scale is not None:
            flat[t.scale.name] = np.zeros(int(scale_offsets(spec, rt, t).max()) + 1)
            flat[t.scale.name][scale_offsets(spec, rt, t)] = data[name].scale_grid
    (p,) = low.schedule.prepasses
    run_prepass(spec, rt, p, flat)
    dst = spec.tensor("dy_q")
    assert np.array_equal(flat["dy_q"][element_offsets(spec, rt, dst)], direct.values)
    assert np.array_equal(flat["dy_q_scale"][scale_offsets(spec, rt, dst)], direct.scale_grid)
    outside = (index < 0) | (index >= 50)
    assert outside.any() and (direct.values[outside] == 0).all()


SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
EDGE_LENGTHS = st.sampled_from([0, 1, 2, 127, 128, 129, 200])
FORMS = st.sampled_from([
    dict(),
    dict(opts=", rows = dst"),
    dict(pad=""),
    dict(fp8="e5m2", out="e5m2", n=136),
])


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), source_rows=st.integers(1, 300), form=FORMS, seed=st.integers(0, 2**16))
def test_flat_schedule_equals_direct_semantics(lengths, source_rows, form, seed):
    (low,) = lower_file(spec_text(**form))
    spec = low.spec
    rng = np.random.default_rng(seed)
    # random_inputs draws the index within the source's rows (repeats allowed).
    rt = random_runtime(spec, rng, lengths={"expert": lengths}, dims={"S": source_rows})
    data = random_inputs(spec, rt, rng)
    assert (data["dst"].values < source_rows).all()
    shape = tuple(dim_size(spec, rt, d) for d in spec.tensor("dw").dims)
    init = {"dw": np.full(shape, np.nan)}
    direct = run_direct(spec, rt, data, init)["dw"]
    flat = run_schedule(spec, rt, low.schedule, data, init)["dw"]
    assert np.array_equal(np.isnan(direct), np.isnan(flat))
    m = ~np.isnan(direct)
    if m.any():
        assert np.abs(direct[m] - flat[m]).max() <= 1e-12 * max(np.abs(direct[m]).max(), 1e-300)


# ---- the derived backward of the training FFN example --------------------------------------

SMALL = {"H = 7168": "H = 384", "N = 4096": "N = 512", "F = 2048": "F = 256", "E = 8": "E = 4"}


def small_example() -> str:
    """The example with smaller compile-time dims (the statements as written)."""
    text = EXAMPLE.read_text()
    for old, new in SMALL.items():
        assert old in text
        text = text.replace(old, new)
    return text


def backward_case(counts, seed=0):
    """Forward values (real h, w_down, route_w, a permutation dst), the backward spec, its
    inputs as the forward and the caller would pass them, and the float64 gradients."""
    from gemmspec.build import build

    (fwd,) = lower_file(small_example())
    bw = derive_backward(fwd.spec)
    exe = build(bw.source)
    spec = exe.spec
    rng = np.random.default_rng(seed)
    t = sum(counts)
    h_dim, f_dim, e = 384, 256, len(counts)
    rt = Runtime({"T": t, "S": t}, {"expert_offsets": np.concatenate([[0], np.cumsum(counts)])})
    h = rng.standard_normal((t, f_dim))
    w_real = rng.standard_normal((e, h_dim, f_dim)) / 16
    dy_real = rng.standard_normal((t, h_dim))
    route_w = rng.uniform(0.1, 1.0, t).astype(np.float32)
    dst = rng.permutation(t)
    data = {
        "dst": TensorData(dst.astype(np.float64)),
        "route_w": TensorData(route_w.astype(np.float64)),
    }
    for name, real in (("dy", dy_real), ("w_down", w_real), ("h_t", h), ("h", h)):
        q, grid = quantize_real_values(spec, rt, real, spec.tensor(name))
        data[name] = TensorData(q, grid)
    # float64 gradients of y[dst[t], n] = route_w[t] * sum[f] h[t, f] * w_down[e(t), n, f],
    # from the FP8 values the backward reads (dy and w_down as stored) and the real h.
    dq = data["dy"].values * np.repeat(data["dy"].scale_grid.astype(np.float64), 128, axis=1)
    wq = data["w_down"].values * np.kron(data["w_down"].scale_grid.astype(np.float64), np.ones((1, 128, 128)))
    gid = np.repeat(np.arange(e), counts)
    dy_rows = dq[dst] * route_w[:, None].astype(np.float64)
    dh = np.einsum("tn,tnf->tf", dy_rows, wq[gid])
    dw = np.zeros((e, h_dim, f_dim))
    np.add.at(dw, gid, np.einsum("tn,tf->tnf", dy_rows, h))
    # The SwiGLU up-projection's backward runs in the same call (its values are
    # tests/front/test_swiglu_backward.py's and the GPU tests' business): x's S = T tokens
    # read through src with repeats, and w_up.
    n_dim = spec.dim("N").size
    for name, real in (("x", rng.standard_normal((t, h_dim))), ("w_up", rng.standard_normal((e, n_dim, h_dim)) / 16)):
        q, grid = quantize_real_values(spec, rt, real, spec.tensor(name))
        data[name] = TensorData(q, grid)
    data["src"] = TensorData(rng.integers(0, max(t, 1), t).astype(np.float64))
    init = {n: np.full(tuple(rt.dims.get(d) or spec.dim(d).size for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    return exe, rt, data, init, dh, dw


def _rel(got, want):
    return np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-300)


@pytest.mark.parametrize("counts", [COUNTS, [129, 127, 1, 0]], ids=["up", "down"])
def test_the_derived_backward_on_the_flat_executor_matches_float64(counts):
    exe, rt, data, init, dh, dw = backward_case(counts, seed=len(counts) + counts[0])
    passes = [(p.kind, p.source, p.index, p.weight) for p in exe.schedule.prepasses]
    assert ("requantize", "dy", "dst", "route_w") in passes
    assert all(source != "h" for _, source, _, _ in passes)  # h_t, the forward's copy, is read
    out = run_schedule(exe.spec, rt, exe.schedule, data, init)
    assert not np.isnan(out["dh"]).any() and not np.isnan(out["dw_down"]).any()
    # dh: dy and w_down are read as stored (no requantize), so bf16 rounding only.
    assert _rel(out["dh"], dh) < 4e-3, _rel(out["dh"], dh)
    # dw_down: the weighted, gathered dy requantized to 128x1 and h's FP8 copy.
    assert _rel(out["dw_down"], dw) < 0.09, _rel(out["dw_down"], dw)
    assert (out["dw_down"][counts.index(0)] == 0).all()
    # d route_w: the rows of the DGRAD before the weight dotted with the FP8 h the forward wrote.
    hq = data["h"].values * np.repeat(data["h"].scale_grid.astype(np.float64), 128, axis=1)
    drw = (dh / data["route_w"].values[:, None] * hq).sum(axis=1)
    assert _rel(out["droute_w"], drw) < 4e-3, _rel(out["droute_w"], drw)
    direct = run_direct(exe.spec, rt, data, init)
    for name in ("dh", "dw_down", "dh_pre", "droute_w"):
        assert np.allclose(out[name], direct[name], rtol=1e-12, atol=1e-12 * np.abs(direct[name]).max())
