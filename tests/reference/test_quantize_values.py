"""The float32 quantize reference against an independent per-block formulation:
zero blocks, short row blocks, saturation, NaN, both block shapes and both FP8 types.
With pow2, the scales against the rule by exact rational arithmetic (and the kernel's
integer rule on the bits of amax), every power of two float32 holds included."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, pow2_scales, quantize_values

SPEC = """
gemm g {{
  dim R
  dim C = {c}, N = 128
  tensor x   : {src} [{batch}R, C]
  tensor x_q : {dst} [{batch}R, C] scale f32 [{block}] = quantize(x)
  tensor w   : {dst} [{batch}N, C] scale f32 [{wblock}]
  tensor y   : f32 [{batch}R, N]
  y[{b}r, n] = sum[c] x_q[{b}r, c] * w[{b}n, c]
}}
"""
try:
    import torch
except ImportError:  # the numpy loop below stands in
    torch = None

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def spec_for(c: int, dst: str, rows_per_block: int, batch: bool = False, src: str = "bf16", pow2: bool = False):
    text = SPEC.format(
        c=c, src=src, dst=dst,
        batch="B, " if batch else "", b="b, " if batch else "",
        block=("1, " if batch else "") + f"{rows_per_block}, 128",
        wblock=("1, " if batch else "") + "128, 128",
    )
    if batch:
        text = text.replace("dim C =", "dim B = 2, C =").replace("dim R\n", "dim R = 131\n")
    if pow2:
        text = text.replace("= quantize(x)", "= quantize(x, pow2)")
    (lowered,) = lower_file(text)
    return lowered.spec


def by_blocks(x: np.ndarray, dst: str, br: int, bc: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize by a loop over blocks, in torch where it is installed (else numpy)."""
    dtype, fp8_max = FP8[dst]
    *lead, rows, cols = x.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    q = np.empty(x.shape, dtype=dtype)
    grid = np.empty((*lead, nr, nc), dtype=np.float32)
    for idx in np.ndindex(*lead, nr, nc):
        *b, i, j = idx
        sl = (*b, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
        block = x[sl].astype(np.float32)
        if torch is not None:
            t = torch.from_numpy(block)
            finite = t.abs()[~torch.isnan(t)]
            amax = finite.max() if finite.numel() else torch.tensor(0.0)
            scale = amax / torch.tensor(fp8_max, dtype=torch.float32)
            scale = scale if scale > 0 else torch.tensor(1.0)
            ratio = (t / scale).clamp(-fp8_max, fp8_max)
            q_torch = ratio.to(torch.float8_e4m3fn if dst == "e4m3" else torch.float8_e5m2)
            q[sl] = q_torch.view(torch.uint8).numpy().view(dtype)
            grid[idx] = scale.item()
        else:
            a = np.float32(np.nanmax(np.abs(block), initial=0))
            s = a / np.float32(fp8_max) if a > 0 else np.float32(1)
            q[sl] = np.clip(block / s, -fp8_max, fp8_max).astype(dtype)
            grid[idx] = s
    return q.astype(np.float64), grid


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("dst", ["e4m3", "e5m2"])
@pytest.mark.parametrize("br", [1, 128])
@pytest.mark.parametrize("rows, cols", [(1, 128), (3, 256), (129, 384), (130, 128)])
def test_matches_block_loop(dst, br, rows, cols):
    spec = spec_for(cols, dst, br)
    rng = np.random.default_rng(rows * cols + br)
    x = (rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-20, 20, size=(rows, 1)))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    x[0, : min(cols, 128)] = 0.0  # a zero block (the whole block when br == 1)
    if rows > 2 and cols > 5:
        x[2, 5] = np.nan
    q, grid = quantize_values(spec, Runtime({"R": rows}), x, spec.tensor("x_q"))
    q_ref, grid_ref = by_blocks(x, dst, br, 128)
    assert grid.dtype == np.float32
    assert same(grid, grid_ref)
    assert same(q, q_ref)
    if br == 1:
        assert grid[0, 0] == 1.0 and (q[0, : min(cols, 128)] == 0).all()


def test_three_d_blocks():
    spec = spec_for(256, "e4m3", 128, batch=True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 131, 256)).astype(ml_dtypes.bfloat16).astype(np.float64)
    q, grid = quantize_values(spec, Runtime({"R": 131}), x, spec.tensor("x_q"))
    q_ref, grid_ref = by_blocks(x, "e4m3", 128, 128)
    assert grid.shape == (2, 2, 2)
    assert same(grid, grid_ref) and same(q, q_ref)


