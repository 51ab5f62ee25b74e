"""The shapes the pre-pass kernels are generated for (transpose, requantize,
quantize), said at the declaration rather than when code is emitted."""

from __future__ import annotations

from .. import ast
from ..expr import ONE
from ..spec import KERNEL_K_BLOCK, Gemm, Tensor
from .context import SWIGLU_GRAD_OP, Context, row_major

# The scale blocks the quantize kernel writes (on the last two dims).
QUANTIZE_BLOCKS = frozenset({(1, KERNEL_K_BLOCK), (KERNEL_K_BLOCK, KERNEL_K_BLOCK)})


def check_derived_emittable(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    """The pre-passes exist for the shapes below only (what the emitter generates);
    say so here, at the declaration, rather than when code is emitted."""
    read = {t for g in gemms for t in (g.a.tensor, g.b.tensor)}
    for t in ctx.tensors.values():
        if t.derived is None or t.name not in read or t.derived.op == SWIGLU_GRAD_OP or t.view_of:
            continue  # a derived tensor nobody reads gets no pre-pass; check_swiglu_grad; a view none
        src = ctx.tensors[t.derived.source]
        op = ctx.tensor_ast[t.name].derived.op
        if t.derived.op == "quantize":
            _check_quantize_emittable(ctx, src, t, op.pos)
            continue
        assert src.scale is not None and t.scale is not None
        if t.derived.op == "transpose":
            _check_transpose_emittable(ctx, src, t, op.pos)
        else:
            _check_requantize_emittable(ctx, src, t, op.pos)


def _check_transpose_emittable(ctx: Context, src: Tensor, t: Tensor, pos: ast.Pos) -> None:
    # The kernel copies rows along the source's unit-stride dim into rows along the
    # target's, batched over a third dim (any strides).
    if src.rank not in (2, 3) or src.layout.kind != "strided" or t.layout.kind != "strided":
        raise ctx.error(
            f"transpose({src.name}) is generated for 2-D and 3-D tensors with row_major, "
            f"major(...) or strides(...) layouts only; '{src.name}' is {src.rank}-D "
            f"{src.layout} and '{t.name}' is {t.layout}",
            pos,
        )
    a, b = src.layout.contiguous_axis(), t.layout.contiguous_axis()
    if a is None or b is None or a == b:
        why = (
            f"'{src.name}' has no dim of stride 1" if a is None
            else f"'{t.name}' has no dim of stride 1" if b is None
            else f"both have {src.dims[a]} contiguous, so nothing moves"
        )
        raise ctx.error(
            f"transpose({src.name}) moves the contiguous dim of '{src.name}' to another "
            f"one, but {why}",
            pos,
            f"declare '{t.name}' with the dim it is contracted over contiguous, e.g. major(...)",
        )
    if src.scale.layout.strides != t.scale.layout.strides:
        raise ctx.error(
            f"transpose({src.name}) shares the scale tensor of '{src.name}', so "
            f"the scale layout of '{t.name}' ({t.scale.layout}) must be that of "
            f"'{src.name}' ({src.scale.layout})",
            pos,
            f"declare the scale of '{t.name}' with the same layout as '{src.name}'",
        )
    # CUDA grids hold at most 65535 blocks along y (64 rows of the target's
    # contiguous dim each) and z (the batch).
    rest = [i for i in range(src.rank) if i not in (a, b)]
    for axis, per_block, where in ((b, 64, "rows"), *((r, 1, "batch entries") for r in rest)):
        size = ctx.dims[src.dims[axis]].size
        if size is not None and -(-size // per_block) > 65535:
            raise ctx.error(
                f"transpose({src.name}) launches one block per {per_block} {where} of "
                f"{src.dims[axis]} = {size}, more than the 65535 a CUDA grid holds there",
                pos,
            )


def _check_requantize_emittable(ctx: Context, src: Tensor, t: Tensor, pos: ast.Pos) -> None:
    wrong = []
    if src.rank != 2:
        wrong.append(f"'{src.name}' is {src.rank}-D")
    elif src.layout.kind != "strided" or src.layout.contiguous_axis() != 1:
        wrong.append(f"'{src.name}' is {src.layout}, not row-major [T, C]")
    if src.scale.block != (1, KERNEL_K_BLOCK):
        wrong.append(f"its scale blocks are {src.scale.block_text}, not [1, 128]")
    if t.scale.block != (KERNEL_K_BLOCK, 1):
        wrong.append(f"'{t.name}' has scale blocks {t.scale.block_text}, not [128, 1]")
    if wrong:
        raise ctx.error(
            f"requantize({src.name}) is generated only from a 2-D row-major [T, C] FP8 "
            f"tensor with [1, 128] scales into [128, 1] scales: {'; '.join(wrong)}",
            pos,
        )
    check_token_major_target(ctx, f"requantize({src.name})", t, pos)
    if ctx.anchor_along(src, 1) is not None:
        raise ctx.error(
            f"requantize({src.name}) reads the [1, 128] scales of '{src.name}' in blocks "
            f"from channel 0, but they are declared per '{src.scale.anchor}'",
            pos,
        )


def check_token_major_target(ctx: Context, what: str, t: Tensor, pos: ast.Pos) -> None:
    """The [T, C] target of the requantize kernel (`what` names the pass): each segment's
    tokens contiguous ([T, C] with T contiguous, or segment_major on T) and a row-major
    grid of [128, 1] scale blocks restarted at every segment."""
    tokens, channels = t.dims  # the target's rows: the source's, or those an index names
    dense = (ONE, ctx.size_poly(tokens))
    lay = t.layout
    segmented = lay.kind == "segment_major" and lay.seg_axis == 0
    if not segmented and not (lay.kind == "strided" and lay.strides == dense):
        raise ctx.error(
            f"{what} writes '{t.name}' with {tokens} contiguous and no "
            f"padding (strides(1, {tokens}), major({tokens})) or segment_major over a "
            f"group of {tokens}; '{t.name}' is {lay}",
            pos,
            f"declare '{t.name}' with layout major({tokens}) or segment_major(GROUP)",
        )
    anchor = ctx.anchor_along(t, 0)
    if anchor is not None and anchor != (lay.group if segmented else None):
        where = f"the segments of '{lay.group}'" if segmented else "the start of the tensor"
        raise ctx.error(
            f"{what} starts the scale blocks of '{t.name}' at {where}, "
            f"but they are declared per '{anchor}'",
            pos,
            f"drop `per {anchor}` or store '{t.name}' as segment_major({anchor})",
        )
    if t.scale.layout.kind != "strided" or t.scale.layout.strides != (ctx.size_poly(channels), ONE):
        raise ctx.error(
            f"{what} writes the scales of '{t.name}' row-major (a row of "
            f"{channels} per block of 128 tokens); its scale layout is {t.scale.layout}",
            pos,
            "declare the scale with the default layout",
        )


def _check_quantize_emittable(ctx: Context, src: Tensor, t: Tensor, pos: ast.Pos) -> None:
    # One warp per [1, 128] block or one CTA per [128, 128] block: rows are read along
    # the source's contiguous last dim, the target and its scale grid written dense
    # and row-major.
    assert t.scale is not None
    rank = src.rank
    wrong = []
    if rank not in (2, 3):
        wrong.append(f"'{src.name}' is {rank}-D")
    else:
        if src.layout.kind != "strided" or src.layout.contiguous_axis() != rank - 1:
            wrong.append(f"'{src.name}' is {src.layout}, its last dim {src.dims[-1]} not contiguous")
        sizes = [ctx.size_poly(d) for d in t.dims]
        if t.layout.kind != "strided" or t.layout.strides != tuple(row_major(sizes, None)):
            wrong.append(f"'{t.name}' is {t.layout}, not row_major without padding")
        block = t.scale.block
        if block[:-2] != (1,) * (rank - 2) or block[-2:] not in QUANTIZE_BLOCKS:
            wrong.append(f"'{t.name}' has scale blocks {t.scale.block_text}")
        elif t.scale.anchor is not None:
            wrong.append(f"its scale blocks restart per '{t.scale.anchor}'")
        elif t.scale.layout.strides != tuple(row_major(ctx.scale_grid(t), None)):
            wrong.append(f"its scale layout is {t.scale.layout}")
        # Only whole 128-column blocks have run on a GPU: with a short last block
        # (C = 200) the GEMM fed by the pass did not match its reference.
        columns = ctx.dims[src.dims[-1]].size
        if columns is None or columns % KERNEL_K_BLOCK:
            size = "known only at run time" if columns is None else str(columns)
            wrong.append(
                f"its contiguous dim {src.dims[-1]} is {size}, not a constant multiple of "
                f"{KERNEL_K_BLOCK} (short column blocks are not supported yet)"
            )
    # CUDA grids hold at most 65535 blocks along y (column blocks) and z (the batch).
    if not wrong:
        for axis, per_block, where in ((rank - 1, KERNEL_K_BLOCK, "columns"), (0, 1, "batch entries")):
            size = ctx.dims[src.dims[axis]].size
            if (axis < rank - 2 or axis == rank - 1) and size is not None and -(-size // per_block) > 65535:
                wrong.append(
                    f"it launches one block per {per_block} {where} of {src.dims[axis]} = {size}, "
                    "more than the 65535 a CUDA grid holds there"
                )
    if wrong:
        blocks = "[1, 1, 128] or [1, 128, 128]" if rank == 3 else "[1, 128] or [128, 128]"
        raise ctx.error(
            f"quantize({src.name}) is generated only from a 2-D [R, C] or 3-D [B, R, C] "
            f"tensor with C contiguous (a constant multiple of 128) into a row_major FP8 "
            f"tensor with {blocks} scale "
            f"blocks from index 0 (no `per GROUP`), scales in the default layout: "
            + "; ".join(wrong),
            pos,
        )
