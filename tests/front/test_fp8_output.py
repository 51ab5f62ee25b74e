"""FP8 outputs: what the checker accepts (one f32 scale per row and 128 columns, `=`,
row-major, whole blocks), the tiles the analysis picks for them, and each refusal located
at its token with a note."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

BASE = """\
gemm g {
  dim T, S
  dim N = 512, F = 256, K = 384, M = 96, R = 200
  group expert[E = 4] = ragged(T, offsets = offs)
  group masked_e[B = 4] = masked(M, counts = counts)
  group cols[P = 2] = split(N, sizes = [256, 256])
  tensor idx : i32 [T]
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor xb : bf16 [T, K]
  tensor xm : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor w64 : e4m3 [E, N, K] scale f32 [1, 64, 128]
  tensor wr : e4m3 [E, R, K] scale f32 [1, 1, 128]
  tensor wm : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor wp : e4m3 [P, N, K] scale f32 [1, 128, 128]
  tensor wb : bf16 [E, N, K]
  tensor rw : f32 [T]
  tensor bias : bf16 [E, N]
  OUTPUT
  STATEMENT
}
"""
OUTPUT_LINE, LINE = 20, 21
PLAIN = "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]"
SWIGLU = "y[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]"
Y = "tensor y : e4m3 [T, N] scale f32 [1, 128]"
H = "tensor y : e4m3 [T, F] scale f32 [1, 128]"


def spec_with(output: str, statement: str, directive: str = "") -> str:
    return BASE.replace("OUTPUT", output).replace("STATEMENT", statement + (f"\n  {directive}" if directive else ""))


def checked(output: str, statement: str, directive: str = ""):
    (spec,) = check(parse(spec_with(output, statement, directive), "s.gspec"))
    return spec


def first_error(output: str, statement: str, directive: str = "") -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(spec_with(output, statement, directive), "s.gspec"))
    return info.value


def tile_of(output: str, statement: str, directive: str = ""):
    (x,) = lower_file(spec_with(output, statement, directive))
    (launch,) = x.schedule.launches
    return launch, x


@pytest.mark.parametrize(
    "output, statement",
    [
        (Y, PLAIN),
        (Y.replace("e4m3", "e5m2"), PLAIN),
        (H, SWIGLU),
        (Y + " pow2", PLAIN),
        (Y.replace("[1, 128]", "[1, 128] as y_sf"), PLAIN),
        # Epilogue operands before the quantization; a SwiGLU with a router weight.
        (Y, "y[t, n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]"),
        (H, SWIGLU.replace("= silu", "= rw[t] * silu")),
        # Gathered rows, BF16 operands, a masked batch of 3-D outputs.
        ("tensor y : e4m3 [T, N] scale f32 [1, 128]", "y[t, n] = sum[k] xs[idx[t], k] * w[expert(t), n, k]"),
        (Y, "y[t, n] = sum[k] xb[t, k] * wb[expert(t), n, k]"),
        ("tensor y : e4m3 [B, M, N] scale f32 [1, 1, 128]", "y[e, m, n] = sum[k] xm[e, m, k] * wm[e, n, k]"),
    ],
    ids=["e4m3", "e5m2", "swiglu", "pow2", "named-scale", "epilogue", "swiglu-row-weight", "gathered", "bf16-operands", "masked-3d"],
)
def test_fp8_outputs_are_accepted(output, statement):
    spec = checked(output, statement)
    y = spec.tensor("y")
    assert y.dtype in ("e4m3", "e5m2") and y.scale.block[-1] == 128 and all(b == 1 for b in y.scale.block[:-1])
    assert y.scale.pow2 == ("pow2" in output)
    (x,) = lower_file(spec_with(output, statement))
    for launch in x.schedule.launches:
        pg = launch.problems
        assert pg.sd is not None and pg.sd.tensor == y.scale.name and pg.sd.block == (1, 128)
        assert launch.signature.d_type == y.dtype and launch.signature.d_scale_pow2 == y.scale.pow2
        assert "scale D" in str(launch) and "(written)" in str(launch)


def test_the_d_scale_map_follows_the_leaf():
    launch, _ = tile_of(Y, PLAIN)
    sd = launch.problems.sd
    # One scale per row: the leaf's first row's scales, 4 blocks per row of 512 columns.
    assert (str(sd.offset), str(sd.strides[0]), str(sd.strides[1])) == ("4*bstart.m", "4", "1")
    masked, _ = tile_of("tensor y : e4m3 [B, M, N] scale f32 [1, 1, 128]", "y[e, m, n] = sum[k] xm[e, m, k] * wm[e, n, k]")
    assert str(masked.problems.sd.offset) == "384*g.masked_e"  # 96 rows of 4 blocks per batch entry


@pytest.mark.parametrize(
    "output, statement, tile_n",
    [
        (Y, PLAIN, 128),  # scaled FP8: 128 (wider would straddle a block)
        (H, SWIGLU, 256),  # 128 gate/up pairs: two wgmma halves
        (Y, "y[t, n] = sum[k] xb[t, k] * wb[expert(t), n, k]", 256),  # unscaled: the cost prefers 256
        (H, SWIGLU.replace("x[t, k]", "xb[t, k]").replace("w[", "wb["), 256),
    ],
    ids=["fp8", "fp8-swiglu", "bf16", "bf16-swiglu"],
)
def test_tiles_cover_whole_blocks_of_the_output(output, statement, tile_n):
    launch, x = tile_of(output, statement)
    assert launch.signature.tile_n == tile_n
    why = next(r for r in x.schedule.reasons if r.startswith("tile choice"))
    assert "quantized per row and 128 columns in the epilogue" in why
    assert ("two 128-column halves" in why) == (tile_n == 256 and "xb" not in statement)
    stores = next(r for r in x.schedule.reasons if r.startswith("stores"))
    assert "rounded to bf16" in stores and "y_scale" in stores


def test_the_tile_directive_must_cover_whole_blocks():
    launch, _ = tile_of(H, SWIGLU, "tile(128, 256)")
    assert launch.signature.tile_n == 256
    launch, _ = tile_of(Y, PLAIN, "tile(64, 128)")
    assert (launch.signature.tile_m, launch.signature.tile_n) == (64, 128)


def test_explain_json_has_the_scale_map_of_d(tmp_path):
    import json

    from gemmspec.cli import main

    path = tmp_path / "s.gspec"
    path.write_text(spec_with(Y + " pow2", PLAIN))
    from contextlib import redirect_stdout
    from io import StringIO

    out = StringIO()
    with redirect_stdout(out):
        assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(out.getvalue())
    (launch,) = doc["launches"]
    assert launch["signature"]["d_type"] == "e4m3" and launch["signature"]["d_scale_pow2"] is True
    assert launch["scales"]["D"]["tensor"] == "y_scale" and launch["scales"]["D"]["block"] == {"m": 1, "n": 128}


def test_the_backward_skips_an_fp8_output():
    from gemmspec.backward import derive_backward

    bw = derive_backward(checked(Y, PLAIN))
    (skipped,) = bw.skipped
    assert "FP8" in skipped.reason and not bw.statements and not bw.source


# (output, statement, directive, line, token, message fragment, note fragment)
ERRORS = {
    "accumulate": (Y, PLAIN.replace(" = ", " += "), "", LINE, "+=", "stored with `=`", "accumulate into a bf16 or f32"),
    "scattered": (
        "tensor y : e4m3 [S, N] scale f32 [1, 128]", "y[idx[t], n] = sum[k] x[t, k] * w[expert(t), n, k]", "",
        LINE, "idx", "stored at its own rows only", "scatter a bf16 output",
    ),
    "no-scale": ("tensor y : e4m3 [T, N]", PLAIN, "", LINE, "y", "has no scale", "scale f32 [1, 128]"),
    "columns-not-last": (
        "tensor y : e4m3 [N, T] scale f32 [128, 1]", "y[n, t] = sum[k] x[t, k] * w[expert(t), n, k]", "",
        LINE, "n,", "the columns come last", "column index last",
    ),
    "block-64": (Y.replace("128]", "64]"), PLAIN, "", OUTPUT_LINE, "64", "scale block [1, 64]", "scale f32 [1, 128]"),
    "block-rows": (Y.replace("[1, 128]", "[128, 128]"), PLAIN, "", OUTPUT_LINE, "128,", "scale block [128, 128]", "[1, 128]"),
    "block-256": (Y.replace("128]", "256]"), PLAIN, "", OUTPUT_LINE, "256", "one scale per row and 128 columns", "[1, 128]"),
    "scale-layout": (Y + " layout major(T)", PLAIN, "", OUTPUT_LINE, "layout major", "writes them row-major", "drop the scale's layout"),
    "scale-anchor": (Y + " per expert", PLAIN, "", OUTPUT_LINE, "expert", "need no anchor", "drop `per expert`"),
    "layout": (
        "tensor y : e4m3 [T, N] layout major(T) scale f32 [1, 128]", PLAIN, "", OUTPUT_LINE, "layout",
        "writes FP8 row-major", "drop the layout",
    ),
    "padded": (
        "tensor y : e4m3 [T, N] layout row_major pad 1024 scale f32 [1, 128]", PLAIN, "", OUTPUT_LINE, "layout",
        "writes FP8 row-major", "drop the layout",
    ),
    "columns-not-whole-blocks": (
        "tensor y : e4m3 [T, R] scale f32 [1, 128]", "y[t, r] = sum[k] x[t, k] * wr[expert(t), r, k]", "",
        LINE, "r]", "R = 200 columns", "multiple of 128",
    ),
    # Blocks of 128 along a run-time last dim: the scale grid's own layout refuses it first.
    "columns-at-run-time": (
        "tensor y : e4m3 [T, S] scale f32 [1, 128]\n  tensor ws : e4m3 [S, K] scale f32 [1, 128]",
        "y[t, s] = sum[k] x[t, k] * ws[s, k]", "", OUTPUT_LINE, "scale", "blocks along the run-time dim S", None,
    ),
    "columns-whole-run-time-dim": (
        "tensor y : e4m3 [T, S] scale f32 [1, S]\n  tensor ws : e4m3 [S, K] scale f32 [1, 128]",
        "y[t, s] = sum[k] x[t, k] * ws[s, k]", "", OUTPUT_LINE, "f32 [1, S]", "scale block [1, S]", "[1, 128]",
    ),
    "columns-split": (
        Y, "y[t, n] = sum[k] x[t, k] * wp[cols(n), n, k]", "", LINE, "n]", "splits the columns N",
        "split the rows instead",
    ),
    "swiglu-b-blocks": (H, SWIGLU.replace("w[", "w64["), "", 13, "64,", "every 64 rows along N", "blocks of 128"),
    "directive-not-whole": (Y, PLAIN, "tile(128, 192)", LINE + 1, "tile", "whole blocks of it", "tile(128, 128)"),
    "directive-swiglu-half": (H, SWIGLU, "tile(128, 128)", LINE + 1, "tile", "64 output columns of a SwiGLU", "tile(128, 256)"),
    "pow2-on-a-quantize-target": (
        Y + "\n  tensor xq : e4m3 [T, K] scale f32 [1, 128] pow2 = quantize(xb)",
        PLAIN.replace("x[t, k]", "xq[t, k]"), "", OUTPUT_LINE + 1, "pow2", "whose option says how", "quantize(xb, pow2)",
    ),
    "pow2-twice": (Y + " pow2 pow2", PLAIN, "", OUTPUT_LINE, "pow2 pow2", "written twice", None),
}
ERRORS["pow2-on-an-input"] = (
    Y + "\n  tensor x2 : e4m3 [T, K] scale f32 [1, 128] pow2", PLAIN.replace("x[t, k]", "x2[t, k]"), "",
    OUTPUT_LINE + 1, "pow2", "no statement writes 'x2'", "drop `pow2`",
)


@pytest.mark.parametrize("case", sorted(ERRORS))
def test_errors_are_located_with_a_note(case):
    output, statement, directive, line, token, fragment, note = ERRORS[case]
    err = first_error(output, statement, directive)
    text = spec_with(output, statement, directive)
    assert fragment in err.message, err.render()
    assert err.location.line == line, err.render()
    src = text.splitlines()[line - 1]
    column = src.index(token) + 1
    if case == "pow2-twice":  # the second one
        column = src.index(token) + len("pow2 ") + 1
    if case == "columns-whole-run-time-dim":  # at the block entry S
        column = src.index(token) + len("f32 [1, ") + 1
    assert err.location.column == column, err.render()
    if note is not None:
        assert err.note is not None and note in err.note, err.render()