def test_rule_by_hand():
    spec = spec_for(256, "e4m3", 1, src="f32")
    x = np.zeros((2, 256))
    x[0, :3] = [1.0, -3.0, 2.0]
    x[0, 128:130] = [7.0, -0.5]
    x[1, 0] = np.float32(1e-30)
    q, grid = quantize_values(spec, Runtime({"R": 2}), x, spec.tensor("x_q"))
    s = np.float32(3.0) / np.float32(448.0)
    assert grid[0, 0] == s and grid[0, 1] == np.float32(7.0) / np.float32(448.0)
    assert q[0, 1] == -448.0 and q[0, 128] == 448.0  # the block's amax maps onto the FP8 max
    want = float(np.float32(np.float32(1.0) / s).astype(ml_dtypes.float8_e4m3fn))
    assert q[0, 0] == want
    assert grid[1, 1] == 1.0 and (q[1, 128:] == 0).all()  # an all-zero block
    assert q[1, 0] == 448.0  # a lone tiny value still spans the range


def test_saturation_not_nan():
    # amax / 448 rounds down, so amax / scale may land past 448 by an ulp: it saturates.
    spec = spec_for(128, "e4m3", 1, src="f32")
    rng = np.random.default_rng(0)
    x = rng.uniform(-1e3, 1e3, size=(4096, 128)).astype(np.float32).astype(np.float64)
    q, grid = quantize_values(spec, Runtime({"R": 4096}), x, spec.tensor("x_q"))
    assert not np.isnan(q).any()
    assert np.abs(q).max() == 448.0
    over = np.abs(x.astype(np.float32) / grid.repeat(128, axis=1)) > 448.0
    assert over.any(), "no element exceeded the FP8 max before saturation"


# ---- quantize(SOURCE, pow2) --------------------------------------------------------------


def exact_pow2(amax: float, fp8_max: float) -> np.float32:
    """The documented rule by exact rational arithmetic: the least e >= -127 with
    amax <= fp8_max * 2^e (1 for 0, inf for inf), as a float32."""
    if amax == 0:
        return np.float32(1)
    if math.isinf(amax):
        return np.float32(np.inf)
    ratio = Fraction(amax) / Fraction(fp8_max)
    e = ratio.numerator.bit_length() - ratio.denominator.bit_length()
    while ratio > Fraction(2) ** e:
        e += 1
    while ratio <= Fraction(2) ** (e - 1):
        e -= 1
    return np.float32(2.0 ** max(e, -127))


def kernel_rule(amax: np.ndarray, dtype: str) -> np.ndarray:
    """The quantize kernel's scale_of for pow2 (quantize.cu.jinja), transliterated to
    numpy integer arithmetic on the bits of amax (non-negative float32, no NaN)."""
    out_max_exp = {"e4m3": 8, "e5m2": 15}[dtype]
    bits = np.asarray(amax, dtype=np.float32).view(np.uint32).astype(np.int64)
    e = (bits >> 23) - 127 - out_max_exp + ((bits & 0x7FFFFF) > 0x600000)
    e = np.maximum(e, -127)
    scale_bits = np.where(e > -127, (e + 127) << 23, 0x00400000).astype(np.uint32)
    scale = scale_bits.view(np.float32)
    scale = np.where(bits >= 0x7F800000, np.asarray(amax, dtype=np.float32), scale)
    return np.where(bits == 0, np.float32(1), scale).astype(np.float32)


def boundary_amax(fp8_max: float) -> np.ndarray:
    """FP8 max times every power of two float32 holds, with its neighbours, and the
    subnormal, zero and infinite corners."""
    with np.errstate(over="ignore"):
        base = np.float32(fp8_max) * np.ldexp(np.float32(1), np.arange(-160, 128)).astype(np.float32)
    base = base[np.isfinite(base) & (base > 0)]
    values = [base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))]
    corners = np.array([0, 2.0**-149, 2.0**-127, 2.0**-126, np.finfo(np.float32).max, np.inf], dtype=np.float32)
    return np.unique(np.concatenate(values + [corners]).astype(np.float32))


