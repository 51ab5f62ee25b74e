"""`gemmspec.torch.function` given its outputs: it writes them in place and returns them,
as `gemmspec.torch.op` does, so a test can poison them before the call. On the CPU, the
reference stands in for the kernels (reference_ops)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
from reference_ops import CpuKernels  # noqa: E402

import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402

SPEC = """\
gemm function_outputs {
  dim T
  dim N = 64, K = 128
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
COUNTS = [5, 0, 11]


@pytest.fixture(scope="module")
def fn():
    kernels = CpuKernels()
    yield kernels(gt.function(SPEC), in_place=True)


def inputs(seed: int = 0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    t = sum(COUNTS)
    return {
        "x": torch.randn(t, 128, generator=gen, dtype=torch.bfloat16, requires_grad=True),
        "w": (torch.randn(3, 64, 128, generator=gen) / 16).to(torch.bfloat16).requires_grad_(True),
        "offs": torch.tensor([0, *np.cumsum(COUNTS).tolist()], dtype=torch.int32),
    }


def test_given_outputs_are_written_in_place_and_returned(fn) -> None:
    assert fn.forward_op.outputs == ("y",)
    fresh_args = inputs()
    fresh = fn(**fresh_args)
    poisoned = torch.full((sum(COUNTS), 64), float("nan"), dtype=torch.bfloat16)
    args = inputs()
    y = fn(**args, y=poisoned)
    assert y is poisoned and not torch.isnan(y).any()
    assert torch.equal(y.detach(), fresh.detach())
    # Gradients flow from the written output as from a fresh one.
    dy = torch.randn(sum(COUNTS), 64, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    fresh.backward(dy)
    y.backward(dy)
    assert torch.equal(args["x"].grad, fresh_args["x"].grad)
    assert torch.equal(args["w"].grad, fresh_args["w"].grad)


def test_unknown_names_and_outputs_that_require_grad_are_refused(fn) -> None:
    y = torch.zeros(sum(COUNTS), 64, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match=r"optionally every output \(y\).*unknown \['z'\]"):
        fn(**inputs(), z=y)
    with pytest.raises(ArgumentError, match="output 'y' requires grad"):
        fn(**inputs(), y=y.clone().requires_grad_(True))


TWO_OUTPUTS = """\
gemm function_two_outputs {
  dim T
  dim N = 64, K = 128
  tensor x : bf16 [T, K]
  tensor u : bf16 [N, K]
  tensor v : bf16 [N, K]
  tensor y : bf16 [T, N]
  tensor z : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * u[n, k]
  z[t, n] = sum[k] x[t, k] * v[n, k]
}
"""


def test_every_output_or_none() -> None:
    kernels = CpuKernels()  # kept: its registrations live as long as it does
    fn = kernels(gt.function(TWO_OUTPUTS), in_place=True)
    gen = torch.Generator().manual_seed(2)
    args = {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in
            (("x", (7, 128)), ("u", (64, 128)), ("v", (64, 128)))}
    y = torch.full((7, 64), float("nan"), dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="pass every output \\(y, z\\) or none; missing z"):
        fn(**args, y=y)
    z = torch.full((7, 64), float("nan"), dtype=torch.bfloat16)
    got_y, got_z = fn(**args, y=y, z=z)
    assert got_y is y and got_z is z
    want_y, want_z = fn(**args)
    assert torch.equal(y, want_y) and torch.equal(z, want_z)
