"""What docs/usage.md says of gemmspec.torch, checked on the CPU (the custom ops run the
float64 reference there): the documented calls work, and bad arguments (wrong dtypes,
ranks or strides, int64 or float offsets, tensors on two devices, arguments that are not
tensors, an input that requires grad through `op`) raise a gemmspec error naming the
argument rather than a torch or numpy one, or a wrong value."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from reference_ops import CpuKernels  # noqa: E402

import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError, GemmspecError  # noqa: E402
from gemmspec.torch_reference import reference_kernel  # noqa: E402

# Specs of their own: ops are shared by spec text, and other tests register CPU kernels.
BF16 = """\
gemm doc_claims_bf16 {
  dim T
  dim N = 64, K = 128
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
FP8 = """\
gemm doc_claims_fp8 {
  dim T
  dim N = 256, K = 256
  group expert[E = 2] = ragged(T, offsets = expert_offsets)
  tensor x : e4m3 [T, K] scale f32 [1, 128] layout major(T)
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""


@pytest.fixture(scope="module")
def kernels():
    return CpuKernels()  # kept for the module: its registrations live as long as it does


@pytest.fixture(scope="module")
def bf16(kernels):
    return kernels(gt.function(BF16), in_place=True)


@pytest.fixture(scope="module")
def fp8(kernels):
    return kernels(gt.function(FP8), in_place=True)


def args(**changed) -> dict:
    gen = torch.Generator().manual_seed(0)
    out = {
        "x": torch.randn(12, 128, generator=gen).bfloat16(),
        "w": torch.randn(2, 64, 128, generator=gen).bfloat16(),
        "offs": torch.tensor([0, 5, 12], dtype=torch.int32),
    }
    out.update(changed)
    return out


def expected(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.cat([x[:5].double() @ w[0].double().T, x[5:].double() @ w[1].double().T]).bfloat16()


def test_op_computes_and_checks_arguments_as_on_the_gpu(bf16) -> None:
    op = bf16.forward_op
    a = args()
    assert torch.equal(op(**a), expected(a["x"], a["w"]))
    bad = [
        ({"x": torch.randn(12, 128)}, "'x'"),  # f32 for bf16
        ({"x": torch.ones(12, 128, dtype=torch.int64)}, "'x'"),
        ({"x": torch.randn(128, 12).bfloat16().T}, "tensor 'x' must have element strides"),
        ({"x": torch.randn(12, 64).bfloat16()}, "tensor 'x' must have shape"),
        ({"w": torch.randn(3, 64, 128).bfloat16()}, "tensor 'w' must have shape"),
        ({"offs": torch.tensor([0, 5, 12])}, "'offs' must be int32"),
        ({"offs": torch.tensor([0.0, 5.5, 12.0])}, "'offs' must be int32"),
        ({"offs": torch.tensor([0, 5, 10], dtype=torch.int32)}, "offsets 'offs'"),
        ({"offs": torch.tensor([0, 12], dtype=torch.int32)}, "'offs' must have shape"),
    ]
    for changed, match in bad:
        with pytest.raises(ArgumentError, match=match):
            op(**args(**changed))


def test_reference_kernel_checks_before_computing(bf16) -> None:
    """Called directly, as a CPU registration calls it: an int64 offsets tensor whose
    values would read fine is refused, not computed."""
    run = reference_kernel(bf16.forward_op)
    a = args()
    with pytest.raises(ArgumentError, match="'offs' must be int32"):
        run(a["x"], a["w"], a["offs"].long())


def test_tensors_on_two_devices_are_refused(bf16) -> None:
    """With a CPU kernel registered, a meta tensor among CPU ones would send the call to
    the fake implementation (or the reverse): refused, both named."""
    for name in ("offs", "x"):
        a = args()
        a[name] = torch.empty_like(a[name], device="meta")
        with pytest.raises(ArgumentError, match="different devices"):
            bf16.forward_op(**a)
        with pytest.raises(ArgumentError, match="different devices"):
            bf16(**a)
    a = args()
    with pytest.raises(ArgumentError, match="different devices.*'y' on meta"):
        bf16.forward_op(**a, y=torch.empty(12, 64, dtype=torch.bfloat16, device="meta"))


def test_arguments_that_are_not_tensors_are_named(bf16) -> None:
    for value in ([[1.0]], args()["x"].float().numpy()):
        with pytest.raises(ArgumentError, match="'x' is a"):
            bf16.forward_op(**args(x=value))
        with pytest.raises(ArgumentError, match="'x' is a"):
            bf16(**args(x=value))
    with pytest.raises(ArgumentError, match="quantize: value must be a floating-point"):
        gt.quantize([[1.0]], "e4m3", (1, 128))


def test_a_backward_through_op_raises_instead_of_leaving_no_gradient(bf16) -> None:
    x = args()["x"].requires_grad_()
    y = bf16.forward_op(**args(x=x))
    assert torch.equal(y.detach(), expected(x.detach(), args()["w"]))
    with pytest.raises(GemmspecError, match="no derivative.*gemmspec.torch.function"):
        y.float().sum().backward()
    with torch.no_grad():  # no gradient asked for: nothing to refuse
        assert not bf16.forward_op(**args(x=x)).requires_grad


def test_function_refuses_operands_it_cannot_take(bf16) -> None:
    with pytest.raises(ArgumentError, match="'x' must be a floating-point tensor"):
        bf16(**args(x=torch.ones(12, 128, dtype=torch.int64)))
    with pytest.raises(ArgumentError, match="'x' must have 2 dims"):
        bf16(**args(x=torch.ones(12 * 128, dtype=torch.bfloat16)))
    # Offsets pass as they are: the op refuses them, as it would on the GPU.
    with pytest.raises(ArgumentError, match="'offs' must be int32"):
        bf16(**args(offs=torch.tensor([0, 5, 12])))
    with pytest.raises(ArgumentError, match="'offs' must be int32"):
        bf16(**args(offs=torch.tensor([0.0, 5.0, 12.0], requires_grad=True)))
    with pytest.raises(ArgumentError, match="missing none, unknown \\['x_scale'\\]"):
        bf16(**args(), x_scale=torch.ones(12, 1))
    with pytest.raises(ArgumentError, match="missing \\['offs'\\]"):
        bf16(x=args()["x"], w=args()["w"])
    with pytest.raises(ArgumentError, match="output 'y' requires grad"):
        bf16(**args(), y=torch.empty(12, 64, dtype=torch.bfloat16, requires_grad=True))


def test_function_takes_any_strides_and_zero_rows(bf16) -> None:
    a = args()
    x = torch.empty(128, 12, dtype=torch.bfloat16).T.copy_(a["x"]).requires_grad_()
    assert not x.is_contiguous()
    y = bf16(**args(x=x))
    assert torch.equal(y.detach(), expected(a["x"], a["w"]))
    y.float().sum().backward()
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    x0 = torch.empty(0, 128, dtype=torch.bfloat16, requires_grad=True)
    w0 = a["w"].float().requires_grad_()
    y0 = bf16(x=x0, w=w0, offs=torch.zeros(3, dtype=torch.int32))
    assert y0.shape == (0, 64)
    y0.float().sum().backward()
    assert x0.grad.shape == (0, 128) and w0.grad.dtype == torch.float32 and not w0.grad.any()


def test_fp8_function_as_documented(fp8) -> None:
    """usage.md's example: x in BF16 and a master weight in FP32, gradients back in those
    dtypes; given outputs (NaN first) are written in place and returned."""
    assert fp8.args == ("x", "w", "expert_offsets") and isinstance(fp8.feed, gt.BackwardFeed)
    assert [str(q) for q in fp8.quantizations] == [
        "forward: x -> e4m3, blocks [1, 128]",
        "forward: w -> e4m3, blocks [1, 128, 128]",
        "backward: dy -> e4m3, blocks [1, 128]",
    ]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(12, 256, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(2, 256, 256, generator=gen).requires_grad_()
    offsets = torch.tensor([0, 5, 12], dtype=torch.int32)
    y = fp8(x=x, w=w, expert_offsets=offsets)
    y.backward(torch.randn(y.shape, generator=gen).bfloat16())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    out = torch.full((12, 256), float("nan"), dtype=torch.bfloat16)
    assert fp8(x=x.detach(), w=w.detach(), expert_offsets=offsets, y=out) is out
    assert torch.equal(out, y.detach())


def test_quantize_refuses_what_it_cannot_quantize() -> None:
    for value in (torch.ones(4, 256, dtype=torch.int32), torch.ones(4, 256, dtype=torch.bool),
                  torch.ones(4, 256, dtype=torch.complex64)):
        with pytest.raises(ArgumentError, match="floating-point"):
            gt.quantize(value, "e4m3", (1, 128))
    with pytest.raises(ArgumentError, match="blocks \\[1, 128.0\\]"):
        gt.quantize(torch.ones(4, 256), "e4m3", (1, 128.0))
    q, scale = gt.quantize(torch.randn(4, 256, requires_grad=True), "e4m3", (1, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (4, 2) and q.is_contiguous()
    assert not q.requires_grad and not scale.requires_grad


def test_fake_implementation_names_an_input_of_too_few_dims() -> None:
    """Sizing a fresh output from an input of the wrong rank is the argument's error, not
    an IndexError from inside the fake (or eager) allocation."""
    op = gt.op(BF16.replace("doc_claims_bf16", "doc_claims_rank").replace("N = 64, K = 128", "K = 128")
               .replace("dim T", "dim T, N"))
    meta = {"x": torch.empty(12, 128, dtype=torch.bfloat16, device="meta"),
            "w": torch.empty(2, dtype=torch.bfloat16, device="meta"),
            "offs": torch.empty(3, dtype=torch.int32, device="meta")}
    with pytest.raises(ArgumentError, match="tensor 'w' must have 3 dims"):
        op(**meta)
