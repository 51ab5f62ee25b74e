"""The edges of gemmspec.torch.quantize's torch operations (the CPU's path), byte for
byte, against an independent float64 re-implementation of the rule of docs/language.md,
section 7: amax per block with NaN ignored, scale = amax / FP8 max rounded once to
float32 (1 for an all-zero block), each element x / scale rounded once to float32, then
to the nearest FP8 value (ties to even) and saturated to +-FP8 max.

The FP8 encoder here decodes the formats from their bit layouts (no ml_dtypes, no torch
cast) and rounds by exact distances. A float64 quotient of two float32 values rounded to
float32 is the IEEE float32 quotient (53 >= 2 * 24 + 2 bits), so the float64 rule has the
kernel's bits. NaN outputs are compared as NaN (the rule promises NaN, not its sign).

Covered: all-zero, negative-zero and all-NaN blocks; NaN beside numbers; +-inf; amax so
small that the scale is a float32 subnormal or rounds to 0 (zeros then become NaN, the
rule's own corner); saturation; exact ties; the largest finite inputs; partial edge
blocks with [1, 128], [128, 128], [128, 1], odd and named blocks, 2-D and 3-D;
non-contiguous inputs; bf16, f16, f32 and float64 sources; and the op's other entries
(kernel=False, the custom op on the CPU) giving the same bytes."""

from __future__ import annotations

import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402

SOURCES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# exponent bits, mantissa bits, bias, largest finite code (e4m3: no inf, 0x7F is NaN)
FORMATS = {"e4m3": (4, 3, 7, 0x7E), "e5m2": (5, 2, 15, 0x7B)}
F32_MAX = float(np.finfo(np.float32).max)
ONE = 0x3F800000  # float32 1.0's bits
INF = 0x7F800000
NAN = None  # an expected byte that is NaN


# ---- the rule, independently ----------------------------------------------------------
def fp8_values(dst: str) -> np.ndarray:
    """Every finite non-negative value of the format, by code (0, 1, ...): increasing."""
    e_bits, m_bits, bias, top = FORMATS[dst]
    out = []
    for code in range(top + 1):
        e, m = code >> m_bits, code & ((1 << m_bits) - 1)
        if e == 0:  # subnormal
            out.append(math.ldexp(m, 1 - bias - m_bits))
        else:
            out.append(math.ldexp((1 << m_bits) | m, e - bias - m_bits))
    return np.array(out)


def encode(r: np.ndarray, dst: str) -> tuple[np.ndarray, np.ndarray]:
    """float32 values (held in float64) to FP8 bytes: saturated to the largest finite
    value, rounded to nearest with ties to the even code. (bytes, NaN mask)."""
    grid = fp8_values(dst)
    nan = np.isnan(r)
    a = np.minimum(np.abs(np.where(nan, 0.0, r)), grid[-1])
    hi = np.searchsorted(grid, a, side="left")  # grid[hi - 1] < a <= grid[hi]
    lo = np.maximum(hi - 1, 0)
    below, above = a - grid[lo], grid[hi] - a  # exact: a is a float32 value
    code = np.where(below < above, lo, np.where(above < below, hi, np.where(lo % 2 == 0, lo, hi)))
    code = np.where(grid[hi] == a, hi, code)
    sign = np.where(np.signbit(r) & ~nan, 0x80, 0)
    return (code | sign).astype(np.uint8), nan


