"""Derivations (`= op(SOURCE, ...)`): transpose, requantize and quantize pre-passes
with their options and keywords; row passes, swiglu_grad and copies are sent to
their own modules."""

from __future__ import annotations

from .. import ast
from ..errors import Edit, Fix
from ..spec import FP8_TYPES, INDEX_TYPE, KERNEL_K_BLOCK, ROW_PASS_OPS, VIEW_OP, Tensor
from .context import (
    COPY_OP,
    QUANTIZE_POW2,
    QUANTIZE_SOURCE_TYPES,
    REQUANTIZE_ROWS,
    REQUANTIZE_WEIGHT,
    SWIGLU_GRAD_OP,
    Context,
)
from .copies import check_copy_declaration
from .fixes import did_you_mean, end_of_scale, fix, insert_at, rename
from .row_passes import check_row_pass
from .swiglu_grad import check_swiglu_grad
from .views import check_view


def check_derivation(ctx: Context, t: ast.TensorDecl) -> None:
    if t.derived is None:
        return
    op, src = t.derived.op, t.derived.source
    if src.text not in ctx.tensors:
        raise ctx.error(
            f"unknown tensor '{src.text}'", src.pos,
            *did_you_mean(src, list(ctx.tensors), "tensors"),
        )
    if op.text in ROW_PASS_OPS:
        check_row_pass(ctx, t)
        return
    if op.text == SWIGLU_GRAD_OP:
        check_swiglu_grad(ctx, t)
        return
    if op.text == VIEW_OP:
        check_view(ctx, t)
        return
    check_derivation_options(ctx, t)
    check_derivation_keywords(ctx, t)
    if op.text == COPY_OP:
        check_copy_declaration(ctx, t)
        return
    if ctx.tensors[src.text].copy_of is not None:
        raise ctx.error(
            f"'{src.text}' is a copy written by a statement's epilogue; derive "
            f"'{t.name.text}' from '{ctx.tensors[src.text].copy_of}', the tensor it copies",
            src.pos,
        )
    source, target = ctx.tensors[src.text], ctx.tensors[t.name.text]
    if src.text == t.name.text:
        raise ctx.error(
            f"'{t.name.text}' is derived from itself; derive it from a tensor that is "
            "passed in",
            src.pos,
        )
    if source.derived is not None and not (op.text == "requantize" and source.derived.op == SWIGLU_GRAD_OP):
        # A swiglu_grad target is requantized as an input would be: its pass runs first.
        message, note = _chain_message(ctx, t.name.text, source)
        raise ctx.error(message, src.pos, note)
    if t.derived.keywords:
        _check_requantize_rows_source(ctx, t, source, target)
    elif source.dims != target.dims:
        raise ctx.error(
            f"{op.text}({src.text}) keeps the logical shape [{', '.join(source.dims)}], but "
            f"'{t.name.text}' is declared [{', '.join(target.dims)}]",
            src.pos,
        )
    if op.text == "quantize":
        _check_quantize(ctx, source, target, op)
        return
    if source.dtype not in FP8_TYPES or target.dtype not in FP8_TYPES:
        raise ctx.error(
            f"{op.text} works on FP8 tensors: '{src.text}' is {source.dtype} and "
            f"'{t.name.text}' is {target.dtype}",
            op.pos,
        )
    if source.scale is None or target.scale is None:
        raise ctx.error(
            f"{op.text} needs scales on both '{src.text}' and '{t.name.text}'", op.pos
        )
    if op.text == "transpose" and source.scale.block != target.scale.block:
        raise ctx.error(
            f"transpose moves bytes only, so '{t.name.text}' must keep the scale blocks "
            f"{source.scale.block_text} of '{src.text}'",
            op.pos,
            "use requantize(...) to change the scale blocks",
        )
    if op.text == "requantize":
        for d, (b_src, b_dst) in enumerate(zip(source.scale.block, target.scale.block)):
            if isinstance(b_dst, str) or b_dst == 1:
                continue  # coarser (the whole dim), or one scale per element
            if isinstance(b_src, str) or (b_dst < b_src and b_src % b_dst):
                raise ctx.error(
                    f"requantize cannot refine blocks along {source.dims[d]} from {b_src} "
                    f"to {b_dst}",
                    op.pos,
                )


