"""Rows through an index tensor: the gathered rows of the first factor and the
scattered rows of an `=` output."""

from __future__ import annotations

from .. import ast
from ..errors import Edit, Fix
from ..spec import INDEX_TYPE, KERNEL_K_BLOCK, Access, Gemm, Tensor
from .context import REQUANTIZE_ROWS, Context
from .fixes import (
    add_declaration,
    add_declaration_last,
    fix,
    rename,
    replace_declaration,
    set_scale,
)


def index_tensor(ctx: Context, idx: ast.Index, s: ast.Statement) -> Tensor:
    """The tensor of `idx[t]` in statement `s`: a declared i32 tensor of one dim."""
    assert idx.via is not None
    name = idx.via.text
    if name not in ctx.tensors:
        raise ctx.error(
            f"unknown index tensor '{name}'", idx.via.pos,
            *_declare_index(ctx, idx, s),
        )
    t = ctx.tensors[name]
    if t.dtype != INDEX_TYPE:
        raise ctx.error(
            f"'{name}' is {t.dtype}, but {name}[{idx.var.text}] reads it as an index tensor; "
            f"index tensors are {INDEX_TYPE} (int32 row numbers)",
            idx.via.pos,
            *_retype_index(ctx, idx, s, t),
        )
    return t  # one dim: checked at its declaration


def _refs(s: ast.Statement) -> list[ast.Ref]:
    refs = [s.out, s.lhs, s.rhs, *s.factors, *((s.bias,) if s.bias is not None else ())]
    return refs + ([s.up.lhs, s.up.rhs] if s.up is not None else [])


def _var_dims(ctx: Context, s: ast.Statement, var: str, skip: str) -> set[str]:
    """The dims statement `s` says the index `var` ranges over: a tensor's dim where `var`
    stands alone, the split dim of a group reference `G(var)`, the dim of an i32 tensor
    of one dim other than `skip` in `IDX[var]` (what binding the statement will require).
    Read from the declarations as written, so that it serves before all are checked."""
    shapes = {d.name.text: (d.dtype.text, [n.text for n in d.shape]) for d in ctx.ast.tensors}
    splits = {g.name.text: g.kind.dim.text for g in ctx.ast.groups}
    dims: set[str] = set()
    for r in _refs(s):
        dtype, shape = shapes.get(r.tensor.text, ("", []))
        for i, x in enumerate(r.indices):
            if not isinstance(x, ast.Index) or x.var.text != var:
                continue
            if x.group is not None:
                if x.group.text in splits:
                    dims.add(splits[x.group.text])
            elif x.via is not None:
                via_type, via_shape = shapes.get(x.via.text, ("", []))
                if x.via.text != skip and via_type == INDEX_TYPE and len(via_shape) == 1:
                    dims.add(via_shape[0])
            elif len(r.indices) == len(shape) and dtype != INDEX_TYPE:
                dims.add(shape[i])
    return dims


def _reads_through(s: ast.Statement, name: str) -> list[str]:
    """The index variables of `name[v]` in statement `s`."""
    return [
        x.var.text
        for r in _refs(s)
        for x in r.indices
        if isinstance(x, ast.Index) and x.via is not None and x.via.text == name
    ]


def index_decl(ctx: Context, name: str, at: tuple[ast.Index, ast.Statement] | None = None) -> tuple[str, bool]:
    """`tensor NAME : i32 [D]`, D the dim the row index ranges over: in the statement `at`
    names (the index and the statement reading through NAME), or where it does not tell,
    in every statement that reads through NAME; and whether D is known (else `T`)."""
    dims: set[str] = set()
    if at is not None:
        dims = _var_dims(ctx, at[1], at[0].var.text, name)
    if not dims:
        dims = {
            d
            for s in ctx.ast.statements
            for var in _reads_through(s, name)
            for d in _var_dims(ctx, s, var, name)
        }
    dim = dims.pop() if len(dims) == 1 else None
    return f"tensor {name} : {INDEX_TYPE} [{dim or 'T'}]", dim is not None


