"""A statement: its indices bound and classified into rows, columns, the contraction
and leaf axes, checked as one `Gemm`."""

from __future__ import annotations

from dataclasses import replace

from .. import ast
from ..spec import INDEX_TYPE, SWIGLU_OUTPUT_TYPES, Access, AxisUse, Gemm, Group, LeafAxis
from .context import Context
from .epilogue import check_epilogue
from .fixes import did_you_mean
from .gather import check_gather_positions, index_tensor
from .groups import check_group_ref, check_sum_restriction, role_dim
from .names import check_identifier
from .operands import check_types
from .swiglu import (
    INTERLEAVED,
    SEPARATE,
    STACKED,
    SwigluPair,
    check_index_exprs,
    check_swiglu_columns,
    check_swiglu_dims,
    check_swiglu_form,
    check_swiglu_halves,
    check_swiglu_up,
)


def check_statement(ctx: Context, index: int, s: ast.Statement) -> Gemm:
    text = str(s)
    check_index_exprs(ctx, s)
    # SwiGLU: checked as one GEMM over the weight's interleaved rows, its second factor
    # indexed by the output's column index `j` where the gate wrote `2*j`.
    pair: SwigluPair | None = None
    if s.up is not None:
        s, pair = check_swiglu_form(ctx, s)
    # The GEMM's three references, then the epilogue operands (bound and checked alike).
    refs = (s.out, s.lhs, s.rhs, *s.factors, *((s.bias,) if s.bias is not None else ()))
    binding: dict[str, tuple[str, ast.Pos]] = {}  # index var -> (dim, where bound)

    def bind(var: ast.Name, dim: str, where: str) -> None:
        if var.text in ctx.dims or var.text in ctx.groups or var.text in ctx.tensors:
            raise ctx.error(
                f"index '{var.text}' has the name of a declared "
                f"{ctx.names[var.text][0]}; index variables need names of their own, "
                f"e.g. '{var.text.lower() if not var.text.islower() else var.text + '_i'}'",
                var.pos,
            )
        check_identifier(ctx, var, "index")
        if var.text in binding and binding[var.text][0] != dim:
            other_dim, other = binding[var.text]
            raise ctx.error(
                f"index '{var.text}' ranges over {dim} in {where} but over {other_dim} at "
                f"{other.line}:{other.column}",
                var.pos,
            )
        binding.setdefault(var.text, (dim, var.pos))

    check_gather_positions(ctx, s, refs)
    # Pass 1: tensors, ranks, plain index bindings.
    for ref in refs:
        if ref.tensor.text not in ctx.tensors:
            raise ctx.error(
                f"unknown tensor '{ref.tensor.text}'", ref.tensor.pos,
                *did_you_mean(ref.tensor, list(ctx.tensors), "tensors"),
            )
        t = ctx.tensors[ref.tensor.text]
        if t.dtype == INDEX_TYPE:
            raise ctx.error(
                f"'{t.name}' is {INDEX_TYPE}, an index tensor: it picks rows of another "
                "tensor, it is not an operand or an output",
                ref.tensor.pos,
                f"read rows through it, e.g. x[{t.name}[t], k], or write them, "
                f"y[{t.name}[t], n] = ...",
            )
        if len(ref.indices) != t.rank:
            raise ctx.error(
                f"'{t.name}' has {t.rank} dims [{', '.join(t.dims)}] but is indexed with "
                f"{len(ref.indices)}",
                ref.tensor.pos,
            )
        used: set[str] = set()
        for axis, (idx, dim) in enumerate(zip(ref.indices, t.dims)):
            if idx.var.text in used and idx.group is None:
                raise ctx.error(
                    f"index '{idx.var.text}' is used twice in {t.name}[...]; a diagonal is "
                    "not a GEMM",
                    idx.var.pos,
                )
            if idx.group is None:
                used.add(idx.var.text)
                if pair is not None and ref is s.rhs and axis == pair.axis and pair.form != SEPARATE:
                    continue  # 2*j and 2*j + 1 range over the weight's rows, j over the output's
                if idx.via is not None:
                    # `idx[t]`: t ranges over the index tensor's dim, the position over t's own.
                    bind(idx.var, index_tensor(ctx, idx, s).dims[0], f"{idx.via.text}[...]")
                    continue
                bind(idx.var, dim, f"{t.name}[...]")
    for sm in s.sums:
        if sm.var.text not in binding:
            raise ctx.error(
                f"summed index '{sm.var.text}' indexes neither factor", sm.var.pos
            )
    pair_dim = check_swiglu_dims(ctx, s, pair, binding) if pair is not None else None
    # Pass 2: group references g(v).
    group_refs: list[tuple[str, ast.Index, str]] = []  # (tensor, index, dim at position)
    for ref in refs:
        t = ctx.tensors[ref.tensor.text]
        for idx, dim in zip(ref.indices, t.dims):
            if idx.group is not None:
                check_group_ref(ctx, idx, dim, t, binding)
                group_refs.append((t.name, idx, dim))
    # Pass 3: classify indices.
    out_t = ctx.tensors[s.out.tensor.text]
    if out_t.view_of is not None:
        raise ctx.error(
            f"'{out_t.name}' is a view of '{out_t.view_of}' and cannot be written by a "
            "statement; a view is read-only",
            s.out.tensor.pos,
            f"write '{out_t.view_of}' itself, indexed by its own dims "
            f"[{', '.join(ctx.tensors[out_t.view_of].dims)}]",
        )
    if out_t.derived is not None:
        raise ctx.error(
            f"'{out_t.name}' is derived by {out_t.derived.op}({out_t.derived.source}) and "
            "cannot be written by a statement",
            s.out.tensor.pos,
        )
    if out_t.copy_of is not None:
        raise ctx.error(
            f"'{out_t.name}' = copy({out_t.copy_of}) is written by the statement that writes "
            f"'{out_t.copy_of}', in its epilogue, and cannot be written by another",
            s.out.tensor.pos,
        )

    def plain(ref: ast.Ref) -> list[str]:
        return [i.var.text for i in ref.indices if i.group is None]

    out_v, lhs_v, rhs_v = plain(s.out), plain(s.lhs), plain(s.rhs)
    if len(s.sums) != 1:
        raise ctx.error(
            f"gemmspec contracts exactly one index per statement, not {len(s.sums)}",
            s.sums[1].var.pos if len(s.sums) > 1 else s.pos,
        )
    sm = s.sums[0]
    k_var = sm.var.text
    if k_var in out_v:
        raise ctx.error(
            f"index '{k_var}' is summed but also indexes the output; a summed index "
            "must disappear from the output",
            sm.var.pos,
        )
    for side, vs, ref in (("first", lhs_v, s.lhs), ("second", rhs_v, s.rhs)):
        if k_var not in vs:
            raise ctx.error(
                f"summed index '{k_var}' does not index the {side} factor "
                f"'{ref.tensor.text}'; not a GEMM",
                ref.tensor.pos,
            )
    k_group_axis: tuple[str, str] | None = None  # (group, output var)
    if sm.group is not None:
        k_group_axis = check_sum_restriction(ctx, sm, binding, out_v)
    m_vars = [v for v in out_v if v in lhs_v and v not in rhs_v]
    n_vars = [v for v in out_v if v in rhs_v and v not in lhs_v]
    batch_vars = [v for v in out_v if v in lhs_v and v in rhs_v]
    for v in out_v:
        if v in m_vars or v in n_vars or v in batch_vars:
            continue
        if k_group_axis and v == k_group_axis[1]:
            continue
        pos = next(i.var.pos for i in s.out.indices if i.var.text == v)
        raise ctx.error(
            f"output index '{v}' indexes neither factor; not a GEMM", pos
        )
    for ref, vs in ((s.lhs, lhs_v), (s.rhs, rhs_v)):
        for v in vs:
            if v != k_var and v not in out_v:
                pos = next(i.var.pos for i in ref.indices if i.var.text == v)
                raise ctx.error(
                    f"index '{v}' of '{ref.tensor.text}' is neither summed nor in the "
                    f"output; not a GEMM (sum over it, or index the output with it)",
                    pos,
                )
    if len(m_vars) != 1 or len(n_vars) != 1:
        what = "row" if len(m_vars) != 1 else "column"
        found = m_vars if len(m_vars) != 1 else n_vars
        raise ctx.error(
            f"not a GEMM: expected exactly one {what} index shared by the output and the "
            f"{'first' if what == 'row' else 'second'} factor, found "
            f"{len(found)}{' (' + ', '.join(found) + ')' if found else ''}",
            s.out.tensor.pos,
        )
    m_var, n_var = m_vars[0], n_vars[0]
    dims_of = {v: binding[v][0] for v in binding}

    # Leaf axes: referenced groups (with their enclosing groups) and batch dims.
    used_groups: list[str] = [idx.group.text for _, idx, _ in group_refs]
    if k_group_axis:
        used_groups.append(k_group_axis[0])
    batch_axes: list[LeafAxis] = []
    batch_use: dict[str, str] = {}  # batch var -> axis name
    for v in batch_vars:
        d = ctx.dims[dims_of[v]]
        masked = ctx.masked_by_count_dim.get(d.name)
        if masked is not None:
            used_groups.append(masked)
            batch_use[v] = masked
            continue
        if d.size is None:
            pos = next(i.var.pos for i in s.out.indices if i.var.text == v)
            raise ctx.error(
                f"batch index '{v}' ranges over '{d.name}', which is known only at run "
                "time; batch dims must be fixed (use a ragged group for run-time sizes)",
                pos,
            )
        batch_axes.append(LeafAxis(v, d.size, None))
        batch_use[v] = v
    closure: set[str] = set()
    for name in used_groups:
        g: Group | None = ctx.groups[name]
        while g is not None and g.name not in closure:  # at most MAX_WITHIN_DEPTH steps
            closure.add(g.name)
            g = ctx.groups[g.within] if g.within else None
    ordered = sorted(closure, key=ctx.group_rank.__getitem__)
    leaf_axes = tuple(batch_axes) + tuple(
        LeafAxis(n, ctx.groups[n].count, n) for n in ordered
    )

    if pair is not None:
        check_swiglu_columns(ctx, s, pair, pair_dim, dims_of[n_var], ordered)
    roles = {
        "m": role_dim(ctx, "m", m_var, dims_of[m_var], ordered, s),
        # An interleaved SwiGLU's GEMM runs over the weight's gate/up rows, twice the
        # output's columns; the other forms count the output's (pair_dim says which).
        "n": role_dim(ctx, "n", n_var, pair_dim or dims_of[n_var], ordered, s),
        "k": role_dim(ctx, "k", k_var, dims_of[k_var], ordered, s),
    }
    role_of = {m_var: "m", n_var: "n", k_var: "k"}
    for n in ordered:
        g = ctx.groups[n]
        if g.kind == "masked":
            continue
        if all(r.dim != g.dim for r in roles.values()):
            raise ctx.error(
                f"group '{n}' splits {g.dim}, which is not the row, column or contracted "
                "dim of this statement",
                s.pos,
            )

    def access(ref: ast.Ref) -> Access:
        uses = []
        for idx in ref.indices:
            v = idx.var.text
            if idx.group is not None:
                uses.append(AxisUse("leaf", axis=idx.group.text))
            elif v in role_of:
                via = idx.via.text if idx.via is not None else None
                uses.append(AxisUse("role", role=role_of[v], index=via))
            elif v in batch_use:
                uses.append(AxisUse("leaf", axis=batch_use[v]))
            else:
                assert k_group_axis and v == k_group_axis[1]
                uses.append(AxisUse("leaf", axis=k_group_axis[0]))
        return Access(ref.tensor.text, tuple(uses))

    gemm = Gemm(
        index=index,
        text=text,
        line=s.pos.line,
        out=access(s.out),
        a=access(s.lhs),
        b=access(s.rhs),
        accumulate=s.accumulate,
        m=roles["m"],
        n=roles["n"],
        k=roles["k"],
        leaf_axes=leaf_axes,
        where=ctx.where(s.pos),
        swiglu=pair is not None,
        swiglu_up=pair.up_tensor if pair is not None else None,
        # Stacked halves: the up half starts the output's column count on (checked).
        swiglu_up_rows=(ctx.dims[dims_of[n_var]].size or 0) if pair is not None and pair.form == STACKED else 0,
    )
    check_types(ctx, gemm, s)
    if pair is not None and pair.form == SEPARATE:
        check_swiglu_up(ctx, s)
    if pair is not None and pair.form != INTERLEAVED:
        check_swiglu_halves(ctx, s, pair, gemm)
    if pair is not None:
        assert n_var == pair.var  # j indexes the output and the weight, not the input
        if out_t.dtype not in SWIGLU_OUTPUT_TYPES:
            raise ctx.error(
                f"output '{out_t.name}' of a SwiGLU is {out_t.dtype}; a SwiGLU stores "
                f"{' or '.join(SWIGLU_OUTPUT_TYPES)}",
                s.out.tensor.pos,
                f"declare '{out_t.name}' as bf16 (or f32)",
            )
    epilogue = check_epilogue(ctx, s, k_var, role_of, batch_use, k_group_axis, access)
    if epilogue and ctx.per_channel(gemm):
        first = (s.factors + ((s.bias,) if s.bias is not None else ()))[0]
        raise ctx.error(
            f"epilogue operand '{first.tensor.text}' beside per-channel scales is not "
            "supported yet: those kernels already scale the finished sum by SA(row) * "
            "SB(column), and both together exceed the registers",
            first.tensor.pos,
            "apply the epilogue in a separate pass, or use 128-wide scale blocks along K",
        )
    if pair is not None and ctx.per_channel(gemm):
        raise ctx.error(
            "a SwiGLU beside per-channel scales is not supported yet: their two epilogues "
            "have not been built into one kernel",
            pair.gate.pos,
            "use 128-wide scale blocks along K, or apply the SwiGLU in a separate pass",
        )
    return replace(gemm, epilogue=epilogue) if epilogue else gemm
