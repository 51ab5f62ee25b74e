"""gemmspec.torch.quantize without a GPU: its torch operations (the CPU's path, and the
fallback for tensors the kernel refuses) reproduce the numpy reference of the language's
quantize rule bit for bit, corners included (all-zero blocks, NaN, infinities, an amax
whose quotient underflows to zero, scale 1; short edge blocks, non-contiguous inputs); the
custom op `gemmspec::quantize` has a schema and a fake implementation that give the kernel's
shapes and dtypes on meta and fake CUDA tensors; bad arguments raise ArgumentError."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402
from gemmspec.pipeline import lower_file  # noqa: E402
from gemmspec.reference.data import Runtime, quantize_values  # noqa: E402

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}
SOURCES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32, "f64": torch.float64}

# The language's quantize on a 2-D [R, C] or batched 3-D [B, R, C] source (the language
# blocks a run-time dim only outermost: R is fixed in 3-D): the reference
# (gemmspec.reference.data.quantize_values) computes the spec's x_q from x.
SPEC_2D = """
gemm q {{
  dim R
  dim C = {c}, N = 128
  tensor x   : f32 [R, C]
  tensor x_q : {dst} [R, C] scale f32 [{br}, 128] = quantize(x)
  tensor w   : {dst} [N, C] scale f32 [128, 128]
  tensor y   : f32 [R, N]
  y[r, n] = sum[c] x_q[r, c] * w[n, c]
}}
"""
SPEC_3D = """
gemm q {{
  dim B = {b}, R = {r}, C = {c}, N = 128
  tensor x   : f32 [B, R, C]
  tensor x_q : {dst} [B, R, C] scale f32 [1, {br}, 128] = quantize(x)
  tensor w   : {dst} [B, N, C] scale f32 [1, 128, 128]
  tensor y   : f32 [B, R, N]
  y[b, r, n] = sum[c] x_q[b, r, c] * w[b, n, c]
}}
"""


def language_reference(x: np.ndarray, dst: str, br: int) -> tuple[np.ndarray, np.ndarray]:
    """(FP8 values as float64, scale grid) of the spec's quantize(x) by the reference."""
    if x.ndim == 3 and 0 in x.shape:  # no spec declares an empty dim: the rule as written
        return numpy_rule(x, dst, (1, br, 128))
    text = (SPEC_3D if x.ndim == 3 else SPEC_2D).format(c=x.shape[-1], b=x.shape[0], r=x.shape[-2], dst=dst, br=br)
    (lowered,) = lower_file(text)
    spec = lowered.spec
    dims = {} if x.ndim == 3 else {"R": x.shape[0]}
    return quantize_values(spec, Runtime(dims, {}), x, spec.tensor("x_q"))


