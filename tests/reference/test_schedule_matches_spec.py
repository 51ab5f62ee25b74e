"""The flat schedule, executed on flat memory as the GPU would, equals the spec's
direct semantics on random ragged sizes (zero-length groups, 1, 127, 129 rows,
K not a multiple of 128)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmspec.bench import moe_spec
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, dim_size, quantize, random_inputs, random_runtime
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

EDGE_LENGTHS = st.sampled_from([0, 1, 2, 127, 128, 129, 200])
SETTINGS = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def moe_fp8(k: int) -> str:
    return moe_spec(n=72, k=k, e=4, fp8=True, scales_major_t=True)


WGRAD = """
gemm wgrad {
  dim T
  dim N = 40, K = 24
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""

NESTED = """
gemm nested {
  dim T
  dim K = 200, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""

QKV = """
gemm qkv {
  dim T
  dim R = 16, N = 96
  group slice[S = 3] = split(N, sizes = [64, 16, 16])
  group lora[L = 3]  = ragged(T, offsets = lora_offsets)
  tensor h  : bf16 [T, S, R]
  tensor wb : bf16 [L, N, R]
  tensor y  : bf16 [T, N]
  y[t, n] = sum[r] h[t, slice(n), r] * wb[lora(t), n, r]
}
"""

MASKED = """
gemm masked {
  dim M = 130, N = 48, K = 300
  group expert[E = 3] = masked(M, counts = counts)
  tensor x : e4m3 [E, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [E, M, N]
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}
"""

TRAINING = """
gemm training {
  dim T
  dim N = 136, K = 260
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor w  : e4m3 [N, K] scale f32 [128, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor y  : bf16 [T, N]
  tensor dx : bf16 [T, K]
  tensor dw : f32  [N, K]
  tensor w_t  : e4m3 [N, K] layout major(N) scale f32 [128, 128] = transpose(w)
  tensor x_q  : e4m3 [T, K] layout major(T) scale f32 [128, 1] = requantize(x)
  tensor dy_q : e4m3 [T, N] layout major(T) scale f32 [128, 1] = requantize(dy)
  y[t, n]   = sum[k] x[t, k] * w[n, k]
  dx[t, k]  = sum[n] dy[t, n] * w_t[n, k]
  dw[n, k] += sum[t] dy_q[t, n] * x_q[t, k]
}
"""

QUANTIZED = """
gemm quantized {
  dim T
  dim N = 72, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x   : bf16 [T, K]
  tensor x_q : e4m3 [T, K] scale f32 [1, 128] = quantize(x)
  tensor w   : f16 [E, N, K]
  tensor w_q : e5m2 [E, N, K] scale f32 [1, 128, 128] = quantize(w)
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x_q[t, k] * w_q[expert(t), n, k]
}
"""


def both_executors(text: str, seed: int, lengths=None, dims=None):
    (lowered,) = lower_file(text)
    spec, schedule = lowered.spec, lowered.schedule
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths=lengths, dims=dims)
    data = random_inputs(spec, rt, rng)
    init = {}
    for g in spec.gemms:
        t = spec.tensor(g.out.tensor)
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        init[t.name] = data.pop(t.name).values if t.name in data else np.full(shape, np.nan)
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, schedule, data, init)
    return direct, flat


def _stored_step(values: np.ndarray) -> float:
    """The relative rounding step of the narrowest type that holds `values` exactly."""
    for dtype, step in (("bf16", 2.0**-8), ("f16", 2.0**-11), ("f32", 2.0**-24)):
        if np.array_equal(quantize(values, dtype), values):
            return step
    return 0.0


def assert_same(direct, flat):
    """Equal up to float64 summation order, and where a `+=` output's leaves (or launches)
    add into one element, up to one rounding of the stored type per addition: the flat
    executor stores after each leaf as the kernels do, the direct semantics once."""
    assert direct.keys() == flat.keys()
    for name in direct:
        a, b = direct[name], flat[name]
        assert np.array_equal(np.isnan(a), np.isnan(b)), f"{name}: written elements differ"
        m = ~np.isnan(a)
        if m.any():
            scale = max(np.abs(a[m]).max(), 1e-300)
            # A rounding of a partial sum is relative to the partials, which may cancel:
            # bounded by the tensor's largest value.
            step = _stored_step(a[m]) if _stored_step(b[m]) else 0.0
            assert np.abs(a[m] - b[m]).max() <= (1e-12 + 4 * step) * scale, name


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), k=st.sampled_from([128, 200, 300]), seed=st.integers(0, 2**16))
def test_moe_fp8_forward(lengths, k, seed):
    assert_same(*both_executors(moe_fp8(k), seed, {"expert": lengths}))


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_k_grouped_wgrad_with_anchored_scale_blocks(lengths, seed):
    assert_same(*both_executors(WGRAD, seed, {"expert": lengths}))


@SETTINGS
@given(lengths=st.lists(st.sampled_from([0, 1, 5, 127, 129]), min_size=6, max_size=6), seed=st.integers(0, 2**16))
def test_nested_lora_over_experts(lengths, seed):
    outer = [sum(lengths[:3]), sum(lengths[3:])]
    assert_same(*both_executors(NESTED, seed, {"lora": outer, "expert": lengths}))


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_qkv_column_slices(lengths, seed):
    assert_same(*both_executors(QKV, seed, {"lora": lengths}))


@SETTINGS
@given(counts=st.lists(st.sampled_from([0, 1, 127, 129, 130]), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_masked_counts(counts, seed):
    direct, flat = both_executors(MASKED, seed, {"expert": counts})
    assert_same(direct, flat)
    # Rows past each expert's count are never written.
    for e, c in enumerate(counts):
        assert np.isnan(direct["y"][e, c:]).all() and not np.isnan(direct["y"][e, :c]).any()


@SETTINGS
@given(t=st.sampled_from([1, 127, 129, 300]), seed=st.integers(0, 2**16))
def test_forward_dgrad_wgrad_with_planned_passes(t, seed):
    assert_same(*both_executors(TRAINING, seed, dims={"T": t}))


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_quantize_prepasses(lengths, seed):
    assert_same(*both_executors(QUANTIZED, seed, {"expert": lengths}))


@SETTINGS
@given(
    lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4),
    which=st.sampled_from(["x", "w", "both"]),
    seed=st.integers(0, 2**16),
)
def test_quantize_prepasses_with_pow2_scales(lengths, which, seed):
    text = QUANTIZED
    for t in ("x", "w") if which == "both" else (which,):
        text = text.replace(f"= quantize({t})", f"= quantize({t}, pow2)")
    (lowered,) = lower_file(text)
    assert sorted(p.target for p in lowered.schedule.prepasses if p.pow2) == sorted(
        {"x": ["x_q"], "w": ["w_q"], "both": ["w_q", "x_q"]}[which]
    )
    direct, flat = both_executors(text, seed, {"expert": lengths})
    assert_same(direct, flat)


def test_zero_tokens_everywhere():
    direct, flat = both_executors(moe_fp8(200), 0, {"expert": [0, 0, 0, 0]})
    assert direct["y"].shape == (0, 72)
    assert_same(direct, flat)


def test_wgrad_requantized_operands_stay_close_to_the_originals():
    # The requantization pass changes values only by FP8 rounding.
    direct, _ = both_executors(TRAINING, 3, dims={"T": 257})
    assert np.isfinite(direct["dw"]).all()


# ---- padded segment_major ------------------------------------------------------------------
# Segments stored in lengths rounded up to multiples of the pad, one after another: the
# schedule finds each leaf's block through its padded prefix (pstart<P>, plen<P>), the
# layout's definition places it independently (reference/data.element_offsets). The
# padding holds NaN in the flat buffers, so reading it would show.

PAD_LENGTHS = st.sampled_from([0, 1, 15, 16, 17, 127, 129])

WGRAD_PAD = WGRAD.replace("segment_major(expert)", "segment_major(expert) pad 16")

REQUANT_PAD = """
gemm wgrad_req {
  dim T
  dim N = 136, K = 260
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""

NESTED_PAD = """
gemm nested_pad {
  dim T
  dim K = 200, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R] layout segment_major(expert) pad 4
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""

SPLIT_PAD = """
gemm split_pad {
  dim N = 40, K = 24, T = 300
  group part[P = 3] = split(T, sizes = [17, 0, 283])
  tensor dy : bf16 [T, N] layout segment_major(part) pad 8
  tensor x  : bf16 [T, K] layout segment_major(part) pad 32
  tensor dw : f32 [P, N, K]
  dw[p, n, k] = sum[t in part(p)] dy[t, n] * x[t, k]
}
"""


@SETTINGS
@given(lengths=st.lists(PAD_LENGTHS, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_k_grouped_wgrad_with_padded_segments(lengths, seed):
    assert_same(*both_executors(WGRAD_PAD, seed, {"expert": lengths}))


@pytest.mark.parametrize("lengths", [[0, 1, 15, 16], [17, 127, 129, 0], [1, 1, 1, 1], [0, 0, 0, 0]])
def test_padded_wgrad_on_the_listed_counts(lengths):
    assert_same(*both_executors(WGRAD_PAD, sum(lengths), {"expert": lengths}))


@SETTINGS
@given(lengths=st.lists(PAD_LENGTHS, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_requantize_into_padded_segments_feeds_wgrad(lengths, seed):
    assert_same(*both_executors(REQUANT_PAD, seed, {"expert": lengths}))


@SETTINGS
@given(lengths=st.lists(PAD_LENGTHS, min_size=6, max_size=6), seed=st.integers(0, 2**16))
def test_nested_padded_segments_in_flat_order(lengths, seed):
    outer = [sum(lengths[:3]), sum(lengths[3:])]
    assert_same(*both_executors(NESTED_PAD, seed, {"lora": outer, "expert": lengths}))


NESTED_REQUANT_PAD = """
gemm nested_req {
  dim T
  dim N = 136, K = 260
  group lora[L = 2]   = ragged(T, offsets = lo)
  group expert[E = 3] = ragged(T within lora, offsets = eo)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


@SETTINGS
@given(lengths=st.lists(PAD_LENGTHS, min_size=6, max_size=6), seed=st.integers(0, 2**16))
def test_nested_requantize_into_padded_segments(lengths, seed):
    outer = [sum(lengths[:3]), sum(lengths[3:])]
    assert_same(*both_executors(NESTED_REQUANT_PAD, seed, {"lora": outer, "expert": lengths}))


def test_split_groups_with_padded_segments():
    assert_same(*both_executors(SPLIT_PAD, 5))


# ---- fused epilogues ----------------------------------------------------------------------

EPILOGUE_MOE = """
gemm moe_epi {
  dim T
  dim N = 72, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128] layout major(T)
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor route_w : f32 [T]
  tensor bias : bf16 [E, N] layout major(N) pad 8
  tensor y : bf16 [T, N]
  y[t, n] = route_w[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]
}
"""

EPILOGUE_LORA = """
gemm lora_epi {
  dim T
  dim N = 96, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor h  : bf16 [T, R]
  tensor wb : bf16 [L, E, N, R]
  tensor alpha : f32 [L]
  tensor route_w : bf16 [T] layout strides(3)
  tensor y  : %(D)s [T, N]
  y[t, n] += alpha[lora(t)] * route_w[t] * sum[r] h[t, r] * wb[lora(t), expert(t), n, r]
}
"""

EPILOGUE_SLICES = """
gemm qkv_epi {
  dim T
  dim R = 16, N = 96
  group slice[S = 3] = split(N, sizes = [64, 16, 16])
  group lora[L = 3]  = ragged(T, offsets = lora_offsets)
  tensor h  : bf16 [T, S, R]
  tensor wb : bf16 [L, N, R]
  tensor alpha : f32 [L, S]
  tensor bias : f32 [N]
  tensor y  : bf16 [T, N]
  y[t, n] = alpha[lora(t), slice(n)] * sum[r] h[t, slice(n), r] * wb[lora(t), n, r] + bias[n]
}
"""

EPILOGUE_WGRAD = """
gemm wgrad_epi {
  dim T
  dim N = 40, K = 24
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dy : bf16 [T, N] layout major(T)
  tensor x  : bf16 [T, K] layout major(T)
  tensor alpha : f32 [E]
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += alpha[e] * sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), k=st.sampled_from([128, 200]), seed=st.integers(0, 2**16))
def test_epilogue_row_weight_and_bias(lengths, k, seed):
    assert_same(*both_executors(EPILOGUE_MOE % {"K": k}, seed, {"expert": lengths}))


@SETTINGS
@given(
    lengths=st.lists(st.sampled_from([0, 1, 5, 127, 129]), min_size=6, max_size=6),
    d=st.sampled_from(["bf16", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_epilogue_scalar_and_row_weight_accumulated(lengths, d, seed):
    outer = [sum(lengths[:3]), sum(lengths[3:])]
    assert_same(*both_executors(EPILOGUE_LORA % {"D": d}, seed, {"lora": outer, "expert": lengths}))


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_epilogue_scalar_per_slice_and_bias(lengths, seed):
    assert_same(*both_executors(EPILOGUE_SLICES, seed, {"lora": lengths}))


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), seed=st.integers(0, 2**16))
def test_epilogue_scalar_on_k_grouped_statement(lengths, seed):
    assert_same(*both_executors(EPILOGUE_WGRAD, seed, {"expert": lengths}))


def test_epilogue_bias_written_where_k_is_empty():
    # A leaf with rows but no K still stores its bias (the sum is zero).
    text = EPILOGUE_MOE % {"K": 128}
    direct, flat = both_executors(text, 3, {"expert": [2, 0, 1, 0]})
    assert_same(direct, flat)
    assert not np.isnan(direct["y"]).any()


def test_epilogue_reference_by_hand():
    # The direct semantics spelled out for one leaf: route_w[t] * (x @ w[e].T) + bias[e].
    (lowered,) = lower_file(EPILOGUE_MOE % {"K": 128})
    spec = lowered.spec
    rng = np.random.default_rng(1)
    rt = random_runtime(spec, rng, lengths={"expert": [3, 0, 2, 1]})
    data = random_inputs(spec, rt, rng)
    init = {"y": np.full((6, 72), np.nan)}
    y = run_direct(spec, rt, data, init)["y"]
    from gemmspec.reference.data import real_values

    x = real_values(spec, rt, spec.tensor("x"), data["x"])
    w = real_values(spec, rt, spec.tensor("w"), data["w"])
    rw = np.asarray(data["route_w"].values, dtype=np.float64)
    bias = np.asarray(data["bias"].values, dtype=np.float64)
    want = rw[3:5, None] * (x[3:5] @ w[2].T) + bias[2][None, :]
    assert np.allclose(y[3:5], quantize(want, spec.tensor("y").dtype), rtol=1e-12, atol=1e-12)


# ---- SwiGLU -----------------------------------------------------------------------------

SWIGLU_FP8 = """
gemm swiglu_fp8 {
  dim T
  dim N = 144, F = 72, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor route_w : f32 [T]
  tensor h : %(D)s [T, F]
  h[t, j] = route_w[t] * silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]
}
"""

SWIGLU_BF16 = """
gemm swiglu_bf16 {
  dim T
  dim N = 48, F = 24, K = 40
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [L, E, N, K]
  tensor alpha : f32 [L]
  tensor h : f32 [F, T] layout strides(1, 29)
  h[j, t] = alpha[lora(t)] * silu(sum[k] x[t, k] * w[lora(t), expert(t), 2*j, k]) * sum[k] x[t, k] * w[lora(t), expert(t), 2*j + 1, k]
}
"""

ROWWISE = """
gemm moe_fp8_rowwise {
  dim T
  dim N = 72, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x : e4m3 [T, K] scale f32 [1, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, 1, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""


@SETTINGS
@given(
    lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4),
    k=st.sampled_from([128, 200]),
    d=st.sampled_from(["bf16", "f32"]),
    seed=st.integers(0, 2**16),
)
def test_swiglu_fp8_with_row_weight(lengths, k, d, seed):
    assert_same(*both_executors(SWIGLU_FP8 % {"K": k, "D": d}, seed, {"expert": lengths}))


@SETTINGS
@given(lengths=st.lists(st.sampled_from([0, 1, 5, 29]), min_size=6, max_size=6), seed=st.integers(0, 2**16))
def test_swiglu_nested_with_scalar_and_transposed_output(lengths, seed):
    outer = [sum(lengths[:3]), sum(lengths[3:])]
    assert_same(*both_executors(SWIGLU_BF16, seed, {"lora": outer, "expert": lengths}, {"T": sum(lengths)}))


def test_swiglu_reference_by_hand():
    # The direct semantics spelled out for one leaf: route_w[t] * silu(g) * u, with g and
    # u the products with the weight's even and odd rows.
    (lowered,) = lower_file(SWIGLU_FP8 % {"K": 200, "D": "f32"})
    spec = lowered.spec
    rng = np.random.default_rng(4)
    rt = random_runtime(spec, rng, lengths={"expert": [2, 0, 3, 1]})
    data = random_inputs(spec, rt, rng)
    y = run_direct(spec, rt, data, {"h": np.full((6, 72), np.nan)})["h"]
    from gemmspec.reference.data import real_values

    x = real_values(spec, rt, spec.tensor("x"), data["x"])
    w = real_values(spec, rt, spec.tensor("w"), data["w"])
    rw = np.asarray(data["route_w"].values, dtype=np.float64)
    g, u = x[2:5] @ w[2, 0::2].T, x[2:5] @ w[2, 1::2].T
    with np.errstate(over="ignore"):  # FP8-sized values: e^-g overflows where silu is 0
        want = rw[2:5, None] * g / (1 + np.exp(-g)) * u
    assert np.allclose(y[2:5], quantize(want, spec.tensor("h").dtype), rtol=1e-12, atol=1e-12)
    assert not np.isnan(y).any()


def test_swiglu_silu_limits():
    from gemmspec.reference.direct import silu

    x = np.array([-1e6, -800.0, -30.0, 0.0, 30.0, 1e6])
    got = silu(x)
    assert got[0] == 0 and got[1] == 0 and got[3] == 0 and got[5] == 1e6
    assert np.allclose(got[[2, 4]], [-30 / (1 + np.exp(30)), 30 / (1 + np.exp(-30))], rtol=1e-15)


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4), k=st.sampled_from([64, 200, 300]), seed=st.integers(0, 2**16))
def test_per_channel_scales(lengths, k, seed):
    assert_same(*both_executors(ROWWISE % {"K": k}, seed, {"expert": lengths}))


def test_per_channel_reference_by_hand():
    # One scale per token and per (expert, column) over the whole of K: (x @ w[e].T) * sx * sw.
    (lowered,) = lower_file(ROWWISE % {"K": 200})
    spec = lowered.spec
    rng = np.random.default_rng(3)
    rt = random_runtime(spec, rng, lengths={"expert": [2, 0, 3, 1]})
    data = random_inputs(spec, rt, rng)
    y = run_direct(spec, rt, data, {"y": np.full((6, 72), np.nan)})["y"]
    x = np.asarray(data["x"].values, dtype=np.float64)
    w = np.asarray(data["w"].values, dtype=np.float64)
    sx = np.asarray(data["x"].scale_grid, dtype=np.float64)  # [T, 1]
    sw = np.asarray(data["w"].scale_grid, dtype=np.float64)  # [E, N, 1]
    want = (x[2:5] @ w[2].T) * sx[2:5] * sw[2][:, 0][None, :]
    assert np.allclose(y[2:5], quantize(want, spec.tensor("y").dtype), rtol=1e-12, atol=1e-12)


# ---- per-tensor scales ----------------------------------------------------------------------

# x's scale is one block over the whole of T (a run-time dim) and K: one scale for all of x,
# x_scale [1, 1]; w's is one per expert. The variants swap in per-channel scales on either
# side (mixed recipes).
PER_TENSOR = """
gemm moe_fp8_tensorwise {
  dim T
  dim N = 72, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x : e4m3 [T, K] scale f32 [%(XS)s]
  tensor w : e4m3 [E, N, K] scale f32 [%(WS)s]
  tensor y : %(D)s [T, N]
  y[t, n] %(OP)s sum[k] x[t, k] * w[expert(t), n, k]
}
"""

# Fixed sizes that are no multiple of 128, a capacity buffer of T and a split N: one block
# over each whole fixed dim, whatever its size, across the segments of both groups (x has
# one scale per slice, w one per part).
PER_TENSOR_FIXED = """
gemm dense_tensorwise {
  dim T = 400
  dim N = 100, K = 200
  group part[P = 3] = ragged(T, offsets = offs, capacity)
  group slice[S = 3] = split(N, sizes = [60, 24, 16])
  tensor x : e4m3 [T, S, K] scale f32 [T, 1, K]
  tensor w : e4m3 [P, N, K] layout strides(N * (K + 16), K + 16, 1) scale f32 [1, N, K]
  tensor y : f32 [T, N]
  y[t, n] = sum[k] x[t, slice(n), k] * w[part(t), n, k]
}
"""


@SETTINGS
@given(
    lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4),
    k=st.sampled_from([64, 128, 200, 300]),
    recipe=st.sampled_from([("T, K", "1, N, K"), ("T, K", "1, 1, K"), ("1, K", "1, N, K"), ("T, K", "1, 64, K")]),
    out=st.sampled_from([("bf16", "="), ("f32", "+=")]),
    seed=st.integers(0, 2**16),
)
def test_per_tensor_scales(lengths, k, recipe, out, seed):
    text = PER_TENSOR % {"K": k, "XS": recipe[0], "WS": recipe[1], "D": out[0], "OP": out[1]}
    assert_same(*both_executors(text, seed, {"expert": lengths}))


@SETTINGS
@given(lengths=st.lists(st.sampled_from([0, 1, 2, 127, 129]), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_per_tensor_scales_over_fixed_dims_and_segments(lengths, seed):
    direct, flat = both_executors(PER_TENSOR_FIXED, seed, {"part": lengths})
    assert_same(direct, flat)
    assert np.isnan(direct["y"][sum(lengths):]).all()  # past the capacity's offsets


def test_per_tensor_reference_by_hand():
    # One scale for all of x, one per expert for w: (x @ w[e].T) * sx * sw[e].
    (lowered,) = lower_file(PER_TENSOR % {"K": 200, "XS": "T, K", "WS": "1, N, K", "D": "f32", "OP": "="})
    spec = lowered.spec
    rng = np.random.default_rng(5)
    rt = random_runtime(spec, rng, lengths={"expert": [2, 0, 3, 1]})
    data = random_inputs(spec, rt, rng)
    assert data["x"].scale_grid.shape == (1, 1) and data["w"].scale_grid.shape == (4, 1, 1)
    y = run_direct(spec, rt, data, {"y": np.full((6, 72), np.nan)})["y"]
    x = np.asarray(data["x"].values, dtype=np.float64)
    w = np.asarray(data["w"].values, dtype=np.float64)
    sx = float(data["x"].scale_grid[0, 0])
    sw = np.asarray(data["w"].scale_grid, dtype=np.float64)[:, 0, 0]
    for e, rows in ((0, slice(0, 2)), (2, slice(2, 5)), (3, slice(5, 6))):
        want = (x[rows] @ w[e].T) * sx * sw[e]
        assert np.allclose(y[rows], quantize(want, spec.tensor("y").dtype), rtol=1e-12, atol=1e-12)


def test_per_tensor_grid_is_one_scale_even_with_no_tokens():
    from gemmspec.reference.data import Runtime, scale_grid_shape

    (lowered,) = lower_file(PER_TENSOR % {"K": 200, "XS": "T, K", "WS": "1, N, K", "D": "bf16", "OP": "="})
    spec = lowered.spec
    for t in (0, 1, 300):
        rt = Runtime({"T": t}, {"expert_offsets": np.array([0, 0, 0, 0, t], dtype=np.int32)})
        assert scale_grid_shape(spec, rt, spec.tensor("x")) == (1, 1)
        assert scale_grid_shape(spec, rt, spec.tensor("w")) == (4, 1, 1)
    direct, flat = both_executors(PER_TENSOR % {"K": 200, "XS": "T, K", "WS": "1, N, K", "D": "bf16", "OP": "="}, 0, {"expert": [0, 0, 0, 0]})
    assert direct["y"].shape == (0, 72)
    assert_same(direct, flat)


def _ffn_backward_text() -> str:
    """The derived backward of examples/moe_ffn_fp8_train.gspec at small compile-time dims:
    the down-projection's DGRAD, WGRAD and row passes, the SwiGLU's recomputed gate/up,
    swiglu_grad in both forms between the launches, and scatter_add."""
    from pathlib import Path

    from gemmspec.backward import derive_backward

    text = (Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec").read_text()
    for old, new in (("H = 7168", "H = 256"), ("N = 4096", "N = 512"), ("F = 2048", "F = 256")):
        text = text.replace(old, new)
    (fwd,) = lower_file(text)
    return derive_backward(fwd.spec).source


def _all_outputs(text: str, seed: int, lengths, dims):
    """Both executors with every tensor the call writes poisoned (row passes' targets too)."""
    (lowered,) = lower_file(text)
    spec, schedule = lowered.spec, lowered.schedule
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths=lengths, dims=dims)
    data = random_inputs(spec, rt, rng)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    return run_direct(spec, rt, data, init), run_schedule(spec, rt, schedule, data, init)


@pytest.mark.slow
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.sampled_from([0, 1, 127, 129]), min_size=8, max_size=8),
    tokens=st.sampled_from([1, 50, 300]),
    seed=st.integers(0, 2**16),
)
def test_the_expert_ffn_backward_with_passes_between_launches(lengths, tokens, seed):
    assert_same(*_all_outputs(_ffn_backward_text(), seed, {"expert": lengths}, {"S": tokens}))


# A segment_major tensor whose other dim is split per leaf too (column slices of each
# adapter's block): each leaf starts at its slice inside the segment's block.
SLICED_OUT = """
gemm sliced_out {
  dim T
  dim N = 6, K = 5
  group part[P = 2] = uniform(N)
  group lora[L = 3] = ragged(T, offsets = lora_offsets)
  tensor x : bf16 [T, P, K]
  tensor w : bf16 [L, N, K]
  tensor y : f32 [T, N] layout segment_major(lora)
  y[t, n] = sum[k] x[t, part(n), k] * w[lora(t), n, k]
}
"""
SLICED_IN = """
gemm sliced_in {
  dim T
  dim N = 3, K = 4
  group part[P = 2] = uniform(K)
  group lora[L = 3] = ragged(T, offsets = lora_offsets)
  tensor x : bf16 [T, K] layout segment_major(lora)
  tensor w : bf16 [L, N, K]
  tensor y : f32 [P, T, N]
  y[p, t, n] = sum[k in part(p)] x[t, k] * w[lora(t), n, k]
}
"""


@pytest.mark.parametrize("text", [SLICED_OUT, SLICED_IN], ids=["output", "input"])
@pytest.mark.parametrize("lengths", [[1, 0, 2], [3, 1, 0], [0, 0, 4]])
def test_segment_major_with_another_dim_split_per_leaf(text, lengths):
    (lo,) = lower_file(text)
    spec = lo.spec
    rt = random_runtime(spec, np.random.default_rng(0), lengths={"lora": lengths})
    rng = np.random.default_rng(sum(lengths))
    data = random_inputs(spec, rt, rng)
    shape = tuple(dim_size(spec, rt, d) for d in spec.tensor("y").dims)
    init = {"y": rng.standard_normal(shape)}
    got = run_schedule(spec, rt, lo.schedule, dict(data), {"y": init["y"].copy()})["y"]
    want = run_direct(spec, rt, dict(data), {"y": init["y"].copy()})["y"]
    # By hand, from the logical values: every element of y is written.
    x, w = data["x"].values, data["w"].values
    bounds = np.cumsum([0, *lengths])
    expert = np.searchsorted(bounds, np.arange(bounds[-1]), side="right") - 1
    if text is SLICED_OUT:  # columns 0-2 read x[t, 0, :], columns 3-5 x[t, 1, :]
        by_hand = np.einsum("tnk,tnk->tn", np.repeat(x, 3, axis=1), w[expert])
    else:  # part p sums k over its half of K
        by_hand = np.stack([np.einsum("tk,tnk->tn", x[:, h], w[expert][:, :, h]) for h in (slice(0, 2), slice(2, 4))])
    # Every element of y is written: f32 results, within a float32 rounding of one another.
    assert np.allclose(want, by_hand, rtol=2**-23, atol=1e-12)
    assert np.allclose(got, want, rtol=2**-23, atol=1e-12)


CAPACITY_SEGMENT_MAJOR = """
gemm capacity_segment_major {
  dim T
  dim N = 3, K = 2
  group expert[E = 2] = ragged(T, offsets = offs, capacity)
  tensor dy : bf16 [T, N] layout segment_major(expert)
  tensor x  : bf16 [T, K]
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""


@pytest.mark.parametrize("ends", [[0, 1, 1], [0, 2, 3], [0, 0, 0]])
def test_a_segment_major_tensor_over_a_capacity_group(ends):
    # Rows past the offsets' end lie in no segment: a segment_major layout stores them
    # nowhere (the flat executor once wrote and read them at the buffer's last element).
    (lo,) = lower_file(CAPACITY_SEGMENT_MAJOR)
    rt = Runtime({"T": 4}, {"offs": np.array(ends)})
    data = random_inputs(lo.spec, rt, np.random.default_rng(len(ends) + ends[-1]))
    init = {"dw": np.full((2, 3, 2), 5.0)}
    got = run_schedule(lo.spec, rt, lo.schedule, dict(data), {"dw": init["dw"].copy()})["dw"]
    dy, x = data["dy"].values, data["x"].values
    by_hand = np.stack([dy[a:b].T @ x[a:b] for a, b in zip(ends, ends[1:])])
    assert np.allclose(got, by_hand, rtol=2**-23, atol=1e-12)
    assert np.allclose(run_direct(lo.spec, rt, dict(data), {"dw": init["dw"].copy()})["dw"], by_hand,
                       rtol=2**-23, atol=1e-12)
