"""Rows through an index tensor: the gathered rows of the first factor and the
scattered rows of an `=` output."""

from __future__ import annotations

from .. import ast
from ..errors import Edit, Fix
from ..spec import INDEX_TYPE, Access, Gemm, Tensor
from .context import Context
from .fixes import add_declaration, add_declaration_last, fix, rename


def index_tensor(ctx: Context, idx: ast.Index) -> Tensor:
    """The tensor of `idx[t]`: a declared i32 tensor of one dim."""
    assert idx.via is not None
    name = idx.via.text
    if name not in ctx.tensors:
        raise ctx.error(
            f"unknown index tensor '{name}'", idx.via.pos,
            *_declare_index(ctx, idx),
        )
    t = ctx.tensors[name]
    if t.dtype != INDEX_TYPE:
        raise ctx.error(
            f"'{name}' is {t.dtype}, but {name}[{idx.var.text}] reads it as an index tensor; "
            f"index tensors are {INDEX_TYPE} (int32 row numbers)",
            idx.via.pos,
            f"declare `tensor {name} : {INDEX_TYPE} [{', '.join(t.dims)}]`",
            fix(rename(ctx.tensor_ast[name].dtype, INDEX_TYPE)),
        )
    return t  # one dim: checked at its declaration


def _combine_hint(ctx: Context, s: ast.Statement, idx: ast.Index) -> tuple[str, Fix | None]:
    """`y[src[t], n] += ...` (a top-k combine): write the rows in row order into a new
    tensor and add them into `y` with a scatter_add row pass, which sums the rows that
    name one row deterministically."""
    out, src = s.out.tensor.text, idx.via.text
    plain = f"store with `=` (the entries of '{src}' distinct)"
    y = ctx.tensors.get(out)
    rows_name = f"{out}_rows"
    row_dim = _row_dim(ctx, s.lhs, idx.var.text)
    if (
        y is None or y.rank != 2 or y.dtype not in ("bf16", "f16", "f32") or y.scale
        or y.derived or rows_name in ctx.names or row_dim is None
    ):
        return f"{plain}, or write '{out}' in row order and add the rows with scatter_add", None
    rows_decl = f"tensor {rows_name} : {y.dtype} [{row_dim}, {y.dims[1]}]"
    derive = f"= scatter_add({rows_name}, rows = {src})"
    ref = ", ".join(idx.var.text if i is idx else str(i) for i in s.out.indices)
    new_out = f"{rows_name}[{ref}] ="
    decl = add_declaration(ctx, out, rows_decl)
    assert s.assign_pos is not None
    start, assign = s.out.tensor.pos, s.assign_pos
    return (
        f"{plain}; or, for a top-k combine, write the routed rows in row order and add them "
        f"into '{out}' with a scatter_add row pass (deterministic: row s of '{out}' is the "
        f"sum of the rows t with {src}[t] == s, zero where there is none): declare "
        f"`{rows_decl}`, declare '{out}' `{derive}` and write `{new_out} ...`",
        fix(
            Edit(decl.line, decl.column, decl.end_line, decl.end_column, f" {derive}{decl.text}"),
            Edit(start.line, start.column, assign.line, assign.column + 2, new_out),
        ),
    )


def _row_dim(ctx: Context, lhs: ast.Ref, var: str) -> str | None:
    """The dim the row index `var` ranges over, from the first factor's row position."""
    t = ctx.tensors.get(lhs.tensor.text)
    if t is None or len(lhs.indices) != t.rank:
        return None
    for i, x in enumerate(lhs.indices):
        if isinstance(x, ast.Index) and x.var.text == var and x.group is None:
            if x.via is None:
                return t.dims[i]
            via = ctx.tensors.get(x.via.text)
            return via.dims[0] if via is not None else None
    return None


def _declare_index(ctx: Context, idx: ast.Index) -> tuple[str, Fix | None]:
    """An undeclared index tensor: one row number per row of the statement, so its dim is
    the dim of the row index where that is already known from a tensor it indexes."""
    name = idx.via.text
    dims = {
        ctx.tensors[r.tensor.text].dims[i]
        for s in ctx.ast.statements
        for r in (s.out, s.lhs, s.rhs)
        if r.tensor.text in ctx.tensors and len(r.indices) == ctx.tensors[r.tensor.text].rank
        for i, x in enumerate(r.indices)
        if isinstance(x, ast.Index) and x.via is None and x.group is None and x.var.text == idx.var.text
    }
    dim = dims.pop() if len(dims) == 1 else None
    decl = f"tensor {name} : {INDEX_TYPE} [{dim or 'T'}]"
    note = f"declare it, e.g. `{decl}` (one row number per row {idx.var.text})"
    return note, fix(add_declaration_last(ctx, decl)) if dim else None