def numpy_rule(x: np.ndarray, dst: str, block: tuple) -> tuple[np.ndarray, np.ndarray]:
    """The rule of docs/language.md, section 7, for any blocks (a name: the whole dim)."""
    dtype, fp8_max = FP8[dst]
    x = np.asarray(x, dtype=np.float32)
    block = [max(n, 1) if isinstance(b, str) else b for n, b in zip(x.shape, block)]
    where = np.ix_(*[np.arange(n) // b for n, b in zip(x.shape, block)])
    amax = np.zeros([-(-n // b) for n, b in zip(x.shape, block)], dtype=np.float32)
    np.fmax.at(amax, where, np.abs(x))  # NaN ignored
    grid = amax / np.float32(fp8_max)
    grid = np.where(grid > 0, grid, np.float32(1)).astype(np.float32)  # all zeros, or underflowed
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.clip(x / grid[where], -fp8_max, fp8_max)
    return ratio.astype(dtype).astype(np.float64), grid


def same_values(got: torch.Tensor, want: np.ndarray) -> None:
    """FP8 values equal bit for bit as numbers (NaN where the reference has NaN)."""
    values = got.float().numpy().astype(np.float64)
    assert np.array_equal(np.isnan(values), np.isnan(want)), "NaN positions differ"
    ok = np.isnan(want) | (values == want)
    same_sign = np.signbit(values) == np.signbit(want)  # -0 and +0 are different bits
    bad = ~(ok & (same_sign | np.isnan(want)))
    assert not bad.any(), f"{int(bad.sum())} of {want.size} values differ, first at {np.argwhere(bad)[0]}"


def same_scales(got: torch.Tensor, want: np.ndarray) -> None:
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert np.array_equal(got.numpy().view(np.uint32), want.astype(np.float32).view(np.uint32))


def corners(x: np.ndarray, source: str) -> np.ndarray:
    """Random values with every corner of the rule in some block."""
    x = x.copy()
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    if rows > 6 and flat.shape[1] >= 256:
        flat[0, :128] = 0.0  # an all-zero block: scale 1
        flat[1, 5] = np.nan  # NaN: left out of its block's amax, NaN out
        flat[2, 130] = np.inf  # amax +inf: scale +inf, finite values 0, the inf NaN
        flat[3, :128] *= 2.0**100 if source != "f16" else 1.0  # huge (f16 tops out at 65504)
        flat[4, 128:256] *= 2.0**-30 if source != "f16" else 2.0**-10
        flat[5, :] = -0.0  # negative zeros stay negative
        if source in ("f32", "f64"):
            flat[6, :128] = 0.0
            flat[6, 7] = 2.0**-149  # amax / 448 underflows to 0: scale 1, every value a zero
    return x


CASES = [  # (shape, block)
    ((0, 256), (1, 128)),
    ((1, 128), (1, 128)),
    ((127, 256), (1, 128)),
    ((129, 384), (1, 128)),
    ((129, 384), (128, 128)),
    ((257, 128), (128, 128)),
    ((3, 129, 256), (1, 1, 128)),
    ((3, 129, 256), (1, 128, 128)),
    ((2, 0, 128), (1, 128, 128)),
]


@pytest.mark.parametrize("shape, block", CASES, ids=lambda v: "x".join(map(str, v)))
@pytest.mark.parametrize("source, dst", [("bf16", "e4m3"), ("f16", "e5m2"), ("f32", "e4m3"), ("f64", "e4m3"), ("bf16", "e5m2")])
def test_torch_operations_equal_the_reference_bit_for_bit(shape, block, source, dst):
    rng = np.random.default_rng(sum(shape))
    real = corners(rng.standard_normal(shape) * 3.0, source)
    value = torch.from_numpy(real).to(SOURCES[source])
    q, scale = gt.quantize(value, dst, block)  # on the CPU: torch operations
    assert q.dtype == gt.torch_dtype(dst) and q.shape == value.shape and q.is_contiguous()
    assert scale.is_contiguous()
    exact = value.double().numpy()  # what the tensor holds, before the float32 rounding
    want_q, want_scale = language_reference(exact, dst, block[-2])
    same_values(q, want_q)
    same_scales(scale, want_scale)
    # The same through the kernel switch turned off.
    q2, scale2 = gt.quantize(value, dst, block, kernel=False)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(scale, scale2)


@pytest.mark.parametrize(
    "shape, block",
    [
        ((130, 300), (1, 128)),  # columns not whole blocks: the kernel's refusal, the fallback's case
        ((130, 300), (128, 128)),
        ((70, 96), (32, 32)),
        ((5, 64, 40), (2, 16, 8)),
        ((33, 256), ("T", 128)),  # a name: one block over the whole dim
        ((33, 256), ("T", "K")),  # per-tensor
        ((300,), (128,)),
    ],
    ids=str,
)
def test_other_blocks_follow_the_same_rule(shape, block):
    rng = np.random.default_rng(len(shape))
    real = corners(rng.standard_normal(shape), "f32")
    q, scale = gt.quantize(torch.from_numpy(real).float(), "e4m3", block)
    want_q, want_scale = numpy_rule(real, "e4m3", block)
    same_values(q, want_q)
    same_scales(scale, want_scale)


def test_non_contiguous_inputs():
    rng = np.random.default_rng(5)
    wide = torch.from_numpy(rng.standard_normal((131, 640))).to(torch.bfloat16)
    for value in (wide[:, 128:512], wide[::2, :256], wide.T[:256].T, wide[:256, :256].T):
        q, scale = gt.quantize(value, "e4m3", (1, 128))
        want_q, want_scale = numpy_rule(value.double().numpy(), "e4m3", (1, 128))
        same_values(q, want_q)
        same_scales(scale, want_scale)


def test_the_rule_divides_rather_than_multiplies():
    """amax / 448 by true division: amax * (1 / 448) differs in the last bit for some
    amax, and the kernel divides."""
    amax = np.float32(1.0) + np.arange(1, 4096, dtype=np.float32) * np.float32(2.0**-23)
    differ = (amax / np.float32(448)) != (amax * (np.float32(1) / np.float32(448)))
    assert differ.any()  # the two roundings part somewhere in this range
    value = torch.zeros(len(amax), 128)
    value[:, 0] = torch.from_numpy(amax)
    _, scale = gt.quantize(value, "e4m3", (1, 128))
    assert np.array_equal(scale[:, 0].numpy(), amax / np.float32(448))


def test_results_carry_no_gradient():
    value = torch.randn(4, 256, requires_grad=True)
    q, scale = gt.quantize(value, "e4m3", (1, 128))
    assert not q.requires_grad and not scale.requires_grad


@pytest.mark.parametrize(
    "args, message",
    [
        (("e4m4", (1, 128)), "dtype must be 'e4m3' or 'e5m2'"),
        (("e4m3", (128,)), "give one positive size"),
        (("e4m3", (0, 128)), "give one positive size"),
    ],
)
def test_bad_arguments(args, message):
    with pytest.raises(ArgumentError, match=message):
        gt.quantize(torch.randn(4, 256), *args)


# ---- the custom op's schema and fake implementation --------------------------------------


def test_schema():
    schema = str(torch.ops.gemmspec.quantize.default._schema)
    assert schema == "gemmspec::quantize(Tensor value, str dtype, int[] block) -> (Tensor, Tensor)"


@pytest.mark.parametrize(
    "shape, block, scales",
    [
        ((4096, 1024), (1, 128), (4096, 8)),
        ((8, 1024, 1024), (1, 128, 128), (8, 8, 8)),
        ((129, 384), (128, 128), (2, 3)),
        ((0, 256), (1, 128), (0, 2)),
        ((130, 300), (1, 128), (130, 3)),  # refused by the kernel: the fallback's shapes
    ],
)
@pytest.mark.parametrize("source", [torch.bfloat16, torch.float32])
def test_fake_outputs_on_meta_and_fake_cuda_tensors(shape, block, scales, source):
    from torch._subclasses.fake_tensor import FakeTensorMode

    q, scale = gt.quantize(torch.empty(shape, dtype=source, device="meta"), "e4m3", block)
    assert (q.shape, q.dtype, q.device.type) == (shape, torch.float8_e4m3fn, "meta")
    assert (tuple(scale.shape), scale.dtype) == (scales, torch.float32) and q.is_contiguous()
    with FakeTensorMode():
        value = torch.empty(shape, dtype=source, device="cuda")
        q, scale = gt.quantize(value, "e5m2", block)
    assert (q.shape, q.dtype, q.device.type) == (shape, torch.float8_e5m2, "cuda")
    assert (tuple(scale.shape), scale.dtype, scale.device.type) == (scales, torch.float32, "cuda")
    # The CPU's torch operations agree with the fake.
    q, scale = gt.quantize(torch.zeros(shape, dtype=source), "e5m2", block)
    assert tuple(scale.shape) == scales and q.shape == shape


def test_opcheck():
    """torch.library's own checks of the op on the CPU: schema, fake implementation
    against the real one, no aliasing, dispatch consistency."""
    value = torch.randn(129, 384, dtype=torch.bfloat16)
    for block in ([1, 128], [128, 128]):
        torch.library.opcheck(torch.ops.gemmspec.quantize.default, (value, "e4m3", block))
    torch.library.opcheck(torch.ops.gemmspec.quantize.default, (torch.randn(3, 130, 256), "e5m2", [1, 128, 128]))
