"""`T = swiglu_grad(GU, DH)`: the gradient of a SwiGLU's gate/up columns, quantized into
FP8 in one pre-pass that may read what statements and row passes write (it then runs
after them). Valid forms check and lower with their order; everything else is a located
error; explain prints the order."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from gemmspec.cli import main
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from located import assert_located, edited
from swiglu_grad_spec import SWIGLU_GRAD_SPEC  # noqa: E402

SPEC = SWIGLU_GRAD_SPEC


def _r(old: str, new: str, text: str = SPEC) -> str:
    return edited(old, new, text)


def test_a_valid_form_checks_into_a_prepass_that_reads_two_tensors():
    (low,) = lower_file(SPEC)
    t = low.spec.tensor("dgu")
    assert (t.derived.op, t.derived.source, t.derived.other) == ("swiglu_grad", "gu", "dh")
    assert str(t).endswith("= swiglu_grad(gu, dh)")
    (p,) = low.schedule.prepasses
    assert (p.kind, p.source, p.other, p.target, p.target_block, p.reads_before) == (
        "swiglu_grad", "gu", "dh", "dgu", (1, 128), (2,),
    )
    assert p.reads == ("gu", "dh")
    # The schedule prints its steps in the order they run.
    lines = [ln for ln in str(low.schedule).splitlines() if ln.startswith(("launch", "prepass", "postpass"))]
    assert [ln.split(":")[0] for ln in lines] == ["launch 0", "launch 1", "postpass 0", "prepass 0", "launch 2"]


def test_specs_without_it_keep_the_default_order():
    plain = _r("  tensor dgu    : e4m3 [T, N] scale f32 [1, 128] = swiglu_grad(gu, dh)\n", "  tensor dgu    : e4m3 [T, N] scale f32 [1, 128]\n")
    (low,) = lower_file(plain)
    assert low.schedule.order == () and not any(r.startswith("order:") for r in low.schedule.reasons)


def test_a_requantize_of_its_target_chains_after_it():
    text = _r(
        "  tensor dx     : bf16 [T, H]\n",
        "  tensor dx     : bf16 [T, H]\n"
        "  tensor dgu_q  : e4m3 [T, N] layout major(T) scale f32 [128, 1] = requantize(dgu)\n"
        "  tensor xq     : e4m3 [T, H] layout major(T) scale f32 [128, 1] = requantize(x)\n"
        "  tensor dw     : f32 [N, H]\n",
    )
    text = _r("  dx[t, h] =", "  dw[n, h] = sum[t] dgu_q[t, n] * xq[t, h]\n  dx[t, h] =", text)
    (low,) = lower_file(text)
    kinds = [(p.kind, p.target) for p in low.schedule.prepasses]
    assert ("swiglu_grad", "dgu") in kinds and ("requantize", "dgu_q") in kinds
    order = [(k, x.target if k != "launch" else x.statement) for k, _, x in low.schedule.steps()]
    assert order.index(("prepass", "dgu")) < order.index(("prepass", "dgu_q")) < order.index(("launch", 0))
    assert order.index(("postpass", "dh")) < order.index(("prepass", "dgu"))


CASES = [
    # (id, text, the text the error points at, message fragment)
    ("one_source", _r("swiglu_grad(gu, dh)", "swiglu_grad(gu)"), "swiglu_grad(gu)",
     "takes two tensors and no options"),
    ("keyword", _r("swiglu_grad(gu, dh)", "swiglu_grad(gu, dh, rows = rw)"), "rows = rw", "takes two tensors"),
    ("unknown_other", _r("swiglu_grad(gu, dh)", "swiglu_grad(gu, dq)"), "dq)", "unknown tensor 'dq'"),
    ("scaled_source", _r("swiglu_grad(gu, dh)", "swiglu_grad(x, dh)"), "x, dh)",
     "reads unscaled bf16, f16 or f32 tensors, but 'x' is e4m3 with a scale"),
    ("halves_differ", _r("swiglu_grad(gu, dh)", "swiglu_grad(dx, dh)"), "dh)",
     "pairs the columns of 'dx' (gate 2j, up 2j + 1) with column j of 'dh'"),
    ("target_bf16", _r("tensor dgu    : e4m3 [T, N] scale f32 [1, 128]", "tensor dgu    : bf16 [T, N]"), "dgu ",
     "swiglu_grad writes an FP8 [T, N] tensor, row_major, with [1, 128] scales"),
    ("target_blocks", _r("tensor dgu    : e4m3 [T, N] scale f32 [1, 128]", "tensor dgu    : e4m3 [T, N] scale f32 [128, 128]"),
     "dgu ", "with [1, 128] scales in the default layout"),
    ("wgrad_form_row_major", _r("tensor dgu    : e4m3 [T, N] scale f32 [1, 128]", "tensor dgu    : e4m3 [T, N] scale f32 [128, 1]"),
     "dgu ", "swiglu_grad(gu, dh) writes 'dgu' with T contiguous"),
    ("derived_source", _r("  tensor dx     : bf16 [T, H]\n",
                          "  tensor dx     : bf16 [T, H]\n"
                          "  tensor wq     : e4m3 [T, N] scale f32 [1, 128] = quantize(gu)\n").replace(
        "swiglu_grad(gu, dh)", "swiglu_grad(wq, dh)"), "wq, dh)", "but 'wq' is derived by quantize(...)"),
    ("cycle", _r("  gu[t, n] = sum[h] x[t, h] * w[n, h]", "  gu[t, n] = sum[h] dx[t, h] * wd2[n, h]",
                 _r("  tensor dx     : bf16 [T, H]\n", "  tensor dx     : bf16 [T, H]\n  tensor wd2    : bf16 [N, H]\n")),
     "swiglu_grad(gu, dh)", "'dgu' reads what it feeds"),
]


@pytest.mark.parametrize("text, at, fragment", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_forms_are_located_errors(text, at, fragment):
    assert_located(text, at, fragment)


def test_explain_prints_the_order(tmp_path, capsys):
    path = tmp_path / "swg.gspec"
    path.write_text(SPEC)
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "order: launch 0, launch 1, postpass 0, prepass 0, launch 2" in out
    # The row pass runs before launch 2, so its reason does not say "after every launch".
    assert "once the steps that write what it reads have run (see the order)" in out
    assert "after every launch" not in out
    assert "row passes (in the order above):" in out
    assert "swiglu_grad gu (gate, up interleaved), dh -> dgu" in out
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["order"][:3] == [{"kind": "launch", "index": 0}, {"kind": "launch", "index": 1}, {"kind": "postpass", "index": 0}]
    assert doc["prepasses"][0]["kind"] == "swiglu_grad" and doc["prepasses"][0]["other"] == "dh"
