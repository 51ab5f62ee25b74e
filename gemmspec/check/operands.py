"""A statement's operand types, and the rules of FP8 operands: scale blocks along
the contraction, one kind of K scaling for both, K-major storage."""

from __future__ import annotations

from .. import ast
from ..errors import Fix
from ..spec import FP8_TYPES, KERNEL_K_BLOCK, SIXTEEN_BIT_TYPES, Access, Gemm, Tensor
from .context import QUANTIZE_SOURCE_TYPES, Context
from .fixes import add_anchor, add_declaration, fix, rename, set_scale
from .fp8_output import check_fp8_output
from .gather import check_gathered


def check_types(ctx: Context, gemm: Gemm, s: ast.Statement) -> None:
    out_t = ctx.tensors[gemm.out.tensor]
    a_t, b_t = ctx.tensors[gemm.a.tensor], ctx.tensors[gemm.b.tensor]
    if out_t.dtype in FP8_TYPES:
        check_fp8_output(ctx, gemm, s, out_t)
    for acc, ref in ((gemm.out, s.out), (gemm.a, s.lhs), (gemm.b, s.rhs)):
        t = ctx.tensors[acc.tensor]
        if t.layout.kind != "segment_major":
            continue
        use = acc.uses[t.layout.seg_axis]
        if use.kind != "role" or gemm.role(use.role).group != t.layout.group:
            raise ctx.error(
                f"'{t.name}' is stored segment_major({t.layout.group}), but this statement "
                f"does not split {t.dims[t.layout.seg_axis]} by '{t.layout.group}' per leaf",
                ref.tensor.pos,
            )
    if gemm.gather:
        check_gathered(ctx, gemm, gemm.a, s.lhs, a_t)
    if gemm.scatter:
        check_gathered(ctx, gemm, gemm.out, s.out, out_t)
    a_fp8, b_fp8 = a_t.dtype in FP8_TYPES, b_t.dtype in FP8_TYPES
    if a_t.dtype == "f32" or b_t.dtype == "f32":
        bad = s.lhs if a_t.dtype == "f32" else s.rhs
        raise ctx.error(
            f"'{bad.tensor.text}' is f32; tensor cores take FP8, BF16 or F16 operands",
            bad.tensor.pos,
        )
    if a_fp8 != b_fp8 or (not a_fp8 and a_t.dtype != b_t.dtype):
        raise ctx.error(
            f"operands '{a_t.name}' ({a_t.dtype}) and '{b_t.name}' ({b_t.dtype}) must both "
            "be FP8 or both the same 16-bit type",
            s.rhs.tensor.pos,
            *_quantize_hint(ctx, gemm, s, a_t, b_t),
        )
    assert a_t.dtype in FP8_TYPES + SIXTEEN_BIT_TYPES
    operands = ((gemm.a, s.lhs, a_t, b_t), (gemm.b, s.rhs, b_t, a_t))
    for acc, ref, t, other in operands:
        if t.dtype not in FP8_TYPES:
            continue
        if t.scale is None:
            block, anchor = _proposed_scale(ctx, gemm, acc, other)
            k_axis = acc.axis_of_role("k")
            kdim = t.dims[k_axis]
            clause = f"scale f32 [{', '.join(block)}]{anchor}"
            raise ctx.error(
                f"FP8 operand '{t.name}' has no scale",
                ref.tensor.pos,
                f"declare its scales: `{clause}` after its shape ("
                + (
                    f"one scale along the whole of {kdim}, as '{other.name}' has"
                    if block[k_axis] == kdim
                    else f"{KERNEL_K_BLOCK}-wide blocks along the contracted dim {kdim}, the "
                    "blocks FP8 tensor cores accumulate in"
                    if block[k_axis] == str(KERNEL_K_BLOCK)
                    else f"the forward pass's 1 x {KERNEL_K_BLOCK} blocks, which a requantize "
                    f"pass then turns into {KERNEL_K_BLOCK}-row blocks per segment of {kdim}"
                )
                + ")",
                fix(set_scale(ctx, t.name, block, anchor=anchor)),
            )
        # Scale blocks first: a scale that varies along K needs a requantization,
        # which also fixes the major-ness, so that is the more useful message.
        check_scale_blocks(ctx, gemm, acc, ref, t)
        check_k_major(ctx, gemm, acc, ref, t)
    if a_fp8:
        check_same_k_scaling(ctx, gemm, a_t, b_t)


