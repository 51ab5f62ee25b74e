"""The row pass `T = scatter_add(A, rows = IDX)` (rows of A added into the rows IDX names):
valid forms check and lower to a post-pass whose target is an output of the call;
everything else is a located error; explain prints it, in text and JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from located import assert_located, edited
from scatter_add_spec import SCATTER_ADD_SPEC  # noqa: E402

SPEC = SCATTER_ADD_SPEC


def _r(old: str, new: str, text: str = SPEC) -> str:
    return edited(old, new, text)


def test_valid_forms_lower_to_row_passes_after_the_launches():
    (low,) = lower_file(SPEC)
    spec, schedule = low.spec, low.schedule
    assert [t.name for t in spec.row_passes] == ["dx", "dx2"]
    assert spec.written == ("dxr", "dx", "dx2")
    dx = spec.tensor("dx")
    assert dx.derived is None  # no pre-pass: an output of the call
    assert (dx.row_pass.op, dx.row_pass.source, dx.row_pass.index) == ("scatter_add", "dxr", "src")
    assert dx.row_pass.reads == ("dxr", "src")
    assert str(dx).endswith("= scatter_add(dxr, rows = src)")
    assert schedule.prepasses == ()
    assert [(p.kind, p.source, p.target, p.index) for p in schedule.postpasses] == [
        ("scatter_add", "dxr", "dx", "src"),
        ("scatter_add", "gi", "dx2", "src"),
    ]
    assert "row pass: dx = scatter_add(dxr, rows = src) after every launch" in schedule.reasons
    assert str(schedule).splitlines()[-2] == (
        "postpass 0: scatter_add dxr -> dx: row t added into row src[t] (entries outside the rows "
        "skipped), in ascending t in float32 through an inverse index of src (deterministic)"
    )


def test_the_target_may_have_any_rows_and_the_index_is_an_argument():
    text = _r("tensor dx  : bf16 [S, K]", "tensor dx  : bf16 [T, K]")
    (low,) = lower_file(text)
    assert low.spec.tensor("dx").dims == ("T", "K")
    exe = gemmspec.build(SPEC)
    roles = exe._argument_roles()
    assert {n: roles[n] for n in ("dxr", "dx", "dx2", "src", "gi")} == {
        "dxr": "output", "dx": "output", "dx2": "output", "src": "index", "gi": "input",
    }
    args = {a.name: a for a in exe.manifest.arguments}
    assert (args["src"].role, args["src"].ctype) == ("index", "const int*")
    assert (args["dx"].role, args["dx"].ctype) == ("output", "__nv_bfloat16*")


def test_explain_prints_the_pass_in_text_and_json(capsys, tmp_path):
    import json

    from gemmspec.cli import main

    text = gemmspec.build(SPEC).explain()
    block = text[text.index("row passes (after the launches):"):]
    assert block.splitlines()[1].startswith("  [0] scatter_add dxr -> dx: row t added into row src[t]")
    path = tmp_path / "sa.gspec"
    path.write_text(SPEC)
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    p = doc["postpasses"][0]
    assert (p["kind"], p["source"], p["target"], p["index"], p["other"], p["weight"]) == (
        "scatter_add", "dxr", "dx", "src", None, None,
    )


ERRORS = [
    # (id, text, the text the error points at, message fragment)
    ("positional", _r("scatter_add(dxr, rows = src)", "scatter_add(dxr, src)"), "src)",
     "scatter_add(...) takes one tensor and the option `rows = IDX`, but 'src' is given"),
    ("no-rows", _r("scatter_add(dxr, rows = src)", "scatter_add(dxr)"), "scatter_add(dxr)",
     "scatter_add(...) takes exactly one option, `rows = IDX`"),
    ("weight", _r("scatter_add(dxr, rows = src)", "scatter_add(dxr, weight = src)"), "weight = src",
     "scatter_add(...) takes exactly one option, `rows = IDX` (row t added into row IDX[t]), but 'weight' is given"),
    ("two-options", _r("scatter_add(dxr, rows = src)", "scatter_add(dxr, rows = src, rows = src)"), "rows = src)",
     "scatter_add(...) takes exactly one option, `rows = IDX`"),
    ("unknown-source", _r("scatter_add(dxr, rows = src)", "scatter_add(nope, rows = src)"), "nope",
     "unknown tensor 'nope'"),
    ("unknown-index", _r("scatter_add(dxr, rows = src)", "scatter_add(dxr, rows = nope)"), "nope",
     "unknown tensor 'nope'"),
    ("index-type", _r("tensor src : i32 [T]", "tensor src : f32 [T]"), "src)",
     "'src' gives the target row of each row of 'dxr': an i32 tensor [T], but it is f32 [T]"),
    ("index-dim", _r("tensor src : i32 [T]", "tensor src : i32 [S]"), "src)",
     "an i32 tensor [T], but it is i32 [S]"),
    ("source-1d", _r("scatter_add(gi, rows = src)", "scatter_add(src, rows = src)"), "src, rows",
     "scatter_add reads 2-D tensors whose rows are contiguous (the last dim), but 'src' is [T]"),
    ("source-columns-major", _r("tensor dxr : bf16 [T, K]", "tensor dxr : bf16 [T, K] layout major(T)"), "dxr, rows",
     "scatter_add reads 2-D tensors whose rows are contiguous (the last dim), but 'dxr' is [T, K] layout major(T)"),
    ("source-fp8", _r("tensor gi  : f16 [T, K] layout strides(139, 1)", "tensor gi  : e4m3 [T, K] scale f32 [1, 136]"),
     "gi, rows", "scatter_add reads an unscaled bf16, f16 or f32 tensor, but 'gi' is e4m3 with a scale"),
    ("source-of-a-row-pass", _r("scatter_add(gi, rows = src)", "scatter_add(dx, rows = src)"), "dx, rows",
     "scatter_add reads a tensor passed in or written by a statement, but 'dx' is derived by another pass"),
    ("of-itself", _r("scatter_add(gi, rows = src)", "scatter_add(dx2, rows = src)"), "dx2, rows",
     "'dx2' is computed from itself"),
    ("target-fp8", _r("dx2 : f32 [S, K] = ", "dx2 : e4m3 [S, K] scale f32 [1, 136] = "), "dx2 :",
     "scatter_add writes rows of 'gi': 'dx2' must be an unscaled bf16, f16 or f32 2-D tensor with contiguous "
     "rows, but it is e4m3 [S, K]"),
    ("target-1d", _r("dx2 : f32 [S, K] = ", "dx2 : f32 [S] = "), "dx2 :",
     "'dx2' must be an unscaled bf16, f16 or f32 2-D tensor with contiguous rows, but it is f32 [S]"),
    ("target-columns-major", _r("dx2 : f32 [S, K] = ", "dx2 : f32 [S, K] layout major(S) = "), "dx2 :",
     "but it is f32 [S, K] layout major(S)"),
    ("target-columns", _r("dx2 : f32 [S, K] = ", "dx2 : f32 [S, H] = "), "dx2 :",
     "scatter_add adds whole rows: the columns of 'dx2' [S, H] must be those of 'gi' [T, K]"),
    ("read-by-a-statement",
     _r("  dxr[t, k] = sum", "  tensor z : bf16 [S, H]\n  z[s, n] = sum[k] dx[s, k] * w[k, n]\n  dxr[t, k] = sum"),
     "dx  :", "'dx' = scatter_add(dxr, rows = src) is written by a row pass after every statement; the statement "
     "on line 12 cannot read it"),
    ("written-by-a-statement", _r("dxr[t, k] = sum", "dx[t, k] = sum", _r("dx  : bf16 [S, K]", "dx  : bf16 [T, K]")),
     "dx  :",
     "'dx' = scatter_add(dxr, rows = src) is written by a row pass after every statement; the statement on line 11 "
     "cannot write it"),
]


@pytest.mark.parametrize("text, at, fragment", [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
def test_bad_forms_are_located(text, at, fragment):
    assert_located(text, at, fragment)


def test_a_tensor_may_be_called_scatter_add():
    # The word is a derivation only in `= op(...)`.
    text = SPEC.replace("src", "scatter_add")
    (low,) = lower_file(text)
    assert low.schedule.postpasses[0].index == "scatter_add"
