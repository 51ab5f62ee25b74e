"""Rows through an index tensor: the gathered rows of the first factor and the
scattered rows of an `=` output."""

from __future__ import annotations

from .. import ast
from ..spec import INDEX_TYPE, Access, Gemm, Tensor
from .context import Context


def index_tensor(ctx: Context, idx: ast.Index) -> Tensor:
    """The tensor of `idx[t]`: a declared i32 tensor of one dim."""
    assert idx.via is not None
    name = idx.via.text
    if name not in ctx.tensors:
        raise ctx.error(
            f"unknown index tensor '{name}'", idx.via.pos,
            f"declare it, e.g. `tensor {name} : {INDEX_TYPE} [T]` (one row number per row t)",
        )
    t = ctx.tensors[name]
    if t.dtype != INDEX_TYPE:
        raise ctx.error(
            f"'{name}' is {t.dtype}, but {name}[{idx.var.text}] reads it as an index tensor; "
            f"index tensors are {INDEX_TYPE} (int32 row numbers)",
            idx.via.pos,
            f"declare `tensor {name} : {INDEX_TYPE} [{', '.join(t.dims)}]`",
        )
    return t  # one dim: checked at its declaration


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
                        f"store with `=` (the entries of '{idx.via.text}' distinct), or write "
                        f"'{s.out.tensor.text}' in row order and combine the rows in a separate pass",
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
