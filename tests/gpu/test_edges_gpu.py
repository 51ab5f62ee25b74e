"""On a Hopper GPU: every store path ends each row where the row ends, FP8 products without
scales per K block are promoted into f32 as blockwise ones are, and the requantize pass
is the reference's float32 rule bit for bit. Judged element by element with the guard
bytes around (and between the rows of) every output (gemmspec.runtime.verify).

Row ends: packed rows whose byte length is not a multiple of 16 (BF16 N = 4100, 4098,
100, 520; f32 N = 4097), padded rows (the bytes between rows belong to no element), FP8
outputs and scattered rows, over leaves of 0, 1, 2, 127 and 129 rows placed so that a
one-row leaf sits right before a long one: a one-row leaf's rows are describable by TMA
whatever their stride, and a TMA store writes whole 16-byte chunks, so its row's end
would be written over the next leaf's first row. Each case is checked on two calls with
fresh data. Skipped elsewhere, with a reason."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import gemmspec
from gemmspec.reference.data import (
    TensorData,
    element_offsets,
    expand_scales,
    quantize_real_values,
    random_inputs,
    random_runtime,
    requantize_values,
    scale_offsets,
)
from gemmspec.runtime.verify import check_random, device_arguments

pytestmark = pytest.mark.gpu

# A one-row leaf before long ones, empty leaves, 2, 127 and 129 rows.
COUNTS = [130, 0, 1, 300, 2, 127, 1, 129]

PLAIN = """
gemm row_end {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = 8] = ragged(T, offsets = offs)
  tensor x : {a} [T, K]{sa}
  tensor w : {a} [E, N, K]{sw}
  tensor y : {d} [T, N]{layout}{sy}
  y[t, n] {op} sum[k] x[t, k] * w[expert(t), n, k]
}}
"""

SCATTERED = """
gemm row_end_scatter {{
  dim T, S
  dim N = {n}, K = {k}
  group expert[E = 8] = ragged(T, offsets = offs)
  tensor x   : bf16 [T, K]
  tensor w   : bf16 [E, N, K]
  tensor dst : i32 [T]
  tensor y   : bf16 [S, N]
  y[dst[t], n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""

FP8_SCALES = (" scale f32 [1, 128]", " scale f32 [1, 128, 128]")


def _plain(n: int, d: str = "bf16", op: str = "=", k: int = 512, fp8: bool = False, layout: str = "") -> str:
    sa, sw = FP8_SCALES if fp8 else ("", "")
    sy = " scale f32 [1, 128]" if d == "e4m3" else ""
    return PLAIN.format(n=n, k=k, a="e4m3" if fp8 else "bf16", sa=sa, sw=sw, d=d, layout=layout, sy=sy, op=op)


ROW_END_CASES = {
    **{f"bf16-n{n}": _plain(n) for n in (4100, 4098, 100, 520)},
    **{f"bf16-add-n{n}": _plain(n, op="+=") for n in (4100, 4098, 100)},
    **{f"f32-n{n}": _plain(n, d="f32") for n in (4097, 100)},
    **{f"f32-add-n{n}": _plain(n, d="f32", op="+=") for n in (4097, 4100, 520)},
    "fp8-in-bf16-n4100": _plain(4100, fp8=True),
    "bf16-padded-n4100": _plain(4100, layout=" layout row_major pad 8"),
    "bf16-add-padded-n100": _plain(100, op="+=", layout=" layout row_major pad 64"),
    "f32-add-padded-n4097": _plain(4097, d="f32", op="+=", layout=" layout row_major pad 8"),
    **{f"fp8-out-n{n}": _plain(n, d="e4m3", fp8=True) for n in (640, 4224)},
    **{f"scatter-n{n}": SCATTERED.format(n=n, k=512) for n in (4100, 4098, 100, 520)},
}


@pytest.mark.parametrize("case", sorted(ROW_END_CASES))
def test_stores_end_at_the_row_end(case):
    exe = gemmspec.build(ROW_END_CASES[case])
    dims = {"S": sum(COUNTS) + 37} if "scatter" in case else None
    for seed in (1, 2):  # two calls, fresh data and poisoned outputs each
        report = check_random(exe, lengths={"expert": COUNTS}, dims=dims, seed=seed).report
        assert report.ok, report.describe()


PER_CHANNEL = """
gemm per_channel {{
  dim T
  dim N = 512, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [{xs}]
  tensor w : e4m3 [E, N, K] scale f32 [{ws}]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
{directive}}}
"""

PER_CHANNEL_COUNTS = [0, 1, 300, 513]


@pytest.mark.parametrize("k", [7168, 16384])
@pytest.mark.parametrize("recipe", ["per-channel", "per-tensor x"])
def test_fp8_without_k_blocks_promotes_by_default(k, recipe):
    """Within the blockwise kernel's element-wise bound (BF16 output: 2^-7 of each element
    plus 1e-2 of its row's rms), where summing the whole of K in the tensor cores'
    accumulator (about 14 bits) was not."""
    xs = "1, K" if recipe == "per-channel" else "T, K"
    exe = gemmspec.build(PER_CHANNEL.format(k=k, xs=xs, ws="1, 1, K", directive=""))
    assert all(x.gemm.promotes and x.gemm.per_channel for x in exe.program.launches)
    for seed in (3, 4):
        report = check_random(exe, lengths={"expert": PER_CHANNEL_COUNTS}, seed=seed).report
        assert report.ok, report.describe()


@pytest.mark.parametrize("k", [7168, 16384])
def test_fast_accumulation_is_the_opt_in(k):
    """accumulate(fast): the whole of K in the tensor cores' accumulator. Its error is
    measured and printed (docs/language.md quotes it); every element is written and
    finite, and the result stays within 4x the blockwise bound."""
    exe = gemmspec.build(PER_CHANNEL.format(k=k, xs="1, K", ws="1, 1, K", directive="  accumulate(fast)\n"))
    assert all(not x.gemm.promotes and x.gemm.fast_accum for x in exe.program.launches)
    call = check_random(exe, lengths={"expert": PER_CHANNEL_COUNTS}, seed=3)
    (check,) = call.report.checks
    print(f"accumulate(fast), K = {k}: {check.describe()}")
    assert check.unwritten == 0 and check.clobbered == 0
    loose = check_random(exe, lengths={"expert": PER_CHANNEL_COUNTS}, seed=3, rtol=4 * 2.0**-7, atol=4e-2)
    assert loose.report.ok, loose.report.describe()


def _e4m3_of_float64(r: np.ndarray) -> np.ndarray:
    """Float64 values rounded to e4m3 (3 mantissa bits, normals from 2^-6, saturated at 448)
    to nearest even, in float64 throughout."""
    e = np.floor(np.log2(np.maximum(np.abs(r), 2.0**-6)))
    ulp = 2.0 ** (e - 3)
    return np.clip(np.round(r / ulp) * ulp, -448.0, 448.0)


REQUANT = """
gemm requant_bits {
  dim T
  dim N = 256, K = 384
  group expert[E = 5] = ragged(T, offsets = offs)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


def test_requantize_is_the_float32_rule_bit_for_bit():
    """x's values and scales are drawn so that many products land within float32's error
    of an e4m3 rounding midpoint (the test asserts that they do: float64 rounds them the
    other way); the pass's FP8 bytes and scales equal the reference's exactly."""
    exe = gemmspec.build(REQUANT)
    spec = exe.spec
    rng = np.random.default_rng(7)
    rt = random_runtime(spec, rng, lengths={"expert": [0, 1, 127, 129, 300]})
    data = random_inputs(spec, rt, rng)
    t = int(rt.dims["T"])
    # Rounding midpoints on purpose: in every [128, 1] block (per channel, 128 tokens from a
    # segment's start) the largest value is 256 and every token of a K block has one scale
    # s, not a power of two: the quotient value / (256 s / 448) is 1.75 x value, which for
    # most FP8 values lies exactly halfway between two e4m3 values. Float32 products and
    # scales move it off the midpoint one way, float64 another.
    offs = rt.tensors["offs"]
    starts = np.concatenate([np.arange(a, b, 128) for a, b in zip(offs[:-1], offs[1:])])
    for name in ("x", "dy"):
        values = np.clip(data[name].values, -256.0, 256.0)
        values[starts] = 256.0
        blocks = data[name].scale_grid.shape[1]
        grid = np.broadcast_to((0.3 + 0.0137 * np.arange(blocks)).astype(np.float32), data[name].scale_grid.shape)
        data[name] = TensorData(values, np.ascontiguousarray(grid))
    init = {"dw": np.full((5, 256, 384), np.nan)}
    args, keep, _ = device_arguments(spec, rt, data, init)
    run = exe.prepare(**args)
    run.enqueue()
    run.synchronize()
    differ = 0
    for i, (src, dst) in enumerate((("x", "x_q"), ("dy", "dy_q"))):
        target = spec.tensor(dst)
        want, want_grid = requantize_values(spec, rt, spec.tensor(src), data[src], target)
        off = element_offsets(spec, rt, target)
        got = run.buffers[f"prepass{i}.{dst}"].to_numpy((int(off.max(initial=-1)) + 1,), np.uint8)
        want_bytes = want.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        assert np.array_equal(got[off], want_bytes), f"{dst}: FP8 bytes"
        s_off = scale_offsets(spec, rt, target)
        got_grid = run.buffers[f"prepass{i}.{dst}_scale"].to_numpy((int(s_off.max(initial=-1)) + 1,), np.float32)
        assert np.array_equal(got_grid[s_off].view(np.uint32), want_grid.astype(np.float32).view(np.uint32)), dst
        # The same quotients in float64, rounded to e4m3 here (a float64 -> float8 cast may
        # pass through float32 and land back on the midpoint).
        real = data[src].values * np.repeat(data[src].scale_grid.astype(np.float64), 128, axis=1)[:, : want.shape[1]]
        _, grid64 = quantize_real_values(spec, rt, real, target)
        differ += int((_e4m3_of_float64(real / expand_scales(spec, rt, target, grid64)) != want).sum())
    assert t > 0 and differ > 0, "no value near a rounding midpoint: the data does not test the rule"
    print(f"requantize: {differ} values that float64 would round the other way, all as the reference says")
