"""Syntax tree to checked spec: resolve every name, classify every statement.

Each problem raises a `SpecError` that points at the token responsible and, where
the fix is not obvious, says what would make the spec valid (for instance which
requantization or transpose pass to declare).
"""

from __future__ import annotations

from . import ast
from .errors import SourceLocation, SpecError
from .expr import ONE, Poly
from .spec import (
    FP8_TYPES,
    KERNEL_K_BLOCK,
    SIXTEEN_BIT_TYPES,
    Access,
    AxisUse,
    Derivation,
    Dim,
    Directives,
    Gemm,
    Group,
    Layout,
    LeafAxis,
    RoleDim,
    Scale,
    Spec,
    Tensor,
)

# Names a spec may not use: they reach emitted C++ as parameter and symbol names.
CXX_RESERVED = frozenset(
    """
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class compl concept const consteval constexpr constinit const_cast
    continue co_await co_return co_yield decltype default delete do double dynamic_cast
    else enum explicit export extern false float for friend goto if inline int long
    mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected
    public register reinterpret_cast requires return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try
    typedef typeid typename union unsigned using virtual void volatile wchar_t while xor
    xor_eq main NULL threadIdx blockIdx blockDim gridDim warpSize half float2 float4 int2
    int4 dim3 size_t
    """.split()
)
RESERVED_PREFIXES = ("gs_", "GS_", "__", "cu", "nv")

GROUP_KINDS_THAT_PARTITION = ("ragged", "split", "uniform")


