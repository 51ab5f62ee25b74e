"""requantize(SOURCE, rows = IDX, weight = W): the requantize pre-pass reading its rows
through an int32 index and weighting each by an f32 before it quantizes. Valid forms
check and lower to one requantize pass that names the index and the weight; everything
else is a located error."""

from __future__ import annotations

import pytest
from located import check_error, edited

from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

SPEC = """\
gemm g {
  dim T, S
  dim N = 256, K = 384
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor dy  : e4m3 [S, N] scale f32 [1, 128]
  tensor x_t : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy, rows = dst, weight = rw)
  tensor dw  : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_t[t, k]
}
"""
LINE = 9  # the requantize declaration


def _r(old: str, new: str, text: str = SPEC) -> str:
    return edited(old, new, text)


@pytest.mark.parametrize(
    "options, index, weight",
    [
        ("rows = dst, weight = rw", "dst", "rw"),
        ("weight = rw, rows = dst", "dst", "rw"),
        ("rows = dst", "dst", None),
    ],
)
def test_valid_forms_lower_to_one_requantize_pass(options, index, weight):
    (low,) = lower_file(_r("rows = dst, weight = rw", options))
    (p,) = low.schedule.prepasses
    assert (p.kind, p.source, p.index, p.weight) == ("requantize", "dy", index, weight)
    t = low.spec.tensor("dy_q")
    assert (t.derived.index, t.derived.weight) == (index, weight)
    # The spec prints the form back as it is written (keywords in a fixed order).
    want = "requantize(dy, rows = dst" + (", weight = rw)" if weight else ")")
    assert str(t).endswith(f"= {want}")


def test_weight_alone_keeps_the_source_rows():
    text = _r("[S, N] scale", "[T, N] scale", _r("rows = dst, weight = rw", "weight = rw"))
    (low,) = lower_file(text)
    (p,) = low.schedule.prepasses
    assert (p.index, p.weight) == (None, "rw")
    assert "row t times rw[t]" in p.describe() and "rows through" not in p.describe()


def test_the_plain_requantize_describes_itself_as_before():
    text = _r("[S, N] scale", "[T, N] scale", _r(", rows = dst, weight = rw", ""))
    (low,) = lower_file(text)
    (p,) = low.schedule.prepasses
    assert p.describe() == (
        "requantize dy (row_major, scales [1, 128]) -> dy_q (segment_major(expert) pad 16, "
        "scales [128, 1] per expert): dequantize, transpose, quantize in one FP8-in FP8-out pass"
    )
    assert str(low.spec.tensor("dy_q")).endswith("= requantize(dy)")


ERRORS = [
    # (id, text, the text the error points at, message fragment)
    ("unknown-key", _r("rows = dst", "index = dst"), "index = dst", "unknown option 'index' of requantize"),
    ("twice", _r("weight = rw", "rows = dst"), "rows = dst)", "option 'rows' of requantize is given twice"),
    ("unknown-tensor", _r("weight = rw", "weight = rv"), "rv)", "unknown tensor 'rv'"),
    ("rows-not-i32", _r("dst : i32 [T]", "dst : f32 [T]"), "dst,", "'dst' is the index of its rows in 'dy_q', an i32 tensor [T]"),
    ("rows-other-dim", _r("dst : i32 [T]", "dst : i32 [S]"), "dst,", "but it is i32 [S]"),
    ("weight-not-f32", _r("rw  : f32 [T]", "rw  : bf16 [T]"), "rw)", "'rw' is the weight of its rows in 'dy_q', an f32 tensor [T]"),
    ("weight-2d", _r("rw  : f32 [T]", "rw  : f32 [T, N]"), "rw)", "but it is f32 [T, N]"),
    ("weight-scaled", _r("rw  : f32 [T]", "rw  : e4m3 [T] scale f32 [128]"), "rw)", "but it is e4m3 [T]"),
    ("source-bf16", _r("dy  : e4m3 [S, N] scale f32 [1, 128]", "dy  : bf16 [S, N]"), "dy,",
     "reads a 2-D FP8 source with [1, 128] scales (one per row and 128 columns), but 'dy' is bf16"),
    ("source-128x128", _r("dy  : e4m3 [S, N] scale f32 [1, 128]", "dy  : e4m3 [S, N] scale f32 [128, 128]"), "dy,",
     "but 'dy' is scaled in blocks [128, 128]"),
    ("columns-differ", _r("dy_q : e4m3 [T, N]", "dy_q : e4m3 [T, K]"), "T, K] layout segment",
     "requantize(dy) keeps the columns of [S, N] (rows through the index may be of another dim), but 'dy_q' is declared [T, K]"),
    ("weight-alone-other-rows", _r(", rows = dst", ""), "T, N] layout segment",
     "requantize(dy) keeps the columns of [S, N], but 'dy_q' is declared [T, N]"),
    ("keyword-on-transpose", _r("= requantize(dy, rows = dst, weight = rw)", "= transpose(dy, rows = dst)"), "rows = dst)",
     "transpose(...) takes no `rows = ...`"),
    ("keyword-on-quantize", _r("= requantize(dy, rows = dst, weight = rw)", "= quantize(dy, weight = rw)"), "weight = rw)",
     "quantize(...) takes no `weight = ...`"),
]


@pytest.mark.parametrize("text, at, fragment", [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
def test_bad_forms_are_located(text, at, fragment):
    err = check_error(text)
    assert fragment in err.message, err.render()
    line = text.splitlines()[err.location.line - 1]
    assert err.location.line == LINE or at in line, err.render()
    assert line[err.location.column - 1:].startswith(at), err.render()


def test_a_name_option_on_requantize_is_still_refused():
    err = check_error(_r("rows = dst, weight = rw", "pow2"))
    assert "'pow2' is not an option of requantize" in err.message


def test_a_keyword_value_must_be_a_name():
    with pytest.raises(SpecError):
        parse(_r("rows = dst", "rows = 3"), "spec.gspec")


def test_explain_json_names_the_index_and_the_weight(capsys, tmp_path):
    import json

    from gemmspec.cli import main

    path = tmp_path / "r.gspec"
    path.write_text(SPEC)
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    (p,) = doc["prepasses"]
    assert (p["kind"], p["index"], p["weight"]) == ("requantize", "dst", "rw")
    plain = _r("[S, N] scale", "[T, N] scale", _r(", rows = dst, weight = rw", ""))
    path.write_text(plain)
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    (p,) = doc["prepasses"]
    assert (p["index"], p["weight"]) == (None, None)