def rule(x: np.ndarray, dst: str, block: tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(FP8 bytes, NaN mask, float32 scale grid) of the documented rule; `x` float64
    holding float32 values; a dim's name in `block` is one block over the whole dim."""
    x = np.asarray(x, dtype=np.float64)
    block = tuple(max(n, 1) if isinstance(b, str) else b for n, b in zip(x.shape, block))
    grid_shape = tuple(-(-n // b) for n, b in zip(x.shape, block))
    padded = np.full([g * b for g, b in zip(grid_shape, block)], np.nan)  # NaN: no part of any amax
    padded[tuple(slice(0, n) for n in x.shape)] = x
    blocks = padded.reshape([v for g, b in zip(grid_shape, block) for v in (g, b)])
    amax = np.fmax.reduce(np.abs(blocks), axis=tuple(range(1, 2 * x.ndim, 2)), initial=0.0)
    scale = (amax / FP8_MAX[dst]).astype(np.float32)  # one rounding
    scale = np.where(scale > 0, scale, np.float32(1))  # all zeros, or a quotient that underflows
    per_element = scale.astype(np.float64)
    for axis, b in enumerate(block):
        per_element = np.repeat(per_element, b, axis=axis)
    per_element = per_element[tuple(slice(0, n) for n in x.shape)]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = (x / per_element).astype(np.float32).astype(np.float64)  # one rounding
    q, nan = encode(ratio, dst)
    return q, nan, scale.reshape(grid_shape)


def check(value: torch.Tensor, dst: str, block: tuple) -> tuple[np.ndarray, np.ndarray]:
    """quantize(value) against the rule: scale bits equal, FP8 bytes equal where the rule
    gives a number, NaN where it gives NaN. Returns (bytes, scale bits) of the call."""
    q, scale = gt.quantize(value, dst, block)
    assert q.dtype == gt.torch_dtype(dst) and q.shape == value.shape and q.is_contiguous()
    assert scale.dtype == torch.float32 and scale.is_contiguous()
    want_q, want_nan, want_scale = rule(value.double().numpy(), dst, block)
    assert tuple(scale.shape) == want_scale.shape
    got_scale = scale.numpy().view(np.uint32)
    bad = np.argwhere(got_scale != want_scale.view(np.uint32))
    assert not bad.size, f"scale {bad[0].tolist()}: {got_scale[tuple(bad[0])]:#x}, rule {want_scale.view(np.uint32)[tuple(bad[0])]:#x}"
    got = q.view(torch.uint8).numpy()
    nan = torch.isnan(q.float()).numpy()
    assert np.array_equal(nan, want_nan), f"NaN at {np.argwhere(nan != want_nan)[0].tolist()} differs"
    bad = np.argwhere((got != want_q) & ~want_nan)
    assert not bad.size, (
        f"{len(bad)} bytes differ, first {bad[0].tolist()}: {got[tuple(bad[0])]:#04x}, rule {want_q[tuple(bad[0])]:#04x}"
    )
    return got, got_scale


def test_the_encoder_is_the_formats_round_to_nearest_even():
    """The encoder above against ml_dtypes on every FP8 value, every midpoint and their
    float32 neighbours, both signs (so the expectations below rest on a checked encoder)."""
    for dst, np_type in (("e4m3", ml_dtypes.float8_e4m3fn), ("e5m2", ml_dtypes.float8_e5m2)):
        grid = fp8_values(dst).astype(np.float32)
        mids = ((grid[:-1].astype(np.float64) + grid[1:]) / 2).astype(np.float32)
        base = np.concatenate([grid, mids])
        near = [base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))]
        r = np.concatenate(near)
        r = np.concatenate([r, -r]).astype(np.float64)
        got, nan = encode(r, dst)
        assert not nan.any()
        assert np.array_equal(got, r.astype(np_type).view(np.uint8)), dst


# ---- corners, one 1x128 block each, with the bytes written out -------------------------
def row(values, n: int = 128, fill: float = 0.0) -> np.ndarray:
    x = np.full((1, n), fill)
    x[0, : len(values)] = values
    return x


# (name, source, FP8 type, row, expected scale bits, expected leading bytes, NaN as NAN)
CORNERS = [
    ("all zero", "bf16", "e4m3", row([]), ONE, [0x00] * 4),
    ("all negative zero", "f32", "e5m2", row([], fill=-0.0), ONE, [0x80] * 4),
    ("all NaN", "f16", "e4m3", row([], fill=math.nan), ONE, [NAN] * 4),
    ("NaN beside numbers", "bf16", "e4m3", row([math.nan, 448.0, -1.0, -0.0]), ONE, [NAN, 0x7E, 0xB8, 0x80, 0x00]),
    # amax +inf: scale +inf, finite values +-0 (the sign kept), the infinities NaN
    ("infinities", "f32", "e4m3", row([math.inf, -1.0, 1.0, -math.inf, math.nan]), INF, [NAN, 0x80, 0x00, NAN, NAN, 0x00]),
    ("minus infinity alone", "bf16", "e5m2", row([-math.inf, 2.0]), INF, [NAN, 0x00, 0x00]),
    # amax / 448 rounds to 0 (amax <= 448 * 2^-150, a float32 subnormal): the scale is 1,
    # as for an all-zero block, and every value quantizes to a zero of its sign (a scale of
    # 0 would saturate the values and make the zeros 0 / 0, NaN)
    ("scale underflows to zero", "f32", "e4m3", row([2.0**-149, -(2.0**-149)]), ONE, [0x00, 0x80, 0x00]),
    ("underflow at the tie", "f32", "e4m3", row([7 * 2.0**-144, -0.0]), ONE, [0x00, 0x80, 0x00]),
    ("underflow at the tie, e5m2", "f32", "e5m2", row([7 * 2.0**-137]), ONE, [0x00, 0x00]),
    # one float32 step above the tie: the smallest subnormal scale, rounded up from half
    # of it, so the largest value maps onto 224, not 448
    ("subnormal scale rounded up", "f32", "e4m3", row([225 * 2.0**-149]), 0x1, [0x76, 0x00]),
    # a subnormal scale rounded down: the quotient passes FP8 max and saturates (unsaturated
    # e4m3 would be NaN, e5m2 inf)
    ("subnormal scale saturates", "f32", "e4m3", row([2.0**-140, -(2.0**-140)]), 0x1, [0x7E, 0xFE, 0x00]),
    ("bf16 subnormal saturates, e5m2", "bf16", "e5m2", row([2.0**-133, -(2.0**-133)]), 0x1, [0x7B, 0xFB, 0x00]),
    ("bf16 subnormal, e4m3", "bf16", "e4m3", row([2.0**-133]), 0x92, [0x7E, 0x00]),
    # 2^-131 / 57344 = 4.57 steps of 2^-149, rounded to 5: the largest value 52428.8 -> 49152
    ("bf16 amax short of e5m2 max", "bf16", "e5m2", row([2.0**-131]), 0x5, [0x7A, 0x00]),
    # amax = FP8 max: scale 1, every quotient exact; midpoints go to the even code
    (
        "ties to even, e4m3",
        "f32",
        "e4m3",
        row([448.0, 1.0625, 1.1875, -1.0625, 2.0**-10, 3 * 2.0**-10, 432.0, 13.0]),
        ONE,
        [0x7E, 0x38, 0x3A, 0xB8, 0x00, 0x02, 0x7E, 0x55],
    ),
    (
        "ties to even, e5m2",
        "f32",
        "e5m2",
        row([57344.0, 1.125, 1.375, -1.125, 2.0**-17, 3 * 2.0**-17, 53248.0, 40960.0]),
        ONE,
        [0x7B, 0x3C, 0x3E, 0xBC, 0x00, 0x02, 0x7A, 0x79],
    ),
    # amax / 448 by true division: amax * (1 / 448) rounds to 0x3B12492A here
    ("true division", "f32", "e4m3", row([1 + 4 * 2.0**-23, -1.0]), 0x3B124929, [0x7E, 0xFE]),
    # the largest finite inputs: scales far from both ends of float32
    ("float32 max", "f32", "e4m3", row([F32_MAX, -F32_MAX, 1.0]), 0x7B124924, [0x7E, 0xFE, 0x00]),
    ("float16 max", "f16", "e5m2", row([65504.0, -1.0]), 0x3F9236DB, [0x7B, 0xBB]),
    ("negative zero beside numbers", "f32", "e4m3", row([-0.0, 1.0, -(2.0**-30)]), 0x3B124925, [0x80, 0x7E, 0x80]),
]


@pytest.mark.parametrize("name, source, dst, x, scale_bits, leading", CORNERS, ids=[c[0] for c in CORNERS])
def test_corner_blocks(name, source, dst, x, scale_bits, leading):
    value = torch.from_numpy(x).to(SOURCES[source])
    assert np.array_equal(value.double().numpy(), x, equal_nan=True), "the row is not exact in its source type"
    got, scale = check(value, dst, (1, 128))
    assert int(scale[0, 0]) == scale_bits, f"scale {int(scale[0, 0]):#x}"
    for i, want in enumerate(leading):
        if want is NAN:
            assert math.isnan(float(torch.from_numpy(got[0, i : i + 1]).view(gt.torch_dtype(dst)).float())), i
        else:
            assert got[0, i] == want, f"element {i}: {got[0, i]:#04x}, expected {want:#04x}"


def test_the_documented_snippet_agrees_on_the_corners():
    """docs/language.md's numpy float32 lines (with ml_dtypes) give the bytes and scales
    of the rule above on every corner row: the two readings of the rule are one (the
    snippet's scale lines are checked to be the doc's, with 448 standing for FP8 max)."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "language.md").read_text(encoding="utf-8")
    assert ("scale = amax / np.float32(448)\nscale = scale if scale > 0 else np.float32(1)\n"
            "q = np.clip(block / scale, -448, 448).astype(ml_dtypes.float8_e4m3fn)") in doc
    for name, source, dst, x, _, _ in CORNERS:
        block = torch.from_numpy(x).to(SOURCES[source]).float().numpy()
        fp8_max = np.float32(FP8_MAX[dst])
        np_type = ml_dtypes.float8_e4m3fn if dst == "e4m3" else ml_dtypes.float8_e5m2
        with np.errstate(divide="ignore", invalid="ignore"):
            amax = np.float32(np.nanmax(np.abs(block), initial=0))
            scale = amax / fp8_max
            scale = scale if scale > 0 else np.float32(1)
            q = np.clip(block / scale, -fp8_max, fp8_max).astype(np_type)
        want_q, want_nan, want_scale = rule(x, dst, (1, 128))
        assert np.float32(scale).view(np.uint32) == want_scale.view(np.uint32)[0, 0], name
        assert np.array_equal(np.isnan(q.astype(np.float32)), want_nan), name
        assert np.array_equal(q.view(np.uint8)[~want_nan], want_q[~want_nan]), name


# ---- shapes, blocks and layouts ---------------------------------------------------------
def with_corners(x: np.ndarray, source: str, dst: str) -> np.ndarray:
    """Random values with corner rows (each row of a 2-D view of the last dim)."""
    x = x.copy()
    flat = x.reshape(-1, x.shape[-1])
    tiny = [2.0**-149, 7 * 2.0**-144, 225 * 2.0**-149, 2.0**-140] if source == "f32" else [2.0**-133, 2.0**-131]
    big = {"f32": F32_MAX, "bf16": 2.0**127, "f16": 65504.0}[source]
    rows = [
        lambda r: r.fill(0.0),
        lambda r: r.fill(-0.0),
        lambda r: r.fill(math.nan),
        lambda r: r.__setitem__(slice(3, None, 7), math.nan),
        lambda r: r.__setitem__(slice(0, None, 11), math.inf),
        lambda r: r.__setitem__(slice(5, None, 13), -math.inf),
        lambda r: r.__setitem__(slice(None), np.where(np.arange(r.size) % 2, big, -big)),
        lambda r: r.__setitem__(slice(None), np.round(r * 64) / 64 * (FP8_MAX[dst] / 8)),
    ]
    for t in tiny:
        rows.append(lambda r, t=t: (r.fill(0.0), r.__setitem__(slice(0, None, 9), t), r.__setitem__(slice(4, None, 9), -t / 3)))
    for i, f in enumerate(rows):
        if i < flat.shape[0]:
            f(flat[i])
    flat[len(rows) :: 3] *= 2.0**-20  # small but normal blocks beside large ones
    return x


SHAPES = [  # (shape, block): the last block of each dim short where it can be
    ((130, 260), (1, 128)),
    ((130, 260), (128, 128)),
    ((130, 260), (128, 1)),
    ((37, 70), (1, 32)),
    ((37, 70), (3, 5)),
    ((5, 7), (128, 128)),  # one block larger than the tensor
    ((1, 1), (1, 128)),
    ((2, 129, 130), (1, 128, 128)),
    ((2, 129, 130), (1, 1, 128)),
    ((3, 129, 40), (2, 128, 1)),
    ((33, 200), ("T", 128)),  # a dim's name: one block over the whole dim
    ((33, 200), ("T", "K")),
    ((300,), (128,)),
]


@pytest.mark.parametrize("shape, block", SHAPES, ids=[f"{'x'.join(map(str, s))}-{'x'.join(map(str, b))}" for s, b in SHAPES])
@pytest.mark.parametrize("source, dst", [("bf16", "e4m3"), ("f16", "e5m2"), ("f32", "e4m3"), ("f32", "e5m2"), ("bf16", "e5m2")])
def test_partial_blocks_and_block_shapes(shape, block, source, dst):
    rng = np.random.default_rng([len(shape), *shape])
    x = with_corners(rng.standard_normal(shape) * 3.0, source, dst)
    # Small values in the short blocks at the ends: what fills a short block out to its
    # size must not count in its amax.
    short = np.zeros(shape, dtype=bool)
    for axis, (n, b) in enumerate(zip(shape, block)):
        if isinstance(b, int) and n % b:
            short[(slice(None),) * axis + (slice(n - n % b, None),)] = True
    x = np.where(short, x * 2.0**-20, x)
    check(torch.from_numpy(x).to(SOURCES[source]), dst, block)


def test_non_contiguous_inputs_give_the_bytes_of_their_contiguous_copy():
    rng = np.random.default_rng(7)
    wide = torch.from_numpy(with_corners(rng.standard_normal((260, 391)), "f32", "e4m3")).float()
    cube = torch.from_numpy(with_corners(rng.standard_normal((3, 130, 257)), "bf16", "e4m3")).to(torch.bfloat16)
    views = {
        "columns sliced": (wide[:, 5:261], (1, 128)),
        "every other row": (wide[::2, :256], (128, 128)),
        "transposed": (wide[:256, :130].T, (1, 128)),
        "transposed, 128x1": (wide.T, (128, 1)),
        "row broadcast (stride 0)": (wide[9:10].expand(200, 391), (128, 128)),
        "storage offset": (wide.reshape(-1)[3 : 3 + 129 * 256].view(129, 256), (1, 128)),
        "3-D permuted": (cube.permute(2, 1, 0), (128, 1, 1)),
        "3-D strided batch": (cube[::2, 1:, :256], (1, 128, 128)),
    }
    for name, (value, block) in views.items():
        assert not value.is_contiguous() or value.storage_offset(), name
        got, scale = check(value, "e4m3", block)
        q, s = gt.quantize(value.contiguous(), "e4m3", block)
        assert np.array_equal(got, q.view(torch.uint8).numpy()), name
        assert np.array_equal(scale, s.numpy().view(np.uint32)), name


def test_the_source_type_does_not_matter_for_equal_values():
    """Values every source type holds exactly quantize to the same bytes and scales from
    bf16, f16 and f32 (NaN bytes as NaN: torch's casts give NaN either sign)."""
    rng = np.random.default_rng(11)
    x = rng.integers(-256, 257, (130, 256)) / 64.0
    x[0] = 0.0
    x[1, ::3] = math.nan
    x[2, 7] = math.inf
    results = {}
    for source in SOURCES:
        value = torch.from_numpy(x).to(SOURCES[source])
        assert np.array_equal(value.double().numpy(), x, equal_nan=True)
        q, scale = check(value, "e4m3", (1, 128))
        results[source] = (np.where(q & 0x7F == 0x7F, 0x7F, q), scale)  # e4m3's NaN: 0x7F, 0xFF
    (q, s), *rest = results.values()
    for q2, s2 in rest:
        assert np.array_equal(q, q2) and np.array_equal(s, s2)


def test_float64_is_rounded_to_float32_first():
    """A float64 tensor (which the kernel does not take) is quantized as its float32
    rounding: a value past float32's range is an infinity there (its block's scale +inf,
    its own byte NaN), a value under it a zero."""
    x = torch.tensor([[1e39, 1.0, -1e-50, 3.0] + [0.0] * 124, [1e-50] * 128, [0.1] * 128], dtype=torch.float64)
    q, s = gt.quantize(x, "e4m3", (1, 128))
    q32, s32 = gt.quantize(x.float(), "e4m3", (1, 128))
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)
    assert s.view(torch.int32)[:, 0].tolist() == [INF, ONE, 0x396A0EA1]
    assert torch.isnan(q[0, 0].float()) and q.view(torch.uint8)[0, 1:4].tolist() == [0x00, 0x80, 0x00]
    assert (q.view(torch.uint8)[1] == 0).all() and (q.view(torch.uint8)[2] == 0x7E).all()


def test_every_cpu_entry_gives_the_same_bytes():
    """quantize, quantize(kernel=False) and the custom op on the CPU: the same bytes,
    NaN's included, and the same scales."""
    rng = np.random.default_rng(13)
    value = torch.from_numpy(with_corners(rng.standard_normal((130, 384)), "f32", "e4m3")).float()
    for dst in FP8_MAX:
        q, s = gt.quantize(value, dst, (1, 128))
        for q2, s2 in (
            gt.quantize(value, dst, (1, 128), kernel=False),
            torch.ops.gemmspec.quantize.default(value, dst, [1, 128]),
        ):
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)), dst
            assert torch.equal(s.view(torch.int32), s2.view(torch.int32)), dst
