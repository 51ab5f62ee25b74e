"""Row passes after the statements: `T = rowdot(A, B)` (one dot product per row) and
`T = rowscale(A, weight = W)` (each row times a weight). Valid forms check and lower to
post-passes whose targets are outputs of the call; everything else is a located error;
explain prints them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from located import assert_located, edited
from row_pass_spec import ROW_PASS_SPEC  # noqa: E402

SPEC = ROW_PASS_SPEC
ROWDOT_LINE, ROWSCALE_LINE = 9, 10


def _r(old: str, new: str, text: str = SPEC) -> str:
    return edited(old, new, text)


def test_valid_forms_lower_to_row_passes_after_the_launches():
    (low,) = lower_file(SPEC)
    spec, schedule = low.spec, low.schedule
    assert [t.name for t in spec.row_passes] == ["drw", "dh"]
    assert spec.written == ("g", "drw", "dh")
    drw, dh = spec.tensor("drw"), spec.tensor("dh")
    assert drw.derived is None and dh.derived is None  # no pre-pass: outputs of the call
    assert (drw.row_pass.op, drw.row_pass.source, drw.row_pass.other) == ("rowdot", "g", "h")
    assert (dh.row_pass.op, dh.row_pass.source, dh.row_pass.weight) == ("rowscale", "g", "rw")
    assert str(drw).endswith("= rowdot(g, h)") and str(dh).endswith("= rowscale(g, weight = rw)")
    assert schedule.prepasses == ()
    assert [(p.kind, p.source, p.target, p.other, p.other_scale, p.weight) for p in schedule.postpasses] == [
        ("rowdot", "g", "drw", "h", "h_scale", None),
        ("rowscale", "g", "dh", None, None, "rw"),
    ]
    assert "row pass: drw = rowdot(g, h) after every launch" in schedule.reasons
    assert str(schedule).splitlines()[-2:] == [
        "postpass 0: rowdot g . h (dequantized with h_scale) -> drw: one float32 dot product per "
        "row, summed in a fixed order",
        "postpass 1: rowscale g -> dh: row r times rw[r]",
    ]


def test_a_pass_may_read_inputs_only_and_an_unscaled_second_factor():
    text = _r("tensor h   : e4m3 [T, F] scale f32 [1, 128]", "tensor h   : f32 [T, F]")
    text = _r("rowdot(g, h)", "rowdot(h, g)", text)
    (low,) = lower_file(text)
    (p, _) = low.schedule.postpasses
    assert (p.source, p.other, p.other_scale) == ("h", "g", None)


def test_the_targets_are_written_arguments():
    exe = gemmspec.build(SPEC)
    roles = exe._argument_roles()
    assert {n: roles[n] for n in ("g", "drw", "dh", "h", "rw")} == {
        "g": "output", "drw": "output", "dh": "output", "h": "input", "rw": "input",
    }
    names = exe.argument_names()
    assert {"drw", "dh"} <= set(names)
    args = {a.name: a for a in exe.manifest.arguments}
    assert (args["drw"].role, args["drw"].ctype) == ("output", "float*")


def test_explain_prints_the_row_passes():
    text = gemmspec.build(SPEC).explain()
    block = text[text.index("row passes (after the launches):"):]
    assert block.splitlines()[1:3] == [
        "  [0] rowdot g . h (dequantized with h_scale) -> drw: one float32 dot product per row, "
        "summed in a fixed order",
        "  [1] rowscale g -> dh: row r times rw[r]",
    ]


def test_explain_json_lists_postpasses_only_where_there_are_some(capsys, tmp_path):
    import json

    from gemmspec.cli import main

    path = tmp_path / "rp.gspec"
    path.write_text(SPEC)
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert [(p["kind"], p["source"], p["target"], p["other"], p["other_scale"], p["weight"]) for p in doc["postpasses"]] == [
        ("rowdot", "g", "drw", "h", "h_scale", None),
        ("rowscale", "g", "dh", None, None, "rw"),
    ]
    plain = tmp_path / "plain.gspec"
    plain.write_text(_r("  tensor drw : f32 [T] = rowdot(g, h)\n", "", _r("  tensor dh  : bf16 [T, F] = rowscale(g, weight = rw)\n", "")))
    assert main(["explain", "--json", str(plain)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert "postpasses" not in doc


ERRORS = [
    # (id, text, the text the error points at, message fragment)
    ("rowdot-one-operand", _r("rowdot(g, h)", "rowdot(g)"), "rowdot(g)", "rowdot(...) takes two tensors"),
    ("rowdot-three", _r("rowdot(g, h)", "rowdot(g, h, rw)"), "rw)", "rowdot(...) takes two tensors"),
    ("rowdot-keyword", _r("rowdot(g, h)", "rowdot(g, h, weight = rw)"), "weight = rw", "rowdot(...) takes two tensors"),
    ("rowdot-unknown", _r("rowdot(g, h)", "rowdot(g, hh)"), "hh)", "unknown tensor 'hh'"),
    ("rowdot-fp8-first", _r("rowdot(g, h)", "rowdot(h, g)"), "h, g)",
     "rowdot reads an unscaled bf16, f16 or f32 tensor first, but 'h' is e4m3 with a scale"),
    ("rowdot-shapes", _r("rowdot(g, h)", "rowdot(g, dy)"), "dy)",
     "rowdot multiplies tensors of one shape, but 'dy' is [T, H] and 'g' [T, F]"),
    ("rowdot-128x128", _r("h   : e4m3 [T, F] scale f32 [1, 128]", "h   : e4m3 [T, F] scale f32 [128, 128]"), "h)",
     "rowdot's second factor is an unscaled bf16, f16 or f32 tensor or an FP8 one with [1, 128] scales, but 'h' is e4m3 scaled in blocks [128, 128]"),
    ("rowdot-target", _r("drw : f32 [T] = rowdot", "drw : bf16 [T] = rowdot"), "drw",
     "rowdot writes one f32 per row: 'drw' must be an unscaled, contiguous f32 [T], but it is bf16 [T]"),
    ("rowdot-target-strided", _r("drw : f32 [T] = rowdot", "drw : f32 [T] layout strides(2) = rowdot"), "drw",
     "but it is f32 [T] layout strides(2)"),
    ("rowdot-of-itself", _r("rowdot(g, h)", "rowdot(g, drw)"), "drw)", "'drw' is computed from itself"),
    ("rowdot-columns-major", _r("g   : bf16 [T, F]", "g   : bf16 [T, F] layout major(T)"), "g, h)",
     "rowdot reads 2-D tensors whose rows are contiguous (the last dim), but 'g' is [T, F] layout major(T)"),
    ("rowdot-of-a-row-pass", _r("rowscale(g, weight = rw)", "rowscale(g, weight = rw)\n  tensor d2 : f32 [T] = rowdot(dh, g)"),
     "dh, g)", "rowdot reads tensors passed in or written by statements, but 'dh' is derived by another pass"),
    ("rowscale-option", _r("rowscale(g, weight = rw)", "rowscale(g, rw)"), "rw)", "'rw' is not an option of rowscale"),
    ("rowscale-no-weight", _r("rowscale(g, weight = rw)", "rowscale(g)"), "rowscale(g)",
     "rowscale(...) takes exactly one option, `weight = W`"),
    ("rowscale-rows", _r("rowscale(g, weight = rw)", "rowscale(g, rows = rw)"), "rows = rw",
     "rowscale(...) takes exactly one option, `weight = W`"),
    ("rowscale-weight-type", _r("rw  : f32 [T]", "rw  : bf16 [T]"), "rw)",
     "'rw' is the weight of the rows of 'g', a plain, contiguous f32 tensor [T], but it is bf16 [T]"),
    ("rowscale-weight-strided", _r("rw  : f32 [T]", "rw  : f32 [T] layout strides(2)"), "rw)",
     "but it is f32 [T] layout strides(2)"),
    ("rowscale-target-shape", _r("dh  : bf16 [T, F] = rowscale", "dh  : bf16 [T, H] = rowscale"), "dh ",
     "rowscale keeps the shape of 'g': 'dh' must be an unscaled bf16, f16 or f32 [T, F] with contiguous rows, but it is bf16 [T, H]"),
    ("rowscale-fp8-target", _r("dh  : bf16 [T, F] = rowscale", "dh  : e4m3 [T, F] scale f32 [1, 128] = rowscale"), "dh ",
     "but it is e4m3 [T, F] with a scale"),
    ("read-by-a-statement",
     _r("  g[t, f] = sum", "  tensor w2 : bf16 [H, F]\n  tensor z : bf16 [T, H]\n  z[t, n] = sum[f] dh[t, f] * w2[n, f]\n  g[t, f] = sum"),
     "dh  :", "'dh' = rowscale(g, weight = rw) is written by a row pass after every statement; the statement on line 13 cannot read it"),
    ("written-by-a-statement", _r("g[t, f] = sum", "dh[t, f] = sum"), "dh  :",
     "'dh' = rowscale(g, weight = rw) is written by a row pass after every statement; the statement on line 11 cannot write it"),
]


@pytest.mark.parametrize("text, at, fragment", [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
def test_bad_forms_are_located(text, at, fragment):
    assert_located(text, at, fragment)


def test_the_names_are_keywords_only_after_the_equals_sign():
    # A tensor may still be called rowdot: the words are derivations only in `= op(...)`.
    text = _r("tensor rw  : f32 [T]", "tensor rowdot : f32 [T]").replace("weight = rw", "weight = rowdot")
    (low,) = lower_file(text)
    assert low.schedule.postpasses[1].weight == "rowdot"