def _read_as_data(ctx: Context, name: str) -> ast.Pos | None:
    """Where a statement or a derivation reads `name` as data (not as an index), if it does."""
    for s in ctx.ast.statements:
        for r in _refs(s):
            if r.tensor.text == name:
                return r.tensor.pos
    for d in ctx.ast.tensors:
        if d.derived is None:
            continue
        if d.derived.source.text == name:
            return d.derived.source.pos
        for key, value in d.derived.keywords:
            if value.text == name and key.text != REQUANTIZE_ROWS:
                return value.pos
    return None


def _retype_index(ctx: Context, idx: ast.Index, s: ast.Statement, t: Tensor) -> tuple[str, Fix | None]:
    """A tensor of another type read as an index tensor: declare it as one, over the dim
    the row index ranges over (replacing its declaration), or, where it is also read as
    data, declare an index tensor of its own."""
    name = t.name
    decl, known = index_decl(ctx, name, (idx, s))
    if not known and t.rank == 1:
        decl, known = f"tensor {name} : {INDEX_TYPE} [{t.dims[0]}]", True
    used = _read_as_data(ctx, name)
    if used is None:
        note = f"declare `{decl}` (one int32 row number per row {idx.var.text})"
        return note, fix(replace_declaration(ctx, name, decl)) if known else None
    new = f"{name}_idx"
    if new in ctx.names:
        new = f"{name}_rows"
    own = decl.replace(f"tensor {name} :", f"tensor {new} :", 1)
    note = (
        f"'{name}' is also read as data at {used.line}:{used.column}; declare an index tensor "
        f"of its own, `{own}` (one int32 row number per row {idx.var.text}), and read "
        f"through {new}[{idx.var.text}]"
    )
    if not known or new in ctx.names:
        return note, None
    return note, fix(add_declaration_last(ctx, own), rename(idx.via, new))


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


def _declare_index(ctx: Context, idx: ast.Index, s: ast.Statement) -> tuple[str, Fix | None]:
    """An undeclared index tensor: one row number per row of the statement, so its dim is
    the dim the row index ranges over where the statement already tells it."""
    decl, known = index_decl(ctx, idx.via.text, (idx, s))
    note = f"declare it, e.g. `{decl}` (one row number per row {idx.var.text})"
    return note, fix(add_declaration_last(ctx, decl)) if known else None


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
    if sc.whole(axis):
        want = [str(b) for b in sc.block]
        want[axis] = "1"
        raise ctx.error(
            f"the scales of '{t.name}' are one block over the whole of {dim}, but its rows are "
            f"{what} through {shown}: a scale found through the index needs blocks of rows",
            decl.pos,
            f"use [{', '.join(want)}] blocks on '{t.name}': the scale of row {shown} is then "
            f"{sc.name}[{shown}, ...]",
            fix(set_scale(ctx, t.name, want)),
        )
    if ctx.per_channel(gemm):
        # Blockwise instead: [1, 128] on the gathered rows, and 128 along K on the second
        # factor where it is per-channel too (both operands scale alike along K).
        k_axis = acc.axis_of_role("k")
        want = [str(b) for b in sc.block]
        want[axis], want[k_axis] = "1", str(KERNEL_K_BLOCK)
        edits = [set_scale(ctx, t.name, want)]
        shown_b = ""
        b_t, b_axis = ctx.tensors[gemm.b.tensor], gemm.b.axis_of_role("k")
        if b_t.scale is not None and b_axis is not None and b_t.scale.block[b_axis] != KERNEL_K_BLOCK:
            want_b = [str(b) for b in b_t.scale.block]
            want_b[b_axis] = str(KERNEL_K_BLOCK)
            edits.append(set_scale(ctx, b_t.name, want_b))
            shown_b = f" and [{', '.join(want_b)}] blocks on '{b_t.name}' (both operands blockwise)"
        raise ctx.error(
            f"'{t.name}' has per-channel scales (one along the whole of K), which a {what} "
            "operand does not support yet",
            idx.via.pos,
            f"use [{', '.join(want)}] blocks on '{t.name}'{shown_b}: the scale of row {shown} "
            "is then read through the same index",
            fix(*edits),
        )
