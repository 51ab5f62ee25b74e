"""A derived WGRAD reads the forward's copy `T = copy(A)` in place of requantize(A) when
T is what that requantize would write, and says why not otherwise; the backward spec
it derives checks, lowers and plans no pre-pass for A."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec
from gemmspec.backward import derive_backward

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"


def plain_down(text: str) -> str:
    """The training FFN example with a plain down-projection (no router weight, rows
    stored in routing order): the statement whose backward is derived."""
    out = text.replace("y[dst[t], n] = route_w[t] * sum[f]", "y[t, n] = sum[f]")
    assert out != text
    return out


FFN = plain_down(EXAMPLE.read_text())


def backward_of(text: str, copies: bool = True):
    return derive_backward(gemmspec.build(text).spec, copies=copies)


def test_the_example_derives_its_scattered_weighted_down_projection_over_the_copy():
    """The example as written (rows scattered through dst, weighted by route_w): its
    down-projection's WGRAD reads the copy too (tests/front/test_scatter_backward.py)."""
    bw = derive_backward(gemmspec.build(EXAMPLE).spec)
    assert [(d.forward, d.kind) for d in bw.statements] == [
        (1, "dgrad"), (1, "wgrad"), (1, "rowdot"), (0, "dgrad"), (0, "wgrad"),
    ]
    assert bw.copies == (("h_t", "h_t"),)
    assert bw.skipped == ()  # the SwiGLU too (tests/front/test_swiglu_backward.py)


def test_the_wgrad_reads_the_copy_and_plans_no_requantize_of_h():
    bw = backward_of(FFN)
    wgrad = next(d for d in bw.statements if d.kind == "wgrad")
    assert wgrad.wrt == "w_down"
    assert wgrad.text == "dw_down[e, n, f] = sum[t in expert(e)] dy_q[t, n] * h_t[t, f]"
    assert bw.copies == (("h_t", "h_t"),) and bw.copies_unused == ()
    src = bw.source
    # h_t is a plain input (no `= ...`), as the forward declared it, without pow2.
    assert (
        "tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 "
        "scale f32 [128, 1] layout row_major per expert as h_t_scale\n"
    ) in src
    assert "requantize(h)" not in src and "tensor h " not in src  # A is not read at all
    assert "tensor dy_q : e4m3 [T, H] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)" in src
    exe = gemmspec.build(src)  # checks, analyses, lowers, emits
    passes = [(p.kind, p.source) for p in exe.schedule.prepasses]
    assert ("requantize", "dy") in passes
    assert all(source != "h" for _, source in passes)
    assert "h_t" in exe.argument_names() and "h_t_scale" in exe.argument_names()
    assert "h" not in exe.argument_names()


def test_explain_says_the_wgrad_reads_the_copy():
    text = gemmspec.build(FFN).explain()
    assert "wgrad of w_down (statement #1): dw_down[e, n, f] = sum[t in expert(e)] dy_q[t, n] * h_t[t, f]" in text
    assert "h_t: the forward's copy h_t (written in its source's epilogue), read by the WGRAD as it is: no requantize pre-pass for its source" in text


def test_without_copies_the_wgrad_requantizes_as_before():
    bw = backward_of(FFN, copies=False)
    assert bw.copies == () and bw.copies_unused == ()
    assert "tensor h_q : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(h)" in bw.source
    passes = [(p.kind, p.source) for p in gemmspec.build(bw.source).schedule.prepasses]
    assert ("requantize", "h") in passes and ("requantize", "dy") in passes


def test_a_pow2_copy_is_read_too():
    # The WGRAD takes any f32 scales; powers of two are the forward's choice.
    bw = backward_of(FFN.replace("per expert = copy(h)", "per expert pow2 = copy(h)"))
    assert bw.copies == (("h_t", "h_t"),)
    assert "pow2" not in bw.source  # an input's scales are values, not a rule


MISMATCHES = {
    "pad32": (("pad 16 scale", "pad 32 scale"), "its segments have pad 32, the WGRAD reads 'segment_major(expert) pad 16'"),
    "no-pad": ((" pad 16 scale", " scale"), "its segments have no pad, the WGRAD reads 'segment_major(expert) pad 16'"),
    "e5m2": (
        ("e4m3 [T, F]", "e5m2 [T, F]"),
        "it is e5m2, the WGRAD's requantized operand e4m3",
    ),
    "2-D weight": (
        None,
        "the WGRAD is not grouped over T (its weight has no group index), so it requantizes h into one major(T) segment",
    ),
    "other group": (
        None,
        "its layout 'segment_major(expert) pad 16' is not segment_major(lora) over T, the WGRAD's 'segment_major(lora) pad 16'",
    ),
}


def mismatched(case: str) -> str:
    edit, _ = MISMATCHES[case]
    if edit is not None:
        out = FFN.replace(*edit)
    elif case == "2-D weight":
        out = FFN.replace("tensor w_down  : e4m3 [E, H, F] scale f32 [1, 128, 128]", "tensor w_down  : e4m3 [H, F] scale f32 [128, 128]")
        out = out.replace("w_down[expert(t), n, f]", "w_down[n, f]")
    else:  # the down-projection's weights indexed by a second ragged grouping of T
        out = FFN.replace("  tensor src ", "  group lora[L = 2] = ragged(T, offsets = lora_offsets)\n  tensor src ")
        out = out.replace("tensor w_down  : e4m3 [E, H, F]", "tensor w_down  : e4m3 [L, H, F]")
        out = out.replace("w_down[expert(t), n, f]", "w_down[lora(t), n, f]")
    assert out != FFN
    return out


@pytest.mark.parametrize("case", sorted(MISMATCHES))
def test_a_copy_of_another_form_keeps_the_requantize_and_says_why(case):
    bw = backward_of(mismatched(case))
    assert bw.copies == ()
    reason = MISMATCHES[case][1]
    reason += "" if case == "2-D weight" else "; h is requantized"
    assert bw.copies_unused == (("h_t", reason),)
    assert "= requantize(h)" in bw.source
    assert f"  h_t: the forward's copy, not read: {reason}" in bw.text().splitlines()
    passes = [(p.kind, p.source) for p in gemmspec.build(bw.source).schedule.prepasses]
    assert ("requantize", "h") in passes
