"""Syntax tree to checked spec: resolve every name, classify every statement.

Each problem raises a `SpecError` that points at the token responsible and, where
the fix is not obvious, says what would make the spec valid (for instance which
requantization or transpose pass to declare).

Besides the language's rules it enforces the limits of `spec.py` (sizes the
kernels' integer types can hold, nesting and name lengths), so that everything it
accepts lowers and emits code that compiles. Every loop here is linear in the
spec, or bounded by one of those limits.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .. import ast
from ..aliasing import ENUMERATE_LIMIT, UNDECIDED, element_collision
from ..errors import SpecError, locate, source_lines
from ..expr import Poly
from ..spec import (
    EPILOGUE_KINDS,
    EPILOGUE_TYPES,
    FP8_OUT_BLOCK,
    FP8_TYPES,
    INDEX_TYPE,
    KERNEL_K_BLOCK,
    SWIGLU_OUTPUT_TYPES,
    Access,
    AxisUse,
    Directives,
    EpilogueOperand,
    Gemm,
    Group,
    Layout,
    LeafAxis,
    Spec,
)
from ..tiling import MAX_BIAS_WIDTH
from .context import SWIGLU_GRAD_OP, Context
from .copies import check_copies
from .derivations import check_derivation
from .emittable import check_derived_emittable
from .fp8_output import check_pow2_scales
from .gather import check_gather_positions, index_tensor
from .groups import check_group_ref, check_sum_restriction, declare_group, role_dim
from .names import MAX_POLY_DEGREE, MAX_POLY_TERMS, check_identifier, declare_dim
from .operands import check_types
from .row_passes import check_row_pass_targets
from .swiglu_grad import check_no_cycle
from .tensors import declare_tensor


@dataclass(frozen=True)
class SwigluPair:
    """Where a SwiGLU's weight pairs its rows: index `var` at position `axis` of the
    second factor, written `gate` (2*var) and `up` (2*var + 1)."""

    var: str
    axis: int
    gate: ast.IndexExpr
    up: ast.IndexExpr

# Derivations whose pre-pass writes the target's scales.
SCALING_OPS = frozenset({"requantize", "quantize"})

GATHER_MODES = ("auto", "fused", "prepass")  # the gather(...) directive's choices


class _Checker(Context):
    def check_spec(self) -> Spec:
        check_identifier(self, self.ast.name, "spec")
        for d in self.ast.dims:
            declare_dim(self, d.name, d.size)
        for g in self.ast.groups:
            declare_group(self, g)
        for t in self.ast.tensors:
            declare_tensor(self, t)
        for t in self.ast.tensors:
            check_derivation(self, t)
        if not self.ast.statements:
            raise self.error(
                f"spec '{self.ast.name}' has no GEMM statement", self.ast.name.pos,
                "add one, e.g. y[t, n] = sum[k] x[t, k] * w[n, k]",
            )
        gemms = tuple(self.check_statement(i, s) for i, s in enumerate(self.ast.statements))
        gemms = check_copies(self, gemms)
        check_row_pass_targets(self, gemms)
        check_no_cycle(self, gemms)
        self.check_written_once(gemms)
        check_pow2_scales(self, gemms)
        self.check_outputs_do_not_alias(gemms)
        check_derived_emittable(self, gemms)
        directives = self.check_directives(gemms)
        return Spec(
            name=self.ast.name.text,
            path=self.file.path,
            line=self.ast.name.pos.line,
            dims=tuple(self.dims.values()),
            groups=tuple(self.groups[n] for n in self.group_order),
            tensors=tuple(self.tensors.values()),
            gemms=gemms,
            directives=directives,
            where=self.where(self.ast.name.pos),
        )

    def check_statement(self, index: int, s: ast.Statement) -> Gemm:
        text = str(s)
        self.check_index_exprs(s)
        # SwiGLU: checked as one GEMM over the weight's interleaved rows, its second factor
        # indexed by the output's column index `j` where the gate wrote `2*j`.
        pair: SwigluPair | None = None
        if s.up is not None:
            s, pair = self.check_swiglu_form(s)
        # The GEMM's three references, then the epilogue operands (bound and checked alike).
        refs = (s.out, s.lhs, s.rhs, *s.factors, *((s.bias,) if s.bias is not None else ()))
        binding: dict[str, tuple[str, ast.Pos]] = {}  # index var -> (dim, where bound)

        def bind(var: ast.Name, dim: str, where: str) -> None:
            if var.text in self.dims or var.text in self.groups or var.text in self.tensors:
                raise self.error(
                    f"index '{var.text}' has the name of a declared "
                    f"{self.names[var.text][0]}; index variables need names of their own, "
                    f"e.g. '{var.text.lower() if not var.text.islower() else var.text + '_i'}'",
                    var.pos,
                )
            check_identifier(self, var, "index")
            if var.text in binding and binding[var.text][0] != dim:
                other_dim, other = binding[var.text]
                raise self.error(
                    f"index '{var.text}' ranges over {dim} in {where} but over {other_dim} at "
                    f"{other.line}:{other.column}",
                    var.pos,
                )
            binding.setdefault(var.text, (dim, var.pos))

        check_gather_positions(self, s, refs)
        # Pass 1: tensors, ranks, plain index bindings.
        for ref in refs:
            if ref.tensor.text not in self.tensors:
                raise self.error(
                    f"unknown tensor '{ref.tensor.text}'", ref.tensor.pos,
                    f"declared tensors: {', '.join(self.tensors) or 'none'}",
                )
            t = self.tensors[ref.tensor.text]
            if t.dtype == INDEX_TYPE:
                raise self.error(
                    f"'{t.name}' is {INDEX_TYPE}, an index tensor: it picks rows of another "
                    "tensor, it is not an operand or an output",
                    ref.tensor.pos,
                    f"read rows through it, e.g. x[{t.name}[t], k], or write them, "
                    f"y[{t.name}[t], n] = ...",
                )
            if len(ref.indices) != t.rank:
                raise self.error(
                    f"'{t.name}' has {t.rank} dims [{', '.join(t.dims)}] but is indexed with "
                    f"{len(ref.indices)}",
                    ref.tensor.pos,
                )
            used: set[str] = set()
            for axis, (idx, dim) in enumerate(zip(ref.indices, t.dims)):
                if idx.var.text in used and idx.group is None:
                    raise self.error(
                        f"index '{idx.var.text}' is used twice in {t.name}[...]; a diagonal is "
                        "not a GEMM",
                        idx.var.pos,
                    )
                if idx.group is None:
                    used.add(idx.var.text)
                    if pair is not None and ref is s.rhs and axis == pair.axis:
                        continue  # 2*j and 2*j + 1 range over the weight's rows, j over the output's
                    if idx.via is not None:
                        # `idx[t]`: t ranges over the index tensor's dim, the position over t's own.
                        bind(idx.var, index_tensor(self, idx).dims[0], f"{idx.via.text}[...]")
                        continue
                    bind(idx.var, dim, f"{t.name}[...]")
        for sm in s.sums:
            if sm.var.text not in binding:
                raise self.error(
                    f"summed index '{sm.var.text}' indexes neither factor", sm.var.pos
                )
        pair_dim = self.check_swiglu_dims(s, pair, binding) if pair is not None else None
        # Pass 2: group references g(v).
        group_refs: list[tuple[str, ast.Index, str]] = []  # (tensor, index, dim at position)
        for ref in refs:
            t = self.tensors[ref.tensor.text]
            for idx, dim in zip(ref.indices, t.dims):
                if idx.group is not None:
                    check_group_ref(self, idx, dim, t, binding)
                    group_refs.append((t.name, idx, dim))
        # Pass 3: classify indices.
        out_t = self.tensors[s.out.tensor.text]
        if out_t.derived is not None:
            raise self.error(
                f"'{out_t.name}' is derived by {out_t.derived.op}({out_t.derived.source}) and "
                "cannot be written by a statement",
                s.out.tensor.pos,
            )
        if out_t.copy_of is not None:
            raise self.error(
                f"'{out_t.name}' = copy({out_t.copy_of}) is written by the statement that writes "
                f"'{out_t.copy_of}', in its epilogue, and cannot be written by another",
                s.out.tensor.pos,
            )

        def plain(ref: ast.Ref) -> list[str]:
            return [i.var.text for i in ref.indices if i.group is None]

        out_v, lhs_v, rhs_v = plain(s.out), plain(s.lhs), plain(s.rhs)
        if len(s.sums) != 1:
            raise self.error(
                f"gemmspec contracts exactly one index per statement, not {len(s.sums)}",
                s.sums[1].var.pos if len(s.sums) > 1 else s.pos,
            )
        sm = s.sums[0]
        k_var = sm.var.text
        if k_var in out_v:
            raise self.error(
                f"index '{k_var}' is summed but also indexes the output; a summed index "
                "must disappear from the output",
                sm.var.pos,
            )
        for side, vs, ref in (("first", lhs_v, s.lhs), ("second", rhs_v, s.rhs)):
            if k_var not in vs:
                raise self.error(
                    f"summed index '{k_var}' does not index the {side} factor "
                    f"'{ref.tensor.text}'; not a GEMM",
                    ref.tensor.pos,
                )
        k_group_axis: tuple[str, str] | None = None  # (group, output var)
        if sm.group is not None:
            k_group_axis = check_sum_restriction(self, sm, binding, out_v)
        m_vars = [v for v in out_v if v in lhs_v and v not in rhs_v]
        n_vars = [v for v in out_v if v in rhs_v and v not in lhs_v]
        batch_vars = [v for v in out_v if v in lhs_v and v in rhs_v]
        for v in out_v:
            if v in m_vars or v in n_vars or v in batch_vars:
                continue
            if k_group_axis and v == k_group_axis[1]:
                continue
            pos = next(i.var.pos for i in s.out.indices if i.var.text == v)
            raise self.error(
                f"output index '{v}' indexes neither factor; not a GEMM", pos
            )
        for ref, vs in ((s.lhs, lhs_v), (s.rhs, rhs_v)):
            for v in vs:
                if v != k_var and v not in out_v:
                    pos = next(i.var.pos for i in ref.indices if i.var.text == v)
                    raise self.error(
                        f"index '{v}' of '{ref.tensor.text}' is neither summed nor in the "
                        f"output; not a GEMM (sum over it, or index the output with it)",
                        pos,
                    )
        if len(m_vars) != 1 or len(n_vars) != 1:
            what = "row" if len(m_vars) != 1 else "column"
            found = m_vars if len(m_vars) != 1 else n_vars
            raise self.error(
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
            d = self.dims[dims_of[v]]
            masked = self.masked_by_count_dim.get(d.name)
            if masked is not None:
                used_groups.append(masked)
                batch_use[v] = masked
                continue
            if d.size is None:
                pos = next(i.var.pos for i in s.out.indices if i.var.text == v)
                raise self.error(
                    f"batch index '{v}' ranges over '{d.name}', which is known only at run "
                    "time; batch dims must be fixed (use a ragged group for run-time sizes)",
                    pos,
                )
            batch_axes.append(LeafAxis(v, d.size, None))
            batch_use[v] = v
        closure: set[str] = set()
        for name in used_groups:
            g: Group | None = self.groups[name]
            while g is not None and g.name not in closure:  # at most MAX_WITHIN_DEPTH steps
                closure.add(g.name)
                g = self.groups[g.within] if g.within else None
        ordered = sorted(closure, key=self.group_rank.__getitem__)
        leaf_axes = tuple(batch_axes) + tuple(
            LeafAxis(n, self.groups[n].count, n) for n in ordered
        )

        if pair is not None:
            self.check_swiglu_columns(s, pair, pair_dim, dims_of[n_var], ordered)
        roles = {
            "m": role_dim(self, "m", m_var, dims_of[m_var], ordered, s),
            # A SwiGLU's GEMM runs over the weight's gate/up rows, twice the output's columns.
            "n": role_dim(self, "n", n_var, pair_dim or dims_of[n_var], ordered, s),
            "k": role_dim(self, "k", k_var, dims_of[k_var], ordered, s),
        }
        role_of = {m_var: "m", n_var: "n", k_var: "k"}
        for n in ordered:
            g = self.groups[n]
            if g.kind == "masked":
                continue
            if all(r.dim != g.dim for r in roles.values()):
                raise self.error(
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
            where=self.where(s.pos),
            swiglu=pair is not None,
        )
        check_types(self, gemm, s)
        if pair is not None:
            assert n_var == pair.var  # j indexes the output and the weight, not the input
            if out_t.dtype not in SWIGLU_OUTPUT_TYPES:
                raise self.error(
                    f"output '{out_t.name}' of a SwiGLU is {out_t.dtype}; a SwiGLU stores "
                    f"{' or '.join(SWIGLU_OUTPUT_TYPES)}",
                    s.out.tensor.pos,
                    f"declare '{out_t.name}' as bf16 (or f32)",
                )
        epilogue = self.check_epilogue(s, k_var, role_of, batch_use, k_group_axis, access)
        if epilogue and self.per_channel(gemm):
            first = (s.factors + ((s.bias,) if s.bias is not None else ()))[0]
            raise self.error(
                f"epilogue operand '{first.tensor.text}' beside per-channel scales is not "
                "supported yet: those kernels already scale the finished sum by SA(row) * "
                "SB(column), and both together exceed the registers",
                first.tensor.pos,
                "apply the epilogue in a separate pass, or use 128-wide scale blocks along K",
            )
        if pair is not None and self.per_channel(gemm):
            raise self.error(
                "a SwiGLU beside per-channel scales is not supported yet: their two epilogues "
                "have not been built into one kernel",
                pair.gate.pos,
                "use 128-wide scale blocks along K, or apply the SwiGLU in a separate pass",
            )
        return replace(gemm, epilogue=epilogue) if epilogue else gemm

    def check_index_exprs(self, s: ast.Statement) -> None:
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
                    raise self.error(
                        f"index expression '{_short(idx)}' in {ref.tensor.text}[...]: only {where} takes "
                        "one (its interleaved gate/up rows); a position is an index variable or a "
                        "group reference",
                        idx.pos,
                        "a SwiGLU is written `h[t, j] = silu(sum[k] x[t, k] * w[e, 2*j, k]) * "
                        "sum[k] x[t, k] * w[e, 2*j + 1, k]`",
                    )

    def check_swiglu_form(self, s: ast.Statement) -> tuple[ast.Statement, SwigluPair]:
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
            raise self.error(
                "a SwiGLU statement stores its result: `+=` cannot be fused with the activation",
                s.assign_pos or up.silu,
                "use `=` into a tensor of its own, and add it where it is read",
            )
        if s.bias is not None:
            raise self.error(
                f"the bias '{s.bias.tensor.text}' cannot be fused with SwiGLU: the epilogue adds "
                "no term before or after the activation",
                s.bias.tensor.pos,
                "add it in a separate pass; a per-leaf scalar or per-row weight factor can be fused",
            )
        if [str(x) for x in up.sums] != [str(x) for x in s.sums]:
            raise self.error(
                f"the up product sums over [{', '.join(map(str, up.sums))}] but the gate over "
                f"[{', '.join(map(str, s.sums))}]; both products of a SwiGLU contract the same index",
                up.sums[0].var.pos,
                form,
            )
        if str(up.lhs) != str(s.lhs):
            raise self.error(
                f"the up product's first factor is '{up.lhs}' but the gate's is '{s.lhs}'; both "
                "products of a SwiGLU read the same input",
                up.lhs.tensor.pos,
                form,
            )
        w, u = s.rhs, up.rhs
        if u.tensor.text != w.tensor.text:
            raise self.error(
                f"the gate reads weight '{w.tensor.text}' and the up product '{u.tensor.text}': "
                "separate gate and up weights are not fused",
                u.tensor.pos,
                "stacked gate/up halves are not fused yet; interleave the weight rows into one "
                "tensor (row 2*j the gate, row 2*j + 1 the up)",
            )
        if len(u.indices) != len(w.indices):
            raise self.error(
                f"the up product indexes '{u.tensor.text}' with {len(u.indices)} positions and "
                f"the gate with {len(w.indices)}",
                u.tensor.pos,
            )
        differ = [
            i for i, (a, b) in enumerate(zip(w.indices, u.indices))
            if str(a) != str(b) or isinstance(a, ast.IndexExpr)
        ]
        if not differ:
            raise self.error(
                f"the gate and the up product read the same rows of '{w.tensor.text}'; a SwiGLU "
                "reads its gate from rows 2*j and its up projection from rows 2*j + 1",
                u.tensor.pos,
                form,
            )
        if len(differ) > 1:
            # Point at a difference other than the gate/up rows (the first index expression).
            paired = next((i for i in differ if isinstance(w.indices[i], ast.IndexExpr)), differ[0])
            other = next(i for i in differ if i != paired)
            raise self.error(
                f"the gate and the up product differ at {len(differ)} positions of "
                f"'{w.tensor.text}' ({_short(w.indices[other])} and {_short(u.indices[other])} here); only the "
                "gate/up rows may differ",
                u.indices[other].pos,
                form,
            )
        axis = differ[0]
        g_idx, u_idx = w.indices[axis], u.indices[axis]
        gate, upp = self._index_poly(g_idx), self._index_poly(u_idx)
        var = next(iter(gate.symbols)) if gate is not None and len(gate.symbols) == 1 else None
        if var is not None and upp is not None:
            j = Poly.sym(var)
            if gate == 2 * j and upp == 2 * j + 1:
                indices = list(w.indices)
                indices[axis] = ast.Index(ast.Name(var, g_idx.pos))
                view = replace(s, rhs=replace(w, indices=tuple(indices)))
                return view, SwigluPair(var, axis, g_idx, u_idx)
            if gate == 2 * j + 1 and upp == 2 * j:
                raise self.error(
                    f"the gate (inside silu) reads rows {_short(g_idx)} of '{w.tensor.text}' and the up "
                    f"product rows {_short(u_idx)}; the gate is the even row of each pair",
                    g_idx.pos,
                    f"interleave the weight with the gate first (row 2*{var} the gate, 2*{var} + 1 the up)",
                )
            if gate == j and upp != j and var not in (upp + j * -1).symbols:
                raise self.error(
                    f"the gate reads rows {_short(g_idx)} of '{w.tensor.text}' and the up product rows "
                    f"{_short(u_idx)}: gate and up as two halves of one weight",
                    u_idx.pos,
                    "stacked gate/up halves are not fused yet; interleave the weight rows "
                    f"(row 2*{var} the gate, row 2*{var} + 1 the up)",
                )
        bad = g_idx if gate is None or var is None or gate != 2 * Poly.sym(var) else u_idx
        raise self.error(
            f"a SwiGLU reads its gate from rows 2*j and its up projection from rows 2*j + 1 of "
            f"'{w.tensor.text}' (j the output's column index); found {_short(g_idx)} and {_short(u_idx)}",
            bad.pos,
            form,
        )

    @staticmethod
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

    def check_swiglu_dims(self, s: ast.Statement, pair: SwigluPair, binding) -> str:
        """The output's column dim holds the pairs of the weight's gate/up dim: both fixed,
        the weight's even and twice the output's. Returns the weight's dim."""
        w = self.tensors[s.rhs.tensor.text]
        rows = w.dims[pair.axis]
        if pair.var not in binding:
            raise self.error(
                f"'{pair.var}' in {_short(pair.gate)} does not index the output; it must be the output's "
                "column index",
                pair.gate.pos,
                f"index the output by '{pair.var}', e.g. h[t, {pair.var}]",
            )
        cols = binding[pair.var][0]
        for d in (rows, cols):
            if self.dims[d].size is None:
                raise self.error(
                    f"a SwiGLU's column dims are fixed at compile time, but {d} is known only at "
                    "run time",
                    pair.gate.pos,
                    f"give {d} a size in its declaration",
                )
        n, f = self.dims[rows].size, self.dims[cols].size
        assert n is not None and f is not None
        at = self.dim_pos[rows]
        if n % 2:
            raise self.error(
                f"'{w.name}' has {rows} = {n} gate/up rows (declared at {at.line}:{at.column}), an "
                "odd number: interleaved rows come in pairs",
                pair.gate.pos,
                f"give {rows} an even size, twice the output's {cols}",
            )
        if n != 2 * f:
            fat = self.dim_pos[cols]
            raise self.error(
                f"'{w.name}' has {rows} = {n} gate/up rows, {n // 2} pairs, but the output's "
                f"column dim is {cols} = {f} (declared at {fat.line}:{fat.column})",
                pair.gate.pos,
                f"declare {cols} = {n // 2}" if cols != rows else f"give the output a column dim of its own, of size {n // 2}",
            )
        return rows

    def check_swiglu_columns(self, s: ast.Statement, pair: SwigluPair, rows: str, cols: str, groups: list[str]) -> None:
        """The paired index is the GEMM's column index, not split by any group."""
        for name in groups:
            g = self.groups[name]
            if g.dim in (rows, cols):
                raise self.error(
                    f"group '{name}' splits {g.dim}, the columns of a SwiGLU; a SwiGLU's columns "
                    "are not split into segments",
                    pair.gate.pos,
                    "split the rows (tokens) instead, or write one statement per segment",
                )

    def check_epilogue(self, s: ast.Statement, k_var: str, role_of, batch_use, k_group_axis, access) -> tuple[EpilogueOperand, ...]:
        """Classify each epilogue operand by the indices it takes: leaf axes only (a
        per-leaf scalar), the row index (a per-row weight) or, for the added term, the
        column index (a per-column bias). Everything else cannot be applied to a finished
        accumulator tile and is refused here."""
        found: dict[str, tuple[EpilogueOperand, ast.Ref]] = {}
        terms = [(f, False) for f in s.factors] + ([(s.bias, True)] if s.bias is not None else [])
        m_var = next(v for v, r in role_of.items() if r == "m")
        n_var = next(v for v, r in role_of.items() if r == "n")
        for ref, added in terms:
            t = self.tensors[ref.tensor.text]
            what = "added term" if added else "factor"
            for idx in ref.indices:
                v = idx.var.text
                if v == k_var:
                    via = f"{idx.group}({v})" if idx.group else f"'{v}'"
                    raise self.error(
                        f"epilogue {what} '{t.name}' is indexed by {via}, the contracted index: "
                        "an epilogue applies to the finished sum, which no longer has a "
                        f"'{v}'",
                        idx.pos,
                        f"scale the factor that '{v}' indexes instead (a separate pass), or "
                        f"index '{t.name}' by the output's indices only",
                    )
                if idx.group is None and v not in role_of and v not in batch_use and not (
                    k_group_axis and v == k_group_axis[1]
                ):
                    raise self.error(
                        f"index '{v}' of epilogue {what} '{t.name}' indexes neither the output "
                        "nor a factor of the product",
                        idx.var.pos,
                        f"index '{t.name}' by the output's indices ({', '.join(str(i) for i in s.out.indices)})"
                        " or by group references such as expert(t)",
                    )
            acc = access(ref)
            has_m = acc.axis_of_role("m") is not None
            has_n = acc.axis_of_role("n") is not None
            if added:
                if has_m or not has_n:
                    shape = "per element" if has_m and has_n else "per row" if has_m else "per leaf"
                    raise self.error(
                        f"the added term '{t.name}' is {shape}; the epilogue adds a per-column "
                        f"bias only, indexed by the column index '{n_var}' (and leaf axes)",
                        ref.tensor.pos,
                        f"declare it over the columns, e.g. {t.name}[{n_var}] or "
                        f"{t.name}[expert({m_var}), {n_var}]; a per-row or per-element term "
                        "needs its own statement or pass",
                    )
                kind = "bias"
            elif has_n:
                raise self.error(
                    f"factor '{t.name}' varies along the column index '{n_var}'; the epilogue "
                    "multiplies by a per-leaf scalar and a per-row weight only",
                    ref.tensor.pos,
                    f"fold a per-column scale into the second factor's rows, or add it as a "
                    f"bias (`+ {t.name}[...]`) if it is a term",
                )
            else:
                kind = "row" if has_m else "alpha"
            if kind in found:
                first = found[kind][1].tensor
                label = {"alpha": "per-leaf scalar", "row": "per-row weight", "bias": "bias"}[kind]
                raise self.error(
                    f"a second {label} ('{t.name}'; the first is '{first}' at "
                    f"{first.pos.line}:{first.pos.column}); the epilogue takes one of each kind",
                    ref.tensor.pos,
                    "multiply them into one tensor before the call",
                )
            if t.dtype not in EPILOGUE_TYPES:
                raise self.error(
                    f"epilogue {what} '{t.name}' is {t.dtype}; epilogue operands are "
                    f"{', '.join(EPILOGUE_TYPES)}",
                    ref.tensor.pos,
                    f"declare '{t.name}' as f32 (or bf16, f16)",
                )
            if t.layout.kind != "strided":
                raise self.error(
                    f"epilogue {what} '{t.name}' is stored {t.layout}; epilogue operands take "
                    "row_major, major(...) or strides(...) layouts",
                    ref.tensor.pos,
                    "declare it with a strided layout",
                )
            found[kind] = (EpilogueOperand(kind, acc, t.dtype), ref)
        return tuple(found[k][0] for k in EPILOGUE_KINDS if k in found)

    def check_written_once(self, gemms: tuple[Gemm, ...]) -> None:
        written: dict[str, int] = {}
        for g, s in zip(gemms, self.ast.statements):
            if g.out.tensor in written and not g.accumulate:
                raise self.error(
                    f"'{g.out.tensor}' is already written by the statement on line "
                    f"{written[g.out.tensor]}; use += to accumulate",
                    s.out.tensor.pos,
                )
            written.setdefault(g.out.tensor, g.line)
            for operand in g.reads:
                if operand == g.out.tensor:
                    raise self.error(
                        f"'{operand}' is both read and written by one statement", s.out.tensor.pos
                    )

    def check_outputs_do_not_alias(self, gemms: tuple[Gemm, ...]) -> None:
        """Two elements of a written tensor at one address would be a write race (and a
        wrong sum with +=). Decided exactly where it can be: a zero stride or two equal
        strides on dims of more than one element always alias; all-constant strides are
        checked in full."""
        written: dict[str, None] = {}
        for g in gemms:
            written.setdefault(g.out.tensor)
        read = {t for g in gemms for t in (g.a.tensor, g.b.tensor)}
        for t in self.tensors.values():
            if t.derived is not None and t.name in read:  # written by its pre-pass
                written.setdefault(t.name)
        for name in written:
            t, decl = self.tensors[name], self.tensor_ast[name]
            pos = decl.layout.pos if decl.layout else decl.name.pos
            self._check_injective(t.name, t.dims, t.layout, pos)
            if t.derived is not None and (t.derived.op in SCALING_OPS or t.derived.op == SWIGLU_GRAD_OP) and t.scale is not None:
                # A requantize or quantize pass writes the target's scales too.
                assert decl.scale is not None
                spos = decl.scale.layout.pos if decl.scale.layout else decl.scale.pos
                self._check_injective(f"{t.name}'s scale", t.dims, t.scale.layout, spos, t.scale.block)

    def _check_injective(
        self, owner: str, dims: tuple[str, ...], layout: Layout, pos: ast.Pos,
        block: tuple[int | str, ...] | None = None,
    ) -> None:
        if layout.kind != "strided":
            return  # segment_major stores every segment as its own dense block
        sizes: list[int | None] = []
        for i, name in enumerate(dims):
            size = self.dims[name].size
            if block is not None and isinstance(block[i], str):
                size = 1  # one block over the whole run-time dim
            elif size is not None and block is not None:
                size = -(-size // block[i])
            sizes.append(size)
        # Dims that can hold more than one element (a run-time dim may).
        wide = [i for i, n in enumerate(sizes) if n is None or n > 1]
        by_stride: dict[Poly, int] = {}
        for i in wide:
            stride = layout.strides[i]
            if not stride.terms:
                raise self.error(
                    f"'{owner}' is written, but its stride along {dims[i]} is 0: every "
                    f"element along {dims[i]} lands on one address (a write race)",
                    pos,
                    "give every dim of a written tensor its own non-zero stride",
                )
            if stride in by_stride:
                j = by_stride[stride]
                raise self.error(
                    f"'{owner}' is written, but {dims[j]} and {dims[i]} have the same stride "
                    f"{stride}: ({dims[j]}=1, {dims[i]}=0) and ({dims[j]}=0, {dims[i]}=1) land "
                    "on one address (a write race)",
                    pos,
                )
            by_stride[stride] = i
        if any(sizes[i] is None or not layout.strides[i].is_const for i in wide):
            return  # depends on run-time sizes: not decidable here
        clash = element_collision([(sizes[i], layout.strides[i].value) for i in wide])
        if clash is UNDECIDED:
            raise self.error(
                f"'{owner}' is written, and its strides interleave in a way that cannot be "
                f"checked for two elements at one address (more than {ENUMERATE_LIMIT} "
                "elements, three or more interleaved dims)",
                pos,
                "use strides where each one passes the farthest offset the smaller ones reach",
            )
        if clash is not None:
            first, second, offset = clash
            names = [dims[i] for i in wide]
            a = ", ".join(f"{n}={v}" for n, v in zip(names, first))
            b = ", ".join(f"{n}={v}" for n, v in zip(names, second))
            raise self.error(
                f"'{owner}' is written, but its layout puts two elements at one address: "
                f"({a}) and ({b}) are both at offset {offset} (a write race)",
                pos,
            )

    def check_directives(self, gemms: tuple[Gemm, ...]) -> Directives:
        force = None
        force_pos = None
        target = "sm_90a"
        tile = None
        gather_rows = "auto"
        scaled = any(t.scale is not None for t in self.ast.tensors)
        for d in self.ast.directives:
            if d.kind in ("flatten", "split"):
                if force is not None and force != d.kind:
                    raise self.error(
                        f"'{d.kind}' contradicts the earlier '{force}' directive", d.pos
                    )
                if force is None:
                    force_pos = d.pos
                force = d.kind
            elif d.kind == "target":
                if d.args[0] != "sm_90a":
                    raise self.error(
                        f"unsupported target '{d.args[0]}'; gemmspec emits code for sm_90a "
                        "(Hopper with wgmma)",
                        d.pos,
                    )
            elif d.kind == "tile":
                tm, tn = int(d.args[0]), int(d.args[1])
                if tm not in (64, 128) or tn % 8 or not 8 <= tn <= 256:
                    raise self.error(
                        f"tile({tm}, {tn}) is not a supported tile: the kernels take 64 or 128 "
                        "rows by a multiple of 8 columns from 8 to 256",
                        d.pos,
                    )
                fp8_out = [
                    (g, st) for g, st in zip(gemms, self.ast.statements)
                    if self.tensors[g.out.tensor].dtype in FP8_TYPES
                ]
                for g, st in fp8_out:
                    cols = tn // 2 if g.swiglu else tn
                    if cols % FP8_OUT_BLOCK:
                        what = f"{cols} output columns of a SwiGLU" if g.swiglu else f"{tn} columns"
                        raise self.error(
                            f"tile({tm}, {tn}) gives {what}, but the FP8 output "
                            f"'{g.out.tensor}' (line {st.pos.line}) is quantized per row and "
                            f"{FP8_OUT_BLOCK} columns: a tile covers whole blocks of it",
                            d.pos,
                            f"use tile({tm}, {2 * FP8_OUT_BLOCK if g.swiglu else FP8_OUT_BLOCK})",
                        )
                copying = next(((g, st) for g, st in zip(gemms, self.ast.statements) if g.copy), None)
                if copying is not None and tm != 128:
                    g, st = copying
                    raise self.error(
                        f"tile({tm}, {tn}) has {tm} rows, but the statement on line {st.pos.line} "
                        f"writes '{g.copy}' = copy({g.out.tensor}), whose [{KERNEL_K_BLOCK}, 1] scale "
                        f"blocks are one 128-row tile each",
                        d.pos,
                        f"use tile(128, {tn})",
                    )
                halves = bool(fp8_out) and all(g.swiglu for g, _ in fp8_out) and len(fp8_out) == len(gemms)
                if tn > 192 and scaled and not (halves and tn == 2 * FP8_OUT_BLOCK):
                    raise self.error(
                        f"tile({tm}, {tn}) is too wide for scaled FP8: those kernels keep two "
                        "accumulator tiles in registers, so at most 192 columns",
                        d.pos,
                    )
                bias = next((s.bias for s in self.ast.statements if s.bias is not None), None)
                if tn > MAX_BIAS_WIDTH and bias is not None:
                    raise self.error(
                        f"tile({tm}, {tn}) is too wide for a statement with a bias (+ "
                        f"{bias.tensor.text}[...] on line {bias.tensor.pos.line}): the bias loads "
                        f"and the accumulators fit the registers up to {MAX_BIAS_WIDTH} columns",
                        d.pos,
                        f"use tile({tm}, {MAX_BIAS_WIDTH}) or narrower",
                    )
                tile = (tm, tn)
            elif d.kind == "gather":
                mode = d.args[0]
                if mode not in GATHER_MODES:
                    raise self.error(
                        f"gather({mode}) is not a way to read gathered rows: use "
                        + ", ".join(f"gather({m})" for m in GATHER_MODES),
                        d.pos,
                    )
                if not any(g.gather for g in gemms):
                    raise self.error(
                        f"gather({mode}): no statement reads rows through an index tensor "
                        "(x[idx[t], k])",
                        d.pos,
                    )
                if gather_rows != "auto" and mode != gather_rows:
                    raise self.error(f"gather({mode}) contradicts the earlier gather({gather_rows})", d.pos)
                gather_rows = mode
        where = self.where(force_pos) if force_pos is not None else None
        return Directives(force, target, tile, gather_rows, force_where=where)


def _short(x: object) -> str:
    """A written index for a message, shortened when it is long."""
    text = str(x)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def check(file: ast.FileAst) -> tuple[Spec, ...]:
    """Check every spec of a parsed file; raise the first `SpecError` found."""
    lines = source_lines(file.text)
    seen: dict[str, ast.Pos] = {}
    specs = []
    for s in file.specs:
        if s.name.text in seen:
            first = seen[s.name.text]
            raise SpecError(
                f"spec '{s.name.text}' is defined twice (first at {first.line}:{first.column})",
                locate(file.path, lines, s.name.pos.line, s.name.pos.column),
            )
        seen[s.name.text] = s.name.pos
        specs.append(_Checker(file, s, lines).check_spec())
    if not specs:
        raise SpecError("no `gemm NAME { ... }` spec in this file", locate(file.path, lines, 1, 1))
    return tuple(specs)
