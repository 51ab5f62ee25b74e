"""The derived backward of a statement that scatters its output rows through an index
and/or weights them per row (`y[dst[t], n] = route_w[t] * sum[f] h[t, f] * w[...]`): the
DGRAD reads dy's rows through the index (before the row weight: G), the WGRAD reads
`requantize(dy, rows = dst, weight = route_w)`; the row weight's gradient is the row pass
`rowdot(G, h)` and dh the row pass `rowscale(G, weight = route_w)`; a BF16 statement of
that form is skipped with its reason."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec
from gemmspec.backward import derive_backward

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"

DGRAD = "dh_pre[t, f] = sum[n] dy[dst[t], n] * w_down_t[expert(t), n, f]"
DGRAD_TEXT = f"{DGRAD}; dh = rowscale(dh_pre, weight = route_w)"
ROWDOT = "droute_w = rowdot(dh_pre, h): droute_w[t] = sum[f] dh_pre[t, f] * h[t, f]"
WGRAD = "dw_down[e, n, f] = sum[t in expert(e)] dyw_q[t, n] * h_t[t, f]"

ONE = """\
gemm down {{
  dim T
  dim N = 256, K = 384
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor x   : {t} [T, K]{xs}
  tensor w   : {t} [E, N, K]{ws}
  tensor y   : bf16 [T, N]
  {stmt}
}}
"""


def one(stmt: str, fp8: bool = True) -> str:
    if fp8:
        return ONE.format(t="e4m3", xs=" scale f32 [1, 128]", ws=" scale f32 [1, 128, 128]", stmt=stmt)
    return ONE.format(t="bf16", xs="", ws="", stmt=stmt)


def example_backward():
    return derive_backward(gemmspec.build(EXAMPLE).spec)


def test_the_example_derives_both_gradients_of_its_down_projection():
    bw = example_backward()
    assert [(d.forward, d.kind, d.wrt, d.grad, d.text) for d in bw.statements] == [
        (1, "dgrad", "h", "dh", DGRAD_TEXT),
        (1, "wgrad", "w_down", "dw_down", WGRAD),
        (1, "rowdot", "route_w", "droute_w", ROWDOT),
        (0, "dgrad", "x", "dx", bw.statements[3].text),  # the SwiGLU's (test_swiglu_backward)
        (0, "wgrad", "w_up", "dw_up", bw.statements[4].text),
    ]
    assert bw.output_grads == (("y", "dy"),)
    assert bw.copies == (("h_t", "h_t"),) and bw.copies_unused == ()
    assert bw.not_derived == ()
    assert bw.skipped == ()
    src = bw.source
    assert "  tensor dy : e4m3 [T, H] scale f32 [1, 128]\n" in src  # 1x128 along n
    assert "  tensor dst : i32 [T] layout row_major\n" in src
    assert "  tensor route_w : f32 [T] layout row_major\n" in src
    assert (
        "  tensor dyw_q : e4m3 [T, H] layout segment_major(expert) pad 16 scale f32 [128, 1] "
        "per expert = requantize(dy, rows = dst, weight = route_w)\n"
    ) in src
    # Only the dims the backward's tensors use (S and N: x and w_up, read by the SwiGLU's).
    assert "  dim T\n  dim S\n  dim H = 7168\n  dim N = 4096\n  dim F = 2048\n  dim E = 8\n" in src
    # The WGRAD reads the forward's copy: h is not requantized; the rowdot reads h as the
    # forward wrote it (1x128 scales).
    assert "requantize(h" not in src
    assert "  tensor h : e4m3 [T, F] layout row_major scale f32 [1, 128] layout row_major as h_scale\n" in src
    assert "  tensor dh_pre : bf16 [T, F]\n" in src
    assert "  tensor dh : bf16 [T, F] = rowscale(dh_pre, weight = route_w)\n" in src
    assert "  tensor droute_w : f32 [T] = rowdot(dh_pre, h)\n" in src


def test_the_backward_spec_checks_lowers_and_emits():
    from gemmspec.build import build_backward

    exe, bw = build_backward(gemmspec.build(EXAMPLE).spec)
    assert [g.text for g in exe.spec.gemms][:2] == [DGRAD, WGRAD]
    passes = {(p.kind, p.source, p.index, p.weight) for p in exe.schedule.prepasses}
    assert ("requantize", "dy", "dst", "route_w") in passes
    assert ("transpose", "w_down", None, None) in passes
    assert not any(p.source == "h" for p in exe.schedule.prepasses)
    dgrad = exe.program.launches[0]
    assert dgrad.gemm.epilogue == ()  # the DGRAD before the weight
    assert [(p.kind, p.source, p.target, p.other, p.weight) for p in exe.schedule.postpasses] == [
        ("rowscale", "dh_pre", "dh", None, "route_w"),
        ("rowdot", "dh_pre", "droute_w", "h", None),
        ("scatter_add", "dx_rows", "dx", None, None),
    ]
    names = exe.argument_names()
    assert {"dy", "dy_scale", "dst", "route_w", "h", "h_scale", "h_t", "h_t_scale", "dh", "dh_pre", "dw_down", "droute_w"} <= set(names)
    roles = exe._argument_roles()
    assert {n: roles[n] for n in ("dh_pre", "dh", "droute_w", "h")} == {
        "dh_pre": "output", "dh": "output", "droute_w": "output", "h": "input",
    }


def test_explain_prints_what_is_derived_and_what_is_not():
    text = gemmspec.build(EXAMPLE).explain()
    block = text[text.index("backward (derived):"):]
    assert f"  dgrad of h (statement #1): {DGRAD_TEXT}" in block
    assert f"  wgrad of w_down (statement #1): {WGRAD}" in block
    assert f"  rowdot of route_w (statement #1): {ROWDOT}" in block
    assert "gradient not derived" not in block
    assert "not derived" not in block  # the SwiGLU's too (test_swiglu_backward)
    assert "  h_t: the forward's copy h_t" in block


@pytest.mark.parametrize(
    "stmt, dgrad, wgrad_operand",
    [
        ("y[dst[t], n] = sum[k] x[t, k] * w[expert(t), n, k]",
         "dx[t, k] = sum[n] dy[dst[t], n] * w_t[expert(t), n, k]", "requantize(dy, rows = dst)"),
        ("y[t, n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]",
         "dx_pre[t, k] = sum[n] dy[t, n] * w_t[expert(t), n, k]; dx = rowscale(dx_pre, weight = rw)",
         "requantize(dy, weight = rw)"),
        ("y[dst[t], n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]",
         "dx_pre[t, k] = sum[n] dy[dst[t], n] * w_t[expert(t), n, k]; dx = rowscale(dx_pre, weight = rw)",
         "requantize(dy, rows = dst, weight = rw)"),
    ],
    ids=["scatter", "weight", "both"],
)
def test_one_statement_forms(stmt, dgrad, wgrad_operand):
    bw = derive_backward(gemmspec.build(one(stmt)).spec)
    assert not bw.skipped
    d, w, *row = bw.statements
    assert d.text == dgrad
    assert [(r.kind, r.wrt, r.grad) for r in row] == ([("rowdot", "rw", "drw")] if "rw" in stmt else [])
    q = "dyw_q" if "weight" in wgrad_operand else "dy_q"
    assert w.text == f"dw[e, n, k] = sum[t in expert(e)] {q}[t, n] * x_q[t, k]"
    assert f"= {wgrad_operand}\n" in bw.source
    assert "= requantize(x)\n" in bw.source  # no copy: x is requantized as before
    assert bw.not_derived == ()
    exe = gemmspec.build(bw.source)  # checks, lowers, emits
    assert len(exe.program.launches) == 2
    assert len(exe.program.postpasses) == (2 if "rw" in stmt else 0)


@pytest.mark.parametrize(
    "stmt, fragment",
    [
        ("y[dst[t], n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]", "scatters its rows through 'dst' and weights its rows by 'rw' in bf16"),
        ("y[dst[t], n] = sum[k] x[t, k] * w[expert(t), n, k]", "scatters its rows through 'dst' in bf16"),
        ("y[t, n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k]", "weights its rows by 'rw' in bf16"),
    ],
)
def test_bf16_scattered_or_weighted_statements_derive_dx_but_not_dw(stmt, fragment):
    # In 16-bit the DGRAD reads dy's rows through the index (and the weight goes through
    # rowscale, its gradient through rowdot); the WGRAD would read dy's rows gathered and
    # weighted, which no 16-bit pass writes: w's gradient is not derived, with the reason.
    bw = derive_backward(gemmspec.build(one(stmt, fp8=False)).spec)
    assert not bw.skipped
    assert {d.wrt for d in bw.statements} == ({"x", "rw"} if "rw" in stmt else {"x"})
    why = dict(bw.not_derived)["w"]
    assert fragment in why and "no 16-bit pass writes them" in why
    dgrad = next(d.text for d in bw.statements if d.kind == "dgrad")
    assert ("dy[dst[t], n]" in dgrad) == ("dst" in stmt)
    exe = gemmspec.build(bw.source)  # checks, lowers, emits
    assert len(exe.program.postpasses) == (2 if "rw" in stmt else 0)


def test_gathered_rows_are_added_back_by_scatter_add_and_a_bias_gradient_is_not_derived():
    gathered = one("y[t, n] = sum[k] x[dst[t], k] * w[expert(t), n, k]")
    bw = derive_backward(gemmspec.build(gathered).spec)
    assert not bw.skipped
    assert [d.text for d in bw.statements] == [
        "dx_rows[t, k] = sum[n] dy[t, n] * w_t[expert(t), n, k]; dx = scatter_add(dx_rows, rows = dst)",
        "dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]",
    ]
    assert "  tensor x_q : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x, rows = dst)\n" in bw.source
    for form, why in (
        (one("y[t, n] = sum[k] x[dst[t], k] * w[expert(t), n, k]", fp8=False), "in 16-bit"),
        (one("y[t, n] = rw[t] * sum[k] x[dst[t], k] * w[expert(t), n, k]"), "with a row weight"),
    ):
        (s,) = derive_backward(gemmspec.build(form).spec).skipped
        assert "reads the rows of 'x' through 'dst'" in s.reason and why in s.reason
    bias = one("y[t, n] = sum[k] x[t, k] * w[expert(t), n, k] + b[expert(t), n]").replace(
        "  tensor y ", "  tensor b   : f32 [E, N]\n  tensor y "
    )
    bw = derive_backward(gemmspec.build(bias).spec)
    assert not bw.skipped and {d.wrt for d in bw.statements} == {"x", "w"}
    assert "its gradient, dD's columns summed over each leaf's rows, is not derived" in dict(bw.not_derived)["b"]


LINEAR = """\
gemm lin_scatter {
  dim T
  dim N = 256, K = 384
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : e4m3 [N, K] scale f32 [128, 128]
  tensor y   : bf16 [T, N]
  y[dst[t], n] = rw[t] * sum[k] x[t, k] * w[n, k]
}
"""


def test_an_ungrouped_statement_requantizes_into_one_segment():
    import numpy as np

    from gemmspec.pipeline import lower_file
    from gemmspec.reference.data import dim_size, random_inputs, random_runtime
    from gemmspec.reference.direct import run_direct
    from gemmspec.reference.schedule_exec import run_schedule

    bw = derive_backward(gemmspec.build(LINEAR).spec)
    assert [d.text for d in bw.statements] == [
        "dx_pre[t, k] = sum[n] dy[dst[t], n] * w_t[n, k]; dx = rowscale(dx_pre, weight = rw)",
        "dw[n, k] = sum[t] dyw_q[t, n] * x_q[t, k]",
        "drw = rowdot(dx_pre, x): drw[t] = sum[k] dx_pre[t, k] * x[t, k]",
    ]
    assert (
        "tensor dyw_q : e4m3 [T, N] layout major(T) scale f32 [128, 1] "
        "= requantize(dy, rows = dst, weight = rw)\n"
    ) in bw.source
    # The derived spec on the flat executor equals its direct semantics (129 rows).
    (low,) = lower_file(bw.source)
    spec = low.spec
    rng = np.random.default_rng(4)
    rt = random_runtime(spec, rng, dims={"T": 129})
    data = random_inputs(spec, rt, rng)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    direct, flat = run_direct(spec, rt, data, init), run_schedule(spec, rt, low.schedule, data, init)
    for name in ("dx", "dw", "drw", "dx_pre"):
        assert not np.isnan(direct[name]).any()
        assert np.allclose(direct[name], flat[name], rtol=1e-12, atol=1e-12 * np.abs(direct[name]).max())