def check_derivation_keywords(ctx: Context, t: ast.TensorDecl) -> None:
    """requantize(SOURCE, rows = IDX, weight = W): IDX an i32 index tensor and W an f32
    tensor, each 1-D over the target's rows (its first dim); each keyword at most once.
    The other derivations take no keywords."""
    op, keywords = t.derived.op, t.derived.keywords
    name = t.name.text
    seen: set[str] = set()
    for key, value in keywords:
        if op.text != "requantize":
            raise ctx.error(
                f"{op.text}(...) takes no `{key.text} = ...`; rows through an index and a row "
                "weight are options of requantize",
                key.pos,
            )
        if key.text not in (REQUANTIZE_ROWS, REQUANTIZE_WEIGHT):
            raise ctx.error(
                f"unknown option '{key.text}' of requantize; it takes `{REQUANTIZE_ROWS} = IDX` "
                f"(row t read from row IDX[t] of the source) and `{REQUANTIZE_WEIGHT} = W` "
                "(row t multiplied by W[t])",
                key.pos,
            )
        if key.text in seen:
            raise ctx.error(f"option '{key.text}' of requantize is given twice", key.pos)
        seen.add(key.text)
        if value.text not in ctx.tensors:
            raise ctx.error(f"unknown tensor '{value.text}'", value.pos)
        v = ctx.tensors[value.text]
        rows = ctx.tensors[name].dims[0]
        want = INDEX_TYPE if key.text == REQUANTIZE_ROWS else "f32"
        what = "the index of its rows" if key.text == REQUANTIZE_ROWS else "the weight of its rows"
        if v.dtype != want or v.rank != 1 or v.dims[0] != rows:
            raise ctx.error(
                f"'{value.text}' is {what} in '{name}', an {want} tensor [{rows}] (one entry per "
                f"row of '{name}'), but it is {v.dtype} [{', '.join(v.dims)}]",
                value.pos,
                f"declare `tensor {value.text} : {want} [{rows}]`",
            )
        if v.derived is not None or v.copy_of is not None or v.scale is not None:
            raise ctx.error(
                f"'{value.text}' ({what} in '{name}') must be a plain tensor passed in",
                value.pos,
            )


def _check_requantize_rows_source(ctx: Context, t: ast.TensorDecl, source: Tensor, target: Tensor) -> None:
    """requantize with rows or a weight reads an FP8 [S, C] source with [1, 128] scales
    (the form its kernel dequantizes row by row); with rows, the target's [T, C] may
    have other rows than the source, else the shapes agree."""
    src = t.derived.source
    keys = {k.text for k, _ in t.derived.keywords}
    if source.dtype not in FP8_TYPES or source.scale is None or source.rank != 2 or (
        source.scale.block != (1, KERNEL_K_BLOCK)
    ):
        what = (
            source.dtype if source.dtype not in FP8_TYPES
            else f"{source.dtype} with no scale" if source.scale is None
            else f"{source.rank}-D" if source.rank != 2
            else f"scaled in blocks {source.scale.block_text}"
        )
        raise ctx.error(
            f"requantize({src.text}, {', '.join(f'{k} = ...' for k in sorted(keys))}) reads a 2-D "
            f"FP8 source with [1, {KERNEL_K_BLOCK}] scales (one per row and 128 columns), but "
            f"'{src.text}' is {what}",
            src.pos,
        )
    same = source.dims[1:] == target.dims[1:] if REQUANTIZE_ROWS in keys else source.dims == target.dims
    if target.rank != source.rank or not same:
        rows = " (rows through the index may be of another dim)" if REQUANTIZE_ROWS in keys else ""
        raise ctx.error(
            f"requantize({src.text}) keeps the columns of [{', '.join(source.dims)}]{rows}, but "
            f"'{t.name.text}' is declared [{', '.join(target.dims)}]",
            t.shape[0].pos,
        )


