"""`= swiglu_grad(GU, DH)`: the one pre-pass that may read what statements write, and
the loop that reading could close."""

from __future__ import annotations

from .. import ast
from ..spec import FP8_TYPES, KERNEL_K_BLOCK, Gemm
from .context import QUANTIZE_SOURCE_TYPES, SWIGLU_GRAD_OP, Context, row_major
from .emittable import check_token_major_target
from .row_passes import check_rows_contiguous


def check_swiglu_grad(ctx: Context, t: ast.TensorDecl) -> None:
    """`T = swiglu_grad(GU, DH)`: GU an unscaled bf16/f16/f32 [R, 2F] (columns 2j the
    gate, 2j + 1 the up, as a SwiGLU statement reads its weight's rows), DH of GU's type
    family [R, F], both 2-D with contiguous rows, passed in or written by a statement or
    a row pass (the pass then runs after it); T an FP8 [R, 2F] with [1, 128] scales in
    the default layouts, quantized as quantize(...) does."""
    d = t.derived
    name = t.name.text
    usage = f"`{name} = swiglu_grad(GU, DH)`: GU the gate/up columns, DH the gradient of silu(gate) * up"
    if len(d.options) != 1 or d.keywords:
        pos = d.keywords[0][0].pos if d.keywords else d.options[1].pos if d.options else d.op.pos
        raise ctx.error("swiglu_grad(...) takes two tensors and no options", pos, usage)
    other = d.options[0]
    if other.text not in ctx.tensors:
        raise ctx.error(f"unknown tensor '{other.text}'", other.pos)
    gu, dh, target = ctx.tensors[d.source.text], ctx.tensors[other.text], ctx.tensors[name]
    for ref, x in ((d.source, gu), (other, dh)):
        if x.name == name:
            raise ctx.error(f"'{name}' is computed from itself", ref.pos)
        if x.derived is not None or x.copy_of is not None:
            what = "a copy" if x.copy_of is not None else f"derived by {x.derived.op}(...)"
            raise ctx.error(
                f"swiglu_grad reads tensors passed in or written by statements or row passes, "
                f"but '{x.name}' is {what}",
                ref.pos,
            )
        if x.dtype not in QUANTIZE_SOURCE_TYPES or x.scale is not None:
            what = f"{x.dtype} with a scale" if x.scale is not None else x.dtype
            raise ctx.error(
                f"swiglu_grad reads unscaled bf16, f16 or f32 tensors, but '{x.name}' is {what}", ref.pos
            )
        check_rows_contiguous(ctx, "swiglu_grad", x, ref.pos)
    pairs, cols = ctx.dims[gu.dims[1]].size, ctx.dims[dh.dims[1]].size
    if dh.dims[0] != gu.dims[0] or pairs is None or cols is None or pairs != 2 * cols:
        raise ctx.error(
            f"swiglu_grad pairs the columns of '{gu.name}' (gate 2j, up 2j + 1) with column j of "
            f"'{dh.name}': they need the same rows and constant column counts 2F and F, but they "
            f"are [{', '.join(gu.dims)}] and [{', '.join(dh.dims)}]",
            other.pos,
        )
    sizes = [ctx.size_poly(x) for x in target.dims]
    if (
        target.dtype in FP8_TYPES and target.scale is not None and target.dims == gu.dims
        and target.scale.block == (KERNEL_K_BLOCK, 1) and not target.scale.pow2
    ):
        # The WGRAD's form: tokens contiguous per segment, 128x1 blocks per segment.
        check_token_major_target(ctx, f"swiglu_grad({gu.name}, {dh.name})", target, t.name.pos)
    elif (
        target.dtype not in FP8_TYPES or target.scale is None or target.dims != gu.dims
        or target.scale.block != (1, KERNEL_K_BLOCK) or target.scale.anchor is not None
        or target.scale.pow2 or target.layout.kind != "strided"
        or target.layout.strides != tuple(row_major(sizes, None))
        or target.scale.layout.strides != tuple(row_major(ctx.scale_grid(target), None))
    ):
        raise ctx.error(
            f"swiglu_grad writes an FP8 [{', '.join(gu.dims)}] tensor, row_major, with "
            f"[1, {KERNEL_K_BLOCK}] scales in the default layout (or, for a WGRAD, with "
            f"[{KERNEL_K_BLOCK}, 1] scales and {gu.dims[0]} contiguous per segment), but '{name}' is {target}",
            t.name.pos,
            f"declare `tensor {name} : e4m3 [{', '.join(gu.dims)}] scale f32 [1, {KERNEL_K_BLOCK}] = "
            f"swiglu_grad({gu.name}, {dh.name})`",
        )
    if pairs % KERNEL_K_BLOCK:
        raise ctx.error(
            f"swiglu_grad quantizes whole {KERNEL_K_BLOCK}-column blocks, but '{gu.name}' has "
            f"{pairs} columns",
            d.source.pos,
        )


def check_no_cycle(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    """Statements and passes run in an order where each reads what the others write
    before it (gemmspec.lower.lowering.step_order). Only a swiglu_grad pass reads what
    statements write (the other passes read inputs, and no statement reads a row
    pass's target), so only it can close a loop: a statement that reads, through any
    chain, a pass that reads the statement's own output."""
    if not any(t.derived is not None and t.derived.op == SWIGLU_GRAD_OP for t in ctx.tensors.values()):
        return
    steps: list[tuple[str, tuple[str, ...], tuple[str, ...]]] = [
        (f"the statement on line {g.line}", g.reads, g.writes) for g in gemms
    ]
    for t in ctx.tensors.values():
        d = t.derived
        if d is not None:
            steps.append((f"'{t.name}' = {d}", d.reads, (t.name,)))
        elif t.row_pass is not None:
            steps.append((f"'{t.name}' = {t.row_pass}", t.row_pass.reads, (t.name,)))
    writers: dict[str, list[int]] = {}
    for i, (_, _, writes) in enumerate(steps):
        for w in writes:
            writers.setdefault(w, []).append(i)
    after = [sorted({j for r in reads for j in writers.get(r, ())} - {i}) for i, (_, reads, _) in enumerate(steps)]
    state = [0] * len(steps)  # 0 unseen, 1 on the path, 2 done
    for root in range(len(steps)):
        if state[root]:
            continue
        path, todo = [root], [iter(after[root])]  # depth-first, without recursion
        state[root] = 1
        while todo:
            j = next(todo[-1], None)
            if j is None:
                state[path.pop()] = 2
                todo.pop()
                continue
            if state[j] == 0:
                state[j] = 1
                path.append(j)
                todo.append(iter(after[j]))
                continue
            if state[j] != 1:
                continue
            loop = path[path.index(j):]
            derived = next((k for k in loop if k >= len(gemms)), None)
            if derived is None:
                continue  # statements alone: the analysis reports their cycle
            names = " <- ".join(steps[k][0] for k in [j, *reversed(loop)])
            name = steps[derived][2][0]
            raise ctx.error(
                f"'{name}' reads what it feeds: {names}",
                ctx.tensor_ast[name].derived.op.pos,
                "a pass may read what statements write only when none of them reads the pass's result",
            )