class _Checker:
    def __init__(self, file: ast.FileAst, spec: ast.SpecAst):
        self.file = file
        self.ast = spec
        self.lines = file.text.splitlines()
        self.dims: dict[str, Dim] = {}
        self.dim_pos: dict[str, ast.Pos] = {}
        self.groups: dict[str, Group] = {}
        self.group_order: list[str] = []
        self.tensors: dict[str, Tensor] = {}
        self.tensor_ast: dict[str, ast.TensorDecl] = {}
        self.names: dict[str, tuple[str, ast.Pos]] = {}  # every run-time-visible name

    # ---- diagnostics -------------------------------------------------------------
    def error(self, message: str, pos: ast.Pos, note: str | None = None) -> SpecError:
        src = self.lines[pos.line - 1] if 0 < pos.line <= len(self.lines) else ""
        return SpecError(message, SourceLocation(self.file.path, pos.line, pos.column, src), note)

    def check_identifier(self, name: ast.Name, what: str) -> None:
        text = name.text
        if text in CXX_RESERVED:
            raise self.error(
                f"{what} name '{text}' is reserved in C++/CUDA and would reach emitted code",
                name.pos,
                "rename it",
            )
        if text.startswith(RESERVED_PREFIXES):
            raise self.error(
                f"{what} name '{text}' uses a prefix reserved for generated code "
                f"({', '.join(RESERVED_PREFIXES)})",
                name.pos,
            )

    def claim(self, name: ast.Name, what: str) -> None:
        """Dims, groups, tensors and run-time tensors share one namespace."""
        self.check_identifier(name, what)
        if name.text in self.names:
            other_what, other_pos = self.names[name.text]
            raise self.error(
                f"{what} '{name.text}' collides with the {other_what} declared at "
                f"{other_pos.line}:{other_pos.column}",
                name.pos,
            )
        self.names[name.text] = (what, name.pos)

    # ---- entry ---------------------------------------------------------------------
    def run(self) -> Spec:
        self.check_identifier(self.ast.name, "spec")
        for d in self.ast.dims:
            self.declare_dim(d.name, d.size)
        for g in self.ast.groups:
            self.declare_group(g)
        for t in self.ast.tensors:
            self.declare_tensor(t)
        for t in self.ast.tensors:
            self.check_derivation(t)
        if not self.ast.statements:
            raise self.error(
                f"spec '{self.ast.name}' has no GEMM statement", self.ast.name.pos,
                "add one, e.g. y[t, n] = sum[k] x[t, k] * w[n, k]",
            )
        gemms = tuple(self.check_statement(i, s) for i, s in enumerate(self.ast.statements))
        self.check_written_once(gemms)
        directives = self.check_directives()
        return Spec(
            name=self.ast.name.text,
            path=self.file.path,
            line=self.ast.name.pos.line,
            dims=tuple(self.dims.values()),
            groups=tuple(self.groups[n] for n in self.group_order),
            tensors=tuple(self.tensors.values()),
            gemms=gemms,
            directives=directives,
        )

    # ---- dims and groups ---------------------------------------------------------
    def declare_dim(self, name: ast.Name, size: int | None) -> None:
        if name.text in self.dims:
            old = self.dims[name.text]
            first = self.dim_pos[name.text]
            if old.size != size:
                was = "known at run time" if old.size is None else f"{old.size}"
                now = "known at run time" if size is None else f"{size}"
                raise self.error(
                    f"dim '{name.text}' is given two sizes: {now} here, {was} at "
                    f"{first.line}:{first.column}",
                    name.pos,
                )
            raise self.error(f"dim '{name.text}' is declared twice", name.pos)
        if size is not None and size <= 0:
            raise self.error(f"dim '{name.text}' must be positive, not {size}", name.pos)
        self.claim(name, "dim")
        self.dims[name.text] = Dim(name.text, size)
        self.dim_pos[name.text] = name.pos

    def need_dim(self, name: ast.Name) -> Dim:
        if name.text not in self.dims:
            raise self.error(f"unknown dim '{name.text}'", name.pos, self._suggest_dim())
        return self.dims[name.text]

    def _suggest_dim(self) -> str:
        known = ", ".join(self.dims) or "none"
        return f"declare it with `dim NAME` or `dim NAME = SIZE` (known dims: {known})"

    def const_expr(self, e: ast.Expr, what: str) -> int:
        p = self.poly(e)
        if not p.is_const:
            raise self.error(f"{what} must be known at compile time, not '{p}'", e.pos)
        return p.value

    def poly(self, e: ast.Expr) -> Poly:
        if isinstance(e, ast.IntLit):
            return Poly.const(e.value)
        if isinstance(e, ast.NameRef):
            d = self.need_dim(e.name)
            return Poly.sym(d.name) if d.size is None else Poly.const(d.size)
        left, right = self.poly(e.left), self.poly(e.right)
        return left + right if e.op == "+" else left * right

    def declare_group(self, g: ast.GroupDecl) -> None:
        if g.name.text in self.groups:
            raise self.error(f"group '{g.name.text}' is declared twice", g.name.pos)
        # The count dim: declared here (`[E = 8]`) or earlier (`[E]`).
        if g.count is None:
            if g.count_dim.text not in self.dims:
                raise self.error(
                    f"group '{g.name.text}' needs a group count: write [{g.count_dim.text} = N] "
                    f"or declare `dim {g.count_dim.text} = N` first",
                    g.count_dim.pos,
                )
            count = self.dims[g.count_dim.text].size
            if count is None:
                raise self.error(
                    f"the number of groups '{g.count_dim.text}' must be known at compile time",
                    g.count_dim.pos,
                )
        else:
            count = g.count
            if count <= 0:
                raise self.error(f"group count must be positive, not {count}", g.count_dim.pos)
            if g.count_dim.text in self.dims:
                known = self.dims[g.count_dim.text]
                if known.size != count:
                    was = "known at run time" if known.size is None else str(known.size)
                    raise self.error(
                        f"dim '{g.count_dim.text}' is given two sizes: {count} here, {was} "
                        f"at {self.dim_pos[g.count_dim.text].line}:"
                        f"{self.dim_pos[g.count_dim.text].column}",
                        g.count_dim.pos,
                    )
            else:
                self.declare_dim(g.count_dim, count)
        self.claim(g.name, "group")
        k = g.kind
        dim = self.need_dim(k.dim)
        within = None
        sizes: tuple[int, ...] = ()
        if k.within is not None:
            if k.within.text not in self.groups:
                raise self.error(f"unknown group '{k.within.text}'", k.within.pos)
            outer = self.groups[k.within.text]
            if outer.kind != "ragged":
                raise self.error(
                    f"group '{g.name.text}' can nest only within a ragged group; "
                    f"'{outer.name}' is {outer.kind}",
                    k.within.pos,
                )
            if outer.dim != dim.name:
                raise self.error(
                    f"group '{g.name.text}' splits {dim.name} within '{outer.name}', but "
                    f"'{outer.name}' does not split {dim.name}",
                    k.within.pos,
                )
            within = outer.name
        if k.kind == "split":
            sizes = tuple(self.const_expr(e, "a split size") for e in k.sizes)
            if len(sizes) != count:
                raise self.error(
                    f"split gives {len(sizes)} sizes for {count} groups", k.pos
                )
            if any(s < 0 for s in sizes):
                raise self.error("split sizes must not be negative", k.pos)
            if dim.size is None:
                raise self.error(
                    f"split needs '{dim.name}' to be known at compile time; use ragged(...) "
                    "for run-time segments",
                    k.dim.pos,
                )
            if sum(sizes) != dim.size:
                raise self.error(
                    f"split sizes add up to {sum(sizes)} but dim '{dim.name}' is {dim.size}",
                    k.sizes[0].pos,
                )
        elif k.kind == "uniform":
            if dim.size is None or dim.size % count:
                raise self.error(
                    f"uniform({dim.name}) needs '{dim.name}' to be a compile-time multiple of "
                    f"{count}",
                    k.dim.pos,
                )
            sizes = (dim.size // count,) * count
        elif k.kind == "masked" and dim.size is None:
            raise self.error(
                f"masked({dim.name}): the padded size '{dim.name}' must be known at compile time",
                k.dim.pos,
            )
        if within is not None and k.kind != "ragged":
            raise self.error("only ragged groups may nest with `within`", k.pos)
        if k.tensor is not None:
            self.claim(k.tensor, "offsets tensor" if k.kind == "ragged" else "counts tensor")
        self.groups[g.name.text] = Group(
            name=g.name.text,
            kind=k.kind,
            count_dim=g.count_dim.text,
            count=count,
            dim=dim.name,
            within=within,
            tensor=k.tensor.text if k.tensor else None,
            sizes=sizes,
        )
        self.group_order.append(g.name.text)

    # ---- tensors --------------------------------------------------------------------
    def declare_tensor(self, t: ast.TensorDecl) -> None:
        if t.name.text in self.tensors:
            raise self.error(f"tensor '{t.name.text}' is declared twice", t.name.pos)
        self.claim(t.name, "tensor")
        dims = tuple(self.need_dim(n).name for n in t.shape)
        seen: set[str] = set()
        for n in t.shape:
            if n.text in seen:
                raise self.error(
                    f"dim '{n.text}' appears twice in the shape of '{t.name.text}'", n.pos
                )
            seen.add(n.text)
        layout = self.layout(t.layout, t.shape, t.name.text)
        scale = self.scale(t) if t.scale else None
        derived = Derivation(t.derived.op.text, t.derived.source.text) if t.derived else None
        self.tensors[t.name.text] = Tensor(
            t.name.text, t.dtype.text, dims, layout, scale, derived, t.name.pos.line
        )
        self.tensor_ast[t.name.text] = t

    def layout(
        self,
        decl: ast.LayoutDecl | None,
        shape: tuple[ast.Name, ...],
        owner: str,
        sizes: list[Poly] | None = None,
    ) -> Layout:
        dims = [self.dims[n.text] for n in shape]
        if sizes is None:
            sizes = [Poly.const(d.size) if d.size is not None else Poly.sym(d.name) for d in dims]
        kind = decl.kind if decl else "row_major"
        if kind == "strides":
            assert decl is not None
            if len(decl.strides) != len(shape):
                raise self.error(
                    f"strides(...) gives {len(decl.strides)} strides for the "
                    f"{len(shape)} dims of '{owner}'",
                    decl.pos,
                )
            strides = tuple(self.poly(e) for e in decl.strides)
            text = "strides(" + ", ".join(str(s) for s in strides) + ")"
            if decl.pad is not None:
                raise self.error("pad applies to row_major and major(...) layouts", decl.pos)
            return Layout("strided", text, strides=strides)
        if kind == "segment_major":
            assert decl is not None and decl.group is not None
            gname = decl.group.text
            if gname not in self.groups:
                raise self.error(f"unknown group '{gname}'", decl.group.pos)
            group = self.groups[gname]
            names = [n.text for n in shape]
            if group.kind not in GROUP_KINDS_THAT_PARTITION or group.dim not in names:
                raise self.error(
                    f"segment_major({gname}): group '{gname}' does not split any dim of "
                    f"'{owner}' ({', '.join(names)})",
                    decl.group.pos,
                )
            axis = names.index(group.dim)
            others = [i for i in range(len(shape)) if i != axis]
            other_strides = _row_major([sizes[i] for i in others], None)
            return Layout(
                "segment_major", f"segment_major({gname})", group=gname, seg_axis=axis,
                other_strides=tuple(other_strides),
            )
        order = list(range(len(shape)))
        text = "row_major"
        if kind == "major":
            assert decl is not None and decl.dim is not None
            names = [n.text for n in shape]
            if decl.dim.text not in names:
                raise self.error(
                    f"major({decl.dim.text}): '{decl.dim.text}' is not a dim of '{owner}' "
                    f"({', '.join(names)})",
                    decl.dim.pos,
                )
            axis = names.index(decl.dim.text)
            order = [i for i in order if i != axis] + [axis]
            text = f"major({decl.dim.text})"
        pad = decl.pad if decl else None
        if pad is not None:
            if pad <= 0:
                raise self.error("pad must be positive", decl.pos)
            inner = dims[order[-1]]
            if inner.size is None:
                raise self.error(
                    f"pad needs the contiguous dim '{inner.name}' to be known at compile time",
                    decl.pos,
                )
            text += f" pad {pad}"
        ordered = _row_major([sizes[i] for i in order], pad)
        strides = [Poly()] * len(shape)
        for pos, axis in enumerate(order):
            strides[axis] = ordered[pos]
        return Layout("strided", text, strides=tuple(strides))

    def scale(self, t: ast.TensorDecl) -> Scale:
        s = t.scale
        assert s is not None
        if t.dtype.text not in FP8_TYPES:
            raise self.error(
                f"'{t.name.text}' is {t.dtype.text}: scales apply to FP8 (e4m3, e5m2) tensors only",
                s.pos,
            )
        if s.dtype.text != "f32":
            raise self.error(
                f"scale type {s.dtype.text} is not supported yet; use f32", s.dtype.pos
            )
        if len(s.block) != len(t.shape):
            raise self.error(
                f"scale block has {len(s.block)} entries but '{t.name.text}' has "
                f"{len(t.shape)} dims",
                s.pos,
            )
        for b in s.block:
            if b.value <= 0:
                raise self.error("scale block sizes must be positive", b.pos)
        anchor = None
        if s.anchor is not None:
            if s.anchor.text not in self.groups:
                raise self.error(f"unknown group '{s.anchor.text}'", s.anchor.pos)
            g = self.groups[s.anchor.text]
            if g.kind not in GROUP_KINDS_THAT_PARTITION or g.dim not in [n.text for n in t.shape]:
                raise self.error(
                    f"scale blocks are anchored per '{g.name}', but '{g.name}' does not split "
                    f"any dim of '{t.name.text}'",
                    s.anchor.pos,
                )
            anchor = g.name
        name = s.name or ast.Name(f"{t.name.text}_scale", t.name.pos)
        if s.name is None and name.text in self.names:
            raise self.error(
                f"the scale of '{t.name.text}' is passed as '{name.text}', which collides with "
                f"the {self.names[name.text][0]} of that name; name it with `as OTHER`",
                s.pos,
            )
        self.claim(name, "scale tensor")
        # The scale grid's own layout is over block indices; its dims are named after
        # the tensor's, so `major(T)` reads naturally. A run-time dim cut into blocks
        # has a run-time block count, which no stride may depend on.
        grid: list[Poly] = []
        for n, b in zip(t.shape, s.block):
            d = self.dims[n.text]
            if d.size is not None:
                grid.append(Poly.const(-(-d.size // b.value)))
            elif b.value == 1:
                grid.append(Poly.sym(d.name))
            else:
                grid.append(Poly.sym(f"{d.name}_blocks"))
        if s.layout is not None and s.layout.kind == "segment_major":
            raise self.error("scales cannot be segment_major; use row_major or major(...)", s.layout.pos)
        layout = self.layout(s.layout, t.shape, f"{t.name.text}'s scale", grid)
        for stride in layout.strides:
            blocked = [sym for sym in stride.symbols if sym.endswith("_blocks")]
            if blocked:
                dim = blocked[0][: -len("_blocks")]
                raise self.error(
                    f"this scale layout needs the number of blocks along the run-time dim "
                    f"{dim} in a stride; keep {dim}'s blocks outermost (row_major)",
                    (s.layout or ast.LayoutDecl("row_major", s.pos)).pos,
                )
        return Scale(name.text, s.dtype.text, tuple(b.value for b in s.block), layout, anchor)

    def check_derivation(self, t: ast.TensorDecl) -> None:
        if t.derived is None:
            return
        op, src = t.derived.op, t.derived.source
        if src.text not in self.tensors:
            raise self.error(f"unknown tensor '{src.text}'", src.pos)
        source, target = self.tensors[src.text], self.tensors[t.name.text]
        if source.derived is not None:
            raise self.error(
                f"'{src.text}' is itself derived; derive '{t.name.text}' from its source "
                f"'{source.derived.source}'",
                src.pos,
            )
        if source.dims != target.dims:
            raise self.error(
                f"{op.text}({src.text}) keeps the logical shape [{', '.join(source.dims)}], but "
                f"'{t.name.text}' is declared [{', '.join(target.dims)}]",
                src.pos,
            )
        if source.dtype not in FP8_TYPES or target.dtype not in FP8_TYPES:
            raise self.error(
                f"{op.text} works on FP8 tensors: '{src.text}' is {source.dtype} and "
                f"'{t.name.text}' is {target.dtype}",
                op.pos,
            )
        if source.scale is None or target.scale is None:
            raise self.error(
                f"{op.text} needs scales on both '{src.text}' and '{t.name.text}'", op.pos
            )
        if op.text == "transpose" and source.scale.block != target.scale.block:
            raise self.error(
                f"transpose moves bytes only, so '{t.name.text}' must keep the scale blocks "
                f"{list(source.scale.block)} of '{src.text}'",
                op.pos,
                "use requantize(...) to change the scale blocks",
            )
        if op.text == "requantize":
            for d, (b_src, b_dst) in enumerate(zip(source.scale.block, target.scale.block)):
                if b_dst < b_src and b_dst != 1 and b_src % b_dst:
                    raise self.error(
                        f"requantize cannot refine blocks along {source.dims[d]} from {b_src} "
                        f"to {b_dst}",
                        op.pos,
                    )

    # ---- statements -----------------------------------------------------------------
    def check_statement(self, index: int, s: ast.Statement) -> Gemm:
        refs = (s.out, s.lhs, s.rhs)
        binding: dict[str, tuple[str, ast.Pos]] = {}  # index var -> (dim, where bound)

        def bind(var: ast.Name, dim: str, where: str) -> None:
            if var.text in self.dims or var.text in self.groups or var.text in self.tensors:
                raise self.error(
                    f"index '{var.text}' has the name of a declared "
                    f"{self.names[var.text][0]}; index variables need names of their own, "
                    f"e.g. '{var.text.lower() if not var.text.islower() else var.text + '_i'}'",
                    var.pos,
                )
            self.check_identifier(var, "index")
            if var.text in binding and binding[var.text][0] != dim:
                other_dim, other = binding[var.text]
                raise self.error(
                    f"index '{var.text}' ranges over {dim} in {where} but over {other_dim} at "
                    f"{other.line}:{other.column}",
                    var.pos,
                )
            binding.setdefault(var.text, (dim, var.pos))

        # Pass 1: tensors, ranks, plain index bindings.
        for ref in refs:
            if ref.tensor.text not in self.tensors:
                raise self.error(
                    f"unknown tensor '{ref.tensor.text}'", ref.tensor.pos,
                    f"declared tensors: {', '.join(self.tensors) or 'none'}",
                )
            t = self.tensors[ref.tensor.text]
            if len(ref.indices) != t.rank:
                raise self.error(
                    f"'{t.name}' has {t.rank} dims [{', '.join(t.dims)}] but is indexed with "
                    f"{len(ref.indices)}",
                    ref.tensor.pos,
                )
            used: set[str] = set()
            for idx, dim in zip(ref.indices, t.dims):
                if idx.var.text in used and idx.group is None:
                    raise self.error(
                        f"index '{idx.var.text}' is used twice in {t.name}[...]; a diagonal is "
                        "not a GEMM",
                        idx.var.pos,
                    )
                if idx.group is None:
                    used.add(idx.var.text)
                    bind(idx.var, dim, f"{t.name}[...]")
        for sm in s.sums:
            if sm.var.text not in binding:
                raise self.error(
                    f"summed index '{sm.var.text}' indexes neither factor", sm.var.pos
                )
        # Pass 2: group references g(v).
        group_refs: list[tuple[str, ast.Index, str]] = []  # (tensor, index, dim at position)
        for ref in refs:
            t = self.tensors[ref.tensor.text]
            for idx, dim in zip(ref.indices, t.dims):
                if idx.group is not None:
                    self.check_group_ref(idx, dim, t, binding)
                    group_refs.append((t.name, idx, dim))
        # Pass 3: classify indices.
        out_t, a_t, b_t = (self.tensors[r.tensor.text] for r in refs)
        if out_t.derived is not None:
            raise self.error(
                f"'{out_t.name}' is derived by {out_t.derived.op}({out_t.derived.source}) and "
                "cannot be written by a statement",
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
            k_group_axis = self.check_sum_restriction(sm, binding, out_v)
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
            masked = [g for g in self.groups.values() if g.kind == "masked" and g.count_dim == d.name]
            if masked:
                used_groups.append(masked[0].name)
                batch_use[v] = masked[0].name
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
        closure: list[str] = []
        for name in used_groups:
            chain = []
            g: Group | None = self.groups[name]
            while g is not None:
                chain.append(g.name)
                g = self.groups[g.within] if g.within else None
            for n in chain:
                if n not in closure:
                    closure.append(n)
        ordered = [n for n in self.group_order if n in closure]
        leaf_axes = tuple(batch_axes) + tuple(
            LeafAxis(n, self.groups[n].count, n) for n in ordered
        )

        roles = {
            "m": self.role_dim("m", m_var, dims_of[m_var], ordered, s),
            "n": self.role_dim("n", n_var, dims_of[n_var], ordered, s),
            "k": self.role_dim("k", k_var, dims_of[k_var], ordered, s),
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
                    uses.append(AxisUse("role", role=role_of[v]))
                elif v in batch_use:
                    uses.append(AxisUse("leaf", axis=batch_use[v]))
                else:
                    assert k_group_axis and v == k_group_axis[1]
                    uses.append(AxisUse("leaf", axis=k_group_axis[0]))
            return Access(ref.tensor.text, tuple(uses))

        gemm = Gemm(
            index=index,
            text=str(s),
            line=s.pos.line,
            out=access(s.out),
            a=access(s.lhs),
            b=access(s.rhs),
            accumulate=s.accumulate,
            m=roles["m"],
            n=roles["n"],
            k=roles["k"],
            leaf_axes=leaf_axes,
        )
        self.check_types(gemm, s)
        return gemm

    def check_group_ref(self, idx: ast.Index, dim: str, t: Tensor, binding) -> None:
        assert idx.group is not None
        gname = idx.group.text
        if gname not in self.groups:
            raise self.error(
                f"unknown group '{gname}'", idx.group.pos,
                f"declared groups: {', '.join(self.groups) or 'none'}",
            )
        g = self.groups[gname]
        if g.count_dim != dim:
            raise self.error(
                f"{gname}({idx.var.text}) gives a group index in 0..{g.count_dim}, but this "
                f"position of '{t.name}' is dim {dim}",
                idx.group.pos,
            )
        if g.kind == "masked":
            raise self.error(
                f"masked group '{gname}' is indexed by a batch index over {g.count_dim}, "
                f"not as {gname}({idx.var.text})",
                idx.group.pos,
            )
        if idx.var.text not in binding:
            raise self.error(
                f"index '{idx.var.text}' in {gname}({idx.var.text}) is not bound by any "
                "tensor position",
                idx.var.pos,
            )
        vdim = binding[idx.var.text][0]
        if vdim != g.dim:
            raise self.error(
                f"group '{gname}' splits {g.dim}, but '{idx.var.text}' ranges over {vdim}",
                idx.var.pos,
            )

    def check_sum_restriction(self, sm: ast.SumIndex, binding, out_vars) -> tuple[str, str]:
        assert sm.group is not None and sm.group_var is not None
        gname = sm.group.text
        if gname not in self.groups:
            raise self.error(f"unknown group '{gname}'", sm.group.pos)
        g = self.groups[gname]
        kdim = binding[sm.var.text][0]
        if g.kind not in GROUP_KINDS_THAT_PARTITION or g.dim != kdim:
            raise self.error(
                f"'{sm.var.text} in {gname}(...)': group '{gname}' does not split {kdim}",
                sm.group.pos,
            )
        ev = sm.group_var.text
        if ev not in out_vars:
            raise self.error(
                f"'{ev}' must index the output: each of the {g.count} segments of '{gname}' "
                "produces its own output slice",
                sm.group_var.pos,
            )
        if binding[ev][0] != g.count_dim:
            raise self.error(
                f"'{ev}' ranges over {binding[ev][0]}, but {gname}(...) takes an index over "
                f"{g.count_dim}",
                sm.group_var.pos,
            )
        return gname, ev

    def role_dim(self, role: str, var: str, dim: str, groups: list[str], s: ast.Statement) -> RoleDim:
        splitting = [
            n for n in groups
            if self.groups[n].kind in GROUP_KINDS_THAT_PARTITION and self.groups[n].dim == dim
        ]
        innermost = None
        for n in splitting:
            others = [o for o in splitting if o != n]
            ancestors = set()
            g = self.groups[n]
            while g.within:
                ancestors.add(g.within)
                g = self.groups[g.within]
            if any(o not in ancestors and not self._is_within(o, n) for o in others):
                o = next(o for o in others if o not in ancestors and not self._is_within(o, n))
                raise self.error(
                    f"groups '{n}' and '{o}' both split {dim}, but neither is declared within "
                    "the other",
                    s.pos,
                )
            if not any(self._is_within(o, n) for o in others):
                innermost = n
        masked = [
            n for n in groups if self.groups[n].kind == "masked" and self.groups[n].dim == dim
        ]
        return RoleDim(role, var, dim, innermost, masked[0] if masked else None)

    def _is_within(self, inner: str, outer: str) -> bool:
        g = self.groups[inner]
        while g.within:
            if g.within == outer:
                return True
            g = self.groups[g.within]
        return False

    # ---- types, majors, scales -----------------------------------------------------------
    def check_types(self, gemm: Gemm, s: ast.Statement) -> None:
        out_t = self.tensors[gemm.out.tensor]
        a_t, b_t = self.tensors[gemm.a.tensor], self.tensors[gemm.b.tensor]
        if out_t.dtype in FP8_TYPES:
            raise self.error(
                f"output '{out_t.name}' is {out_t.dtype}; FP8 output is not supported, use "
                "bf16, f16 or f32",
                s.out.tensor.pos,
            )
        for acc, ref in ((gemm.out, s.out), (gemm.a, s.lhs), (gemm.b, s.rhs)):
            t = self.tensors[acc.tensor]
            if t.layout.kind != "segment_major":
                continue
            use = acc.uses[t.layout.seg_axis]
            if use.kind != "role" or gemm.role(use.role).group != t.layout.group:
                raise self.error(
                    f"'{t.name}' is stored segment_major({t.layout.group}), but this statement "
                    f"does not split {t.dims[t.layout.seg_axis]} by '{t.layout.group}' per leaf",
                    ref.tensor.pos,
                )
        a_fp8, b_fp8 = a_t.dtype in FP8_TYPES, b_t.dtype in FP8_TYPES
        if a_t.dtype == "f32" or b_t.dtype == "f32":
            bad = s.lhs if a_t.dtype == "f32" else s.rhs
            raise self.error(
                f"'{bad.tensor.text}' is f32; tensor cores take FP8, BF16 or F16 operands",
                bad.tensor.pos,
            )
        if a_fp8 != b_fp8 or (not a_fp8 and a_t.dtype != b_t.dtype):
            raise self.error(
                f"operands '{a_t.name}' ({a_t.dtype}) and '{b_t.name}' ({b_t.dtype}) must both "
                "be FP8 or both the same 16-bit type",
                s.rhs.tensor.pos,
            )
        assert a_t.dtype in FP8_TYPES + SIXTEEN_BIT_TYPES
        for acc, ref, t in ((gemm.a, s.lhs, a_t), (gemm.b, s.rhs, b_t)):
            if t.dtype not in FP8_TYPES:
                continue
            if t.scale is None:
                raise self.error(
                    f"FP8 operand '{t.name}' has no scale; declare one, e.g. "
                    f"`scale f32 [{', '.join('1' for _ in t.dims)}]`",
                    ref.tensor.pos,
                )
            # Scale blocks first: a scale that varies along K needs a requantization,
            # which also fixes the major-ness, so that is the more useful message.
            self.check_scale_blocks(gemm, acc, ref, t)
            self.check_k_major(gemm, acc, ref, t)

    def check_k_major(self, gemm: Gemm, acc: Access, ref: ast.Ref, t: Tensor) -> None:
        k_axis = acc.axis_of_role("k")
        assert k_axis is not None
        lay = t.layout
        ok = lay.contiguous_axis() == k_axis
        if ok and lay.kind == "segment_major" and lay.group != gemm.k.group:
            ok = False
        if ok:
            return
        contiguous = lay.contiguous_axis()
        cdim = t.dims[contiguous] if contiguous is not None else "none"
        kdim = t.dims[k_axis]
        if lay.kind == "segment_major" and contiguous == k_axis:
            reason = (
                f"its segments follow '{lay.group}', but the contraction runs over "
                f"{gemm.k.group or 'all of ' + kdim}"
            )
        else:
            reason = f"its contiguous dim is {cdim} but the contraction runs over {kdim}"
        suggestion = self._k_major_layout(gemm, t, k_axis)
        raise self.error(
            f"FP8 operand '{t.name}' is not K-major: {reason}; FP8 wgmma reads both operands "
            "K-major, so this needs a transpose pass",
            ref.tensor.pos,
            f"declare the transposed copy and use it here: `tensor {t.name}_t : {t.dtype} "
            f"[{', '.join(t.dims)}] layout {suggestion} scale f32 "
            f"[{', '.join(str(b) for b in t.scale.block)}] = transpose({t.name})`",
        )

    def _k_major_layout(self, gemm: Gemm, t: Tensor, k_axis: int) -> str:
        if gemm.k.group and self.groups[gemm.k.group].kind == "ragged":
            return f"segment_major({gemm.k.group})"
        return f"major({t.dims[k_axis]})"

    def check_scale_blocks(self, gemm: Gemm, acc: Access, ref: ast.Ref, t: Tensor) -> None:
        sc = t.scale
        assert sc is not None
        blocks = self.tensor_ast[t.name].scale.block
        for axis, use in enumerate(acc.uses):
            b = sc.block[axis]
            pos = blocks[axis].pos
            dim = t.dims[axis]
            if use.kind == "leaf":
                if b != 1:
                    raise self.error(
                        f"scale block {b} along {dim} spans several groups; a group or batch "
                        "dim takes one scale per entry (block 1)",
                        pos,
                    )
                continue
            role = gemm.role(use.role)
            if use.role == "k":
                if b < KERNEL_K_BLOCK:
                    raise self.error(
                        f"scale of '{t.name}' changes every {b} element{'s' if b > 1 else ''} "
                        f"along the contracted dim {dim}, finer than the {KERNEL_K_BLOCK}-wide "
                        "K block inside which FP8 tensor cores accumulate without scales; "
                        "this needs a requantization",
                        pos,
                        self._requant_hint(gemm, t, axis),
                    )
                if b != KERNEL_K_BLOCK:
                    raise self.error(
                        f"scale block {b} along the contracted dim {dim} is not supported; "
                        f"use {KERNEL_K_BLOCK}",
                        pos,
                    )
            elif b != 1 and KERNEL_K_BLOCK % b and b % KERNEL_K_BLOCK:
                raise self.error(
                    f"scale block {b} along {dim} does not divide the {KERNEL_K_BLOCK}-wide tile "
                    f"grid; use a divisor or multiple of {KERNEL_K_BLOCK}",
                    pos,
                )
            if b != 1 and role.group is not None:
                g = self.groups[role.group]
                aligned = g.kind in ("split", "uniform") and all(x % b == 0 for x in g.starts)
                if sc.anchor != g.name and not aligned:
                    raise self.error(
                        f"scale blocks of {b} along {dim} would straddle the segments of "
                        f"'{g.name}', whose lengths are not multiples of {b}",
                        pos,
                        f"anchor the blocks at each segment's start with `per {g.name}` after "
                        "the scale block",
                    )

    def _requant_hint(self, gemm: Gemm, t: Tensor, k_axis: int) -> str:
        block = ["1"] * t.rank
        block[k_axis] = str(KERNEL_K_BLOCK)
        anchor = f" per {gemm.k.group}" if gemm.k.group else ""
        return (
            f"dequantize '{t.name}', transpose it so {t.dims[k_axis]} is contiguous and "
            f"quantize again with [{', '.join(block)}] blocks: declare `tensor {t.name}_q : "
            f"{t.dtype} [{', '.join(t.dims)}] layout {self._k_major_layout(gemm, t, k_axis)} "
            f"scale f32 [{', '.join(block)}]{anchor} = requantize({t.name})` and use it here"
        )

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
            for operand in (g.a.tensor, g.b.tensor):
                if operand == g.out.tensor:
                    raise self.error(
                        f"'{operand}' is both read and written by one statement", s.out.tensor.pos
                    )

    def check_directives(self) -> Directives:
        force = None
        target = "sm_90a"
        tile = None
        for d in self.ast.directives:
            if d.kind in ("flatten", "split"):
                if force is not None and force != d.kind:
                    raise self.error(
                        f"'{d.kind}' contradicts the earlier '{force}' directive", d.pos
                    )
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
                if tn > 192 and any(t.scale is not None for t in self.ast.tensors):
                    raise self.error(
                        f"tile({tm}, {tn}) is too wide for scaled FP8: those kernels keep two "
                        "accumulator tiles in registers, so at most 192 columns",
                        d.pos,
                    )
                tile = (tm, tn)
        return Directives(force, target, tile)


def _row_major(sizes: list[Poly], pad: int | None) -> list[Poly]:
    """Row-major strides for `sizes` (outermost first); `pad` rounds the row length up."""
    strides: list[Poly] = [ONE] * len(sizes)
    acc = ONE
    for i in range(len(sizes) - 1, -1, -1):
        strides[i] = acc
        size = sizes[i]
        if i == len(sizes) - 1 and pad is not None:
            size = Poly.const(-(-size.value // pad) * pad)
        acc = acc * size
    return strides


def check(file: ast.FileAst) -> tuple[Spec, ...]:
    """Check every spec of a parsed file; raise the first `SpecError` found."""
    seen: dict[str, ast.Pos] = {}
    specs = []
    for s in file.specs:
        if s.name.text in seen:
            first = seen[s.name.text]
            lines = file.text.splitlines()
            raise SpecError(
                f"spec '{s.name.text}' is defined twice (first at {first.line}:{first.column})",
                SourceLocation(file.path, s.name.pos.line, s.name.pos.column, lines[s.name.pos.line - 1]),
            )
        seen[s.name.text] = s.name.pos
        specs.append(_Checker(file, s).run())
    if not specs:
        raise SpecError("no `gemm NAME { ... }` spec in this file", SourceLocation(file.path, 1, 1, (file.text.splitlines() or [""])[0]))
    return tuple(specs)
