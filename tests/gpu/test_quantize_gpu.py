"""On a Hopper GPU: quantize(x) pre-passes feeding FP8 grouped GEMMs. Against the float64
reference (ragged segments of 0, 1, 127 and 129 rows, K a multiple of 128 or not), a
3-D weight quantized in [1, 128, 128] blocks, and bit for bit against the same GEMM fed
with the numpy reference's quantization of x; the same with power-of-two scales
(quantize(x, pow2)), the corners of their rule included."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec
from gemmspec.reference.data import (
    NUMPY_TYPES,
    Runtime,
    dim_size,
    quantize_values,
    random_inputs,
    random_runtime,
)
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.verify import GuardedBuffer, run_random

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129]

TOKENS = """
gemm {name} {{
  dim T
  dim N = 264, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x   : {src} [T, K]
  tensor x_q : {fp8} [T, K] scale f32 [1, 128] = quantize(x)
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x_q[t, k] * w[expert(t), n, k]
}}
"""

WEIGHTS = """
gemm {name} {{
  dim T
  dim N = 264, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : bf16 [E, N, K]
  tensor w_q : e4m3 [E, N, K] scale f32 [1, 128, 128] = quantize(w)
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w_q[expert(t), n, k]
}}
"""

# The same GEMM with x passed in already quantized.
PREQUANTIZED = """
gemm {name} {{
  dim T
  dim N = 264, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x_q : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x_q[t, k] * w[expert(t), n, k]
}}
"""


def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


@pytest.mark.parametrize("k", [128, 1024])
@pytest.mark.parametrize("src, fp8", [("bf16", "e4m3"), ("f16", "e5m2"), ("f32", "e4m3")])
def test_quantized_tokens_match_reference(src, fp8, k):
    exe = gemmspec.build(TOKENS.format(name=f"quant_tokens_{src}_{fp8}_k{k}", src=src, fp8=fp8, k=k))
    report_ok(run_random(exe, lengths={"expert": RAGGED}, seed=k, repeats=0))


@pytest.mark.parametrize("k", [128])
def test_quantized_weights_match_reference(k):
    exe = gemmspec.build(WEIGHTS.format(name=f"quant_weights_k{k}", k=k))
    report_ok(run_random(exe, lengths={"expert": RAGGED}, seed=7 + k, repeats=0))


def _upload(values: np.ndarray, dtype: str, keep: list) -> object:
    host = np.ascontiguousarray(values.astype(np.int32 if dtype == "i32" else NUMPY_TYPES[dtype]))
    buf = DeviceBuffer.from_numpy(host.view(np.uint8) if host.size else np.zeros(16, np.uint8))
    keep.append(buf)
    return buf.view(values.shape, dtype)


def _run(exe, tensors: dict[str, tuple[np.ndarray, str]], out_shape: tuple[int, ...]) -> np.ndarray:
    """y's raw bf16 bits after one call (y poisoned with NaN first, between guard bytes
    that must come back unchanged)."""
    keep: list = []
    args = {name: _upload(v, dtype, keep) for name, (v, dtype) in tensors.items()}
    y = GuardedBuffer(np.full(out_shape, np.nan).astype(NUMPY_TYPES["bf16"]))
    args["y"] = y.view(out_shape, "bf16")
    exe(**args)
    assert y.changed_outside().size == 0, "y: a guard byte changed"
    return y.to_numpy(out_shape, NUMPY_TYPES["bf16"]).view(np.uint16)


@pytest.mark.parametrize("k", [1024])
def test_quantize_pass_is_bit_exact_with_the_reference(k):
    """y from quantize(x) on the device equals, bit for bit, y from the same GEMM fed with
    the numpy reference's x_q and scales: the pass reproduces the documented rule."""
    fused = gemmspec.build(TOKENS.format(name=f"quant_fused_k{k}", src="bf16", fp8="e4m3", k=k))
    plain = gemmspec.build(PREQUANTIZED.format(name=f"quant_plain_k{k}", k=k))
    spec = fused.spec
    rng = np.random.default_rng(k)
    rt: Runtime = random_runtime(spec, rng, lengths={"expert": RAGGED})
    data = random_inputs(spec, rt, rng)
    x = data["x"].values.copy()
    x[0, :128] = 0.0  # an all-zero block: scale 1
    x[2, :128] *= 2.0**100  # a huge block (still finite in bf16)
    x[3, -1] = 2.0**-130  # a subnormal
    q, grid = quantize_values(spec, rt, x, spec.tensor("x_q"))
    w = data["w"]
    shape = (dim_size(spec, rt, "T"), 264)
    common = {"w": (w.values, "e4m3"), "w_scale": (w.scale_grid, "f32"), "offs": (rt.tensors["offs"], "i32")}
    got = _run(fused, {"x": (x, "bf16"), **common}, shape)
    want = _run(plain, {"x_q": (q, "e4m3"), "x_q_scale": (grid, "f32"), **common}, shape)
    assert np.array_equal(got, want), f"{int((got != want).sum())} of {got.size} outputs differ"


