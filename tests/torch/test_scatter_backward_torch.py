"""gemmspec.torch.function over a statement with scattered, weighted rows
(`y[dst[t], n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]`, FP8): its gradients of x,
w and the row weight rw match float64 autograd on counts 0, 1, 127, 129, with the reference
standing in for the kernels on the CPU (rw's gradient is the row pass rowdot of the DGRAD
before the weight with x)."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec

torch = pytest.importorskip("torch")
from reference_ops import CpuKernels  # noqa: E402

import gemmspec.torch as gt  # noqa: E402

COUNTS = [0, 1, 127, 129]
N, K = 256, 384

SPEC = f"""
gemm moe_scatter_down {{
  dim T
  dim N = {N}, K = {K}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y   : bf16 [T, N]
  y[dst[t], n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]
}}
"""


@pytest.fixture(scope="module")
def cpu_kernels():
    yield CpuKernels()


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(COUNTS)
    x = torch.randn(t, K, generator=gen, dtype=torch.float64)
    w = torch.randn(4, N, K, generator=gen, dtype=torch.float64) / 16
    rw = torch.rand(t, generator=gen, dtype=torch.float64) + 0.5
    dst = torch.randperm(t, generator=gen).to(torch.int32)
    offs = torch.tensor([0, *np.cumsum(COUNTS).tolist()], dtype=torch.int32)
    return x, w, rw, dst, offs


def test_gradients_of_x_w_and_rw_match_float64(cpu_kernels):
    fn = cpu_kernels(gt.function(SPEC))
    assert fn.backward.not_derived == ()
    x, w, rw, dst, offs = _inputs()
    xb = x.to(torch.bfloat16).requires_grad_(True)
    wf = w.float().requires_grad_(True)
    rwf = rw.float().requires_grad_(True)
    y = fn(x=xb, w=wf, rw=rwf, dst=dst, offs=offs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(torch.bfloat16)
    y.backward(dy)
    # float64 autograd of the forward formula.
    xd, wd = xb.detach().double().requires_grad_(True), wf.detach().double().requires_grad_(True)
    rwd = rwf.detach().double().requires_grad_(True)
    o = offs.tolist()
    rows = torch.cat([xd[a:b] @ wd[e].T for e, (a, b) in enumerate(zip(o[:-1], o[1:]))]) * rwd[:, None]
    yd = torch.zeros_like(rows).index_copy(0, dst.long(), rows)
    yd.backward(dy.double())
    grads = (("y", y, yd.detach()), ("dx", xb.grad, xd.grad), ("dw", wf.grad, wd.grad), ("drw", rwf.grad, rwd.grad))
    for name, got, want in grads:
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 0.09, (name, err)
    assert rwf.grad.dtype == torch.float32 and rwf.grad.shape == rwf.shape
    assert (wf.grad[0] == 0).all()  # expert 0 has no tokens


def test_a_row_weight_without_grad_gets_none(cpu_kernels):
    fn = cpu_kernels(gt.function(SPEC))
    x, w, rw, dst, offs = _inputs(2)
    xf = x.float().requires_grad_(True)
    y = fn(x=xf, w=w.float(), rw=rw.float(), dst=dst, offs=offs)
    y.float().sum().backward()
    assert xf.grad is not None and xf.grad.shape == xf.shape


def test_explain_of_the_spec_says_how_the_weight_gradient_is_derived():
    text = gemmspec.build(SPEC).explain()
    assert "  rowdot of rw (statement #0): drw = rowdot(dx_pre, x): drw[t] = sum[k] dx_pre[t, k] * x[t, k]" in text
    assert "gradient not derived" not in text