def check_same_k_scaling(ctx: Context, gemm: Gemm, a_t: Tensor, b_t: Tensor) -> None:
    """Both operands blockwise (128 along K) or both per-channel (the whole K): the
    kernel either promotes per K block or scales once in the epilogue, not both."""
    kinds = []
    for acc, t in ((gemm.a, a_t), (gemm.b, b_t)):
        axis = acc.axis_of_role("k")
        assert axis is not None and t.scale is not None
        kinds.append((t.scale.block[axis] != KERNEL_K_BLOCK, t, axis, acc))
    if kinds[0][0] == kinds[1][0]:
        return
    (_, whole, axis, whole_acc), (_, blocked, _, _) = sorted(kinds, key=lambda x: not x[0])
    kdim = whole.dims[axis]
    want = [str(b) for b in whole.scale.block]
    want[axis] = str(KERNEL_K_BLOCK)
    raise ctx.error(
        f"'{whole.name}' has one scale along the whole contracted dim {kdim} "
        f"({'per-tensor' if _per_tensor(ctx, whole, whole_acc) else 'per-channel'}), "
        f"but '{blocked.name}' changes scale every {KERNEL_K_BLOCK} along it (blockwise); "
        "both operands must be per-channel or per-tensor, or both blockwise",
        ctx.tensor_ast[whole.name].scale.block[axis].pos,
        f"give both the block {kdim} along {kdim} (one scale per row of A and per column "
        f"of B), or both {KERNEL_K_BLOCK}: e.g. `scale f32 [{', '.join(want)}]` on '{whole.name}'",
        fix(set_scale(ctx, whole.name, want)),
    )


def _quantize_hint(
    ctx: Context, gemm: Gemm, s: ast.Statement, a_t: Tensor, b_t: Tensor
) -> tuple[str | None, Fix | None]:
    """Beside an FP8 operand, a 16-bit one that the quantize pass can make FP8: one not
    derived, K-major, 2-D as activations are (its scales [1, 128]) or 3-D with K last."""
    fp8, plain, ref, acc = (
        (b_t, a_t, s.lhs, gemm.a) if b_t.dtype in FP8_TYPES else (a_t, b_t, s.rhs, gemm.b)
    )
    k_axis = acc.axis_of_role("k")
    if (
        fp8.dtype not in FP8_TYPES or plain.dtype not in QUANTIZE_SOURCE_TYPES
        or plain.derived is not None or plain.rank not in (2, 3)
        or k_axis != plain.rank - 1 or plain.layout.contiguous_axis() != k_axis
    ):
        return None, None
    block = ["1"] * (plain.rank - 1) + [str(KERNEL_K_BLOCK)]
    if plain.rank == 3:
        block[1] = str(KERNEL_K_BLOCK)
    decl = (
        f"tensor {plain.name}_q : {fp8.dtype} [{', '.join(plain.dims)}] "
        f"scale f32 [{', '.join(block)}] = quantize({plain.name})"
    )
    return (
        f"quantize '{plain.name}' to FP8 in a pre-pass and use that here: `{decl}`",
        fix(add_declaration(ctx, plain.name, decl), rename(ref.tensor, f"{plain.name}_q")),
    )


def _proposed_scale(ctx: Context, gemm: Gemm, acc: Access, other: Tensor) -> tuple[list[str], str]:
    """Scale blocks for an FP8 operand declared without any, and the `per GROUP` anchor
    they need: 1 along leaf axes and gathered rows, 128 along K (or the whole of K beside
    a per-channel other operand), 1 along the rows of A, 128 along the columns of B
    (DeepSeek-V3's 1x128 activation and 128x128 weight blocks) where no segment start
    falls inside a block."""
    other_acc = gemm.b if acc is gemm.a else gemm.a
    other_k = other_acc.axis_of_role("k")
    per_channel = (
        other.scale is not None and other_k is not None
        and other.scale.block[other_k] != KERNEL_K_BLOCK
    )
    t = ctx.tensors[acc.tensor]
    k_axis = acc.axis_of_role("k")
    contiguous = t.layout.contiguous_axis()
    if t.rank == 2 and gemm.k.group and contiguous is not None and contiguous != k_axis:
        # A WGRAD operand stored as the forward pass wrote it (rows of channels): the
        # forward's 1 x 128 blocks, which a requantize pass turns into 128 x 1 per segment.
        block = ["1", "1"]
        block[contiguous] = str(KERNEL_K_BLOCK)
        return block, ""
    block, anchor = [], ""
    for axis, use in enumerate(acc.uses):
        if use.kind == "leaf" or use.index is not None:
            block.append("1")
            continue
        role = gemm.role(use.role)
        g = ctx.groups[role.group] if role.group else None
        if use.role == "k":
            if per_channel and ctx.dims[t.dims[axis]].size is not None:
                block.append(t.dims[axis])
                continue
            block.append(str(KERNEL_K_BLOCK))
            if g is not None and g.kind == "ragged":
                anchor = f" per {g.name}"
            continue
        aligned = g is None or (
            g.kind in ("split", "uniform") and all(x % KERNEL_K_BLOCK == 0 for x in g.starts)
        )
        block.append(str(KERNEL_K_BLOCK) if acc is gemm.b and aligned and not per_channel else "1")
    return block, anchor