@pytest.mark.parametrize("dst", ["e4m3", "e5m2"])
def test_pow2_scales_are_the_exact_rule(dst):
    fp8_max = FP8[dst][1]
    rng = np.random.default_rng(7)
    random = (rng.uniform(0.5, 1, 4000) * 2.0 ** rng.integers(-149, 128, 4000)).astype(np.float32)
    amax = np.concatenate([boundary_amax(fp8_max), random[np.isfinite(random)]])
    got = pow2_scales(amax, dst)
    want = np.array([exact_pow2(float(a), fp8_max) for a in amax], dtype=np.float32)
    assert got.dtype == np.float32 and np.array_equal(got, want)
    finite = np.isfinite(amax) & (amax > 0)
    # Powers of two in UE8M0's range, and the block's amax never saturates.
    m, e = np.frexp(got[finite])
    assert (m == 0.5).all() and e.min() - 1 >= -127 and e.max() - 1 <= 127
    assert (amax[finite] / got[finite] <= np.float32(fp8_max)).all()
    # The least such power: half of it would not hold amax (but for the -127 floor).
    half = got[finite] / 2
    floor = got[finite] == np.float32(2.0**-127)
    assert ((amax[finite] > np.float32(fp8_max) * half) | floor).all()


@pytest.mark.parametrize("dst", ["e4m3", "e5m2"])
def test_kernel_bit_rule_matches_the_reference(dst):
    # Every exponent, fraction bits around the 1.75 boundary (0x600000) and at random.
    exps = np.arange(0, 256, dtype=np.uint32)
    fracs = np.array([0, 1, 0x3FFFFF, 0x400000, 0x5FFFFF, 0x600000, 0x600001, 0x7FFFFE, 0x7FFFFF], dtype=np.uint32)
    fracs = np.concatenate([fracs, np.random.default_rng(3).integers(0, 1 << 23, 4000).astype(np.uint32)])
    bits = ((exps[:, None] << 23) | fracs[None, :]).ravel()
    amax = bits.view(np.float32)
    amax = amax[~np.isnan(amax)]  # the kernel's amax is never NaN (fmaxf drops NaN)
    assert np.array_equal(kernel_rule(amax, dst), pow2_scales(amax, dst))


def test_kernel_source_spells_the_rule_the_test_transliterates():
    from gemmspec.codegen.kernels import QuantizeKernelConfig, render_quantize

    # The rule lives in the device header every kernel includes; the quantize kernel calls it.
    header = (Path(__file__).resolve().parents[2] / "gemmspec" / "codegen" / "include" / "gemmspec_ptx.cuh").read_text()
    assert "static_cast<int>(bits >> 23) - 127 - max_exp + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0)" in header
    assert "e = max(e, -127);" in header and "__uint_as_float(0x00400000u)" in header
    assert "if (bits >= 0x7f800000u) return amax;" in header and "if (!(amax > 0.0f)) return 1.0f;" in header
    assert "const float q = __fdiv_rn(amax, fp8_max);" in header and "return q > 0.0f ? q : 1.0f;" in header
    for dst, exp in (("e4m3", 8), ("e5m2", 15)):
        src = render_quantize(QuantizeKernelConfig(out_type=dst, pow2=True))
        assert f"constexpr int OUT_MAX_EXP = {exp};" in src
        assert "gs_fp8_scale_pow2(amax, OUT_MAX_EXP)" in src and "gs_fp8_scale(amax" not in src and "powf" not in src
    assert "gs_fp8_scale(amax, OUT_MAX)" in render_quantize(QuantizeKernelConfig())