def check_derivation_options(ctx: Context, t: ast.TensorDecl) -> None:
    """quantize takes one option, pow2; requantize only its keywords `rows = IDX` and
    `weight = W`; the other derivations take none."""
    op, options = t.derived.op, t.derived.options
    pow2_home = (
        "power-of-two scales are written by `quantize(SOURCE, pow2)` (from a bf16, f16 or "
        "f32 source) and by an FP8 output whose scale says `pow2`"
    )
    for i, o in enumerate(options):
        if op.text == COPY_OP:
            # pow2 belongs after the copy's scale block (unless it is there already).
            drop, scale_end = _drop_option(ctx, o), end_of_scale(ctx, t.name.text)
            note, found = None, None
            if o.text == QUANTIZE_POW2 and drop is not None and scale_end is not None:
                if t.scale.pow2:
                    note, found = f"drop `, {o.text}`: the scale of '{t.name.text}' says pow2 already", drop
                else:
                    note = f"drop `, {o.text}` and end the scale of '{t.name.text}' with ` pow2`"
                    found = fix(insert_at(scale_end, " pow2"), *drop.edits)
            raise ctx.error(
                f"copy(...) takes no options, but '{o.text}' is given"
                + ("; write `pow2` after the scale block of the copy" if o.text == QUANTIZE_POW2 else ""),
                o.pos,
                note,
                found,
            )
        if op.text == "requantize":
            raise ctx.error(
                f"'{o.text}' is not an option of requantize: its options are the keywords "
                f"`{REQUANTIZE_ROWS} = IDX` (row t read from row IDX[t] of the source) and "
                f"`{REQUANTIZE_WEIGHT} = W` (row t multiplied by W[t])"
                + (f"; {pow2_home}, not by requantize" if o.text == QUANTIZE_POW2 else ""),
                o.pos,
                ("requantize computes its scales as amax / FP8 max: " if o.text == QUANTIZE_POW2 else "")
                + f"drop `{o.text}`",
                _drop_option(ctx, o),
            )
        if op.text != "quantize":
            raise ctx.error(
                f"{op.text}(...) takes no options, but '{o.text}' is given"
                + (f"; {pow2_home}" if o.text == QUANTIZE_POW2 else ""),
                o.pos,
                f"transpose keeps the source's scales: drop `{o.text}`",
                _drop_option(ctx, o),
            )
        if o.text != QUANTIZE_POW2:
            raise ctx.error(
                f"unknown option '{o.text}' of quantize; its one option is pow2 "
                "(power-of-two scales)",
                o.pos,
            )
        if any(p.text == o.text for p in options[:i]):
            raise ctx.error(f"option '{o.text}' of quantize is given twice", o.pos)


def _drop_option(ctx: Context, o: ast.Name) -> Fix | None:
    """Remove the option `o` and the comma before it (both on one line)."""
    line = ctx.lines[o.pos.line - 1]
    col = o.pos.column - 1
    while col > 0 and line[col - 1] in " \t":
        col -= 1
    if col == 0 or line[col - 1] != ",":
        return None
    return fix(Edit(o.pos.line, col, o.pos.line, o.pos.column + len(o.text), ""))


def _check_quantize(ctx: Context, source: Tensor, target: Tensor, op: ast.Name) -> None:
    """quantize turns an unscaled high-precision tensor into FP8 with fresh scales."""
    if source.dtype not in QUANTIZE_SOURCE_TYPES or source.scale is not None:
        what = f"{source.dtype} with a scale" if source.scale is not None else source.dtype
        raise ctx.error(
            f"quantize reads an unscaled bf16, f16 or f32 tensor, but '{source.name}' is {what}",
            op.pos,
            f"'{source.name}' is FP8 already: read it as it is, or derive `= requantize({source.name})` "
            f"where the new blocks are the [{KERNEL_K_BLOCK}, 1] blocks the requantize pass writes"
            if source.scale is not None else None,
            # Into [128, 1] blocks the requantize pass does what was asked.
            fix(rename(op, "requantize"))
            if source.scale is not None and source.scale.block == (1, KERNEL_K_BLOCK)
            and target.scale is not None and target.scale.block == (KERNEL_K_BLOCK, 1) else None,
        )
    if target.dtype not in FP8_TYPES or target.scale is None:
        what = f"{target.dtype} with no scale" if target.dtype in FP8_TYPES else target.dtype
        raise ctx.error(
            f"quantize writes an FP8 (e4m3, e5m2) tensor with a scale, but '{target.name}' "
            f"is {what}",
            op.pos,
        )


def _chain_message(ctx: Context, name: str, source: Tensor) -> tuple[str, str]:
    """Derivations do not chain: follow the sources to the tensor that is passed in
    (or round a cycle) and say which one to derive from."""
    seen = [name]
    t = source
    while t.derived is not None and t.name not in seen:
        seen.append(t.name)
        if t.derived.source not in ctx.tensors:  # reported at its own declaration
            break
        t = ctx.tensors[t.derived.source]
    if t.derived is not None and t.name in seen:
        cycle = " <- ".join(seen[seen.index(t.name):] + [t.name])
        return (
            f"derived tensors form a cycle ({cycle}); each must be derived from a tensor "
            "that is passed in",
            "give one of them no derivation, or derive each from an input",
        )
    root = t.name if t.derived is None else t.derived.source
    op = ctx.tensor_ast[name].derived.op.text
    return (
        f"'{source.name}' is itself derived, and derivations do not chain; derive "
        f"'{name}' from '{root}', the input '{source.name}' comes from",
        f"declare `... = {op}({root})`",
    )