# ---- quantize(SOURCE, pow2): power-of-two scales --------------------------------------------


def _pow2(text: str) -> str:
    out = text.replace("= quantize(x)", "= quantize(x, pow2)").replace("= quantize(w)", "= quantize(w, pow2)")
    assert out != text
    return out


@pytest.mark.parametrize("k", [128, 1024])
@pytest.mark.parametrize("src, fp8", [("bf16", "e4m3"), ("f16", "e5m2"), ("f32", "e4m3")])
def test_pow2_quantized_tokens_match_reference(src, fp8, k):
    exe = gemmspec.build(_pow2(TOKENS.format(name=f"quant_pow2_tokens_{src}_{fp8}_k{k}", src=src, fp8=fp8, k=k)))
    report_ok(run_random(exe, lengths={"expert": RAGGED}, seed=k + 1, repeats=0))


def test_pow2_quantized_weights_match_reference():
    exe = gemmspec.build(_pow2(WEIGHTS.format(name="quant_pow2_weights_k256", k=256)))
    report_ok(run_random(exe, lengths={"expert": RAGGED}, seed=9, repeats=0))


def _same_bits(got: np.ndarray, want: np.ndarray) -> None:
    """Equal bf16 bits wherever the reference's y is a number, NaN where it is NaN."""
    nan_got, nan_want = np.isnan(got.view(NUMPY_TYPES["bf16"])), np.isnan(want.view(NUMPY_TYPES["bf16"]))
    assert np.array_equal(nan_got, nan_want), f"{int((nan_got != nan_want).sum())} outputs differ in NaN-ness"
    differ = (got != want) & ~nan_want
    assert not differ.any(), f"{int(differ.sum())} of {got.size} outputs differ"


@pytest.mark.parametrize("k", [1024])
def test_pow2_quantize_pass_is_bit_exact_with_the_reference(k):
    """y from quantize(x, pow2) on the device equals, bit for bit, y from the same GEMM fed
    with the numpy reference's x_q and power-of-two scales, corners of the rule included:
    an all-zero block (scale 1), a huge block, a subnormal, amax exactly 448 * 2^-3 (scale
    2^-3) and just past 448 * 2^-2 (scale 2^-1), and an infinite element (scale +inf)."""
    fused = gemmspec.build(_pow2(TOKENS.format(name=f"quant_pow2_fused_k{k}", src="bf16", fp8="e4m3", k=k)))
    plain = gemmspec.build(PREQUANTIZED.format(name=f"quant_pow2_plain_k{k}", k=k))
    spec = fused.spec
    rng = np.random.default_rng(k + 2)
    rt: Runtime = random_runtime(spec, rng, lengths={"expert": RAGGED})
    data = random_inputs(spec, rt, rng)
    x = data["x"].values.copy()
    x[0, :128] = 0.0
    x[2, :128] *= 2.0**100
    x[3, -1] = 2.0**-130
    x[4, :128] /= 16.0
    x[4, 5] = 56.0  # 448 * 2^-3: the scale is exactly 2^-3
    x[5, 128:256] /= 16.0
    x[5, 130] = -112.5  # the next bf16 past 448 * 2^-2: the scale is 2^-1
    x[6, 300] = np.inf
    q, grid = quantize_values(spec, rt, x, spec.tensor("x_q"))
    assert grid[4, 0] == np.float32(2.0**-3) and grid[5, 1] == np.float32(2.0**-1)
    assert grid[0, 0] == 1.0 and grid[6, 2] == np.inf
    w = data["w"]
    shape = (dim_size(spec, rt, "T"), 264)
    common = {"w": (w.values, "e4m3"), "w_scale": (w.scale_grid, "f32"), "offs": (rt.tensors["offs"], "i32")}
    got = _run(fused, {"x": (x, "bf16"), **common}, shape)
    want = _run(plain, {"x_q": (q, "e4m3"), "x_q_scale": (grid, "f32"), **common}, shape)
    _same_bits(got, want)
