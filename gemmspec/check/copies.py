"""`T = copy(S)`: a second FP8 output of the statement that writes S, written in its
epilogue."""

from __future__ import annotations

from dataclasses import replace

from .. import ast
from ..expr import ONE
from ..spec import FP8_TYPES, KERNEL_K_BLOCK, Gemm, Tensor
from .context import Context


def check_copy_declaration(ctx: Context, t: ast.TensorDecl) -> None:
    """`T = copy(S)`: S an FP8 output, T another FP8 tensor of S's shape and type with a
    scale (the statement that writes S writes T; check_copies checks that side)."""
    src = t.derived.source
    source, target = ctx.tensors[src.text], ctx.tensors[t.name.text]
    if src.text == t.name.text:
        raise ctx.error(
            f"'{t.name.text}' is a copy of itself; copy(...) names the FP8 output a "
            "statement writes",
            src.pos,
        )
    if source.copy_of is not None or source.derived is not None:
        what = "a copy" if source.copy_of is not None else f"derived by {source.derived.op}(...)"
        root = source.copy_of or source.derived.source
        raise ctx.error(
            f"'{src.text}' is {what}, and copies do not chain: copy(...) names the FP8 output "
            "a statement writes",
            src.pos,
            f"copy the tensor the statement writes, e.g. `= copy({root})`"
            if source.copy_of is not None else None,
        )
    if source.dtype not in FP8_TYPES or source.scale is None:
        raise ctx.error(
            f"copy({src.text}) makes a second FP8 output of the statement that writes "
            f"'{src.text}', but '{src.text}' is {source.dtype}"
            + (" with no scale" if source.dtype in FP8_TYPES else ""),
            src.pos,
            "declare the source e4m3 or e5m2 with `scale f32 [1, 128]`, or quantize a "
            "bf16 tensor with `= quantize(...)`",
        )
    if target.dtype != source.dtype:
        raise ctx.error(
            f"copy({src.text}) has the FP8 type of '{src.text}' ({source.dtype}), but "
            f"'{t.name.text}' is declared {target.dtype}",
            t.dtype.pos,
            f"declare '{t.name.text}' as {source.dtype}",
        )
    if source.dims != target.dims:
        raise ctx.error(
            f"copy({src.text}) keeps the logical shape [{', '.join(source.dims)}], but "
            f"'{t.name.text}' is declared [{', '.join(target.dims)}]",
            t.shape[0].pos,
        )
    if target.scale is None:
        raise ctx.error(
            f"copy({src.text}) is quantized with the scale blocks of '{t.name.text}', which "
            "has no scale",
            t.name.pos,
            f"declare `scale f32 [128, 1] per GROUP` on '{t.name.text}'",
        )


def check_copies(ctx: Context, gemms: tuple[Gemm, ...]) -> tuple[Gemm, ...]:
    """Each `T = copy(S)` is written by the one statement that writes S, in its epilogue:
    S's rows split by a ragged group G (the statement M-grouped by G), T stored
    segment_major(G) (pad P allowed) with [128, 1] scales per G, 128-row tiles.
    Returns the statements with their copies attached."""
    out = list(gemms)
    for t in ctx.tensors.values():
        if t.copy_of is None:
            continue
        decl = ctx.tensor_ast[t.name]
        src_pos = decl.derived.source.pos
        writers = [g for g in gemms if g.out.tensor == t.copy_of]
        if not writers:
            raise ctx.error(
                f"'{t.copy_of}' is not written by a statement of this spec; copy(...) is a "
                "second output of the statement that writes its source",
                src_pos,
                f"a tensor passed in is rearranged by a pre-pass: `= requantize({t.copy_of})`",
            )
        if len(writers) > 1:
            lines = ", ".join(str(g.line) for g in writers)
            raise ctx.error(
                f"'{t.copy_of}' is written by {len(writers)} statements (lines {lines}); "
                "copy(...) needs the one statement that writes it with `=`",
                src_pos,
            )
        g = out[writers[0].index]  # with the copy an earlier declaration attached, if any
        if g.copy is not None:
            raise ctx.error(
                f"the statement on line {g.line} already writes '{g.copy}' = copy({t.copy_of}); "
                "a statement writes one copy",
                decl.derived.op.pos,
            )
        _check_copy_target(ctx, g, t, decl)
        out[g.index] = replace(g, copy=t.name)
    return tuple(out)