def pow2_by_blocks(x: np.ndarray, dst: str, br: int, bc: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize with power-of-two scales by a loop over blocks, with the exact rule."""
    dtype, fp8_max = FP8[dst]
    *lead, rows, cols = x.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    q = np.empty(x.shape, dtype=dtype)
    grid = np.empty((*lead, nr, nc), dtype=np.float32)
    for idx in np.ndindex(*lead, nr, nc):
        *b, i, j = idx
        sl = (*b, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
        block = x[sl].astype(np.float32)
        s = exact_pow2(float(np.nanmax(np.abs(block), initial=0)), fp8_max)
        with np.errstate(invalid="ignore"):
            q[sl] = np.clip(block / s, -fp8_max, fp8_max).astype(dtype)
        grid[idx] = s
    return q.astype(np.float64), grid


@pytest.mark.parametrize("dst", ["e4m3", "e5m2"])
@pytest.mark.parametrize("br", [1, 128])
@pytest.mark.parametrize("rows, cols", [(1, 128), (3, 256), (129, 384)])
def test_pow2_matches_block_loop(dst, br, rows, cols):
    spec = spec_for(cols, dst, br, pow2=True)
    rng = np.random.default_rng(rows * cols + br + 1)
    x = (rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-40, 40, size=(rows, 1)))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    x[0, : min(cols, 128)] = 0.0  # a zero block (the whole block when br == 1)
    if rows > 2 and cols > 5:
        x[2, 5] = np.nan
        x[1, :] *= 0  # with br == 128 part of a block, else a second zero block
        x[1, 3] = FP8[dst][1] * 2.0**-20  # amax exactly the FP8 max times a power of two
    q, grid = quantize_values(spec, Runtime({"R": rows}), x, spec.tensor("x_q"))
    q_ref, grid_ref = pow2_by_blocks(x, dst, br, 128)
    assert grid.dtype == np.float32 and same(grid, grid_ref) and same(q, q_ref)
    finite = ~np.isnan(x)
    # No element saturates: every |x| / scale is at most the FP8 max before rounding.
    scale = grid.repeat(br, axis=0)[:rows].repeat(128, axis=1)
    assert (np.abs(x.astype(np.float32)[finite] / scale[finite]) <= FP8[dst][1]).all()
    if rows > 2 and cols > 5 and br == 1:
        assert grid[1, 0] == np.float32(2.0**-20) and q[1, 3] == FP8[dst][1]


def test_pow2_rule_by_hand():
    spec = spec_for(256, "e4m3", 1, src="f32", pow2=True)
    x = np.zeros((3, 256))
    x[0, :3] = [1.0, -3.0, 2.0]  # amax 3: 3 / 448 is between 2^-8 and 2^-7
    x[0, 128:130] = [448.0, -0.5]  # amax 448: scale exactly 1
    x[1, 0] = np.float32(1e-40)  # a subnormal amax: the 2^-127 floor
    x[2, 0] = np.inf  # an infinite amax: scale +inf, as amax / 448 would give
    x[2, 128] = np.float32(448.0 * (1 + 2.0**-23))  # just past 448: scale 2
    q, grid = quantize_values(spec, Runtime({"R": 3}), x, spec.tensor("x_q"))
    assert grid[0, 0] == np.float32(2.0**-7) and q[0, 1] == -384.0 and q[0, 0] == 128.0
    assert grid[0, 1] == 1.0 and q[0, 128] == 448.0 and q[0, 129] == -0.5
    assert grid[1, 0] == np.float32(2.0**-127) and grid[1, 1] == 1.0  # an all-zero block: 1
    assert q[1, 0] == float(np.float32(np.float32(1e-40) / np.float32(2.0**-127)).astype(ml_dtypes.float8_e4m3fn))
    assert grid[2, 0] == np.inf and np.isnan(q[2, 0]) and q[2, 1] == 0.0
    assert grid[2, 1] == 2.0 and q[2, 128] == 224.0


def test_documented_pow2_snippet_reproduces_the_reference():
    # The numpy lines docs/language.md gives for quantize(x, pow2), run block by block,
    # equal the reference bit for bit (e4m3, [1, 128] blocks).
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "language.md").read_text()
    after = doc[doc.index("**Power-of-two scales: `quantize(SOURCE, pow2)`.**"):]
    snippet = after[after.index("```python\n") + 10 : after.index("```\n", after.index("```python\n"))]
    spec = spec_for(256, "e4m3", 1, src="f32", pow2=True)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((6, 256)) * 2.0 ** rng.integers(-140, 100, size=(6, 1))
    x = x.astype(np.float32).astype(np.float64)
    x[0, :128] = 0.0
    x[1, 128] = 448.0 * 2.0**-5
    x[2, 7] = np.inf
    x[3, :128] = 1e-40
    q, grid = quantize_values(spec, Runtime({"R": 6}), x, spec.tensor("x_q"))
    for r in range(6):
        for c in range(2):
            env = {"np": np, "ml_dtypes": ml_dtypes, "block": x[r, c * 128 : (c + 1) * 128].astype(np.float32)}
            with np.errstate(invalid="ignore"):
                exec(snippet, env)
            assert env["scale"] == grid[r, c] or (np.isinf(env["scale"]) and np.isinf(grid[r, c])), (r, c)
            assert isinstance(env["scale"], np.float32), type(env["scale"])  # float32 division
            assert same(env["q"].astype(np.float64), q[r, c * 128 : (c + 1) * 128]), (r, c)
