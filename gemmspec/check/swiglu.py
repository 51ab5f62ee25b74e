"""SwiGLU statements: `silu(GATE) * UP` checked as one GEMM over a weight's
interleaved gate/up rows."""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import ast
from ..expr import Poly
from .context import Binding, Context
from .names import MAX_POLY_DEGREE, MAX_POLY_TERMS


@dataclass(frozen=True)
class SwigluPair:
    """Where a SwiGLU's weight pairs its rows: index `var` at position `axis` of the
    second factor, written `gate` (2*var) and `up` (2*var + 1)."""

    var: str
    axis: int
    gate: ast.IndexExpr
    up: ast.IndexExpr


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
        "with one A and one W"
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
        raise ctx.error(
            f"the gate reads weight '{w.tensor.text}' and the up product '{u.tensor.text}': "
            "separate gate and up weights are not fused",
            u.tensor.pos,
            "stacked gate/up halves are not fused yet; interleave the weight rows into one "
            "tensor (row 2*j the gate, row 2*j + 1 the up)",
        )
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
        if gate == j and upp != j and var not in (upp + j * -1).symbols:
            raise ctx.error(
                f"the gate reads rows {_short(g_idx)} of '{w.tensor.text}' and the up product rows "
                f"{_short(u_idx)}: gate and up as two halves of one weight",
                u_idx.pos,
                "stacked gate/up halves are not fused yet; interleave the weight rows "
                f"(row 2*{var} the gate, row 2*{var} + 1 the up)",
            )
    bad = g_idx if gate is None or var is None or gate != 2 * Poly.sym(var) else u_idx
    raise ctx.error(
        f"a SwiGLU reads its gate from rows 2*j and its up projection from rows 2*j + 1 of "
        f"'{w.tensor.text}' (j the output's column index); found {_short(g_idx)} and {_short(u_idx)}",
        bad.pos,
        form,
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
    """The output's column dim holds the pairs of the weight's gate/up dim: both fixed,
    the weight's even and twice the output's. Returns the weight's dim."""
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
    if n % 2:
        raise ctx.error(
            f"'{w.name}' has {rows} = {n} gate/up rows (declared at {at.line}:{at.column}), an "
            "odd number: interleaved rows come in pairs",
            pair.gate.pos,
            f"give {rows} an even size, twice the output's {cols}",
        )
    if n != 2 * f:
        fat = ctx.dim_pos[cols]
        raise ctx.error(
            f"'{w.name}' has {rows} = {n} gate/up rows, {n // 2} pairs, but the output's "
            f"column dim is {cols} = {f} (declared at {fat.line}:{fat.column})",
            pair.gate.pos,
            f"declare {cols} = {n // 2}" if cols != rows else f"give the output a column dim of its own, of size {n // 2}",
        )
    return rows


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
