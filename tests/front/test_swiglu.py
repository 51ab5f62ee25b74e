"""SwiGLU statements: what the checker accepts, what it makes of it, and each refusal
located at its token with a note."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

BASE = """\
gemm g {
  dim T
  dim N = 256, F = 128, K = 512, M = 64, V = 96
  group expert[E = 4] = ragged(T, offsets = offs)
  group part[P = 2] = split(F, sizes = [64, 64])
  tensor x : bf16 [T, K]
  tensor x2 : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor wu : bf16 [E, N, K]
  tensor wf : bf16 [E, F, K]
  tensor wn : bf16 [E, N, K]
  tensor wp : bf16 [P, N, K]
  tensor rw : f32 [T]
  tensor alpha : f32 [E]
  tensor bias : bf16 [E, F]
  tensor h : bf16 [T, F]
  tensor h16 : f16 [T, F]
  tensor hn : bf16 [T, N]
  tensor hv : bf16 [T, V]
  STATEMENT
}
"""
LINE = 20  # the statement's line in BASE
GATE = "sum[k] x[t, k] * w[expert(t), 2*j, k]"
UP = "sum[k] x[t, k] * w[expert(t), 2*j + 1, k]"
SWIGLU = f"h[t, j] = silu({GATE}) * {UP}"


def spec_with(statement: str) -> str:
    return BASE.replace("STATEMENT", statement)


def first_error(statement: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(spec_with(statement), "s.gspec"))
    return info.value


def test_a_swiglu_is_one_gemm_over_the_interleaved_rows():
    (spec,) = check(parse(spec_with(SWIGLU)))
    (g,) = spec.gemms
    assert g.swiglu and not g.epilogue and not g.accumulate
    # The GEMM runs over the weight's N rows; the output's column index is j.
    assert (g.n.var, g.n.dim, g.m.dim, g.k.dim) == ("j", "N", "T", "K")
    assert g.b.axis_of_role("n") == 1 and g.out.axis_of_role("n") == 1
    assert g.text == SWIGLU and g.reads == ("x", "w")


def test_plain_statements_are_not_swiglu():
    (spec,) = check(parse(spec_with("hn[t, n] = sum[k] x[t, k] * w[expert(t), n, k]")))
    assert not spec.gemms[0].swiglu


def test_factors_apply_after_the_activation():
    s = f"h[t, j] = alpha[expert(t)] * rw[t] * silu({GATE}) * {UP}"
    (spec,) = check(parse(spec_with(s)))
    (g,) = spec.gemms
    assert g.swiglu and [e.kind for e in g.epilogue] == ["alpha", "row"]
    assert g.text == s


def test_parenthesised_and_reordered_index_expressions():
    s = "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), j*2, k]) * sum[k] x[t, k] * w[expert(t), (1 + 2*j), k]"
    (spec,) = check(parse(spec_with(s)))
    assert spec.gemms[0].swiglu


def test_lowered_swiglu_launch_names_itself_and_stores_from_registers():
    (lowered,) = lower_file(spec_with(SWIGLU))
    (launch,) = lowered.schedule.launches
    assert launch.signature.swiglu and launch.signature.name.endswith("_swiglu")
    assert launch.signature.tile_n % 2 == 0
    assert launch.problems.extent("n").size.value == 256  # the GEMM's N: gate and up rows
    assert str(launch.problems.d.strides[0]) == "128"  # D's rows hold F = 128 columns
    assert any("SwiGLU" in r and "from registers" in r for r in lowered.schedule.reasons)
    assert "swiglu: D(m, j)" in str(launch)


CASES = [
    # (statement, token the caret is under (in a tuple: its last occurrence), message
    # fragment, note fragment)
    (f"h[t, j] += silu({GATE}) * {UP}", "+=", "`+=` cannot be fused", "`=`"),
    (f"{SWIGLU} + bias[expert(t), j]", "bias[", "cannot be fused with SwiGLU", "separate pass"),
    (f"h16[t, j] = silu({GATE}) * {UP}", "h16", "a SwiGLU stores bf16 or f32", "bf16"),
    (
        f"h[t, j] = silu({GATE}) * sum[k] x2[t, k] * w[expert(t), 2*j + 1, k]",
        "x2", "both products of a SwiGLU read the same input", "silu(",
    ),
    (
        f"h[t, j] = silu({GATE}) * sum[k2] x[t, k2] * w[expert(t), 2*j + 1, k2]",
        "k2]", "contract the same index", "silu(",
    ),
    (
        f"h[t, j] = silu({GATE}) * sum[k] x[t, k] * wu[expert(t), 2*j + 1, k]",
        "2*j + 1", "two gate and up weights are read row for row", "wu[e, j, k]",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), j, k]) * sum[k] x[t, k] * w[expert(t), j + 64, k]",
        "j + 64", "64 rows past the gate's, but stacked halves put the up half F = 128 rows", "rows F + j",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), j + F, k]) * sum[k] x[t, k] * w[expert(t), j, k]",
        "j + F", "of stacked halves the gate is the first", "the gate from rows j",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j + 1, k]) * sum[k] x[t, k] * w[expert(t), 2*j, k]",
        "2*j + 1", "the gate is the even row of each pair", "gate first",
    ),
    (
        f"h[t, j] = silu({GATE}) * sum[k] x[t, k] * w[expert(t), 2*j + 2, k]",
        "2*j + 2", "gate from rows 2*j and its up projection from rows 2*j + 1", "silu(",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 3*j, k]) * sum[k] x[t, k] * w[expert(t), 3*j + 1, k]",
        "3*j,", "gate from rows 2*j", "silu(",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), j, k]) * sum[k] x[t, k] * w[expert(t), j, k]",
        ("w[expert(t), j, k]",), "read the same rows", "silu(",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[0, 2*j + 1, k]",
        "0, 2*j + 1", "differ at 2 positions of 'w' (expert(t) and 0 here)", "silu(",
    ),
    (
        "hn[t, n] = sum[k] x[t, k] * w[expert(t), 2*n, k]",
        "2*n", "index expression '2*n'", "silu(",
    ),
    (
        f"h[t, 2*j] = silu({GATE}) * {UP}",
        "2*j] =", "index expression '2*j' in h[...]", None,
    ),
    (
        "hv[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]",
        "2*j, k]) *", "the output's column dim is V = 96", "declare V = 128",
    ),
    (
        "hn[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]",
        "2*j, k]) *", "the output's column dim is N = 256", "a column dim of its own",
    ),
    (
        "h[t, i] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]",
        "2*j, k]) *", "'j' in 2*j does not index the output", "h[t, j]",
    ),
    (
        "h[t, j] = silu(sum[k] x[t, k] * wp[part(j), 2*j, k]) * sum[k] x[t, k] * wp[part(j), 2*j + 1, k]",
        "2*j, k]) *", "the columns of a SwiGLU", "split the rows",
    ),
]


@pytest.mark.parametrize("statement, token, fragment, note", CASES, ids=[c[2][:40] for c in CASES])
def test_refusal_is_located_with_a_note(statement, token, fragment, note):
    err = first_error(statement)
    assert fragment in err.message, err.render()
    assert err.location.line == LINE, err.render()
    at = statement.rindex(token[0]) if isinstance(token, tuple) else statement.index(token)
    assert err.location.column == at + 3, err.render()
    if note is not None:
        assert err.note and note in err.note, err.render()


@pytest.mark.parametrize("n, f, fragment", [(257, 128, "an odd number"), (512, 128, "256 pairs")])
def test_the_weight_rows_must_pair_up_with_the_output_columns(n, f, fragment):
    text = spec_with(SWIGLU).replace("N = 256, F = 128", f"N = {n}, F = {f}").replace(
        "sizes = [64, 64]", f"sizes = [{f - 64}, 64]"
    )
    with pytest.raises(SpecError) as info:
        check(parse(text, "s.gspec"))
    err = info.value
    assert fragment in err.message and "declared at 3:" in err.message, err.render()
    assert (err.location.line, err.location.column) == (LINE, SWIGLU.index("2*j") + 3)


def test_run_time_column_dims_are_refused():
    text = spec_with(SWIGLU).replace("dim N = 256, F = 128,", "dim N, F = 128,")
    with pytest.raises(SpecError) as info:
        check(parse(text, "s.gspec"))
    assert "fixed at compile time, but N is known only at run time" in info.value.message
    assert "give N a size" in info.value.note


def test_silu_needs_the_product_after_it():
    with pytest.raises(SpecError) as info:
        parse(spec_with(f"h[t, j] = silu({GATE})"), "s.gspec")
    assert "expected '*'" in info.value.message
    assert info.value.location.line == LINE + 1


def test_the_statement_text_round_trips():
    s = f"h[t, j] = rw[t] * silu({GATE}) * {UP}"
    (file_spec,) = parse(spec_with(s)).specs
    assert str(file_spec.statements[0]) == s


# ---- gate and up rows not interleaved ------------------------------------------------

SEPARATE = "h[t, j] = silu(sum[k] x[t, k] * wf[expert(t), j, k]) * sum[k] x[t, k] * wg[expert(t), j, k]"
STACKED = "h[t, j] = silu(sum[k] x[t, k] * w[expert(t), j, k]) * sum[k] x[t, k] * w[expert(t), F + j, k]"


def with_up_weight(decl: str, statement: str = SEPARATE) -> str:
    return spec_with(statement).replace("  tensor rw : f32 [T]\n", f"  tensor rw : f32 [T]\n  tensor wg : {decl}\n")


@pytest.mark.parametrize("up", ["F + j", "j + F", "j + 128", "128 + j"])
def test_stacked_halves_are_one_gemm_over_the_output_columns(up):
    (spec,) = check(parse(spec_with(STACKED.replace("F + j", up))))
    (g,) = spec.gemms
    assert g.swiglu and g.swiglu_halves and (g.swiglu_up, g.swiglu_up_rows) == ("w", 128)
    # The GEMM's n counts D's columns; the kernel runs over gate rows, then up rows.
    assert (g.n.var, g.n.dim) == ("j", "F") and g.b.axis_of_role("n") == 1
    assert g.reads == ("x", "w")


def test_two_weights_are_one_gemm_reading_both():
    (spec,) = check(parse(with_up_weight("bf16 [E, F, K]")))
    (g,) = spec.gemms
    assert g.swiglu_halves and (g.swiglu_up, g.swiglu_up_rows) == ("wg", 0)
    assert (g.n.dim, g.reads) == ("F", ("x", "wf", "wg"))


@pytest.mark.parametrize("statement", [SEPARATE, STACKED], ids=["separate", "stacked"])
def test_halves_lower_to_twice_the_columns_with_the_up_map(statement):
    (lowered,) = lower_file(with_up_weight("bf16 [E, F, K]", statement))
    (launch,) = lowered.schedule.launches
    sig, pg = launch.signature, launch.problems
    assert sig.swiglu and sig.swiglu_halves and sig.tile_n % 16 == 0
    assert pg.extent("n").size.value == 256  # gate rows, then up rows
    assert pg.u is not None and pg.u.strides == pg.b.strides
    if statement is STACKED:
        assert sig.swiglu_up_rows == 128 and pg.u.tensor == "w"
        assert str(pg.u.offset) == str(pg.b.offset + pg.b.strides[0] * 128)
        assert sig.name.endswith("_swiglu_halves128")
    else:
        assert sig.swiglu_up_rows == 0 and pg.u.tensor == "wg" and pg.u.offset == pg.b.offset
        assert sig.name.endswith("_swiglu_halves")
    assert any("two TMA boxes per stage" in r for r in lowered.schedule.reasons)


@pytest.mark.parametrize(
    "decl, fragment, fix",
    [
        ("bf16 [E, N, K]", "has dims [E, N, K] but the gate weight 'wf' [E, F, K]", "bf16 [E, F, K]"),
        ("f16 [E, F, K]", "has type f16 but the gate weight 'wf' bf16", "bf16 [E, F, K]"),
        ("bf16 [E, F, K] layout major(F)", "has layout major(F) but the gate weight 'wf' row_major", "bf16 [E, F, K]"),
    ],
)
def test_the_up_weight_is_declared_as_the_gate(decl, fragment, fix):
    text = with_up_weight(decl)
    with pytest.raises(SpecError) as info:
        check(parse(text, "s.gspec"))
    err = info.value
    assert fragment in err.message and "declare 'wg' as 'wf' is" in err.note, err.render()
    line = text.splitlines()[err.location.line - 1]
    assert line[err.location.column - 1:].startswith("wg :"), err.render()
    (spec,) = check(parse(with_up_weight(fix)))  # the fix the note proposes is accepted
    assert spec.gemms[0].swiglu_up == "wg"


FP8_HALVES = """\
gemm g {
  dim T
  dim F = FCOLS, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor wg : e4m3 [E, F, K] scale f32 [1, BLOCK, 128]
  tensor wu : e4m3 [E, F, K] scale f32 [1, BLOCK, 128]
  tensor h : bf16 [T, F]
  h[t, j] = silu(sum[k] x[t, k] * wg[expert(t), j, k]) * sum[k] x[t, k] * wu[expert(t), j, k]
}
"""


def test_fp8_halves_take_128_row_scale_blocks_and_256_tiles():
    (lowered,) = lower_file(FP8_HALVES.replace("FCOLS", "256").replace("BLOCK", "128"))
    (launch,) = lowered.schedule.launches
    assert launch.signature.tile_n == 256 and launch.problems.su is not None
    assert launch.problems.su.tensor != launch.problems.sb.tensor


@pytest.mark.parametrize("f, block", [(256, 64), (192, 128)])
def test_fp8_halves_refuse_other_scale_blocks(f, block):
    text = FP8_HALVES.replace("FCOLS", str(f)).replace("BLOCK", str(block))
    with pytest.raises(SpecError) as info:
        check(parse(text, "s.gspec"))
    err = info.value
    assert "each one scale block" in err.message and "use blocks of 128 rows" in err.note, err.render()
    assert (err.location.line, err.location.column) == (6, text.splitlines()[5].index(str(block)) + 1)


def test_tile_directive_must_split_halves_whole():
    text = with_up_weight("bf16 [E, F, K]").replace("  STATEMENT", "").replace("gemm g {", "gemm g {\n  tile(128, 72)")
    with pytest.raises(SpecError) as info:
        check(parse(text, "s.gspec"))
    assert "its tiles hold gate rows, then as many up rows" in info.value.message
    assert "tile(128, 128)" in info.value.note
    (spec,) = check(parse(text.replace("tile(128, 72)", "tile(128, 128)")))
    assert spec.directives.tile == (128, 128)


@pytest.mark.parametrize("statement", [SEPARATE, STACKED], ids=["separate", "stacked"])
def test_the_backward_skips_halves_with_the_reason(statement):
    from gemmspec.backward import derive_backward

    (spec,) = check(parse(with_up_weight("bf16 [E, F, K]", statement)))
    derived = derive_backward(spec)
    (skipped,) = derived.skipped
    assert skipped.forward == 0 and "gate and up rows are not interleaved" in skipped.reason
    assert not derived.statements


def test_an_undeclared_up_weight_is_a_located_error_with_the_names():
    # Found by the front-half fuzz: the up weight of a SwiGLU over two weights was looked
    # up before anything had checked that it is declared (a KeyError escaped).
    statement = "h[t, j] = silu(sum[k] x[t, k] * wf[expert(t), j, k]) * sum[k] x[t, k] * wff[expert(t), j, k]"
    err = first_error(statement)
    assert err.message == "unknown tensor 'wff'", err.render()
    assert (err.location.line, err.location.column) == (LINE, statement.index("wff") + 3)
    assert err.note and "wf" in err.note, err.render()
