"""quantize(SOURCE): an unscaled bf16/f16/f32 tensor into FP8 with fresh block scales.
Valid shapes check and lower to one pre-pass; everything else is a located error at
the `quantize` of the declaration."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

TOKENS = """\
gemm g {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x   : bf16 [T, K]
  tensor x_q : e4m3 [T, K] scale f32 [1, 128] = quantize(x)
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x_q[t, k] * w[expert(t), n, k]
}
"""

DENSE = """\
gemm g {
  dim T
  dim N = 256, K = 256
  tensor x   : bf16 [T, K]
  tensor x_q : e4m3 [T, K] scale f32 [128, 128] = quantize(x)
  tensor w   : e4m3 [N, K] scale f32 [128, 128]
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x_q[t, k] * w[n, k]
}
"""

WEIGHTS = """\
gemm g {
  dim T
  dim N = 256, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : bf16 [E, N, K] layout strides(N * K + 64, K, 1)
  tensor w_q : e4m3 [E, N, K] scale f32 [1, 128, 128] = quantize(w)
  tensor y   : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w_q[expert(t), n, k]
}
"""


def _error(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(text, "spec.gspec"))
    return info.value


def _at_quantize(err: SpecError, text: str, line: int) -> None:
    assert err.location.line == line, err.render()
    assert err.location.column == text.splitlines()[line - 1].index("quantize(") + 1, err.render()


@pytest.mark.parametrize("text", [TOKENS, DENSE, WEIGHTS], ids=["tokens-1x128", "dense-128x128", "weights-128x128"])
def test_valid_specs_lower_to_one_quantize_pass(text):
    (lowered,) = lower_file(text)
    (p,) = lowered.schedule.prepasses
    assert p.kind == "quantize" and p.source_scale is None and p.source_block == ()
    assert p.describe().startswith(f"quantize {p.source} ")


@pytest.mark.parametrize(
    "old, new",
    [
        ("bf16 [T, K]", "f16 [T, K]"),
        ("bf16 [T, K]", "f32 [T, K]"),
        ("bf16 [T, K]", "bf16 [T, K] layout strides(K + 8, 1)"),
        ("e4m3 [T, K] scale f32 [1, 128] =", "e5m2 [T, K] scale f32 [1, 128] ="),
    ],
)
def test_valid_variants(old, new):
    text = TOKENS.replace(old, new, 1)
    assert new in text
    check(parse(text, "spec.gspec"))


def _q(old: str, new: str, text: str = TOKENS) -> str:
    assert old in text, old
    return text.replace(old, new, 1)


ERRORS = [
    # (id, text, line of the quantize, message fragment)
    ("source-scaled", _q("bf16 [T, K]", "e4m3 [T, K] scale f32 [1, 128]"), 6,
     "quantize reads an unscaled bf16, f16 or f32 tensor, but 'x' is e4m3 with a scale"),
    ("source-fp8", _q("bf16 [T, K]", "e4m3 [T, K]"), 6, "but 'x' is e4m3"),
    ("target-not-fp8", _q("e4m3 [T, K] scale f32 [1, 128] =", "bf16 [T, K] ="), 6,
     "quantize writes an FP8 (e4m3, e5m2) tensor with a scale, but 'x_q' is bf16"),
    ("target-no-scale", _q("e4m3 [T, K] scale f32 [1, 128] =", "e4m3 [T, K] ="), 6,
     "'x_q' is e4m3 with no scale"),
    ("blocks-1xK", _q("[128, 128]\n", "[1, K]\n", _q("[128, 128] = q", "[1, K] = q", DENSE)), 5,
     "'x_q' has scale blocks [1, 256]"),
    ("blocks-64x128", _q("[128, 128] = q", "[64, 128] = q", DENSE), 5, "'x_q' has scale blocks [64, 128]"),
    ("blocks-256x128", _q("[128, 128] = q", "[256, 128] = q", DENSE), 5, "'x_q' has scale blocks [256, 128]"),
    ("target-padded", _q("e4m3 [T, K] scale", "e4m3 [T, K] layout strides(K + 16, 1) scale", DENSE), 5,
     "'x_q' is strides(272, 1), not row_major without padding"),
    ("target-pad", _q("e4m3 [T, K] scale", "e4m3 [T, K] layout row_major pad 384 scale"), 6,
     "not row_major without padding"),
    ("source-not-contiguous", _q("bf16 [T, K]", "bf16 [T, K] layout major(T)"), 6,
     "'x' is major(T), its last dim K not contiguous"),
    ("scale-layout", _q("scale f32 [1, 128] =", "scale f32 [1, 128] layout major(T) ="), 6,
     "its scale layout is major(T)"),
    ("anchored", _q("scale f32 [1, 128] =", "scale f32 [128, 128] per expert ="), 6,
     "its scale blocks restart per 'expert'"),
    ("columns-short", _q("K = 256", "K = 200"), 6,
     "its contiguous dim K is 200, not a constant multiple of 128 (short column blocks"),
    ("weight-blocks", _q("scale f32 [1, 128, 128] =", "scale f32 [1, 64, 128] =", WEIGHTS), 7,
     "'w_q' has scale blocks [1, 64, 128]"),
    ("weight-padded", _q("e4m3 [E, N, K] scale f32 [1, 128, 128] =",
                         "e4m3 [E, N, K] layout strides(N * K + 64, K, 1) scale f32 [1, 128, 128] =", WEIGHTS), 7,
     "'w_q' is strides(131136, 512, 1), not row_major without padding"),
]


@pytest.mark.parametrize("text, line, fragment", [pytest.param(*c[1:], id=c[0]) for c in ERRORS])
def test_unsupported_quantize_is_located(text, line, fragment):
    err = _error(text)
    assert fragment in err.message, err.render()
    _at_quantize(err, text, line)


def test_emittable_error_says_what_is_supported():
    err = _error(_q("[128, 128] = q", "[64, 128] = q", DENSE))
    assert "[1, 128] or [128, 128] scale blocks" in err.message
    assert "row_major FP8 tensor" in err.message


def test_source_4d_is_refused():
    text = """\
