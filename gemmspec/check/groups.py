"""Groups and their nests: declarations (ragged, split, uniform, masked, `within`),
and the group references, restricted sums and grouped dims of a statement."""

from __future__ import annotations

from .. import ast
from ..errors import Fix
from ..spec import (
    MAX_FIXED_SEGMENTS,
    MAX_LEAVES_PER_LAUNCH,
    MAX_WITHIN_DEPTH,
    Group,
    RoleDim,
    Tensor,
)
from .context import Binding, Context
from .fixes import did_you_mean, fix, group_kind_end_of_dim, insert_at
from .names import claim, const_expr, declare_dim, need_dim

GROUP_KINDS_THAT_PARTITION = ("ragged", "split", "uniform")


def declare_group(ctx: Context, g: ast.GroupDecl) -> None:
    if g.name.text in ctx.groups:
        raise ctx.error(f"group '{g.name.text}' is declared twice", g.name.pos)
    # The count dim: declared here (`[E = 8]`) or earlier (`[E]`).
    if g.count is None:
        if g.count_dim.text not in ctx.dims:
            later = _later_group(ctx, g, lambda o: o.count is not None and o.count_dim.text == g.count_dim.text)
            if later is not None:
                raise ctx.error(
                    f"group '{g.name.text}' takes its count from '{g.count_dim.text}', which group "
                    f"'{later.name.text}' declares later (at {later.count_dim.pos.line}:"
                    f"{later.count_dim.pos.column}); a count dim comes from `dim` or from an "
                    "earlier group's [NAME = N]",
                    g.count_dim.pos,
                    f"write [{g.count_dim.text} = {later.count}] here, or declare group "
                    f"'{later.name.text}' before '{g.name.text}'",
                )
            raise ctx.error(
                f"group '{g.name.text}' needs a group count: write [{g.count_dim.text} = N] "
                f"or declare `dim {g.count_dim.text} = N`",
                g.count_dim.pos,
            )
        count = ctx.dims[g.count_dim.text].size
        if count is None:
            raise ctx.error(
                f"the number of groups '{g.count_dim.text}' must be known at compile time",
                g.count_dim.pos,
            )
    else:
        count = g.count
        if count <= 0:
            raise ctx.error(f"group count must be positive, not {count}", g.count_dim.pos)
        if g.count_dim.text in ctx.dims:
            known = ctx.dims[g.count_dim.text]
            if known.size != count:
                was = "known at run time" if known.size is None else str(known.size)
                raise ctx.error(
                    f"dim '{g.count_dim.text}' is given two sizes: {count} here, {was} "
                    f"at {ctx.dim_pos[g.count_dim.text].line}:"
                    f"{ctx.dim_pos[g.count_dim.text].column}",
                    g.count_dim.pos,
                )
        else:
            declare_dim(ctx, g.count_dim, count)
    claim(ctx, g.name, "group")
    k = g.kind
    if count > MAX_LEAVES_PER_LAUNCH:
        raise ctx.error(
            f"group '{g.name.text}' has {count} segments, more than {MAX_LEAVES_PER_LAUNCH}: "
            "each segment is a leaf GEMM, and a launch holds at most "
            f"{MAX_LEAVES_PER_LAUNCH} leaves",
            g.count_dim.pos,
        )
    if k.kind in ("split", "uniform") and count > MAX_FIXED_SEGMENTS:
        raise ctx.error(
            f"{k.kind} group '{g.name.text}' has {count} segments, more than "
            f"{MAX_FIXED_SEGMENTS}: each segment's start and size is compiled into the "
            "leaf table; use a ragged group for many segments",
            g.count_dim.pos,
        )
    dim = need_dim(ctx, k.dim)
    within = None
    depth = 0
    sizes: tuple[int, ...] = ()
    if k.within is not None:
        if k.within.text not in ctx.groups:
            later = _later_group(ctx, g, lambda o: o.name.text == k.within.text)
            if later is not None:
                raise ctx.error(
                    f"group '{g.name.text}' is declared within '{k.within.text}', which is "
                    f"declared after it (at {later.name.pos.line}:{later.name.pos.column}); "
                    "a group written `within OUTER` must come after OUTER",
                    k.within.pos,
                    f"move the declaration of '{k.within.text}' above '{g.name.text}'",
                )
            raise ctx.error(
                f"unknown group '{k.within.text}'", k.within.pos,
                *did_you_mean(k.within, list(ctx.groups), "groups"),
            )
        depth = ctx.group_depth[k.within.text] + 1
        if depth > MAX_WITHIN_DEPTH:
            raise ctx.error(
                f"group '{g.name.text}' nests {depth} deep with `within`, more than "
                f"{MAX_WITHIN_DEPTH}: its offsets tensor would need one axis per "
                "enclosing group",
                k.within.pos,
            )
        outer = ctx.groups[k.within.text]
        if outer.kind not in GROUP_KINDS_THAT_PARTITION:
            raise ctx.error(
                f"group '{g.name.text}' can nest only within a ragged, split or uniform "
                f"group; '{outer.name}' is {outer.kind}",
                k.within.pos,
            )
        if outer.dim != dim.name:
            raise ctx.error(
                f"group '{g.name.text}' splits {dim.name} within '{outer.name}', but "
                f"'{outer.name}' does not split {dim.name}",
                k.within.pos,
            )
        within = outer.name
    if k.kind == "split":
        sizes = tuple(const_expr(ctx, e, "a split size") for e in k.sizes)
        if len(sizes) != count:
            raise ctx.error(
                f"split gives {len(sizes)} sizes for {count} groups", k.pos
            )
        if any(s < 0 for s in sizes):
            raise ctx.error("split sizes must not be negative", k.pos)
        if dim.size is None:
            raise ctx.error(
                f"split needs '{dim.name}' to be known at compile time; use ragged(...) "
                "for run-time segments",
                k.dim.pos,
            )
        if sum(sizes) != dim.size:
            raise ctx.error(
                f"split sizes add up to {sum(sizes)} but dim '{dim.name}' is {dim.size}",
                k.sizes[0].pos,
            )
    elif k.kind == "uniform":
        if dim.size is None or dim.size % count:
            raise ctx.error(
                f"uniform({dim.name}) needs '{dim.name}' to be a compile-time multiple of "
                f"{count}",
                k.dim.pos,
            )
        sizes = (dim.size // count,) * count
    elif k.kind == "masked" and dim.size is None:
        raise ctx.error(
            f"masked({dim.name}): the padded size '{dim.name}' must be known at compile time",
            k.dim.pos,
        )
    if within is not None and k.kind != "ragged":
        raise ctx.error("only ragged groups may nest with `within`", k.pos)
    if k.capacity and within is not None:
        raise ctx.error(
            "a nested group spans its outer segments exactly; only the outermost "
            "ragged group may be a capacity (`capacity`)",
            k.pos,
        )
    if k.tensor is not None:
        claim(ctx, k.tensor, "offsets tensor" if k.kind == "ragged" else "counts tensor")
    ctx.groups[g.name.text] = Group(
        name=g.name.text,
        kind=k.kind,
        count_dim=g.count_dim.text,
        count=count,
        dim=dim.name,
        within=within,
        tensor=k.tensor.text if k.tensor else None,
        sizes=sizes,
        capacity=k.capacity,
    )
    ctx.group_rank[g.name.text] = len(ctx.group_order)
    ctx.group_order.append(g.name.text)
    ctx.group_depth[g.name.text] = depth
    if k.kind == "masked":
        ctx.masked_by_count_dim.setdefault(g.count_dim.text, g.name.text)


def _later_group(ctx: Context, g: ast.GroupDecl, match) -> ast.GroupDecl | None:
    """The first group declared after `g` in the spec for which `match` holds."""
    groups = list(ctx.ast.groups)
    after = groups[next(i for i, o in enumerate(groups) if o is g) + 1:]
    return next((o for o in after if match(o)), None)


def check_group_ref(ctx: Context, idx: ast.Index, dim: str, t: Tensor, binding: Binding) -> None:
    assert idx.group is not None
    gname = idx.group.text
    if gname not in ctx.groups:
        raise ctx.error(
            f"unknown group '{gname}'", idx.group.pos,
            *did_you_mean(idx.group, list(ctx.groups), "groups"),
        )
    g = ctx.groups[gname]
    if g.count_dim != dim:
        raise ctx.error(
            f"{gname}({idx.var.text}) gives a group index in 0..{g.count_dim}, but this "
            f"position of '{t.name}' is dim {dim}",
            idx.group.pos,
        )
    if g.kind == "masked":
        raise ctx.error(
            f"masked group '{gname}' is indexed by a batch index over {g.count_dim}, "
            f"not as {gname}({idx.var.text})",
            idx.group.pos,
        )
    if idx.var.text not in binding:
        raise ctx.error(
            f"index '{idx.var.text}' in {gname}({idx.var.text}) is not bound by any "
            "tensor position",
            idx.var.pos,
        )
    vdim = binding[idx.var.text][0]
    if vdim != g.dim:
        raise ctx.error(
            f"group '{gname}' splits {g.dim}, but '{idx.var.text}' ranges over {vdim}",
            idx.var.pos,
        )


def check_sum_restriction(
    ctx: Context, sm: ast.SumIndex, binding: Binding, out_vars: list[str]
) -> tuple[str, str]:
    assert sm.group is not None and sm.group_var is not None
    gname = sm.group.text
    if gname not in ctx.groups:
        raise ctx.error(
            f"unknown group '{gname}'", sm.group.pos,
            *did_you_mean(sm.group, list(ctx.groups), "groups"),
        )
    g = ctx.groups[gname]
    kdim = binding[sm.var.text][0]
    if g.kind == "masked":
        raise ctx.error(
            f"'{sm.var.text} in {gname}(...)': group '{gname}' is masked; a sum restricted to "
            "a group's segments takes a ragged, split or uniform group",
            sm.group.pos,
            f"write `sum[{sm.var.text}]` and index the output and both factors by a batch "
            f"index over {g.count_dim}, which makes '{gname}' the leaf axis",
        )
    if g.kind not in GROUP_KINDS_THAT_PARTITION or g.dim != kdim:
        raise ctx.error(
            f"'{sm.var.text} in {gname}(...)': group '{gname}' does not split {kdim}",
            sm.group.pos,
        )
    ev = sm.group_var.text
    if ev not in out_vars:
        raise ctx.error(
            f"'{ev}' must index the output: each of the {g.count} segments of '{gname}' "
            "produces its own output slice",
            sm.group_var.pos,
        )
    if binding[ev][0] != g.count_dim:
        raise ctx.error(
            f"'{ev}' ranges over {binding[ev][0]}, but {gname}(...) takes an index over "
            f"{g.count_dim}",
            sm.group_var.pos,
        )
    return gname, ev


def role_dim(ctx: Context, role: str, var: str, dim: str, groups: list[str], s: ast.Statement) -> RoleDim:
    splitting = [
        n for n in groups
        if ctx.groups[n].kind in GROUP_KINDS_THAT_PARTITION and ctx.groups[n].dim == dim
    ]
    innermost = None
    if splitting:
        # The groups splitting one dim must form one `within` chain: the deepest
        # is the innermost, and every other one must enclose it.
        innermost = max(splitting, key=ctx.group_depth.__getitem__)
        enclosing = set()
        g = ctx.groups[innermost]
        while g.within:
            enclosing.add(g.within)
            g = ctx.groups[g.within]
        for o in splitting:
            if o != innermost and o not in enclosing:
                first, second = sorted((o, innermost), key=ctx.group_rank.__getitem__)
                raise ctx.error(
                    f"groups '{first}' and '{second}' both split {dim}, but neither is "
                    "declared within the other",
                    s.pos,
                    *_nest_hint(ctx, first, second),
                )
    masked = [
        n for n in groups if ctx.groups[n].kind == "masked" and ctx.groups[n].dim == dim
    ]
    return RoleDim(role, var, dim, innermost, masked[0] if masked else None)


def _nest_hint(ctx: Context, outer: str, inner: str) -> tuple[str, Fix | None]:
    """Two groups splitting one dim in one statement: the later one declared within the
    earlier, where it may nest (a ragged group, not yet nested, whose offsets then hold
    one row per outer segment)."""
    o, i = ctx.groups[outer], ctx.groups[inner]
    if i.kind != "ragged" or i.within is not None or i.capacity:
        return (
            f"only a ragged group nests (`ragged({i.dim} within {outer}, offsets = ...)`); "
            f"use one group over {i.dim} in this statement",
            None,
        )
    shape = f"[{', '.join(str(g.count) for g in _chain(ctx, outer))}, {i.count + 1}]"
    return (
        f"nest '{inner}' in '{outer}': `ragged({i.dim} within {outer}, offsets = {i.tensor})` "
        f"(its offsets then hold one row per '{outer}' segment, shaped {shape}, absolute "
        f"positions along {i.dim}, each row spanning its '{o.name}' segment)",
        fix(insert_at(group_kind_end_of_dim(ctx, inner), f" within {outer}")),
    )


def _chain(ctx: Context, group: str) -> list[Group]:
    """`group` and the groups it nests in, outermost first."""
    chain = [ctx.groups[group]]
    while chain[0].within:
        chain.insert(0, ctx.groups[chain[0].within])
    return chain