def _check_copy_target(ctx: Context, g: Gemm, t: Tensor, decl: ast.TensorDecl) -> None:
    src = t.copy_of
    op_pos = decl.derived.op.pos
    st = ctx.ast.statements[g.index]
    if g.accumulate:  # an FP8 output is `=` only; said here too, for the copy
        raise ctx.error(
            f"copy({src}) is written by the statement on line {g.line} with `+=`; a copy "
            "is quantized from the finished values",
            st.assign_pos or st.out.tensor.pos,
        )
    if g.scatter:
        raise ctx.error(
            f"copy({src}) is written by a statement that scatters its rows through "
            f"'{g.scatter}'; the copy is stored per segment of the statement's own rows",
            st.out.tensor.pos,
        )
    m_axis = g.out.axis_of_role("m")
    if t.rank != 2 or m_axis != 0:
        raise ctx.error(
            f"copy({src}) is generated for a 2-D output [rows, columns]; '{t.name}' is "
            f"[{', '.join(t.dims)}]",
            decl.shape[0].pos,
        )
    group = g.m.group
    rows = t.dims[0]
    lay = t.layout
    hint = f"declare `layout segment_major({group or 'GROUP'})` (and `pad P` if you like)"
    if group is None:
        raise ctx.error(
            f"copy({src}) stores each segment of a ragged group of {rows} with its rows "
            f"contiguous, but the statement on line {g.line} does not split {rows} by a group",
            op_pos,
            "write the statement M-grouped, e.g. w[expert(t), n, k]",
        )
    grp = ctx.groups[group]
    if grp.kind != "ragged" or grp.within is not None or grp.capacity:
        why = (
            f"'{group}' is {grp.kind}" if grp.kind != "ragged"
            else f"'{group}' is nested within '{grp.within}'" if grp.within is not None
            else f"'{group}' has a capacity (rows past its offsets)"
        )
        raise ctx.error(
            f"copy({src}) is generated for statements whose rows are split by one ragged "
            f"group (no `within`, no capacity); {why}",
            op_pos,
            "write the copy with a separate `= requantize(...)` pre-pass instead",
        )
    if lay.kind != "segment_major" or lay.seg_axis != 0 or lay.group != group:
        raise ctx.error(
            f"copy({src}) stores '{t.name}' segment_major({group}): each segment of "
            f"'{group}' with its {rows} contiguous per column; '{t.name}' is {lay}",
            decl.layout.pos if decl.layout is not None else decl.name.pos,
            hint,
        )
    sd = decl.scale
    scale = t.scale
    assert scale is not None and sd is not None
    if scale.block != (KERNEL_K_BLOCK, 1):
        raise ctx.error(
            f"copy({src}) writes one scale per column and {KERNEL_K_BLOCK} rows of each "
            f"segment, [{KERNEL_K_BLOCK}, 1]; '{t.name}' has scale blocks {scale.block_text}",
            sd.block[0].pos,
            f"declare `scale f32 [{KERNEL_K_BLOCK}, 1] per {group}`",
        )
    if scale.anchor != group:
        raise ctx.error(
            f"copy({src}) starts the scale blocks of '{t.name}' at each segment of '{group}'"
            + (f", but they are anchored per '{scale.anchor}'" if scale.anchor else
               ", but they are not anchored"),
            sd.anchor.pos if sd.anchor is not None else sd.pos,
            f"declare `scale f32 [{KERNEL_K_BLOCK}, 1] per {group}`",
        )
    if scale.layout.kind != "strided" or scale.layout.strides != (ctx.size_poly(t.dims[1]), ONE):
        raise ctx.error(
            f"copy({src}) writes the scales of '{t.name}' row-major (a row of {t.dims[1]} "
            f"per block of {KERNEL_K_BLOCK} rows); its scale layout is {scale.layout}",
            sd.layout.pos if sd.layout is not None else sd.pos,
            "drop the scale's layout",
        )