def _per_tensor(ctx: Context, t: Tensor, acc: Access) -> bool:
    """Whether `t`'s scale, as this statement reads it, is one scale per leaf: one
    block over the whole of every dim but the leaf axes."""
    assert t.scale is not None
    return all(ctx.covers(t, i) for i, use in enumerate(acc.uses) if use.kind == "role")


def check_k_major(ctx: Context, gemm: Gemm, acc: Access, ref: ast.Ref, t: Tensor) -> None:
    k_axis = acc.axis_of_role("k")
    assert k_axis is not None
    lay = t.layout
    ok = lay.contiguous_axis() == k_axis
    if ok and lay.kind == "segment_major" and lay.group != gemm.k.group:
        ok = False
    if ok:
        return
    contiguous = lay.contiguous_axis()
    cdim = t.dims[contiguous] if contiguous is not None else "none"
    kdim = t.dims[k_axis]
    if lay.kind == "segment_major" and contiguous == k_axis:
        reason = (
            f"its segments follow '{lay.group}', but the contraction runs over "
            f"{gemm.k.group or 'all of ' + kdim}"
        )
    else:
        reason = f"its contiguous dim is {cdim} but the contraction runs over {kdim}"
    suggestion = _k_major_layout(ctx, gemm, t, k_axis)
    decl = ctx.tensor_ast[t.name].scale
    anchor = f" per {decl.anchor.text}" if decl.anchor else ""
    copy = (
        f"tensor {t.name}_t : {t.dtype} [{', '.join(t.dims)}] layout {suggestion} scale f32 "
        f"[{', '.join(str(b) for b in t.scale.block)}]{anchor} = transpose({t.name})"
    )
    raise ctx.error(
        f"FP8 operand '{t.name}' is not K-major: {reason}; FP8 wgmma reads both operands "
        "K-major, so this needs a transpose pass",
        ref.tensor.pos,
        f"declare the transposed copy and use it here: `{copy}`",
        fix(add_declaration(ctx, t.name, copy), rename(ref.tensor, f"{t.name}_t")),
    )


def _k_major_layout(ctx: Context, gemm: Gemm, t: Tensor, k_axis: int) -> str:
    if gemm.k.group and ctx.groups[gemm.k.group].kind == "ragged":
        return f"segment_major({gemm.k.group})"
    return f"major({t.dims[k_axis]})"


