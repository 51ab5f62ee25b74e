"""Derived backward statements: every example's are checked, lowered and emitted (or
reported with a reason), `explain` prints them, and gemmspec.torch.function's
gradients match float64 torch on small ragged shapes (counts 0, 1, 127, 129). With
no GPU, the custom ops run the spec's direct semantics (gemmspec.reference) on the
CPU in place of the kernels, so the derivation, the quantization recipe and the
autograd plumbing are what is tested here; tests/gpu runs the same on the kernels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.backward import derive_backward
from gemmspec.bench import moe_spec
from gemmspec.build import build_backward

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))
DERIVED = {
    "linear_fp8_training", "lora_moe_nested", "lora_moe_scaled", "lora_qkv_slices", "moe_bf16_forward", "moe_ffn_fp8", "moe_ffn_fp8_train",
    "moe_fp8_forward", "moe_fp8_gather_scatter", "moe_swiglu_fp8", "split_nest", "lora_qkv_one_spec", "moe_ffn_fp8_decode",
}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_example_derives_or_says_why(path):
    spec = gemmspec.build(path).spec
    bw = derive_backward(spec)
    covered = {s.forward for s in bw.skipped} | {d.forward for d in bw.statements}
    assert covered == {g.index for g in spec.gemms}
    assert all(s.reason for s in bw.skipped)
    assert bool(bw.statements) == (path.stem in DERIVED)
    if bw.statements:
        exe, _ = build_backward(spec)  # parse, check, analyse, lower, emit
        gemms = [d for d in bw.statements if d.kind in ("dgrad", "wgrad")]
        # A SwiGLU's backward recomputes its gate/up columns: one more statement.
        skipped = {x.forward for x in bw.skipped}
        swiglus = [g for g in spec.gemms if g.swiglu and g.index not in skipped]
        assert len(exe.spec.gemms) == len(gemms) + len(swiglus) and exe.program.launches
        # Every statement derived has its DGRAD, and its WGRAD unless the weight's gradient
        # is said not to be derived (nested groups, a 16-bit row weight).
        underived = dict(bw.not_derived)
        for g in spec.gemms:
            kinds = [d.kind for d in gemms if d.forward == g.index]
            if kinds:
                assert kinds.count("dgrad") == 1
                assert kinds.count("wgrad") == (0 if g.b.tensor in underived else 1)
        # A row weight's gradient is a row pass (rowdot) beside rowscale, one per weighted
        # statement; gathered A rows come back through scatter_add.
        rows = [d for d in bw.statements if d.kind == "rowdot"]
        gathered = [g for g in spec.gemms if g.gather and g.index not in skipped]
        assert len(exe.schedule.postpasses) == 2 * len(rows) + len(gathered)
        # Two swiglu_grad passes per SwiGLU: the DGRAD's 1x128 operand and the WGRAD's 128x1.
        assert [p.kind for p in exe.schedule.prepasses].count("swiglu_grad") == 2 * len(swiglus)


def test_fp8_moe_backward_follows_the_recipe():
    bw = derive_backward(gemmspec.build(EXAMPLES[0].parent / "moe_fp8_forward.gspec").spec)
    assert [d.text for d in bw.statements] == [
        "dx[t, k] = sum[n] dy[t, n] * w_t[expert(t), n, k]",
        "dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]",
    ]
    src = bw.source
    assert "tensor dy : e4m3 [T, N] scale f32 [1, 128]" in src  # 1x128 output gradient
    # w transposed by the backward's own pre-pass (3-D: a batch of experts), 128x128 kept.
    assert "layout major(N) scale f32 [1, 128, 128] layout row_major as w_t_scale = transpose(w)" in src
    # Tokens of each expert padded to 16: FP8 rows of whole 16-byte units, loaded by TMA.
    assert "segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)" in src
    assert "tensor dx : bf16 [T, K]" in src and "tensor dw : f32 [E, N, K]" in src
    assert bw.transposed == ()  # nothing left for the caller to copy


def test_explain_prints_the_derived_statements():
    text = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_forward.gspec").explain()
    assert "backward (derived):" in text
    assert "wgrad of w (statement #0): dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]" in text
    text = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_wgrad.gspec").explain()
    assert "statement #0: not derived: it is K-grouped already (a WGRAD-style statement)" in text


# ---- autograd on the CPU, the reference standing in for the kernels ------------------
torch = pytest.importorskip("torch")
from reference_ops import CpuKernels  # noqa: E402

import gemmspec.torch as gt  # noqa: E402

COUNTS = [0, 1, 127, 129]


def moe(fp8: bool, n: int = 256, k: int = 384) -> str:
    kind = "fp8" if fp8 else "bf16"
    return moe_spec(f"moe_grad_{kind}_n{n}_k{k}", n=n, k=k, e=4, fp8=fp8)


@pytest.fixture(scope="module")
def cpu_kernels():
    yield CpuKernels()


def _inputs(seed=0, n=256, k=384):
    gen = torch.Generator().manual_seed(seed)
    t = sum(COUNTS)
    x = torch.randn(t, k, generator=gen, dtype=torch.float64)
    w = torch.randn(4, n, k, generator=gen, dtype=torch.float64) / 16
    offs = torch.tensor([0, *np.cumsum(COUNTS).tolist()], dtype=torch.int32)
    return x, w, offs


def _float64_reference(x, w, offs, dy):
    """y and the gradients by torch autograd in float64."""
    x = x.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    o = offs.tolist()
    y = torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip(o[:-1], o[1:]))])
    y.backward(dy)
    return y.detach(), x.grad, w.grad


# K = 320 and N = 264 are not whole 128-column blocks: x, w and dy go through the torch
# operations of gemmspec.torch.quantize rather than its kernel (on the GPU).
@pytest.mark.parametrize("n, k", [(256, 384), (264, 320)], ids=["n256-k384", "n264-k320"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_function_gradients_match_float64(fp8, n, k, cpu_kernels):
    fn = cpu_kernels(gt.function(moe(fp8, n, k)))
    x, w, offs = _inputs(n=n, k=k)
    dy = torch.randn(x.shape[0], n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    xb = x.to(torch.bfloat16).requires_grad_(True)
    wf = w.float().requires_grad_(True)
    y = fn(x=xb, w=wf, offs=offs)
    assert y.dtype == torch.bfloat16 and y.shape == (257, n)
    y.backward(dy.to(torch.bfloat16))
    ry, rdx, rdw = _float64_reference(xb.double(), wf.double(), offs, dy.to(torch.bfloat16).double())
    # FP8 quantization (e4m3: 3 mantissa bits) of both factors bounds the error.
    tol = 0.09 if fp8 else 0.01
    for got, want in ((y, ry), (xb.grad, rdx), (wf.grad, rdw)):
        err = (got.double() - want).norm() / want.norm()
        assert err < tol, err
    assert xb.grad.dtype == torch.bfloat16 and wf.grad.dtype == torch.float32
    # Expert 0 has no tokens: its weight gradient is exactly zero.
    assert (wf.grad[0] == 0).all()


def test_function_refuses_what_it_cannot_differentiate():
    with pytest.raises(gemmspec.GemmspecError, match="no backward statement derived"):
        gt.function(EXAMPLES[0].parent / "moe_masked_decode.gspec")


def test_quantize_recipe_blocks():
    v = torch.randn(130, 300, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    q, s = gt.quantize(v, "e4m3", (1, 128))
    assert q.dtype == torch.float8_e4m3fn and s.shape == (130, 3)
    scale = s.double().repeat_interleave(128, dim=1)[:, :300]
    back = q.double() * scale
    # Round to nearest with 3 mantissa bits; below 2^-6 the subnormal step is 2^-9.
    assert ((back - v).abs() <= v.abs() * 2**-4 + scale * 2**-10 + 1e-12).all()
    _, s = gt.quantize(v, "e4m3", (128, 128))
    assert s.shape == (2, 3)