gemm g {
  dim A = 2, B = 2, M = 64, N = 64, K = 128
  tensor x   : bf16 [A, B, M, K]
  tensor x_q : e4m3 [A, B, M, K] scale f32 [1, 1, 1, 128] = quantize(x)
  tensor w   : e4m3 [A, B, N, K] scale f32 [1, 1, 128, 128]
  tensor y   : bf16 [A, B, M, N]
  y[a, b, m, n] = sum[k] x_q[a, b, m, k] * w[a, b, n, k]
}
"""
    err = _error(text)
    assert "'x' is 4-D" in err.message
    _at_quantize(err, text, 4)


def test_chain_from_a_quantized_tensor():
    text = _q(
        "  tensor w   :",
        "  tensor x_t : e4m3 [T, K] layout major(T) scale f32 [128, 1] = requantize(x_q)\n  tensor w   :",
    )
    err = _error(text)
    assert "'x_q' is itself derived, and derivations do not chain" in err.message
    assert "derive 'x_t' from 'x'" in err.message


def test_quantize_of_itself_and_cycles():
    text = _q("= quantize(x)", "= quantize(x_q)")
    assert "is derived from itself" in _error(text).message
    cyc = _q("tensor x   : bf16 [T, K]", "tensor x   : bf16 [T, K] = quantize(x_q)")
    assert "derived tensors form a cycle" in _error(cyc).message


def test_shape_must_match():
    text = _q("e4m3 [T, K] scale f32 [1, 128] =", "e4m3 [T, N] scale f32 [1, 128] =")
    err = _error(text)
    assert "keeps the logical shape [T, K]" in err.message
    assert err.location.line == 6


def test_quantized_tensor_cannot_be_written():
    text = _q("y[t, n] = sum[k] x_q[t, k]", "x_q[t, n] = sum[k] x_q[t, k]")
    text = text.replace("x_q[t, n] =", "x_q[t, k] =").replace("x_q[t, k] * w[expert(t), n, k]", "y[t, n] * w[expert(t), n, k]")
    text = text.replace("sum[k]", "sum[n]")
    assert "cannot be written by a statement" in _error(text).message


def test_unread_quantize_gets_no_prepass():
    text = _q("sum[k] x_q[t, k]", "sum[k] x2[t, k]").replace(
        "  tensor w   :", "  tensor x2  : e4m3 [T, K] scale f32 [1, 128]\n  tensor w   :"
    )
    # An unread target is not checked against the kernel's shapes either.
    text = text.replace("scale f32 [1, 128] = quantize", "scale f32 [1, 64] = quantize")
    (lowered,) = lower_file(text)
    assert lowered.schedule.prepasses == ()


def test_explain_lists_the_pass(capsys):
    from gemmspec.cli import main

    path = Path(__file__).resolve().parents[2] / "examples" / "moe_bf16_in_fp8.gspec"
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pre-pass: x_q = quantize(x) before launch 0" in out
    assert "[0] quantize x (row_major) -> x_q (row_major, scales [1, 128])" in out
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    (p,) = doc["prepasses"]
    assert p["kind"] == "quantize" and p["source_scale"] is None
    assert p["target_scale"] == {"name": "x_q_scale", "block": [1, 128]}


# ---- quantize(SOURCE, pow2): power-of-two scales ------------------------------------------


@pytest.mark.parametrize("text", [TOKENS, DENSE, WEIGHTS], ids=["tokens-1x128", "dense-128x128", "weights-128x128"])
def test_pow2_option_lowers_to_a_pow2_pass(text):
    src = text.replace("= quantize(x)", "= quantize(x, pow2)").replace("= quantize(w)", "= quantize(w, pow2)")
    (lowered,) = lower_file(src)
    (p,) = lowered.schedule.prepasses
    assert p.kind == "quantize" and p.pow2
    assert "scale = 2^ceil(log2(amax / FP8 max)), one pass" in p.describe()
    assert any(f"= quantize({p.source}, pow2) before launch 0" in r for r in lowered.schedule.reasons)
    assert str(lowered.spec.tensor(p.target)).endswith(f"= quantize({p.source}, pow2)")
    (plain,) = lower_file(text)
    assert not plain.schedule.prepasses[0].pow2
    assert "scale = amax / FP8 max, one pass" in plain.schedule.prepasses[0].describe()


def _option_at(err: SpecError, text: str, line: int, option: str) -> None:
    row = text.splitlines()[line - 1]
    assert err.location.line == line, err.render()
    assert err.location.column == row.rindex(option) + 1, err.render()


POW2_ERRORS = [
    # (id, old, new, option located, message fragment, note fragment)
    ("unknown", "quantize(x)", "quantize(x, round)", "round",
     "unknown option 'round' of quantize; its one option is pow2 (power-of-two scales)", None),
    ("twice", "quantize(x)", "quantize(x, pow2, pow2)", "pow2",
     "option 'pow2' of quantize is given twice", None),
    ("requantize", "  tensor w   :",
     "  tensor x8  : e4m3 [T, K] scale f32 [1, 128]\n"
     "  tensor x_t : e4m3 [T, K] layout major(T) scale f32 [128, 1] = requantize(x8, pow2)\n  tensor w   :",
     "pow2", "'pow2' is not an option of requantize: its options are the keywords `rows = IDX`",
     "requantize computes its scales as amax / FP8 max"),
    ("transpose", "  tensor w   :",
     "  tensor x8  : e4m3 [T, K] scale f32 [1, 128]\n"
     "  tensor x_t : e4m3 [T, K] layout major(T) scale f32 [1, 128] = transpose(x8, fast)\n  tensor w   :",
     "fast", "transpose(...) takes no options, but 'fast' is given", "transpose keeps the source's scales"),
]


@pytest.mark.parametrize("old, new, option, fragment, note", [pytest.param(*c[1:], id=c[0]) for c in POW2_ERRORS])
def test_quantize_options_are_located(old, new, option, fragment, note):
    text = _q(old, new)
    err = _error(text)
    assert fragment in err.message, err.render()
    if note is not None:
        assert note in (err.note or ""), err.render()
    line = next(i for i, row in enumerate(text.splitlines(), 1) if f", {option}" in row)
    _option_at(err, text, line, option)


def test_pow2_keeps_the_shapes_the_pass_covers():
    # The option changes the scale rule only: the same shapes are refused at `quantize`.
    text = _q("[128, 128] = quantize(x)", "[64, 128] = quantize(x, pow2)", DENSE)
    err = _error(text)
    assert "'x_q' has scale blocks [64, 128]" in err.message
    _at_quantize(err, text, 5)


def test_explain_json_says_pow2(capsys, tmp_path):
    from gemmspec.cli import main

    path = tmp_path / "q.gspec"
    path.write_text(TOKENS.replace("= quantize(x)", "= quantize(x, pow2)"))
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    (p,) = doc["prepasses"]
    assert p["pow2_scales"] is True
    assert "2^ceil(log2(amax / FP8 max))" in p["description"]
