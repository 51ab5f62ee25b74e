"""`T = copy(S)`: a second FP8 output of the statement that writes the FP8 output S,
segment-major per ragged group with [128, 1] scales per group. What the checker accepts,
and each refusal located at its token with a note."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse

BASE = """\
gemm g {
  dim T, S
  dim N = 512, F = 256, K = 384
  group expert[E = 4] = ragged(T, offsets = offs)
  group lora[L = 2] = ragged(T, offsets = loffs)
  group inner[I = 2] = ragged(T within lora, offsets = ioffs)
  group cap[C = 4] = ragged(T, offsets = coffs, capacity)
  tensor idx : i32 [T]
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wi : e4m3 [L, I, N, K] scale f32 [1, 1, 128, 128]
  tensor wc : e4m3 [C, N, K] scale f32 [1, 128, 128]
  tensor wn : e4m3 [N, K] scale f32 [128, 128]
  tensor rw : f32 [T]
  tensor y : e4m3 [T, N] scale f32 [1, 128]
  tensor h : e4m3 [T, F] scale f32 [1, 128]
  COPY
  STATEMENT
}
"""
COPY_LINE, LINE = 18, 19
PLAIN = "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]"
SWIGLU = "h[t, j] = silu(sum[k] xs[idx[t], k] * w[expert(t), 2*j, k]) * sum[k] xs[idx[t], k] * w[expert(t), 2*j + 1, k]"
YT = "tensor y_t : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = copy(y)"
HT = "tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = copy(h)"


def spec_with(copy: str, statement: str, directive: str = "") -> str:
    return BASE.replace("COPY", copy).replace("STATEMENT", statement + (f"\n  {directive}" if directive else ""))


def checked(copy: str, statement: str, directive: str = ""):
    (spec,) = check(parse(spec_with(copy, statement, directive), "s.gspec"))
    return spec


@pytest.mark.parametrize(
    "copy, statement",
    [
        (YT, PLAIN),
        (YT.replace("segment_major(expert)", "segment_major(expert) pad 16"), PLAIN),
        (YT.replace("per expert", "per expert pow2"), PLAIN),
        (YT.replace("per expert", "per expert as y_t_sf"), PLAIN),
        (HT, SWIGLU),
        (HT, SWIGLU.replace("= silu", "= rw[t] * silu")),
        (YT, "y[t, n] = rw[t] * sum[k] xs[idx[t], k] * w[expert(t), n, k]"),
    ],
)
def test_copies_are_accepted_and_attached_to_their_statement(copy, statement):
    spec = checked(copy, statement)
    (g,) = spec.gemms
    target = copy.split()[1]
    assert g.copy == target
    assert g.writes == (g.out.tensor, target)
    t = spec.tensor(target)
    assert t.copy_of == g.out.tensor and t.derived is None
    assert f"copy({g.out.tensor})" in str(t)


def test_a_statement_reading_the_copy_runs_after_its_writer():
    from gemmspec.analyse import dependency_order

    # The WGRAD-style reader comes first in the text; the copy's writer runs first.
    wgrad = (
        "tensor xq : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert\n"
        "  tensor dw : f32 [E, N, K]\n"
        "  dw[e, n, k] += sum[t in expert(e)] y_t[t, n] * xq[t, k]\n  "
    )
    spec = checked(YT + "\n  " + wgrad.rstrip(), PLAIN)
    assert [g.copy for g in spec.gemms] == [None, "y_t"]
    assert dependency_order(spec) == [1, 0]


# (copy, statement, directive, line, token, message fragment, note fragment or None)
ERRORS = {
    "not-written": (
        YT.replace("copy(y)", "copy(x)").replace("[T, N]", "[T, K]"), PLAIN, "", COPY_LINE, "x)",
        "not written by a statement", "requantize(x)",
    ),
    "source-bf16": (
        "tensor yb : bf16 [T, N]\n  tensor y_t : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = copy(yb)",
        PLAIN, "", COPY_LINE + 1, "yb)", "is bf16", "quantize",
    ),
    "of-itself": (YT.replace("copy(y)", "copy(y_t)"), PLAIN, "", COPY_LINE, "y_t)", "copy of itself", None),
    "other-type": (YT.replace("y_t : e4m3", "y_t : e5m2"), PLAIN, "", COPY_LINE, "e5m2", "declared e5m2", "as e4m3"),
    "other-shape": (YT.replace("[T, N] layout", "[T, F] layout"), PLAIN, "", COPY_LINE, "T, F", "keeps the logical shape", None),
    "no-scale": (YT.replace(" scale f32 [128, 1] per expert", ""), PLAIN, "", COPY_LINE, "y_t", "has no scale", "[128, 1] per GROUP"),
    "option": (YT.replace("copy(y)", "copy(y, pow2)"), PLAIN, "", COPY_LINE, "pow2)", "takes no options", None),
    "chained": (
        YT + "\n  tensor y_u : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = copy(y_t)",
        PLAIN, "", COPY_LINE + 1, "y_t)", "copies do not chain", "copy(y)",
    ),
    "written-by-a-statement": (
        YT, PLAIN + "\n  y_t[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", "", LINE + 1, "y_t", "cannot be written by another", None,
    ),
    "row-major": (YT.replace("layout segment_major(expert) ", ""), PLAIN, "", COPY_LINE, "y_t", "stores 'y_t' segment_major(expert)", "segment_major(expert)"),
    "major-T": (YT.replace("segment_major(expert)", "major(T)"), PLAIN, "", COPY_LINE, "layout", "segment_major(expert)", "segment_major(expert)"),
    "scale-block": (YT.replace("[128, 1]", "[1, 128]"), PLAIN, "", COPY_LINE, "1, 128]", "[128, 1]", "per expert"),
    "not-anchored": (YT.replace(" per expert", ""), PLAIN, "", COPY_LINE, "scale", "not anchored", "per expert"),
    "ungrouped": (
        YT, "y[t, n] = sum[k] x[t, k] * wn[n, k]", "", COPY_LINE,
        "copy", "does not split T by a group", "M-grouped",
    ),
    "nested": (
        YT.replace("expert", "inner"), "y[t, n] = sum[k] x[t, k] * wi[lora(t), inner(t), n, k]", "", COPY_LINE,
        "copy", "nested within 'lora'", "requantize",
    ),
    "capacity": (
        YT.replace("expert", "cap"), "y[t, n] = sum[k] x[t, k] * wc[cap(t), n, k]", "", COPY_LINE,
        "copy", "has a capacity", "requantize",
    ),
    "scattered": (
        YT, "y[idx[t], n] = sum[k] x[t, k] * w[expert(t), n, k]", "", LINE, "idx", "stored at its own rows only", None,
    ),
    "accumulate": (YT, PLAIN.replace(" = ", " += "), "", LINE, "+=", "stored with `=`", None),
    "tile-64": (YT, PLAIN, "tile(64, 128)", LINE + 1, "tile", "one 128-row tile each", "tile(128, 128)"),
}


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_located_with_a_note(case):
    copy, statement, directive, line, token, fragment, note = ERRORS[case]
    text = spec_with(copy, statement, directive)
    with pytest.raises(SpecError) as info:
        check(parse(text, "s.gspec"))
    err = info.value
    assert fragment in err.message, err.render()
    assert err.location.line == line, err.render()
    src = text.splitlines()[line - 1]
    assert err.location.column == src.index(token) + 1, err.render()
    if note is not None:
        assert err.note is not None and note in err.note, err.render()
