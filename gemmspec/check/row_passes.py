"""Row passes, which run after every statement: `rowdot`, `rowscale` and
`scatter_add`."""

from __future__ import annotations

from .. import ast
from ..spec import FP8_TYPES, INDEX_TYPE, KERNEL_K_BLOCK, Gemm, Tensor
from .context import QUANTIZE_SOURCE_TYPES, REQUANTIZE_ROWS, REQUANTIZE_WEIGHT, Context
from .fixes import fix, insert_at, replace_declaration


def check_row_pass(ctx: Context, t: ast.TensorDecl) -> None:
    """`T = rowdot(A, B)`: A a 2-D unscaled bf16/f16/f32 [R, C], B of A's shape, unscaled
    16-bit/f32 or FP8 with [1, 128] scales, T an unscaled f32 [R]. `T = rowscale(A,
    weight = W)`: A as for rowdot, W a plain f32 [R], T an unscaled 16-bit/f32 [R, C].
    Each row is contiguous (its last dim); the operands are passed in or written by
    statements (a row pass runs after all of them), not derived by another pass."""
    d = t.derived
    op, name = d.op.text, t.name.text
    if op == "scatter_add":
        check_scatter_add(ctx, t)
        return
    target = ctx.tensors[name]
    if op == "rowdot":
        if len(d.options) != 1 or d.keywords:
            pos = d.keywords[0][0].pos if d.keywords else d.options[1].pos if d.options else d.op.pos
            raise ctx.error(
                f"rowdot(...) takes two tensors, the two factors of the row-wise product: "
                f"`{name} = rowdot(A, B)` ({name}[r] = sum over c of A[r, c] * B[r, c])",
                pos,
            )
    else:
        if d.options:
            o = d.options[0]
            shown = f"rowscale({d.source.text}, {REQUANTIZE_WEIGHT} = {o.text})"
            raise ctx.error(
                f"'{o.text}' is not an option of rowscale: its one option is the keyword "
                f"`{REQUANTIZE_WEIGHT} = W` (row r multiplied by W[r])", o.pos,
                f"write `{shown}`",
                fix(insert_at((o.pos.line, o.pos.column), f"{REQUANTIZE_WEIGHT} = "))
                if len(d.options) == 1 and not d.keywords else None,
            )
        keys = [k for k, _ in d.keywords]
        bad = next((k for k in keys if k.text != REQUANTIZE_WEIGHT), None)
        if bad is not None or len(keys) != 1:
            raise ctx.error(
                f"rowscale(...) takes exactly one option, `{REQUANTIZE_WEIGHT} = W` (row r multiplied by W[r])",
                bad.pos if bad is not None else keys[1].pos if keys else d.op.pos,
            )
    source = ctx.tensors[d.source.text]
    operands = [(d.source, source)]
    if op == "rowdot":
        other = d.options[0]
        if other.text not in ctx.tensors:
            raise ctx.error(f"unknown tensor '{other.text}'", other.pos)
        operands.append((other, ctx.tensors[other.text]))
    for ref, x in operands:
        if x.name == name:
            raise ctx.error(f"'{name}' is computed from itself", ref.pos)
        if x.derived is not None or x.row_pass is not None or x.copy_of is not None:
            what = "a copy" if x.copy_of is not None else "derived by another pass"
            raise ctx.error(
                f"{op} reads tensors passed in or written by statements, but '{x.name}' is {what}",
                ref.pos,
            )
        check_rows_contiguous(ctx, op, x, ref.pos)
    if source.dtype not in QUANTIZE_SOURCE_TYPES or source.scale is not None:
        what = f"{source.dtype} with a scale" if source.scale is not None else source.dtype
        raise ctx.error(
            f"{op} reads an unscaled bf16, f16 or f32 tensor first, but '{source.name}' is {what}",
            d.source.pos,
        )
    if op == "rowdot":
        ref, other = operands[1]
        if other.dims != source.dims:
            raise ctx.error(
                f"rowdot multiplies tensors of one shape, but '{other.name}' is "
                f"[{', '.join(other.dims)}] and '{source.name}' [{', '.join(source.dims)}]",
                ref.pos,
            )
        fp8 = other.dtype in FP8_TYPES and other.scale is not None and other.scale.block == (1, KERNEL_K_BLOCK)
        plain = other.dtype in QUANTIZE_SOURCE_TYPES and other.scale is None
        if not (fp8 or plain):
            raise ctx.error(
                f"rowdot's second factor is an unscaled bf16, f16 or f32 tensor or an FP8 one with "
                f"[1, {KERNEL_K_BLOCK}] scales, but '{other.name}' is {other.dtype}"
                + (f" scaled in blocks {other.scale.block_text}" if other.scale is not None else " with no scale"
                   if other.dtype in FP8_TYPES else ""),
                ref.pos,
            )
        if (
            target.dtype != "f32" or target.scale is not None or target.dims != source.dims[:1]
            or target.layout.contiguous_axis() != 0
        ):
            decl = f"tensor {name} : f32 [{source.dims[0]}] = rowdot({d.source.text}, {d.options[0].text})"
            raise ctx.error(
                f"rowdot writes one f32 per row: '{name}' must be an unscaled, contiguous f32 "
                f"[{source.dims[0]}], but it is {target.dtype} [{', '.join(target.dims)}] layout {target.layout}",
                t.name.pos,
                f"declare `{decl}`",
                fix(replace_declaration(ctx, name, decl)),
            )
        return
    key, value = d.keywords[0]
    if value.text not in ctx.tensors:
        raise ctx.error(f"unknown tensor '{value.text}'", value.pos)
    w = ctx.tensors[value.text]
    rows = source.dims[0]
    if w.dtype != "f32" or w.dims != (rows,) or w.scale is not None or w.derived is not None or (
        w.row_pass is not None or w.copy_of is not None or w.layout.contiguous_axis() != 0
    ):
        raise ctx.error(
            f"'{value.text}' is the weight of the rows of '{source.name}', a plain, contiguous f32 "
            f"tensor [{rows}], but it is {w.dtype} [{', '.join(w.dims)}] layout {w.layout}"
            + (" with a scale" if w.scale is not None else "")
            + (", written by a pass or an epilogue" if w.derived or w.row_pass or w.copy_of else ""),
            value.pos,
            f"declare `tensor {value.text} : f32 [{rows}]`",
        )
    if (
        target.dtype not in QUANTIZE_SOURCE_TYPES or target.scale is not None
        or target.dims != source.dims or target.layout.kind != "strided"
        or target.layout.contiguous_axis() != 1
    ):
        raise ctx.error(
            f"rowscale keeps the shape of '{source.name}': '{name}' must be an unscaled bf16, f16 "
            f"or f32 [{', '.join(source.dims)}] with contiguous rows, but it is {target.dtype} "
            f"[{', '.join(target.dims)}]" + (" with a scale" if target.scale is not None else ""),
            t.name.pos,
        )


