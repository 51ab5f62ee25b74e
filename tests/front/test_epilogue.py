"""Fused epilogues: what the checker accepts, and each refusal located at its token
with a note."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

BASE = """\
gemm g {
  dim T
  dim N = 256, K = 512
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 4] = ragged(T within lora, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor alpha : f32 [L]
  tensor rw : f32 [T]
  tensor bias : bf16 [E, N]
  tensor cs : f32 [N]
  tensor full : f32 [T, N]
  tensor kv : f32 [K]
  tensor q : e4m3 [T] scale f32 [1]
  tensor y : bf16 [T, N]
  STATEMENT
}
"""
GEMM = "sum[k] x[t, k] * w[expert(t), n, k]"


def spec_with(statement: str) -> str:
    return BASE.replace("STATEMENT", statement)


def first_error(statement: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(spec_with(statement), "e.gspec"))
    return info.value


def test_every_kind_is_classified():
    (spec,) = check(parse(spec_with(f"y[t, n] += alpha[lora(t)] * rw[t] * {GEMM} + bias[expert(t), n]")))
    (g,) = spec.gemms
    assert [(e.kind, e.access.tensor, e.dtype) for e in g.epilogue] == [
        ("alpha", "alpha", "f32"), ("row", "rw", "f32"), ("bias", "bias", "bf16")
    ]
    assert g.accumulate and g.reads == ("x", "w", "alpha", "rw", "bias")
    # Factors in either order; the epilogue keeps its own order.
    (spec,) = check(parse(spec_with(f"y[t, n] = rw[t] * alpha[lora(t)] * {GEMM}")))
    assert [e.kind for e in spec.gemms[0].epilogue] == ["alpha", "row"]


def test_an_epilogue_group_becomes_a_leaf_axis():
    text = spec_with("y[t, n] = alpha[lora(t)] * sum[k] x[t, k] * w[expert(t), n, k]")
    (lowered,) = lower_file(text)
    assert [a.name for a in lowered.spec.gemms[0].leaf_axes] == ["lora", "expert"]
    (e,) = lowered.schedule.launches[0].problems.epilogue
    assert str(e.offset) == "g.lora" and e.kind == "alpha"
    assert lowered.schedule.launches[0].signature.name.endswith("_eaf32")


def test_no_epilogue_keeps_the_kernel_name():
    (lowered,) = lower_file(spec_with(f"y[t, n] = {GEMM}"))
    assert "_e" not in lowered.schedule.launches[0].signature.name.rsplit("_", 1)[-1]
    assert lowered.schedule.launches[0].problems.epilogue == ()


CASES = [
    # (statement, token the caret is under, message fragment, note fragment)
    (f"y[t, n] = kv[k] * {GEMM}", "k] *", "indexed by 'k', the contracted index", "by the output's indices"),
    (f"y[t, n] = cs[n] * {GEMM}", "cs", "varies along the column index 'n'", "bias"),
    (f"y[t, n] = full[t, n] * {GEMM}", "full", "varies along the column index 'n'", "bias"),
    (f"y[t, n] = {GEMM} + rw[t]", "rw[t]", "the added term 'rw' is per row", "over the columns"),
    (f"y[t, n] = {GEMM} + full[t, n]", "full", "is per element", "over the columns"),
    (f"y[t, n] = {GEMM} + alpha[lora(t)]", "alpha[lora", "is per leaf", "over the columns"),
    (f"y[t, n] = rw[t] * rw[t] * {GEMM}", "rw[t] * sum", "a second per-row weight", "one tensor"),
    (f"y[t, n] = q[t] * {GEMM}", "q[t]", "is e4m3; epilogue operands are f32, bf16, f16", "f32"),
    (f"y[t, n] = alpha[j] * {GEMM}", "j]", "index 'j' of epilogue factor 'alpha' indexes neither", "output's indices"),
    (f"y[t, n] = alpha[t] * {GEMM}", "t] *", "ranges over L in", None),
    (f"y[t, n] = alpha[lora(t), n] * {GEMM}", "alpha", "has 1 dims [L] but is indexed with 2", None),
    (f"y[t, n] = nope[t] * {GEMM}", "nope", "unknown tensor 'nope'", None),
]


@pytest.mark.parametrize("statement, token, fragment, note", CASES, ids=[c[2][:40] for c in CASES])
def test_refusal_is_located_with_a_note(statement, token, fragment, note):
    err = first_error(statement)
    assert fragment in err.message, err.render()
    assert err.location.line == 16, err.render()
    assert err.location.column == statement.index(token) + 3, err.render()
    if note is not None:
        assert err.note and note in err.note, err.render()


def test_contracted_index_through_a_group_is_refused():
    text = """\
gemm g {
  dim M = 64, N = 64, K = 256
  group part[P = 2] = split(K, sizes = [128, 128])
  tensor a : bf16 [M, K]
  tensor b : bf16 [N, K]
  tensor s : f32 [P]
  tensor y : f32 [P, M, N]
  y[p, m, n] = s[part(k)] * sum[k in part(p)] a[m, k] * b[n, k]
}
"""
    with pytest.raises(SpecError) as info:
        check(parse(text, "e.gspec"))
    assert "part(k), the contracted index" in info.value.message
    assert info.value.location.column == text.splitlines()[7].index("part(k)") + 1


def test_a_wide_tile_directive_is_refused_with_a_bias():
    text = spec_with(f"y[t, n] = {GEMM} + bias[expert(t), n]\n  tile(128, 256)")
    text = text.replace("  tensor q : e4m3 [T] scale f32 [1]\n", "")  # not a scaled spec
    with pytest.raises(SpecError) as info:
        check(parse(text, "e.gspec"))
    assert "too wide for a statement with a bias" in info.value.message
    assert info.value.location.line == 16 and "tile(128, 128)" in info.value.note


def test_a_bias_launch_takes_tiles_at_most_128_wide():
    (lowered,) = lower_file(spec_with(f"y[t, n] = {GEMM} + bias[expert(t), n]"))
    assert lowered.schedule.launches[0].signature.tile_n <= 128


def test_parse_keeps_the_epilogue_in_the_statement_text():
    s = f"y[t, n] += alpha[lora(t)] * rw[t] * {GEMM} + bias[expert(t), n]"
    (spec,) = check(parse(spec_with(s)))
    assert spec.gemms[0].text == s