def check_scale_blocks(ctx: Context, gemm: Gemm, acc: Access, ref: ast.Ref, t: Tensor) -> None:
    sc = t.scale
    assert sc is not None
    blocks = ctx.tensor_ast[t.name].scale.block
    for axis, use in enumerate(acc.uses):
        b = sc.block[axis]
        pos = blocks[axis].pos
        dim = t.dims[axis]
        if use.kind == "leaf":
            if b != 1:
                want = [str(x) for x in sc.block]
                want[axis] = "1"
                raise ctx.error(
                    f"scale block {b} along {dim} spans several groups; a group or batch "
                    "dim takes one scale per entry (block 1)",
                    pos,
                    f"declare `scale f32 [{', '.join(want)}]`",
                    fix(set_scale(ctx, t.name, want)),
                )
            continue
        if use.index is not None:
            continue  # rows read through an index tensor: their scales too (check_gathered)
        role = gemm.role(use.role)
        size = ctx.dims[dim].size
        whole = isinstance(b, str)  # one block over the whole of a run-time dim
        if use.role == "k" and whole:
            raise ctx.error(
                f"scale block '{b}' spans the whole contracted dim {dim}, which is known only "
                "at run time; one scale along the whole of K (per-channel or per-tensor "
                "scales) needs K fixed at compile time",
                pos,
                f"declare `dim {dim} = SIZE`, or use {KERNEL_K_BLOCK}-wide blocks along {dim}",
            )
        if use.role == "k" and b != KERNEL_K_BLOCK and b == size:
            # Per-channel: one scale along the whole of K, applied in the epilogue.
            if role.group is not None:
                raise ctx.error(
                    f"scale block {b} spans the whole contracted dim {dim}, but this "
                    f"statement contracts over the segments of '{role.group}'; one scale "
                    "along the whole of K (per-channel) is supported only for a "
                    f"contraction over all of {dim}",
                    pos,
                    f"use {KERNEL_K_BLOCK}-wide blocks along {dim}",
                )
            continue
        if use.role == "k":
            if b < KERNEL_K_BLOCK:
                raise ctx.error(
                    f"scale of '{t.name}' changes every {b} element{'s' if b > 1 else ''} "
                    f"along the contracted dim {dim}, finer than the {KERNEL_K_BLOCK}-wide "
                    "K block inside which FP8 tensor cores accumulate without scales",
                    pos,
                    *_finer_k_hint(ctx, gemm, ref, t, axis),
                )
            if b != KERNEL_K_BLOCK:
                want = [str(x) for x in sc.block]
                want[axis] = str(KERNEL_K_BLOCK)
                raise ctx.error(
                    f"scale block {b} along the contracted dim {dim} is not supported; "
                    f"use {KERNEL_K_BLOCK} (blockwise) or "
                    + (
                        f"{dim}'s whole extent {size} (per-channel)"
                        if size is not None
                        else f"fix {dim} at compile time for one scale along the whole of "
                        "it (per-channel); a dim known only at run time takes 128 only"
                    ),
                    pos,
                    f"declare `scale f32 [{', '.join(want)}]`",
                    fix(set_scale(ctx, t.name, want)),
                )
        # One block over the whole of M or N: every row (column) of every leaf reads
        # the same scale, so no block straddles a segment.
        covers = ctx.covers(t, axis)
        if use.role != "k":
            k_axis = acc.axis_of_role("k")
            if covers and (sc.block[k_axis] != KERNEL_K_BLOCK or ctx.covers(t, k_axis)):
                # Beside one scale along the whole of K (an invalid K block is reported
                # at K): the per-channel epilogue (or, with K at most 128, the one K
                # block's promotion) reads this scale for every row or column, so any
                # extent will do: per-tensor scales.
                continue
            if whole:
                raise ctx.error(
                    f"one scale along the whole of the run-time dim {dim} is supported only "
                    f"beside one scale along the whole of the contracted dim "
                    f"{t.dims[k_axis]} (per-tensor or per-channel scales), but the block "
                    f"along {t.dims[k_axis]} is {sc.block[k_axis]}",
                    pos,
                    f"declare the block along {t.dims[k_axis]} as {t.dims[k_axis]} (the "
                    f"whole of it) on both operands, or use 1 or {KERNEL_K_BLOCK} along {dim}",
                )
            if b != 1 and KERNEL_K_BLOCK % b and b % KERNEL_K_BLOCK:
                raise ctx.error(
                    f"scale block {b} along {dim} does not divide the {KERNEL_K_BLOCK}-wide tile "
                    f"grid; use a divisor or multiple of {KERNEL_K_BLOCK}",
                    pos,
                )
        if b != 1 and role.group is not None and not covers:
            g = ctx.groups[role.group]
            aligned = g.kind in ("split", "uniform") and all(x % b == 0 for x in g.starts)
            if sc.anchor != g.name and not aligned:
                raise ctx.error(
                    f"scale blocks of {b} along {dim} would straddle the segments of "
                    f"'{g.name}', whose lengths are not multiples of {b}",
                    pos,
                    f"anchor the blocks at each segment's start with `per {g.name}` after "
                    "the scale block",
                    fix(add_anchor(ctx, t.name, g.name)) if sc.anchor is None else None,
                )


def _finer_k_hint(ctx: Context, gemm: Gemm, ref: ast.Ref, t: Tensor, k_axis: int) -> tuple[str, Fix | None]:
    """What to do about scales finer than 128 along K. Scales with 128 along the other
    dim of a 2-D operand (a WGRAD operand quantized along its rows) are turned into 128
    along K by the requantize pass; any other tensor is declared with the 128-wide
    blocks along K that its producer then writes."""
    block = t.scale.block
    other = 1 - k_axis
    if t.rank == 2 and t.derived is None and block[other] == KERNEL_K_BLOCK and block[k_axis] == 1:
        return _requant_hint(ctx, gemm, ref, t, k_axis)
    want = [str(b) for b in block]
    want[k_axis] = str(KERNEL_K_BLOCK)
    return (
        f"declare '{t.name}' with {KERNEL_K_BLOCK}-wide scale blocks along {t.dims[k_axis]}: "
        f"`scale f32 [{', '.join(want)}]`",
        fix(set_scale(ctx, t.name, want)),
    )


def _requant_hint(ctx: Context, gemm: Gemm, ref: ast.Ref, t: Tensor, k_axis: int) -> tuple[str, Fix]:
    block = ["1"] * t.rank
    block[k_axis] = str(KERNEL_K_BLOCK)
    anchor = f" per {gemm.k.group}" if gemm.k.group else ""
    decl = (
        f"tensor {t.name}_q : {t.dtype} [{', '.join(t.dims)}] layout "
        f"{_k_major_layout(ctx, gemm, t, k_axis)} scale f32 [{', '.join(block)}]{anchor} "
        f"= requantize({t.name})"
    )
    return (
        f"requantize it: dequantize '{t.name}', transpose it so {t.dims[k_axis]} is contiguous and "
        f"quantize again with [{', '.join(block)}] blocks: declare `{decl}` and use it here",
        fix(add_declaration(ctx, t.name, decl), rename(ref.tensor, f"{t.name}_q")),
    )