def check_gather_positions(ctx: Context, s: ast.Statement, refs: tuple[ast.Ref, ...]) -> None:
    """`idx[t]` stands only at the row position of the first factor (gathered rows) and
    of an `=` output (scattered rows), with t the statement's row index. Decided from
    the indices as written, before any binding, so that the message names the role."""

    def plain(ref: ast.Ref) -> set[str]:
        return {i.var.text for i in ref.indices if isinstance(i, ast.Index) and i.group is None}

    out_v, lhs_v, rhs_v = plain(s.out), plain(s.lhs), plain(s.rhs)
    summed = {sm.var.text for sm in s.sums}
    for ref in refs:
        for idx in ref.indices:
            if not isinstance(idx, ast.Index) or idx.via is None:
                continue
            v = idx.var.text
            shown = f"{idx.via.text}[{v}]"
            is_row = v in out_v and v in lhs_v and v not in rhs_v and v not in summed
            if is_row and ref is s.lhs:
                continue
            if is_row and ref is s.out:
                if s.accumulate:
                    raise ctx.error(
                        f"'{s.out.tensor.text}' is written through {shown} with +=: rows t "
                        f"with one {shown} would add into the same elements at once (a race), "
                        "so scattered outputs are stored with `=` only",
                        idx.via.pos,
                        *_combine_hint(ctx, s, idx),
                    )
                continue
            if is_row:
                where = f"the epilogue operand '{ref.tensor.text}' along the row index '{v}'"
            elif v in summed:
                where = f"'{ref.tensor.text}' along the contracted index '{v}'"
            elif v in out_v and v in rhs_v and v in lhs_v:
                where = f"'{ref.tensor.text}' along the batch index '{v}'"
            elif v in out_v and v in rhs_v:
                where = f"'{ref.tensor.text}' along the column index '{v}'"
            else:
                where = f"'{ref.tensor.text}' along '{v}'"
            rows = sorted(out_v & lhs_v - rhs_v - summed)
            row = rows[0] if len(rows) == 1 else "t"
            raise ctx.error(
                f"{shown} reads {where}; only rows go through an index tensor: the row "
                f"position of the first factor (gathered rows) and of the output (scattered "
                f"rows), indexed by the statement's row index",
                idx.via.pos,
                f"gather the rows of the first factor (e.g. {s.lhs.tensor.text}[{idx.via.text}[{row}], "
                f"...]) or index '{ref.tensor.text}' by '{v}' itself",
            )


def check_gathered(ctx: Context, gemm: Gemm, acc: Access, ref: ast.Ref, t: Tensor) -> None:
    """A tensor whose rows go through an index tensor is strided (each row found by its
    number), and its scales are read through the same index: the scale of x[idx[t], k]
    is x_scale at row idx[t] (block idx[t] / b along the gathered dim), so blocks must
    count from the dim's origin (no `per GROUP`) and span K in 128-wide blocks."""
    axis = acc.axis_of_role("m")
    assert axis is not None
    idx = ref.indices[axis]
    assert isinstance(idx, ast.Index) and idx.via is not None
    shown = f"{idx.via.text}[{idx.var.text}]"
    what = "gathered" if acc is gemm.a else "scattered"
    if t.layout.kind != "strided":
        raise ctx.error(
            f"'{t.name}' is stored {t.layout}, but its rows are {what} through {shown}: a row "
            "picked by number needs one row stride",
            ref.tensor.pos,
            "store it row_major, major(...) or strides(...)",
        )
    sc = t.scale
    if sc is None:
        return
    dim = t.dims[axis]
    decl = ctx.tensor_ast[t.name].scale
    if sc.anchor is not None and ctx.groups[sc.anchor].dim == dim:
        raise ctx.error(
            f"the scale blocks of '{t.name}' restart at each '{sc.anchor}' segment along {dim}, "
            f"but {shown} reads its rows in another order: the scale of row {shown} could not "
            f"be found through the same index",
            decl.anchor.pos,
            f"drop `per {sc.anchor}`: the scale of {t.name}[{shown}, k] is "
            f"{sc.name}[{shown} / {sc.block[axis]}, k / 128]",
        )
    if ctx.per_channel(gemm):
        raise ctx.error(
            f"'{t.name}' has per-channel scales (one along the whole of K), which a {what} "
            "operand does not support yet",
            idx.via.pos,
            f"use [1, 128] blocks on '{t.name}': the scale of row {shown} is then read through "
            "the same index",
        )
