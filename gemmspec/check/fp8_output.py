"""FP8 outputs, quantized in the epilogue, and `pow2` scales."""

from __future__ import annotations

from .. import ast
from ..spec import FP8_OUT_BLOCK, Gemm, Tensor
from .context import Context, row_major
from .fixes import drop_layout, fix, set_scale


def check_fp8_output(ctx: Context, gemm: Gemm, s: ast.Statement, t: Tensor) -> None:
    """An FP8 output is the result rounded to bf16 and quantized in the epilogue, one
    f32 scale per row and FP8_OUT_BLOCK columns, as the quantize pass would make it:
    `=` at its own rows, row-major with the columns last, whole blocks of a fixed
    column dim, scale blocks [1, ..., 1, 128] in the default layout."""
    name = t.name
    hint = f"declare `tensor {name} : {t.dtype} [{', '.join(t.dims)}] scale f32 [{_fp8_out_block(t.rank)}]`"
    if gemm.accumulate:
        raise ctx.error(
            f"'{name}' is {t.dtype}: an FP8 output is stored with `=` (each block's scale comes "
            "from the finished values); `+=` into FP8 is not supported",
            s.assign_pos or s.out.tensor.pos,
            "accumulate into a bf16 or f32 tensor, then quantize it (`= quantize(...)`)",
        )
    axis = gemm.out.axis_of_role("m")
    via = s.out.indices[axis] if axis is not None else None
    if isinstance(via, ast.Index) and via.via is not None:
        raise ctx.error(
            f"'{name}' is {t.dtype} and its rows are scattered through {via}; an FP8 output "
            "is stored at its own rows only (not supported yet)",
            via.via.pos,
            f"write '{name}' in row order, or scatter a bf16 output",
        )
    if t.scale is None:
        raise ctx.error(
            f"FP8 output '{name}' has no scale; the epilogue writes one f32 scale per row and "
            f"{FP8_OUT_BLOCK} columns",
            s.out.tensor.pos,
            hint,
            fix(set_scale(ctx, name, _fp8_out_block(t.rank).split(", "))),
        )
    decl = ctx.tensor_ast[name]
    n_axis = gemm.out.axis_of_role("n")
    assert n_axis is not None
    if n_axis != t.rank - 1:
        raise ctx.error(
            f"FP8 output '{name}' has its columns ({t.dims[n_axis]}) at position {n_axis + 1} of "
            f"{t.rank}; its scale blocks run along the last dim, so the columns come last",
            s.out.indices[n_axis].pos,
            f"index '{name}' with the column index last, e.g. {name}[..., {gemm.n.var}]",
        )
    for i, (b, entry) in enumerate(zip(t.scale.block, decl.scale.block)):
        want = FP8_OUT_BLOCK if i == t.rank - 1 else 1
        if b != want:
            raise ctx.error(
                f"FP8 output '{name}' has scale block {t.scale.block_text}; the epilogue "
                f"writes one scale per row and {FP8_OUT_BLOCK} columns, [{_fp8_out_block(t.rank)}]",
                entry.pos,
                hint,
                fix(set_scale(ctx, name, _fp8_out_block(t.rank).split(", "))),
            )
    if decl.scale.layout is not None and t.scale.layout.strides != tuple(row_major(ctx.scale_grid(t), None)):
        raise ctx.error(
            f"the scales of FP8 output '{name}' are stored {t.scale.layout}; the epilogue "
            "writes them row-major (the default)",
            decl.scale.layout.pos,
            "drop the scale's layout",
        )
    if t.scale.anchor is not None:
        raise ctx.error(
            f"the scales of FP8 output '{name}' are anchored per '{t.scale.anchor}'; with one "
            "scale per row they need no anchor",
            decl.scale.anchor.pos,
            f"drop `per {t.scale.anchor}`",
        )
    padded = decl.layout is not None and decl.layout.pad is not None  # even a pad that changes no stride
    if padded or t.layout.kind != "strided" or t.layout.strides != tuple(
        row_major([ctx.size_poly(d) for d in t.dims], None)
    ):
        raise ctx.error(
            f"FP8 output '{name}' is stored {t.layout}; the epilogue writes FP8 row-major "
            "(the default, no padding)",
            decl.layout.pos if decl.layout is not None else s.out.tensor.pos,
            "drop the layout",
            fix(drop_layout(ctx, name)),
        )
    cols = ctx.dims[t.dims[n_axis]]
    col_pos = s.out.indices[n_axis].pos
    if cols.size is None or cols.size % FP8_OUT_BLOCK:
        size = "known only at run time" if cols.size is None else f"{cols.size}"
        raise ctx.error(
            f"FP8 output '{name}' has {cols.name} = {size} columns; the epilogue quantizes "
            f"whole {FP8_OUT_BLOCK}-column blocks, so {cols.name} must be fixed at compile time "
            f"and a multiple of {FP8_OUT_BLOCK}",
            col_pos,
            f"declare `dim {cols.name} = ...` with a multiple of {FP8_OUT_BLOCK}",
        )
    b_t = ctx.tensors[gemm.b.tensor]
    if gemm.swiglu and b_t.scale is not None and not ctx.per_channel(gemm):
        # 128 gate/up pairs per tile: 256 columns, two 128-column wgmma halves, each with
        # one B scale per K block.
        b_axis = gemm.b.axis_of_role("n")
        block = b_t.scale.block[b_axis]
        if not ctx.covers(b_t, b_axis) and block % FP8_OUT_BLOCK:
            raise ctx.error(
                f"'{b_t.name}' changes scale every {block} rows along {b_t.dims[b_axis]}; a SwiGLU "
                f"into FP8 runs tiles of {2 * FP8_OUT_BLOCK} gate/up rows as two "
                f"{FP8_OUT_BLOCK}-row halves, each with one scale of '{b_t.name}' per K block",
                ctx.tensor_ast[b_t.name].scale.block[b_axis].pos,
                f"use blocks of {FP8_OUT_BLOCK} (or a multiple) along {b_t.dims[b_axis]}",
            )
    splitting = [a.group for a in gemm.leaf_axes if a.group and ctx.groups[a.group].dim == cols.name]
    if splitting:
        raise ctx.error(
            f"group '{splitting[0]}' splits the columns {cols.name} of FP8 output '{name}'; "
            "its scale blocks run across whole rows of the output (not supported yet)",
            col_pos,
            "split the rows instead, or write one statement per column segment",
        )


def check_pow2_scales(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    """`scale f32 [...] pow2` says how the epilogue computes the scales it writes, so it
    belongs to FP8 outputs; a quantize pass spells it `quantize(SOURCE, pow2)`."""
    written = {w for g in gemms for w in g.writes}
    for t in ctx.tensors.values():
        if t.scale is None or not t.scale.pow2 or t.name in written:
            continue
        pos = ctx.tensor_ast[t.name].scale.pow2[0]
        if t.derived is not None and t.derived.op == "quantize":
            raise ctx.error(
                f"'{t.name}' is quantized by a pre-pass, whose option says how it computes its "
                "scales: write it there",
                pos,
                f"drop this `pow2` and declare `= quantize({t.derived.source}, pow2)`",
            )
        raise ctx.error(
            f"`pow2` says how gemmspec computes the scales it writes, but no statement writes "
            f"'{t.name}': its scales are passed in",
            pos,
            "drop `pow2` (power-of-two scales passed in need no declaration)",
        )


def _fp8_out_block(rank: int) -> str:
    """The scale block of an FP8 output of `rank` dims, as written: `1, 128`."""
    return ", ".join(["1"] * (rank - 1) + [str(FP8_OUT_BLOCK)])
