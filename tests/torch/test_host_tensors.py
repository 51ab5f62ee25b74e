"""Host (CPU) tensors passed to `gemmspec.torch.op` and `gemmspec.torch.function` are
refused with the error `gemmspec.build`'s executables give ("tensor 'x' is on the host;
pass a CUDA tensor"), not torch's dispatcher message about a missing CPU backend; a CPU
kernel registered for the op (as the CPU tests register the reference) still takes them."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from reference_ops import CpuKernels  # noqa: E402

import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402

# A spec of its own: ops are shared by spec text, and other tests register CPU kernels.
SPEC = """\
gemm host_tensors_{tag} {{
  dim T
  dim N = 64, K = 128
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""
HOST = "tensor 'x' is on the host; pass a CUDA tensor"


def inputs(device: str = "cpu") -> dict:
    return {
        "x": torch.ones(12, 128, dtype=torch.bfloat16, device=device),
        "w": torch.ones(2, 64, 128, dtype=torch.bfloat16, device=device),
        "offs": torch.tensor([0, 5, 12], dtype=torch.int32, device=device),
    }


def test_op_refuses_host_tensors_by_name() -> None:
    op = gt.op(SPEC.format(tag="op"))
    with pytest.raises(ArgumentError, match=HOST):
        op(**inputs())
    y = torch.empty(12, 64, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match=HOST):
        op(**inputs(), y=y)
    # The first host tensor is named: here the weight, the activations being on meta.
    mixed = {**inputs("meta"), "w": torch.ones(2, 64, 128, dtype=torch.bfloat16)}
    with pytest.raises(ArgumentError, match="tensor 'w' is on the host"):
        op(**mixed)


def test_meta_tensors_still_take_the_fake_implementation() -> None:
    op = gt.op(SPEC.format(tag="op"))
    y = op(**inputs("meta"))
    assert y.device.type == "meta" and tuple(y.shape) == (12, 64) and y.dtype == torch.bfloat16


def test_function_refuses_host_tensors_before_quantizing() -> None:
    fn = gt.function(SPEC.format(tag="function"))
    with pytest.raises(ArgumentError, match=HOST):
        fn(**inputs())
    with pytest.raises(ArgumentError, match=HOST):
        fn(**inputs(), y=torch.empty(12, 64, dtype=torch.bfloat16))


def test_a_registered_cpu_kernel_takes_host_tensors() -> None:
    kernels = CpuKernels()
    fn = kernels(gt.function(SPEC.format(tag="registered")))
    y = fn(**inputs())
    # Every row is a sum of 128 products of ones.
    assert y.device.type == "cpu" and torch.equal(y, torch.full((12, 64), 128.0, dtype=torch.bfloat16))
