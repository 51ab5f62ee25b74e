"""SwiGLU statements: `silu(GATE) * UP` checked as one GEMM over a weight's gate and up
rows: interleaved in one tensor (rows 2j, 2j + 1), stacked halves of one tensor (rows j,
F + j) or two tensors declared alike (row j of each)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import ast
from ..expr import Poly
from ..spec import KERNEL_K_BLOCK
from .context import Binding, Context
from .fixes import did_you_mean
from .names import MAX_POLY_DEGREE, MAX_POLY_TERMS

# How a SwiGLU's weight holds its gate and up rows (spec.Gemm.swiglu_up says where the
# up rows of the last two lie).
INTERLEAVED, STACKED, SEPARATE = "interleaved", "stacked", "separate"


@dataclass(frozen=True)
class SwigluPair:
    """Where a SwiGLU's weight pairs its rows: index `var` at position `axis` of the
    second factor, written `gate` and `up` there. Interleaved: 2*var and 2*var + 1;
    stacked: var and var + `up_offset` (a dim's name or a number: checked to be the
    output's column count); separate: var in both, the up rows in tensor `up_tensor`."""

    var: str
    axis: int
    gate: ast.Index | ast.IndexExpr
    up: ast.Index | ast.IndexExpr
    form: str = INTERLEAVED
    up_tensor: str | None = None
    up_offset: Poly | None = None


def check_index_exprs(ctx: Context, s: ast.Statement) -> None:
    """Index expressions (`2*j + 1`) stand only where a SwiGLU reads its weight's gate
    and up rows; anywhere else a position is an index variable or a group reference."""
    allowed = (s.rhs, s.up.rhs) if s.up is not None else ()
    refs = [s.out, s.lhs, s.rhs, *s.factors, *((s.bias,) if s.bias is not None else ())]
    if s.up is not None:
        refs += [s.up.lhs, s.up.rhs]
    for ref in refs:
        for idx in ref.indices:
            if isinstance(idx, ast.IndexExpr) and not any(ref is r for r in allowed):
                where = (
                    "the second factor of a SwiGLU's two products"
                    if s.up is not None
                    else "the weight of a SwiGLU statement"
                )
                raise ctx.error(
                    f"index expression '{_short(idx)}' in {ref.tensor.text}[...]: only {where} takes "
                    "one (its interleaved gate/up rows); a position is an index variable or a "
                    "group reference",
                    idx.pos,
                    "a SwiGLU is written `h[t, j] = silu(sum[k] x[t, k] * w[e, 2*j, k]) * "
                    "sum[k] x[t, k] * w[e, 2*j + 1, k]`",
                )


def check_swiglu_form(ctx: Context, s: ast.Statement) -> tuple[ast.Statement, SwigluPair]:
    """`silu(GATE) * UP` must be one GEMM whose weight rows come in gate/up pairs: the
    two products equal but for one position of the second factor, `2*j` in the gate and
    `2*j + 1` in the up product. Returns the statement as that GEMM (the gate's product,
    `j` at the paired position) and where the pair is."""
    up = s.up
    assert up is not None
    form = (
        "write `silu(sum[k] A[...] * W[..., 2*j, ...]) * sum[k] A[...] * W[..., 2*j + 1, ...]` "
        "with one A and one W (interleaved rows), `W[..., j, ...]` and `W[..., F + j, ...]` "
        "(stacked halves) or `WG[..., j, ...]` and `WU[..., j, ...]` (two weights)"
    )
    if s.accumulate:
        raise ctx.error(
            "a SwiGLU statement stores its result: `+=` cannot be fused with the activation",
            s.assign_pos or up.silu,
            "use `=` into a tensor of its own, and add it where it is read",
        )
    if s.bias is not None:
        raise ctx.error(
            f"the bias '{s.bias.tensor.text}' cannot be fused with SwiGLU: the epilogue adds "
            "no term before or after the activation",
            s.bias.tensor.pos,
            "add it in a separate pass; a per-leaf scalar or per-row weight factor can be fused",
        )
    if [str(x) for x in up.sums] != [str(x) for x in s.sums]:
        raise ctx.error(
            f"the up product sums over [{', '.join(map(str, up.sums))}] but the gate over "
            f"[{', '.join(map(str, s.sums))}]; both products of a SwiGLU contract the same index",
            up.sums[0].var.pos,
            form,
        )
    if str(up.lhs) != str(s.lhs):
        raise ctx.error(
            f"the up product's first factor is '{up.lhs}' but the gate's is '{s.lhs}'; both "
            "products of a SwiGLU read the same input",
            up.lhs.tensor.pos,
            form,
        )
    w, u = s.rhs, up.rhs
    if u.tensor.text != w.tensor.text:
        return s, _separate_pair(ctx, s, form)
    if len(u.indices) != len(w.indices):
        raise ctx.error(
            f"the up product indexes '{u.tensor.text}' with {len(u.indices)} positions and "
            f"the gate with {len(w.indices)}",
            u.tensor.pos,
        )
    differ = [
        i for i, (a, b) in enumerate(zip(w.indices, u.indices))
        if str(a) != str(b) or isinstance(a, ast.IndexExpr)
    ]
    if not differ:
        raise ctx.error(
            f"the gate and the up product read the same rows of '{w.tensor.text}'; a SwiGLU "
            "reads its gate from rows 2*j and its up projection from rows 2*j + 1",
            u.tensor.pos,
            form,
        )
    if len(differ) > 1:
        # Point at a difference other than the gate/up rows (the first index expression).
        paired = next((i for i in differ if isinstance(w.indices[i], ast.IndexExpr)), differ[0])
        other = next(i for i in differ if i != paired)
        raise ctx.error(
            f"the gate and the up product differ at {len(differ)} positions of "
            f"'{w.tensor.text}' ({_short(w.indices[other])} and {_short(u.indices[other])} here); only the "
            "gate/up rows may differ",
            u.indices[other].pos,
            form,
        )
    axis = differ[0]
    g_idx, u_idx = w.indices[axis], u.indices[axis]
    gate, upp = _index_poly(g_idx), _index_poly(u_idx)
    if isinstance(u_idx, ast.Index) and u_idx.group is None and gate is not None and upp is not None:
        var_u = u_idx.var.text
        if gate != upp and var_u not in (gate + upp * -1).symbols and var_u in gate.symbols:
            raise ctx.error(
                f"the gate (inside silu) reads rows {_short(g_idx)} of '{w.tensor.text}' and the up "
                f"product rows {_short(u_idx)}; of stacked halves the gate is the first",
                g_idx.pos,
                f"read the gate from rows {var_u} and the up projection from rows {_short(g_idx)}",
            )
    var = next(iter(gate.symbols)) if gate is not None and len(gate.symbols) == 1 else None
    if var is not None and upp is not None:
        j = Poly.sym(var)
        if gate == 2 * j and upp == 2 * j + 1:
            indices = list(w.indices)
            indices[axis] = ast.Index(ast.Name(var, g_idx.pos))
            view = replace(s, rhs=replace(w, indices=tuple(indices)))
            return view, SwigluPair(var, axis, g_idx, u_idx)
        if gate == 2 * j + 1 and upp == 2 * j:
            raise ctx.error(
                f"the gate (inside silu) reads rows {_short(g_idx)} of '{w.tensor.text}' and the up "
                f"product rows {_short(u_idx)}; the gate is the even row of each pair",
                g_idx.pos,
                f"interleave the weight with the gate first (row 2*{var} the gate, 2*{var} + 1 the up)",
            )
        if gate == j and upp is not None and var not in (upp + j * -1).symbols:
            # Stacked halves: the up rows start a fixed count past the gate's (checked
            # against the output's columns once the dims are bound).
            return s, SwigluPair(var, axis, g_idx, u_idx, STACKED, w.tensor.text, upp + j * -1)
    bad = g_idx if gate is None or var is None or gate != 2 * Poly.sym(var) else u_idx
    raise ctx.error(
        f"a SwiGLU reads its gate from rows 2*j and its up projection from rows 2*j + 1 of "
        f"'{w.tensor.text}' (j the output's column index); found {_short(g_idx)} and {_short(u_idx)}",
        bad.pos,
        form,
    )


def _separate_pair(ctx: Context, s: ast.Statement, form: str) -> SwigluPair:
    """Gate and up in two weights, `WG[..., j, ...]` and `WU[..., j, ...]`: indexed alike,
    row for row (both declared alike: check_swiglu_up). The paired position is the one
    the output's column index takes."""
    assert s.up is not None
    w, u = s.rhs, s.up.rhs
    if len(u.indices) != len(w.indices) or any(
        str(a) != str(b) or isinstance(a, ast.IndexExpr) for a, b in zip(w.indices, u.indices)
    ):
        bad = next(
            (b for a, b in zip(w.indices, u.indices) if str(a) != str(b) or isinstance(a, ast.IndexExpr)),
            None,
        )
        raise ctx.error(
            f"the gate reads '{w.tensor.text}[{', '.join(map(str, w.indices))}]' and the up product "
            f"'{u.tensor.text}[{', '.join(map(str, u.indices))}]': two gate and up weights are read "
            "row for row, with the same indices",
            bad.pos if bad is not None else u.tensor.pos,
            f"index both alike, e.g. `{w.tensor.text}[e, j, k]` and `{u.tensor.text}[e, j, k]`",
        )
    out_vars = {i.var.text for i in s.out.indices if i.group is None}
    in_vars = {i.var.text for i in s.lhs.indices if i.group is None}
    axes = [
        a for a, i in enumerate(w.indices)
        if isinstance(i, ast.Index) and i.group is None and i.via is None
        and i.var.text in out_vars and i.var.text not in in_vars
    ]
    if len(axes) != 1:
        raise ctx.error(
            f"a SwiGLU over two weights reads row j of '{w.tensor.text}' and of '{u.tensor.text}' "
            "for output column j: one index of the weights must be the output's column index",
            w.tensor.pos,
            form,
        )
    axis = axes[0]
    return SwigluPair(w.indices[axis].var.text, axis, w.indices[axis], u.indices[axis], SEPARATE, u.tensor.text)


def check_swiglu_up(ctx: Context, s: ast.Statement) -> None:
    """Two gate and up weights are declared alike (type, dims, layout, scale blocks and
    their layout): the kernel reads the up rows where it reads the gate's, in the second
    tensor, each with its own scales."""
    assert s.up is not None
    up = s.up.rhs.tensor
    if up.text not in ctx.tensors:
        raise ctx.error(f"unknown tensor '{up.text}'", up.pos, *did_you_mean(up, list(ctx.tensors), "tensors"))
    g, u = ctx.tensors[s.rhs.tensor.text], ctx.tensors[up.text]
    gs, us = g.scale, u.scale

    def scale_text(t) -> str:
        sc = t.scale
        if sc is None:
            return "no scale"
        return f"scale {sc.dtype} {sc.block_text} layout {sc.layout}" + (f" per {sc.anchor}" if sc.anchor else "")

    differs = [
        (what, a, b)
        for what, a, b in (
            ("type", g.dtype, u.dtype),
            ("dims", f"[{', '.join(g.dims)}]", f"[{', '.join(u.dims)}]"),
            ("layout", str(g.layout), str(u.layout) if replace(u.layout, text="") != replace(g.layout, text="") else str(g.layout)),
            ("scale", scale_text(g), scale_text(u)),
        )
        if a != b
    ]
    if not differs and (gs is None) == (us is None) and gs is not None and us is not None:
        if (replace(gs.layout, text=""), gs.pow2) != (replace(us.layout, text=""), us.pow2):
            differs.append(("scale", scale_text(g), scale_text(u)))
    if differs:
        what, a, b = differs[0]
        decl = ctx.tensor_ast[u.name]
        raise ctx.error(
            f"the up weight '{u.name}' has {what} {b} but the gate weight '{g.name}' {a}; a SwiGLU's "
            "two weights are declared alike (the kernel reads the up rows where it reads the gate's, "
            "each with its own scales)",
            decl.name.pos,
            f"declare '{u.name}' as '{g.name}' is ({what} {a})",
        )


def check_swiglu_halves(ctx: Context, s: ast.Statement, pair: SwigluPair, gemm) -> None:
    """Gate and up rows not interleaved: the weights are passed in (no pass derives them),
    and FP8 scales come in 128-row blocks along the paired dim with the output's columns
    whole blocks: a tile holds 128 gate rows, then the same 128 up rows, each half one
    scale block of its weight per K block."""
    for name in dict.fromkeys((gemm.b.tensor, gemm.swiglu_up)):
        t = ctx.tensors[name]
        if t.derived is not None:
            raise ctx.error(
                f"'{name}' is derived by {t.derived.op}(...); a SwiGLU over gate and up weights "
                "that are not interleaved reads weights passed in",
                ctx.tensor_ast[name].name.pos,
                f"pass '{name}' in as it is stored",
            )
    b_t = ctx.tensors[gemm.b.tensor]
    if b_t.scale is None or ctx.per_channel(gemm):
        return
    block = b_t.scale.block[pair.axis]
    cols = gemm.n.dim
    f = ctx.dims[cols].size
    assert f is not None
    if block != KERNEL_K_BLOCK or f % KERNEL_K_BLOCK:
        raise ctx.error(
            f"'{b_t.name}' has scale blocks of {block} rows along {b_t.dims[pair.axis]} and the output "
            f"{cols} = {f} columns; a SwiGLU over gate and up halves runs tiles of "
            f"{KERNEL_K_BLOCK} gate rows and the same {KERNEL_K_BLOCK} up rows, each one scale block",
            ctx.tensor_ast[b_t.name].scale.block[pair.axis].pos,
            f"use blocks of {KERNEL_K_BLOCK} rows along {b_t.dims[pair.axis]}, and a multiple of "
            f"{KERNEL_K_BLOCK} for {cols}",
        )


def _index_poly(idx: ast.Index | ast.IndexExpr) -> Poly | None:
    """A position as a polynomial in the names it uses; None for a group reference or
    an expression too large to be any of the forms a SwiGLU takes (folding stops there:
    a product of sums multiplies term counts)."""
    if isinstance(idx, ast.Index):
        return None if idx.group is not None else Poly.sym(idx.var.text)

    def fold(e: ast.Expr) -> Poly | None:
        if isinstance(e, ast.IntLit):
            return Poly.const(e.value)
        if isinstance(e, ast.NameRef):
            return Poly.sym(e.name.text)
        acc: Poly | None = None
        for x in e.terms if isinstance(e, ast.Sum) else e.factors:
            p = fold(x)
            if p is None:
                return None
            acc = p if acc is None else acc + p if isinstance(e, ast.Sum) else acc * p
            if len(acc.terms) > MAX_POLY_TERMS or any(len(m) > MAX_POLY_DEGREE for m, _ in acc.terms):
                return None
        return acc

    return fold(idx.expr)


def check_swiglu_dims(ctx: Context, s: ast.Statement, pair: SwigluPair, binding: Binding) -> str:
    """The output's column dim holds the weight's gate/up pairs, both fixed: interleaved,
    the weight's dim twice the output's; stacked, twice too, the up half starting at the
    output's column count; two weights, the output's (bound as one index). Returns the
    dim the GEMM's columns are counted in: the weight's interleaved rows, else the
    output's columns (the kernel runs over twice as many: gate, then up)."""
    w = ctx.tensors[s.rhs.tensor.text]
    rows = w.dims[pair.axis]
    if pair.var not in binding:
        raise ctx.error(
            f"'{pair.var}' in {_short(pair.gate)} does not index the output; it must be the output's "
            "column index",
            pair.gate.pos,
            f"index the output by '{pair.var}', e.g. h[t, {pair.var}]",
        )
    cols = binding[pair.var][0]
    for d in (rows, cols):
        if ctx.dims[d].size is None:
            raise ctx.error(
                f"a SwiGLU's column dims are fixed at compile time, but {d} is known only at "
                "run time",
                pair.gate.pos,
                f"give {d} a size in its declaration",
            )
    n, f = ctx.dims[rows].size, ctx.dims[cols].size
    assert n is not None and f is not None
    at = ctx.dim_pos[rows]
    if pair.form == SEPARATE:
        return cols  # j indexes the weights' dim and the output's alike (one binding)
    if n % 2:
        what = "interleaved rows come in pairs" if pair.form == INTERLEAVED else "stacked halves are equal"
        raise ctx.error(
            f"'{w.name}' has {rows} = {n} gate/up rows (declared at {at.line}:{at.column}), an "
            f"odd number: {what}",
            pair.gate.pos,
            f"give {rows} an even size, twice the output's {cols}",
        )
    if n != 2 * f:
        fat = ctx.dim_pos[cols]
        what = f"{n // 2} pairs" if pair.form == INTERLEAVED else f"two halves of {n // 2}"
        raise ctx.error(
            f"'{w.name}' has {rows} = {n} gate/up rows, {what}, but the output's "
            f"column dim is {cols} = {f} (declared at {fat.line}:{fat.column})",
            pair.gate.pos,
            f"declare {cols} = {n // 2}" if cols != rows else f"give the output a column dim of its own, of size {n // 2}",
        )
    if pair.form == INTERLEAVED:
        return rows
    assert pair.up_offset is not None
    offset = _offset_value(ctx, pair.up_offset)
    if offset != f:
        shown = "" if pair.up_offset.is_const or offset is None else f" = {offset}"
        raise ctx.error(
            f"the up product reads rows {_short(pair.up)} of '{w.name}': {pair.up_offset}{shown} rows "
            f"past the gate's, but stacked halves put the up half {cols} = {f} rows (the output's "
            "columns) after the gate's",
            pair.up.pos,
            f"read the up projection from rows {cols} + {pair.var}",
        )
    return cols


def _offset_value(ctx: Context, p: Poly) -> int | None:
    """The number of rows a stacked up half starts at: a constant, or a fixed dim's size;
    None for anything else."""
    if p.is_const:
        return p.value
    if len(p.terms) == 1 and p.symbols <= set(ctx.dims):
        (name,) = p.symbols
        if p == Poly.sym(name):
            return ctx.dims[name].size
    return None


def check_swiglu_columns(ctx: Context, s: ast.Statement, pair: SwigluPair, rows: str, cols: str, groups: list[str]) -> None:
    """The paired index is the GEMM's column index, not split by any group."""
    for name in groups:
        g = ctx.groups[name]
        if g.dim in (rows, cols):
            raise ctx.error(
                f"group '{name}' splits {g.dim}, the columns of a SwiGLU; a SwiGLU's columns "
                "are not split into segments",
                pair.gate.pos,
                "split the rows (tokens) instead, or write one statement per segment",
            )


def _short(x: object) -> str:
    """A written index for a message, shortened when it is long."""
    text = str(x)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"
