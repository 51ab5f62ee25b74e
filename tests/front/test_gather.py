"""Rows read through an index tensor (`x[idx[t], k]`) and outputs written through one
(`y[idx[t], n] = ...`): what the checker accepts, what it makes of it, and each misuse
refused at its token with a note."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse

BASE = """\
gemm g {
  dim T, S
  dim N = 256, K = 512, F = 128, M = 64
  group expert[E = 4] = ragged(T, offsets = offs)
  group part[P = 2] = split(N, sizes = [128, 128])
  group slot[Q = 2] = masked(M, counts = cnt)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor sdx : i32 [S]
  tensor widx : bf16 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor x2 : e4m3 [S, K] scale f32 [128, 128]
  tensor xc : e4m3 [S, K] scale f32 [1, K]
  tensor xt : e4m3 [T, K] scale f32 [128, 128] per expert
  tensor xs : bf16 [S, K] layout row_major
  tensor xb : bf16 [S, K]
  tensor xm : bf16 [Q, M, K]
  tensor mi : i32 [M]
  tensor h : bf16 [T, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wc : e4m3 [E, N, K] scale f32 [1, 1, K]
  tensor wb : bf16 [E, N, K]
  tensor wg : bf16 [E, N, K]
  tensor wm : bf16 [Q, N, K]
  tensor rw : f32 [T]
  tensor rs : f32 [S]
  tensor y : bf16 [T, N]
  tensor ys : bf16 [S, N]
  tensor yf : f32 [S, N]
  tensor ym : bf16 [Q, M, N]
  tensor hs : bf16 [T, F]
  tensor bias : bf16 [E, N]
  tensor yw : f32 [E, F, K]
  STATEMENT
}
"""
LINE = 34  # the statement's line in BASE
GATHER = "y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]"
SCATTER = "ys[src[t], n] = sum[k] h[t, k] * wb[expert(t), n, k]"


def spec_with(statement: str, base: str = BASE) -> str:
    return base.replace("STATEMENT", statement)


def checked(statement: str):
    (spec,) = check(parse(spec_with(statement), "g.gspec"))
    return spec, spec.gemms[0]


def first_error(statement: str, base: str = BASE) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(spec_with(statement, base), "g.gspec"))
    return info.value


def test_the_base_spec_lines_up():
    assert BASE.splitlines()[LINE - 1] == "  STATEMENT"


def test_gathered_rows_are_the_row_index_read_through_the_index_tensor():
    spec, g = checked(GATHER)
    assert (g.m.var, g.m.dim, g.m.group) == ("t", "T", "expert")
    assert g.gather == "idx" and g.scatter is None and g.index_tensors == ("idx",)
    axis = g.a.axis_of_role("m")
    assert axis == 0 and g.a.uses[axis].index == "idx"
    assert spec.tensor("x").dims[axis] == "S"  # the position's own dim
    assert g.text == GATHER and g.reads == ("x", "w")
    assert "gather=idx" in str(spec)


def test_scattered_rows_store_through_the_index_tensor():
    _, g = checked(SCATTER)
    assert g.scatter == "src" and g.gather is None
    assert g.out.uses[0].index == "src" and g.out.uses[0].role == "m"
    assert not g.accumulate


def test_gather_and_scatter_in_one_statement_and_with_epilogue_factors():
    _, g = checked("ys[src[t], n] = rw[t] * sum[k] x[idx[t], k] * w[expert(t), n, k]")
    assert (g.gather, g.scatter, g.index_tensors) == ("idx", "src", ("idx", "src"))
    assert [e.kind for e in g.epilogue] == ["row"]  # read in routing order, by t
    # One index tensor for both sides.
    _, g = checked("ys[idx[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]")
    assert g.index_tensors == ("idx",)


@pytest.mark.parametrize(
    "statement",
    [
        "y[t, n] = sum[k] x2[idx[t], k] * w[expert(t), n, k]",  # 128x128 blocks over S's rows
        "y[t, n] = sum[k] xb[idx[t], k] * wb[expert(t), n, k]",  # BF16
        "hs[t, j] = silu(sum[k] xb[idx[t], k] * wg[expert(t), 2*j, k]) * sum[k] xb[idx[t], k] * wg[expert(t), 2*j + 1, k]",
        "ym[q, m, n] = sum[k] xm[q, mi[m], k] * wm[q, n, k]",  # masked rows, one index per row
        "ys[src[t], n] = sum[k] h[t, k] * wb[expert(t), n, k] + bias[expert(t), n]",
        "ys[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]",
    ],
    ids=["fp8_128x128", "bf16", "swiglu", "masked", "bias", "both"],
)
def test_accepted_shapes(statement):
    _, g = checked(statement)
    assert g.gather or g.scatter


def test_ungrouped_rows_can_be_gathered():
    base = BASE.replace("tensor wb : bf16 [E, N, K]", "tensor wb : bf16 [E, N, K]\n  tensor wd : bf16 [N, K]")
    (spec,) = check(parse(spec_with("y[t, n] = sum[k] xb[idx[t], k] * wd[n, k]", base)))
    g = spec.gemms[0]
    assert g.gather == "idx" and g.m.group is None and not g.leaf_axes


CASES = [
    # (statement, token the caret is under, message fragment, note fragment)
    (
        "y[t, n] = sum[k] x[widx[t], k] * w[expert(t), n, k]",
        "widx", "'widx' is bf16, but widx[t] reads it as an index tensor; index tensors are i32",
        "tensor widx : i32 [T]",
    ),
    (
        "y[t, n] = sum[k] x[sdx[t], k] * w[expert(t), n, k]",
        "t], k]", "index 't' ranges over S in sdx[...] but over T", None,
    ),
    (
        "y[t, n] = sum[k] x[nope[t], k] * w[expert(t), n, k]",
        "nope", "unknown index tensor 'nope'", "tensor nope : i32 [T]",
    ),
    (
        "y[t, n] = sum[k] xb[t, k] * wb[expert(t), idx[n], k]",
        "idx[n]", "reads 'wb' along the column index 'n'; only rows go through an index tensor",
        "gather the rows of the first factor",
    ),
    (
        "y[t, n] = sum[k] h[t, idx[k]] * wb[expert(t), n, k]",
        "idx[k]", "reads 'h' along the contracted index 'k'", "gather the rows",
    ),
    (
        "yw[e, n, k] = sum[t in expert(e)] xb[idx[t], n] * h[t, k]",
        "idx[t]", "along the contracted index 't'", None,
    ),
    (
        "y[t, n] = rw[idx[t]] * sum[k] h[t, k] * wb[expert(t), n, k]",
        "idx[t]]", "reads the epilogue operand 'rw' along the row index 't'", "index 'rw' by 't' itself",
    ),
    (
        "yf[src[t], n] += sum[k] h[t, k] * wb[expert(t), n, k]",
        "src", "written through src[t] with +=", "store with `=`",
    ),
    (
        "y[t, n] = sum[k] idx[t, k] * w[expert(t), n, k]",
        "idx[t, k]", "'idx' is i32, an index tensor", "x[idx[t], k]",
    ),
    (
        "idx[t] = sum[k] h[t, k] * wb[expert(t), n, k]",
        "idx[t] =", "'idx' is i32, an index tensor", None,
    ),
    (
        "y[t, n] = sum[k] xc[idx[t], k] * wc[expert(t), n, k]",
        "idx", "per-channel scales", "use [1, 128] blocks on 'xc'",
    ),
    (
        "y[t, n] = sum[k] xs[idx[t], k] * wb[expert(t), n, k]",
        "xs", "its rows are gathered through idx[t]", "row_major",
    ),
]


@pytest.mark.parametrize("statement, token, fragment, note", CASES, ids=[c[2][:40] for c in CASES])
def test_misuse_is_located_with_a_note(statement, token, fragment, note):
    base = BASE.replace("tensor xs : bf16 [S, K] layout row_major", "tensor xs : bf16 [T, K] layout segment_major(expert)")
    err = first_error(statement, base)
    assert fragment in err.message, err.render()
    assert err.location.line == LINE, err.render()
    assert err.location.column == statement.index(token) + 3, err.render()
    if note is not None:
        assert err.note and note in err.note, err.render()


def test_anchored_scales_cannot_be_read_through_the_index():
    # Blocks restarting per segment of the rows as stored: row idx[t] has no block to find
    # through the index alone. Located at `per expert` in the declaration.
    err = first_error("y[t, n] = sum[k] xt[idx[t], k] * w[expert(t), n, k]")
    assert "restart at each 'expert' segment along T" in err.message, err.render()
    decl = BASE.splitlines().index("  tensor xt : e4m3 [T, K] scale f32 [128, 128] per expert")
    assert err.location.line == decl + 1
    assert err.location.column == BASE.splitlines()[decl].index("expert") + 1
    assert "drop `per expert`" in err.note and "xt_scale[idx[t] / 128, k / 128]" in err.note


@pytest.mark.parametrize(
    "decl, token, fragment",
    [
        ("tensor bad : i32 [T, K]", "K]", "has 2 dims [T, K]; an index tensor has one"),
        ("tensor bad : i32 [T] layout strides(2)", "layout", "index tensor 'bad' is stored strides(2)"),
        ("tensor bad : i32 [T] scale f32 [1]", "scale", "scales apply to FP8"),
    ],
)
def test_index_tensor_declarations(decl, token, fragment):
    base = BASE.replace("  tensor idx : i32 [T]\n", f"  tensor idx : i32 [T]\n  {decl}\n")
    err = first_error(GATHER, base)
    assert fragment in err.message, err.render()
    assert err.location.line == 8
    assert err.location.column == decl.index(token) + 3, err.render()


def test_i32_is_an_element_type_of_index_tensors_only():
    base = BASE.replace("tensor rw : f32 [T]", "tensor rw : i32 [T]")
    err = first_error("y[t, n] = rw[t] * sum[k] h[t, k] * wb[expert(t), n, k]", base)
    assert "'rw' is i32, an index tensor" in err.message


def test_explain_says_which_loader_each_launch_uses_and_why(capsys, tmp_path):
    import json

    from gemmspec.cli import main
    from gemmspec.explain import explain_text
    from gemmspec.pipeline import lower_file

    text = spec_with("ys[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]")
    (x,) = lower_file(text)
    out = explain_text(x.spec, x.schedule)
    assert "A gathered through idx: rows loaded by TMA, a one-row box each" in out  # the kernel line
    assert "rows loaded by TMA, a box of one row each (each producer thread" in out  # how
    assert "else copied by the producer warpgroup" in out  # and where TMA cannot
    assert "its [1, 128] scales read through idx too" in out
    assert "one CTA per tile (A's rows are gathered row by row" in out
    assert "D scattered through src: rows stored from registers" in out
    assert "the entries of src must be distinct" in out
    assert "A x(m, k) = x_base[0 + idx[start.m + m]*(512) + k*(1)]" in out
    assert "reads at run time: offs, idx, src" in out
    assert "dgrad of x (statement #0): dx_rows[t, k] = sum[n] dys[src[t], n] * w_t[expert(t), n, k]; dx = scatter_add(dx_rows, rows = idx)" in out

    path = tmp_path / "gather.gspec"
    path.write_text(text)
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    (launch,) = doc["launches"]
    assert launch["operands"]["A"]["rows_through"] == {"tensor": "idx", "offset": "start.m", "bound": "S"}
    assert launch["operands"]["D"]["rows_through"]["tensor"] == "src"
    assert launch["scales"]["A"]["rows_through"]["tensor"] == "idx"
    assert "rows_through" not in launch["operands"]["B"] and launch["signature"]["cluster"] == 1
    assert launch["runtime_tensors"] == ["offs", "idx", "src"]


def test_a_scale_over_the_whole_gathered_dim_cannot_be_read_through_the_index():
    # One block over all of S along the gathered rows: the scale of row gix[t] is no block
    # the index can name (before this refusal the lowering wrote the dim's name into the
    # block and emission failed). Located at the declaration's scale, with a fix.
    text = """
gemm gather_whole_scale {
  dim T, S
  dim N = 16, K = 256
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor gix : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [S, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[gix[t], k] * w[expert(t), n, k]
}
"""
    with pytest.raises(SpecError) as info:
        check(parse(text))
    err = info.value
    assert "the scales of 'x' are one block over the whole of S, but its rows are gathered through gix[t]" \
        in err.message, err.render()
    line = text.splitlines()[err.location.line - 1]
    assert line.strip().startswith("tensor x :") and line[err.location.column - 1:].startswith("scale f32 [S, 128]")
    assert "use [1, 128] blocks on 'x'" in err.note
    fixed = text.replace("scale f32 [S, 128]", "scale f32 [1, 128]")
    check(parse(fixed))  # the note's blocks check