def check_rows_contiguous(ctx: Context, op: str, x: Tensor, pos: ast.Pos) -> None:
    """The passes that work on whole rows read 2-D tensors with contiguous rows."""
    if x.rank != 2 or x.layout.kind != "strided" or x.layout.contiguous_axis() != 1:
        raise ctx.error(
            f"{op} reads 2-D tensors whose rows are contiguous (the last dim), but '{x.name}' "
            f"is [{', '.join(x.dims)}] layout {x.layout}",
            pos,
        )


def check_scatter_add(ctx: Context, t: ast.TensorDecl) -> None:
    """`T = scatter_add(A, rows = IDX)`: A a 2-D unscaled bf16/f16/f32 [R, C] with
    contiguous rows, passed in or written by a statement; IDX an i32 [R]; T an unscaled
    bf16/f16/f32 [S, C] with contiguous rows (S any dim: IDX's entries pick its rows)."""
    d = t.derived
    name = t.name.text
    usage = f"`{name} = scatter_add(A, rows = IDX)`: {name}[s, c] = sum over the t with IDX[t] == s of A[t, c]"
    if d.options:
        raise ctx.error(
            f"scatter_add(...) takes one tensor and the option `{REQUANTIZE_ROWS} = IDX`, but "
            f"'{d.options[0].text}' is given",
            d.options[0].pos,
            usage,
        )
    keys = [k for k, _ in d.keywords]
    bad = next((k for k in keys if k.text != REQUANTIZE_ROWS), None)
    if bad is not None or len(keys) != 1:
        raise ctx.error(
            f"scatter_add(...) takes exactly one option, `{REQUANTIZE_ROWS} = IDX` (row t added into "
            f"row IDX[t])"
            + (f", but '{bad.text}' is given" if bad is not None else ""),
            bad.pos if bad is not None else keys[1].pos if keys else d.op.pos,
            usage,
        )
    source, target = ctx.tensors[d.source.text], ctx.tensors[name]
    if source.name == name:
        raise ctx.error(f"'{name}' is computed from itself", d.source.pos)
    if source.derived is not None or source.row_pass is not None or source.copy_of is not None:
        what = "a copy" if source.copy_of is not None else "derived by another pass"
        raise ctx.error(
            f"scatter_add reads a tensor passed in or written by a statement, but '{source.name}' is {what}",
            d.source.pos,
        )
    check_rows_contiguous(ctx, "scatter_add", source, d.source.pos)
    if source.dtype not in QUANTIZE_SOURCE_TYPES or source.scale is not None:
        what = f"{source.dtype} with a scale" if source.scale is not None else source.dtype
        raise ctx.error(
            f"scatter_add reads an unscaled bf16, f16 or f32 tensor, but '{source.name}' is {what}",
            d.source.pos,
            "FP8 rows are added once dequantized: write them to a 16-bit or f32 tensor first"
            if source.dtype in FP8_TYPES else None,
        )
    _, value = d.keywords[0]
    if value.text not in ctx.tensors:
        raise ctx.error(f"unknown tensor '{value.text}'", value.pos)
    idx = ctx.tensors[value.text]
    rows = source.dims[0]
    derive = f"scatter_add({d.source.text}, rows = {value.text})"
    if idx.dtype != INDEX_TYPE or idx.dims != (rows,):
        raise ctx.error(
            f"'{value.text}' gives the target row of each row of '{source.name}': an {INDEX_TYPE} "
            f"tensor [{rows}], but it is {idx.dtype} [{', '.join(idx.dims)}]",
            value.pos,
            f"declare `tensor {value.text} : {INDEX_TYPE} [{rows}]`",
        )
    if (
        target.dtype not in QUANTIZE_SOURCE_TYPES or target.scale is not None or target.rank != 2
        or target.layout.kind != "strided" or target.layout.contiguous_axis() != 1
    ):
        dtype = target.dtype if target.dtype in QUANTIZE_SOURCE_TYPES else source.dtype
        decl = f"tensor {name} : {dtype} [{target.dims[0]}, {source.dims[1]}] = {derive}"
        raise ctx.error(
            f"scatter_add writes rows of '{source.name}': '{name}' must be an unscaled bf16, f16 or "
            f"f32 2-D tensor with contiguous rows, but it is {target.dtype} [{', '.join(target.dims)}] "
            f"layout {target.layout}" + (" with a scale" if target.scale is not None else ""),
            t.name.pos,
            f"declare `{decl}`",
            fix(replace_declaration(ctx, name, decl)),
        )
    if target.dims[1] != source.dims[1]:
        decl = f"tensor {name} : {target.dtype} [{target.dims[0]}, {source.dims[1]}] = {derive}"
        raise ctx.error(
            f"scatter_add adds whole rows: the columns of '{name}' [{', '.join(target.dims)}] must be "
            f"those of '{source.name}' [{', '.join(source.dims)}]",
            t.name.pos,
            f"declare `{decl}`",
            fix(replace_declaration(ctx, name, decl)),
        )


def check_row_pass_targets(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    """A row pass's target is written after every statement: no statement reads or
    writes it."""
    for g in gemms:
        for x in (*g.reads, *g.writes):
            t = ctx.tensors[x]
            if t.row_pass is not None:
                raise ctx.error(
                    f"'{x}' = {t.row_pass} is written by a row pass after every statement; "
                    f"the statement on line {g.line} cannot {'write' if x in g.writes else 'read'} it",
                    ctx.tensor_ast[x].name.pos,
                )
