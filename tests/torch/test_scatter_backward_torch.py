"""gemmspec.torch.function over a statement with scattered, weighted rows
(`y[dst[t], n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]`, FP8): its gradients of x
and w match float64 autograd on counts 0, 1, 127, 129, with the reference standing in for
the kernels on the CPU; the row weight's gradient is not derived, so a call whose `rw`
requires grad is refused with the reason rather than given None."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError

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


def test_gradients_of_x_and_w_match_float64(cpu_kernels):
    fn = cpu_kernels(gt.function(SPEC))
    assert [n for n, _ in fn.backward.not_derived] == ["rw"]
    x, w, rw, dst, offs = _inputs()
    xb = x.to(torch.bfloat16).requires_grad_(True)
    wf = w.float().requires_grad_(True)
    rwf = rw.float()
    y = fn(x=xb, w=wf, rw=rwf, dst=dst, offs=offs)
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(torch.bfloat16)
    y.backward(dy)
    # float64 autograd of the forward formula.
    xd, wd = xb.detach().double().requires_grad_(True), wf.detach().double().requires_grad_(True)
    o = offs.tolist()
    rows = torch.cat([xd[a:b] @ wd[e].T for e, (a, b) in enumerate(zip(o[:-1], o[1:]))]) * rwf.double()[:, None]
    yd = torch.zeros_like(rows).index_copy(0, dst.long(), rows)
    yd.backward(dy.double())
    for name, got, want in (("y", y, yd.detach()), ("dx", xb.grad, xd.grad), ("dw", wf.grad, wd.grad)):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 0.09, (name, err)
    assert (wf.grad[0] == 0).all()  # expert 0 has no tokens


def test_a_row_weight_that_requires_grad_is_refused(cpu_kernels):
    fn = cpu_kernels(gt.function(SPEC))
    x, w, rw, dst, offs = _inputs(2)
    with pytest.raises(ArgumentError, match=r"'rw' requires grad, but its gradient is not derived \(the row weight"):
        fn(x=x.float(), w=w.float(), rw=rw.float().requires_grad_(True), dst=dst, offs=offs)
    with torch.no_grad():  # no graph: nothing to refuse
        fn(x=x.float(), w=w.float(), rw=rw.float().requires_grad_(True), dst=dst, offs=offs)


def test_explain_of_the_spec_says_the_weight_gradient_is_not_derived():
    text = gemmspec.build(SPEC).explain()
    assert "  rw: gradient not derived: the row weight of statement #0;" in text
