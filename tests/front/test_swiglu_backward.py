"""The derived backward of an FP8 SwiGLU statement: the gate/up columns recomputed, their
gradient quantized by swiglu_grad from the gradient of the SwiGLU's output (the DGRAD of
the statement that reads it, or an input where none does), then a DGRAD and a WGRAD over
the gate/up columns; gathered rows come back through scatter_add. The forms it does not
derive are skipped with their reason."""

from __future__ import annotations

from pathlib import Path

import gemmspec
from gemmspec.backward import derive_backward
from gemmspec.build import build_backward

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SWIGLU = "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]"

FFN = """\
gemm ffn {{
  dim T
  dim H = 256, N = 512, F = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x  : {t} [T, H]{xs}
  tensor w  : {t} [E, N, H]{ws}
  tensor h  : bf16 [T, F]
  tensor wd : bf16 [E, H, F]
  tensor wd2 : bf16 [E, H, F]
  tensor y  : bf16 [T, H]
  tensor y2 : bf16 [T, H]
  {stmts}
}}
"""


def ffn(*stmts: str, fp8: bool = True) -> str:
    scales = (" scale f32 [1, 128]", " scale f32 [1, 128, 128]") if fp8 else ("", "")
    return FFN.format(t="e4m3" if fp8 else "bf16", xs=scales[0], ws=scales[1], stmts="\n  ".join(stmts))


def test_a_swiglu_nobody_reads_takes_its_gradient_as_a_bf16_input():
    bw = derive_backward(gemmspec.build(EXAMPLES / "moe_swiglu_fp8.gspec").spec)
    assert bw.skipped == () and bw.output_grads == (("h", "dh"),)
    assert [(d.kind, d.wrt, d.grad) for d in bw.statements] == [("dgrad", "x", "dx"), ("wgrad", "w", "dw")]
    src = bw.source
    assert "  tensor dh : bf16 [T, F]\n" in src  # unscaled: swiglu_grad reads it as it is
    assert "  tensor h_gate_up : bf16 [T, N]\n" in src
    assert "  tensor dh_gate_up : e4m3 [T, N] scale f32 [1, 128] = swiglu_grad(h_gate_up, dh)\n" in src
    assert "  h_gate_up[t, j] = sum[k] x[t, k] * w[expert(t), j, k]\n" in src
    assert "  dx[t, k] = sum[j] dh_gate_up[t, j] * w_t[expert(t), j, k]\n" in src
    assert "  dw[e, j, k] = sum[t in expert(e)] dh_gate_up_q[t, j] * x_q[t, k]\n" in src
    # The WGRAD's 128x1 form from the same bf16 gradients, not requantized from dh_gate_up.
    assert (
        "  tensor dh_gate_up_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] "
        "per expert = swiglu_grad(h_gate_up, dh)\n"
    ) in src
    assert "requantize(dh_gate_up)" not in src
    exe, _ = build_backward(gemmspec.build(EXAMPLES / "moe_swiglu_fp8.gspec").spec)
    steps = [(k, getattr(x, "target", None) or x.statement_text.split("[")[0]) for k, _, x in exe.schedule.steps()]
    at = {s: i for i, s in enumerate(steps)}
    # The recompute first, then both passes, and the DGRAD and WGRAD reading them.
    assert at[("launch", "h_gate_up")] < at[("prepass", "dh_gate_up")] < at[("launch", "dx")]
    assert at[("launch", "h_gate_up")] < at[("prepass", "dh_gate_up_q")] < at[("launch", "dw")]


def test_the_example_ffn_chains_the_down_projections_dgrad_into_the_swiglu():
    exe, bw = build_backward(gemmspec.build(EXAMPLES / "moe_ffn_fp8_train.gspec").spec)
    assert bw.skipped == () and bw.output_grads == (("y", "dy"),)  # no input gradient of h
    d0 = [d for d in bw.statements if d.forward == 0]
    assert [(d.kind, d.wrt, d.grad) for d in d0] == [("dgrad", "x", "dx"), ("wgrad", "w_up", "dw_up")]
    assert d0[0].text.endswith(
        "dx_rows[t, k] = sum[j] dh_gate_up[t, j] * w_up_t[expert(t), j, k]; dx = scatter_add(dx_rows, rows = src)"
    )
    assert "swiglu_grad(h_gate_up, dh)" in d0[0].text  # dh: the rowscale of the down DGRAD
    assert d0[1].text == (
        "dh_gate_up_q = swiglu_grad(h_gate_up, dh) in [128, 1] blocks per expert; "
        "dw_up[e2, j, k] = sum[t in expert(e2)] dh_gate_up_q[t, j] * x_q[t, k]"
    )
    steps = [(k, getattr(x, "target", None) or x.statement_text.split("[")[0]) for k, _, x in exe.schedule.steps()]
    at = {s: i for i, s in enumerate(steps)}
    assert at[("launch", "dh_pre")] < at[("postpass", "dh")] < at[("prepass", "dh_gate_up")]
    assert at[("postpass", "dh")] < at[("prepass", "dh_gate_up_q")]
    assert at[("launch", "h_gate_up")] < at[("prepass", "dh_gate_up")] < at[("prepass", "dh_gate_up_q")]
    assert at[("prepass", "dh_gate_up")] < at[("launch", "dx_rows")] < at[("postpass", "dx")]
    assert at[("prepass", "dh_gate_up_q")] < at[("launch", "dw_up")]
    assert {"x", "x_scale", "w_up", "w_up_scale", "src", "dx", "dw_up", "h_gate_up", "dx_rows"} <= set(exe.argument_names())


def test_a_bf16_swiglu_is_skipped_with_the_reason():
    bw = derive_backward(gemmspec.build(ffn(SWIGLU, fp8=False)).spec)
    (s,) = bw.skipped
    assert s.forward == 0 and "it fuses SwiGLU in bf16" in s.reason and "swiglu_grad pass" in s.reason
    assert "writes FP8 only" in s.reason and not bw.statements


def test_two_readers_sum_their_gradients_of_the_swiglu_output():
    # h read by two statements: the second DGRAD adds into the first's dh, which
    # swiglu_grad reads after both.
    text = ffn(SWIGLU, "y[t, n] = sum[f] h[t, f] * wd[expert(t), n, f]", "y2[t, n] = sum[f] h[t, f] * wd2[expert(t), n, f]")
    exe, bw = build_backward(gemmspec.build(text).spec)
    assert not bw.skipped
    texts = [d.text for d in bw.statements if d.wrt == "h"]
    assert texts == [
        "dh[t, f] = sum[n] dy[t, n] * wd[expert(t), n, f]",
        "dh[t, f] += sum[n] dy2[t, n] * wd2[expert(t), n, f]",
    ]
    steps = [(k, getattr(x, "target", None) or x.statement_text.split("[")[0]) for k, _, x in exe.schedule.steps()]
    dh_writes = [i for i, s in enumerate(steps) if s == ("launch", "dh")]
    assert len(dh_writes) == 2 and max(dh_writes) < steps.index(("prepass", "dh_gate_up"))


def test_a_reader_that_is_not_derived_leaves_the_swiglu_without_a_gradient():
    text = ffn(SWIGLU, "wd[e, n, f] = sum[t in expert(e)] y[t, n] * h[t, f]")
    bw = derive_backward(gemmspec.build(text).spec)
    reasons = {s.forward: s.reason for s in bw.skipped}
    assert "it is K-grouped already" in reasons[1]
    assert "read by a statement whose gradient is not derived" in reasons[0]
