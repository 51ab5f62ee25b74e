"""Backward statements derived from a forward statement: DGRAD and WGRAD.

For a forward statement `D[m, n] = sum[k] A[m, k] * B[n, k]` (per leaf), the
gradients are two more grouped GEMMs over the same groups:

    DGRAD  dA[m, k] = sum[n] dD[m, n] * B[n, k]          (contracts over D's columns)
    WGRAD  dB[n, k] = sum[m in G(e)] dD[m, n] * A[m, k]  (contracts over D's rows; K-grouped
                                                          by G when B is indexed by G(m))

In FP8 they follow DeepSeek-V3's recipe: the output gradient dD is quantized with
1x128 blocks along its columns; DGRAD reads B through a transposed copy (FP8 wgmma
reads K-major operands; 2-D weights and 3-D ones such as an MoE's [E, N, K] get the
checker's `transpose` pass, larger ones a copy the caller passes, `<B>_t`; either shares
B's 128x128 scales); WGRAD reads dD and A through
the `requantize` pass (1x128 -> 128x1 blocks, tokens contiguous, per segment when
K-grouped, the segments padded to multiples of 16 tokens so that TMA loads them).
dA comes out in BF16 (or A's 16-bit type), dB in FP32.

A forward `T = copy(A)` (the segment-major 128x1 form of an FP8 output A, written in the
epilogue of A's statement) replaces that pre-pass for A: when T's layout and scales are
exactly what the WGRAD would requantize A into (`segment_major(G) pad 16` over the WGRAD's
group G, e4m3, `[128, 1]` blocks along the rows `per G`), the WGRAD reads T, declared in
the backward spec as a plain FP8 input of the same name (`copies` pairs them), and no
`requantize(A)` runs; the caller passes the forward's T (the autograd wrapper keeps it
in place of A). A copy of another layout keeps the requantize, and `text()` says why.
The copy quantizes the statement's bf16 result once, where requantize(A) quantizes A's
1x128-scaled FP8 values again, so the two WGRADs agree to FP8 rounding, not bit for bit.
dD is the caller's and is always requantized.

A statement whose output rows are scattered through an index and/or weighted per row
(`D[idx[m], n] = w[m] * sum[k] A[m, k] * B[n, k]`, FP8) is derived too:

    DGRAD  dA[m, k] = w[m] * sum[n] dD[idx[m], n] * B[n, k]   (dD's rows gathered, w in the epilogue)
    WGRAD  dB[n, k] = sum[m in G(e)] dDw_q[m, n] * A[m, k],
           dDw_q = requantize(dD, rows = idx, weight = w)      (w[m] * dD[idx[m], n], 128x1 blocks)

With a row weight, the DGRAD stops before it, G[m, k] = sum[n] dD[idx[m], n] * B[n, k],
and two row passes after the statements (gemmspec.spec.RowPass) make both gradients that
need G:

    dA = rowscale(G, weight = w)     (dA[m, k] = w[m] * G[m, k])
    dw = rowdot(G, A)                (dw[m] = sum[k] G[m, k] * A[m, k]
                                      = sum[n] dD[idx[m], n] * (A B^T)[m, n])

the second reading A as the forward has it (FP8 with its 1x128 scales; a forward output
such as an FFN's intermediate is kept by gemmspec.torch.function for it). The rowscale
rounds dA a second time (G is stored in dA's 16-bit type first). Where the row passes
cannot read A (not 2-D with contiguous rows and [1, 128] scales) the weight stays in the
DGRAD's epilogue and its gradient is not derived: `Backward.not_derived` lists it,
`text()` prints it, and gemmspec.torch.function refuses a call whose w requires grad. A
16-bit statement of this form derives its DGRAD (and rowdot) but not its WGRAD (no 16-bit
pass gathers and weights dD's rows before a statement reads them): B is `not_derived`.

`+=` statements derive as `=` ones (dD passes through to the old contents); a per-leaf
scalar multiplies both gradients in their epilogues; a bias's and a scalar's own
gradients are `not_derived`. Every gradient of one forward tensor lands in one backward
tensor: the first statement writes it, later ones `+=` into it (a row pass's target takes
no `+=`, so that case is skipped with the reason). A 16-bit statement whose output later
statements read as A (a LoRA shrink's h) is derived after them, from their DGRADs' sum.

`derive_backward` writes the derived statements as one more spec (`<spec>_backward`),
a pass of the front half: a spec in, a spec's text out. `gemmspec.build.build_backward`
runs that text through the whole compiler, so the derived statements are checked,
analysed and lowered exactly as written ones; a statement whose gradient the
language or the kernels cannot express yet is reported with the reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .spec import FP8_TYPES, FreshNames, Gemm, Spec, Tensor

_REF_START = re.compile(r"(\w+)\[")
_DECL_DIMS = re.compile(r"tensor \w+ : \w+ \[([^\]]*)\]")
# Ranks of the tensors the `transpose` pre-pass takes (the third dim a batch): a DGRAD
# weight of another rank is transposed by the caller.
TRANSPOSE_PASS_RANKS = (2, 3)
# A K-grouped WGRAD's requantized operands pad each segment to this many tokens: every
# expert's FP8 rows are then whole 16-byte units, which TMA loads whatever the counts.
WGRAD_PAD = 16


@dataclass(frozen=True)
class Derived:
    """One derived statement: the gradient of `wrt` for forward statement `forward`."""

    forward: int
    kind: str  # "dgrad", "wgrad" or "rowdot" (a row weight's gradient, a row pass)
    wrt: str  # the forward input it is the gradient of
    grad: str  # the backward output holding it
    text: str


@dataclass(frozen=True)
class Skipped:
    forward: int
    reason: str


@dataclass(frozen=True)
class Backward:
    """The backward spec of a forward spec, and how its arguments relate to the forward's."""

    spec_name: str
    source: str  # .gspec text of the backward spec ('' when nothing was derived)
    statements: tuple[Derived, ...]
    skipped: tuple[Skipped, ...]
    output_grads: tuple[tuple[str, str], ...]  # (forward output, its gradient: a backward input)
    transposed: tuple[tuple[str, str], ...]  # (forward input, its transposed copy the caller passes)
    # (forward copy T = copy(A), the backward input the WGRAD reads in place of requantize(A))
    copies: tuple[tuple[str, str], ...] = ()
    # (forward copy, why the WGRAD requantizes its source rather than reading it)
    copies_unused: tuple[tuple[str, str], ...] = ()
    # (forward input, why its gradient is not derived) for inputs of derived statements
    # other than the two factors: a row weight the row passes cannot derive (the index
    # tensors have none).
    not_derived: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict:
        """The derivation as `explain --json` carries it (docs/explain-json.md), without
        the backward spec's own explain."""
        return {
            "name": self.spec_name if self.source else None,
            "source": self.source or None,
            "derived": [
                {"statement": d.forward, "kind": d.kind, "wrt": d.wrt, "grad": d.grad, "text": d.text}
                for d in self.statements
            ],
            "output_grads": [{"output": o, "grad": g} for o, g in self.output_grads],
            "transposed": [{"tensor": t, "copy": c} for t, c in self.transposed],
            "copies": [{"copy": c, "input": n} for c, n in self.copies],
            "not_derived": [{"tensor": t, "reason": r} for t, r in self.not_derived],
            "refused": [{"statement": s.forward, "reason": s.reason} for s in self.skipped],
        }

    def text(self) -> str:
        """What `explain` prints about the derived backward."""
        lines = ["backward (derived):"]
        for d in self.statements:
            lines.append(f"  {d.kind} of {d.wrt} (statement #{d.forward}): {d.text}")
        for out, grad in self.output_grads:
            lines.append(f"  {grad}: the gradient of {out}")
        for src, copy in self.transposed:
            lines.append(f"  {copy}: {src} transposed by the caller (the transpose pass takes 2-D and 3-D tensors only)")
        for copy, name in self.copies:
            lines.append(
                f"  {name}: the forward's copy {copy} (written in its source's epilogue), read by the "
                "WGRAD as it is: no requantize pre-pass for its source"
            )
        for copy, reason in self.copies_unused:
            lines.append(f"  {copy}: the forward's copy, not read: {reason}")
        for name, reason in self.not_derived:
            lines.append(f"  {name}: gradient not derived: {reason}")
        for s in self.skipped:
            lines.append(f"  statement #{s.forward}: not derived: {s.reason}")
        return "\n".join(lines)


def _ref_list(text: str) -> list[tuple[str, str]]:
    """Every `NAME[...]` of a statement's text, outermost only, as (name, what is inside
    the brackets): `y[dst[t], n]` is ('y', 'dst[t], n')."""
    refs, at = [], 0
    while (m := _REF_START.search(text, at)) is not None:
        depth, end = 1, m.end()
        while depth:
            depth += {"[": 1, "]": -1}.get(text[end], 0)
            end += 1
        refs.append((m.group(1), text[m.end() : end - 1]))
        at = end
    return refs


def _split_indices(inner: str) -> list[str]:
    """`dst[t], n` -> ['dst[t]', 'n'] (commas inside brackets or parentheses kept)."""
    parts, depth, cur = [], 0, ""
    for ch in inner:
        depth += {"[": 1, "(": 1, "]": -1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*parts, cur.strip()]


def _refs(g: Gemm) -> tuple[list[str], list[str], list[str]]:
    """Index lists of the output and the two factors of a statement's text (found by
    name: a bias may follow the product)."""
    refs = _ref_list(g.text)
    out = refs[0]
    a = next(r for r in refs[1:] if r[0] == g.a.tensor)
    b = next(r for r in refs[1:] if r[0] == g.b.tensor)
    split = [_split_indices(r[1]) for r in (out, a, b)]
    return split[0], split[1], split[2]


def _dims_and_groups(spec: Spec, decls: list[str]) -> list[str]:
    """The forward's dims that the backward's tensors or groups use (a run-time dim no
    tensor has would have no size at a call), and its groups."""
    used = {d.strip() for decl in decls for d in _DECL_DIMS.search(decl).group(1).split(",")}
    used |= {x for g in spec.groups for x in (g.dim, g.count_dim)}
    lines = []
    for d in spec.dims:
        if d.name not in used:
            continue
        lines.append(f"  dim {d.name}" if d.size is None else f"  dim {d.name} = {d.size}")
    for g in spec.groups:
        where = f"{g.dim} within {g.within}" if g.within else g.dim
        if g.kind == "ragged":
            body = f"ragged({where}, offsets = {g.tensor}{', capacity' if g.capacity else ''})"
        elif g.kind == "masked":
            body = f"masked({g.dim}, counts = {g.tensor})"
        elif g.kind == "split":
            body = f"split({g.dim}, sizes = [{', '.join(str(s) for s in g.sizes)}])"
        else:
            body = f"uniform({g.dim})"
        lines.append(f"  group {g.name}[{g.count_dim}] = {body}")
    return lines


def _decl(t: Tensor, name: str | None = None, layout: str | None = None, scale_as: str | None = None) -> str:
    s = f"  tensor {name or t.name} : {t.dtype} [{', '.join(t.dims)}] layout {layout or t.layout.text}"
    if t.scale is not None:
        sc = t.scale
        s += f" scale f32 [{', '.join(str(b) for b in sc.block)}] layout {sc.layout.text}"
        if sc.anchor:
            s += f" per {sc.anchor}"
        s += f" as {scale_as or sc.name}"
    return s


def _row_dot_reads(a: Tensor) -> bool:
    """Whether the row passes read `a` as the DGRAD's A (rowdot's second factor): 2-D,
    rows contiguous, FP8 with [1, 128] scales or unscaled 16-bit."""
    if a.rank != 2 or a.layout.contiguous_axis() != 1 or a.derived is not None or a.copy_of is not None:
        return False
    if a.dtype in FP8_TYPES:
        return a.scale is not None and a.scale.block == (1, 128)
    return a.scale is None and a.dtype in ("bf16", "f16", "f32")


def _capacity_rows(spec: Spec, g: Gemm) -> str | None:
    """The capacity group among the groups splitting `g`'s rows, if any: rows past its
    offsets' end are written by no statement, while a row pass reads every row."""
    if g.m.group is None:
        return None
    return next((group.name for group in spec.enclosing(g.m.group) if group.capacity), None)


def _gather_capacity(spec: Spec, g: Gemm) -> str | None:
    """Why gathered rows of `g` cannot come back through scatter_add, or None."""
    cap = _capacity_rows(spec, g) if g.gather else None
    if cap is None:
        return None
    return (
        f"it reads the rows of '{g.a.tensor}' through '{g.gather}' and its rows are split by "
        f"the capacity group '{cap}': scatter_add would add every row of the DGRAD's output into "
        f"the gradient, the rows past the offsets' end too, which no statement writes"
    )


def _eligible(spec: Spec, g: Gemm) -> str | None:
    """Why statement `g` gets no derived backward, or None when it does. (A `+=`
    statement derives as a `=` one: its output's gradient flows into both factors, and
    the old contents' gradient is the same dD, passed through.)"""
    if g.k.group is not None:
        return "it is K-grouped already (a WGRAD-style statement)"
    if g.swiglu:  # derived apart (_swiglu_backward) unless this says why not
        return _swiglu_eligible(spec, g) or "it fuses SwiGLU"
    if g.a.tensor == g.b.tensor:
        return f"both its factors are '{g.a.tensor}'; the product of a tensor with itself is not derived"
    ta = spec.tensor(g.a.tensor)
    if g.gather and (
        ta.dtype not in FP8_TYPES or g.a.axis_of_role("m") != 0
        or ta.rank != 2 or g.epilogue_of("row") is not None
    ):
        return (
            f"it reads the rows of '{g.a.tensor}' through '{g.gather}' in 16-bit, from a tensor that "
            "is not 2-D [rows, K], or with a row weight; the derived form (the DGRAD's rows added "
            "into the gradient by scatter_add, the WGRAD reading requantize(A, rows = IDX)) takes "
            "FP8 A of two dims, rows first, and no row weight"
        )
    if _gather_capacity(spec, g) is not None:
        return _gather_capacity(spec, g)
    if spec.tensor(g.out.tensor).dtype in FP8_TYPES:
        return (
            f"its output '{g.out.tensor}' is FP8, quantized in the epilogue; the gradient of a "
            "quantized output is not derived"
        )
    for acc in (g.a, g.b):
        t = spec.tensor(acc.tensor)
        if t.derived is not None:
            return f"it reads the derived tensor '{t.name}'"
    if g.m.masked_by is not None:
        return "its rows are masked (a WGRAD over masked rows is not expressible yet)"
    row = g.epilogue_of("row")
    if row is not None and spec.tensor(row.access.tensor).rank != 1:
        return (
            f"its row weight '{row.access.tensor}' has {spec.tensor(row.access.tensor).rank} dims; "
            "the gradients weigh rows by a 1-D tensor only"
        )
    if any(g.out.tensor in x.reads for x in spec.gemms if x is not g):
        if ta.dtype in FP8_TYPES:
            return (
                f"its output '{g.out.tensor}' is read by another statement; in FP8 its gradient (that "
                "statement's bf16 DGRAD) would be quantized between the two, and no pass of one call "
                "quantizes what a statement writes (only a SwiGLU's gradient, by swiglu_grad)"
            )
        if g.scatter or row is not None or g.epilogue_of("bias") is not None:
            return (
                f"its output '{g.out.tensor}' is read by another statement and its rows are scattered, "
                "weighted or biased; only a plain product (a per-leaf scalar allowed) takes its output's "
                "gradient from another statement's DGRAD"
            )
    return None


def _wgrad_copy(spec: Spec, a: Tensor, group: str | None, m_dim: str) -> tuple[Tensor | None, tuple[str, str] | None]:
    """The forward's copy of A that a WGRAD contracting over `m_dim` (K-grouped by
    `group`, or not grouped) reads in place of requantize(A): (the copy, None) when its
    layout and scales are exactly what the requantize would write, (None, (copy, why
    not)) when they are not, (None, None) when A has no copy."""
    copy = next((t for t in spec.tensors if t.copy_of == a.name), None)
    if copy is None:
        return None, None
    if group is None:
        return None, (copy.name, (
            f"the WGRAD is not grouped over {m_dim} (its weight has no group index), so it "
            f"requantizes {a.name} into one major({m_dim}) segment"
        ))
    axis = copy.dims.index(m_dim)
    lay, sc = copy.layout, copy.scale
    want_layout = f"segment_major({group}) pad {WGRAD_PAD}"
    blocks = tuple(128 if i == axis else 1 for i in range(copy.rank))
    want_scale = f"scale f32 [{', '.join(map(str, blocks))}] per {group}"
    why = None
    if lay.kind != "segment_major" or lay.group != group or lay.seg_axis != axis:
        why = f"its layout '{lay.text}' is not segment_major({group}) over {m_dim}, the WGRAD's '{want_layout}'"
    elif lay.pad != WGRAD_PAD:
        pad = f"pad {lay.pad}" if lay.pad > 1 else "no pad"
        why = f"its segments have {pad}, the WGRAD reads '{want_layout}'"
    elif copy.dtype != "e4m3":
        why = f"it is {copy.dtype}, the WGRAD's requantized operand e4m3"
    elif sc is None or sc.block != blocks or sc.anchor != group or sc.dtype != "f32":
        why = f"its scales are not '{want_scale}'"
    if why is not None:
        return None, (copy.name, f"{why}; {a.name} is requantized")
    return copy, None


def _swiglu_eligible(spec: Spec, g: Gemm) -> str | None:
    """Why SwiGLU statement `g` gets no derived backward, or None when it does."""
    ta, tb = spec.tensor(g.a.tensor), spec.tensor(g.b.tensor)
    if g.swiglu_halves:
        return (
            "its gate and up rows are not interleaved (two weights, or stacked halves); the derived "
            "SwiGLU backward reads one weight's interleaved rows 2j and 2j + 1"
        )
    if g.accumulate or g.epilogue:
        return "it fuses SwiGLU with an epilogue or `+=`; only a plain silu(gate) * up is derived"
    if ta.dtype not in FP8_TYPES or tb.dtype not in FP8_TYPES:
        return (
            f"it fuses SwiGLU in {ta.dtype}: its DGRAD and WGRAD would read the gate/up gradient "
            f"as a {ta.dtype} operand, and the swiglu_grad pass that makes it writes FP8 only "
            "([1, 128] or 128x1 blocks, for blockwise FP8 GEMMs); no 16-bit form of it exists"
        )
    if spec.per_channel(g):
        return (
            "it fuses SwiGLU with per-channel or per-tensor scales; the derived SwiGLU backward "
            "quantizes the gate/up gradient into FP8 with [1, 128] scales for blockwise FP8 GEMMs, "
            "and its DGRAD would need the weight's per-channel scales requantized along N, which "
            "no pass does"
        )
    if any(t.scale is None or t.scale.block[-1] != 128 for t in (ta, tb)):
        return "its scales are not blockwise along K (1x128 and 128x128)"
    if ta.rank != 2 or ta.derived is not None or tb.derived is not None:
        return "its A is not a 2-D tensor passed in, or its B is derived"
    if g.k.group is not None or g.m.masked_by is not None:
        return "it is K-grouped or its rows are masked"
    if _gather_capacity(spec, g) is not None:
        return _gather_capacity(spec, g)
    b_ref = next(inner for name, inner in _ref_list(g.text) if name == g.b.tensor)
    if len([i for i in _split_indices(b_ref) if i.endswith(f"({g.m.var})")]) > 1:
        return "its B operand is indexed by nested groups of its rows"
    return None


def _swiglu_backward(
    spec: Spec, g: Gemm, names: FreshNames, decls: dict[str, str], body: list[str],
    derived: list[Derived], out_grads: dict[str, str], transposed: list[tuple[str, str]], dh: str | None,
) -> None:
    """The backward of `h[m, j] = silu(sum[k] A * B[2j]) * sum[k] A * B[2j + 1]` (FP8,
    blockwise): the gate/up columns recomputed into a 16-bit GU, their gradient dGU =
    swiglu_grad(GU, dh) in FP8 ([1, 128] scales for the DGRAD, and again in 128x1 blocks per
    segment for the WGRAD, both from the bf16 gradients), then DGRAD and WGRAD over GU's
    columns as for a plain statement reading B's rows one by one. `dh` is the DGRAD of the statement
    that reads h, or (None) a bf16 input, the gradient of h from outside. Gathered A rows
    (`x[idx[m], k]`) come back through scatter_add(...) into x's rows."""
    refs = [r for r in _ref_list(g.text) if r[0] != "sum"]  # h, A, B (gate), A, B (up)
    a_idx, b_fwd = (_split_indices(r[1]) for r in refs[1:3])
    ta, tb, td = spec.tensor(g.a.tensor), spec.tensor(g.b.tensor), spec.tensor(g.out.tensor)
    n_axis, m_out = g.b.axis_of_role("n"), g.out.axis_of_role("m")
    b_idx = [g.n.var if i == n_axis else idx for i, idx in enumerate(b_fwd)]
    rows_dim, n_dim, k_dim = td.dims[m_out], tb.dims[n_axis], ta.dims[g.a.axis_of_role("k")]
    m, n = g.m.var, g.n.var
    decls.setdefault(ta.name, _decl(ta))
    decls.setdefault(tb.name, _decl(tb))
    if g.gather:
        decls.setdefault(g.gather, _decl(spec.tensor(g.gather)))
    if dh is None:  # h is an output of the forward: its gradient comes from outside
        dh = out_grads.get(td.name) or names.fresh(f"d{td.name}", f"grad_{td.name}")
        out_grads[td.name] = dh
        decls[dh] = f"  tensor {dh} : bf16 [{', '.join(td.dims)}]"

    # GU: the gate and up columns again (16-bit), and their gradient in FP8.
    gu = names.fresh(f"{td.name}_gate_up")
    decls[gu] = f"  tensor {gu} : bf16 [{rows_dim}, {n_dim}]"
    body.append(f"  {gu}[{m}, {n}] = sum[{g.k.var}] {refs[1][0]}[{', '.join(a_idx)}] * {tb.name}[{', '.join(b_idx)}]")
    dgu = names.fresh(f"d{gu}")
    decls[dgu] = (
        f"  tensor {dgu} : e4m3 [{rows_dim}, {n_dim}] scale f32 [1, 128] = swiglu_grad({gu}, {dh})"
    )

    # DGRAD over GU's columns: rows of the statement, scattered back into A's rows when gathered.
    b_t = names.fresh(f"{tb.name}_t")
    if tb.rank in TRANSPOSE_PASS_RANKS:
        decls[b_t] = _decl(tb, b_t, f"major({n_dim})", scale_as=f"{b_t}_scale") + f" = transpose({tb.name})"
    else:
        decls[b_t] = _decl(tb, b_t, f"major({n_dim})")
        transposed.append((tb.name, b_t))
    da = names.fresh(f"d{ta.name}", f"grad_{ta.name}")
    product = f"sum[{n}] {dgu}[{m}, {n}] * {b_t}[{', '.join(b_idx)}]"
    if g.gather:
        da_rows = names.fresh(f"{da}_rows")
        decls[da_rows] = f"  tensor {da_rows} : bf16 [{rows_dim}, {k_dim}]"
        decls[da] = f"  tensor {da} : bf16 [{', '.join(ta.dims)}] = scatter_add({da_rows}, rows = {g.gather})"
        body.append(f"  {da_rows}[{m}, {g.k.var}] = {product}")
        text = f"{da_rows}[{m}, {g.k.var}] = {product}; {da} = scatter_add({da_rows}, rows = {g.gather})"
    else:
        decls[da] = f"  tensor {da} : bf16 [{', '.join(ta.dims)}]"
        text = f"{da}[{', '.join(a_idx)}] = {product}"
        body.append(f"  {text}")
    recompute = f"{gu}[{m}, {n}] = (the gate/up columns again); {dgu} = swiglu_grad({gu}, {dh}); "
    derived.append(Derived(g.index, "dgrad", ta.name, da, recompute + text))

    # WGRAD over the statement's rows, K-grouped when B is indexed by G(m).
    db = names.fresh(f"d{tb.name}", f"grad_{tb.name}")
    decls[db] = f"  tensor {db} : f32 [{', '.join(tb.dims)}]"
    on_m = [(i, idx) for i, idx in enumerate(b_idx) if idx.endswith(f"({m})")]
    if on_m:
        axis, ref = on_m[0]
        group = ref.split("(", 1)[0]
        e = names.fresh(spec.group(group).count_dim.lower(), "e")
        db_idx = [e if i == axis else idx for i, idx in enumerate(b_idx)]
        sums, layout, per = f"{m} in {group}({e})", f"segment_major({group}) pad {WGRAD_PAD}", f" per {group}"
    else:
        db_idx, sums, layout, per = b_idx, m, f"major({rows_dim})", ""
    dgu_q, a_q = names.fresh(f"{dgu}_q"), names.fresh(f"{ta.name}_q")
    # The WGRAD's 128x1 form quantized from the same bf16 gradients (not requantized from dgu).
    decls[dgu_q] = (
        f"  tensor {dgu_q} : e4m3 [{rows_dim}, {n_dim}] layout {layout} scale f32 [128, 1]{per} = swiglu_grad({gu}, {dh})"
    )
    rows_opt = f", rows = {g.gather}" if g.gather else ""
    decls[a_q] = (
        f"  tensor {a_q} : e4m3 [{rows_dim}, {k_dim}] layout {layout} scale f32 [128, 1]{per} "
        f"= requantize({ta.name}{rows_opt})"
    )
    text = f"{db}[{', '.join(db_idx)}] = sum[{sums}] {dgu_q}[{m}, {n}] * {a_q}[{m}, {g.k.var}]"
    body.append(f"  {text}")
    how = f"{dgu_q} = swiglu_grad({gu}, {dh}) in [128, 1] blocks{per}; "
    derived.append(Derived(g.index, "wgrad", tb.name, db, how + text))


def derive_backward(spec: Spec, copies: bool = True) -> Backward:
    """The backward spec of `spec` (see the module's docstring). `copies=False` ignores
    the forward's copies (every WGRAD operand requantized, as before copies existed)."""
    names = FreshNames(spec)
    name = names.fresh(f"{spec.name}_backward")
    decls: dict[str, str] = {}
    body: list[str] = []
    derived: list[Derived] = []
    skipped: list[Skipped] = []
    out_grads: dict[str, str] = {}
    transposed: list[tuple[str, str]] = []
    used_copies: list[tuple[str, str]] = []
    unused_copies: list[tuple[str, str]] = []
    not_derived: dict[str, str] = {}
    grads_of: dict[str, list[str]] = {}  # forward tensor -> the derived DGRADs' gradients of it
    # Every gradient of one forward tensor lands in one backward tensor: the first
    # statement writes it (`=`), later ones add into it (`+=`); a row pass's target
    # (scatter_add, rowscale) takes no `+=`, so a tensor whose gradient a pass makes
    # feeds one statement only.
    grad_name: dict[str, str] = {}
    by_pass: dict[str, int] = {}  # forward tensor -> the statement whose pass makes its gradient

    def add_conflict(g: Gemm, tensor: str, via_pass: bool) -> str | None:
        if tensor not in grad_name:
            return None
        if tensor in by_pass:
            return (
                f"'{tensor}' feeds statement #{by_pass[tensor]} too, whose gradient of it a row pass "
                f"makes; statement #{g.index}'s gradient cannot be added into a row pass's target"
            )
        if via_pass:
            return (
                f"'{tensor}' feeds an earlier statement too, and statement #{g.index}'s gradient of it "
                "comes from a row pass, which cannot add into that gradient"
            )
        return None

    def grad_target(tensor: str, decl: str) -> tuple[str, str]:
        """The backward tensor of `tensor`'s gradient and the operator that writes it."""
        if tensor in grad_name:
            return grad_name[tensor], "+="
        g = grad_name[tensor] = names.fresh(f"d{tensor}", f"grad_{tensor}")
        decls[g] = decl.replace("{}", g)
        return g, "="

    def derive_one(g: Gemm, dd_chain: str | None) -> None:
        """The DGRAD and WGRAD of plain statement `g`; `dd_chain` is its output's
        gradient made by the backward itself (the output is read by later statements)."""
        reason = _eligible(spec, g)
        whole = [
            t.name for t in (spec.tensor(g.a.tensor), spec.tensor(g.b.tensor))
            if t.scale is not None and any(t.scale.whole(i) for i in range(t.rank))
        ]
        ta, tb, td = spec.tensor(g.a.tensor), spec.tensor(g.b.tensor), spec.tensor(g.out.tensor)
        if reason is None and spec.per_channel(g):
            # The backward reuses the forward's scales along other contracted dims.
            reason = (
                f"its FP8 scales are per-channel or per-tensor ('{ta.name}' and '{tb.name}' have one scale "
                "along the whole of K); the DGRAD contracts over N, along which "
                f"'{tb.name}''s scales change every row, so it needs '{tb.name}' requantized into 128x128 "
                "blocks, and no pass refines scales from the whole of a dim into blocks (requantize "
                "keeps or coarsens them along K, transpose keeps them)"
            )
        elif reason is None and whole:
            # K at most 128: blockwise with one K block, but the WGRAD's requantization
            # reads [1, 128] blocks only.
            reason = (
                f"'{whole[0]}' has one scale over the whole of a run-time dim (per-tensor); its DGRAD "
                "or WGRAD contracts along that dim and would need it requantized into 128-blocks, "
                "which no pass does from a per-tensor scale"
            )
        d_idx, a_idx, b_idx = _refs(g)
        alpha = g.epilogue_of("alpha")
        alpha_ref = None
        if reason is None and alpha is not None:
            alpha_ref = next(inner for nm, inner in _ref_list(g.text) if nm == alpha.access.tensor)
            if any(re.search(rf"\b{g.n.var}\b", i) for i in _split_indices(alpha_ref)):
                reason = (
                    f"its scalar {alpha.access.tensor}[{alpha_ref}] changes along the columns "
                    f"{g.n.var}, which the DGRAD sums over (it would weigh dD's columns)"
                )
        fp8 = ta.dtype in FP8_TYPES
        row = g.epilogue_of("row")
        weight = row.access.tensor if row else None
        # The row weight's gradient needs the DGRAD before the weight, G (rowdot(G, A));
        # dA is then rowscale(G, weight = w), a row pass.
        # Not over a capacity group: the row passes read every row of G and of A, and the
        # rows past the offsets' end hold what no statement wrote.
        w_rows = weight is not None and _row_dot_reads(ta) and _capacity_rows(spec, g) is None
        if reason is None:
            reason = add_conflict(g, ta.name, bool(g.gather) or w_rows) or add_conflict(g, tb.name, False)
        if reason is None and dd_chain is None and td.name in out_grads:
            other = next(x for x in spec.gemms if x is not g and x.out.tensor == td.name)
            if (spec.tensor(other.a.tensor).dtype in FP8_TYPES) != fp8:
                reason = (
                    f"'{td.name}' is written by statement #{other.index} too, in "
                    f"{'16-bit' if fp8 else 'FP8'}: its gradient would be read both in FP8 and in 16-bit"
                )
        if reason is not None:
            skipped.append(Skipped(g.index, reason))
            return
        grad_type = "bf16" if fp8 else ta.dtype

        # dD: the output gradient, an input of the backward (1x128 along D's columns in
        # FP8), or the gradient the backward makes of an output later statements read.
        if dd_chain is not None:
            dd = dd_chain
        else:
            dd = out_grads.get(td.name) or names.fresh(f"d{td.name}", f"grad_{td.name}")
            out_grads[td.name] = dd
            n_axis = g.out.axis_of_role("n")
            if fp8:
                blocks = ", ".join("128" if i == n_axis else "1" for i in range(td.rank))
                decls[dd] = f"  tensor {dd} : e4m3 [{', '.join(td.dims)}] scale f32 [{blocks}]"
            else:
                decls[dd] = f"  tensor {dd} : {grad_type} [{', '.join(td.dims)}]"  # an operand now
        # A scattered output's rows: dD is read at the rows the forward wrote (`dy[dst[t], n]`).
        dd_ref = f"{dd}[{', '.join(d_idx)}]"
        m_out = g.out.axis_of_role("m")
        d_rows = [g.m.var if i == m_out else idx for i, idx in enumerate(d_idx)]  # the statement's own rows
        # The per-leaf scalar multiplies both gradients (in their epilogues); its own
        # gradient is not derived.
        alpha_factor = ""
        if alpha is not None:
            decls[alpha.access.tensor] = _decl(spec.tensor(alpha.access.tensor))
            alpha_factor = f"{alpha.access.tensor}[{alpha_ref}] * "
            not_derived.setdefault(alpha.access.tensor, (
                f"the per-leaf scalar of statement #{g.index}; its gradient, per leaf the sum of dD "
                "times the product before the scalar, is not derived (no pass sums whole leaves)"
            ))
        bias = g.epilogue_of("bias")
        if bias is not None:
            not_derived.setdefault(bias.access.tensor, (
                f"the bias of statement #{g.index}; its gradient, dD's columns summed over each "
                "leaf's rows, is not derived (no pass sums columns)"
            ))
        # The row weight multiplies dA's rows (DGRAD epilogue) and dD's rows (WGRAD operand).
        w_factor = ""
        w_grad = None  # (the DGRAD before the weight, the weight's gradient) where derived
        if weight is not None:
            w_text = next(inner for nm, inner in _ref_list(g.text) if nm == weight)
            w_factor = f"{weight}[{w_text}] * "
            decls[weight] = _decl(spec.tensor(weight))
            if w_rows:
                w_factor = ""
                w_grad = (names.fresh(f"d{ta.name}_pre"), names.fresh(f"d{weight}", f"grad_{weight}"))
        if g.scatter:
            decls[g.scatter] = _decl(spec.tensor(g.scatter))

        # DGRAD: dA = sum[n] dD * B, B read with n contiguous.
        b_name = tb.name
        if fp8:
            n_dim = tb.dims[g.b.axis_of_role("n")]
            b_name = names.fresh(f"{tb.name}_t")
            if tb.rank in TRANSPOSE_PASS_RANKS:
                decls[b_name] = _decl(tb, b_name, f"major({n_dim})") + f" = transpose({tb.name})"
                decls[b_name] = decls[b_name].replace(f" as {tb.scale.name}", f" as {b_name}_scale")
                decls[tb.name] = _decl(tb)
            else:
                decls[b_name] = _decl(tb, b_name, f"major({n_dim})")
                transposed.append((tb.name, b_name))
        else:
            decls[tb.name] = _decl(tb)
        product = f"sum[{g.n.var}] {dd_ref} * {b_name}[{', '.join(b_idx)}]"
        # Gathered A rows (`x[idx[t], k]`): the DGRAD writes the statement's rows, and
        # scatter_add adds them into the rows of dA they were read from.
        a_rows = [g.m.var if i == 0 and g.gather else idx for i, idx in enumerate(a_idx)]
        a_decl = f"  tensor {{}} : {grad_type} [{', '.join(ta.dims)}]"
        if g.gather:
            da = names.fresh(f"d{ta.name}", f"grad_{ta.name}")
            grad_name[ta.name], by_pass[ta.name] = da, g.index
            da_rows = names.fresh(f"{da}_rows")
            decls[da_rows] = f"  tensor {da_rows} : {grad_type} [{g.m.dim}, {ta.dims[1]}]"
            decls[da] = f"  tensor {da} : {grad_type} [{', '.join(ta.dims)}] = scatter_add({da_rows}, rows = {g.gather})"
            decls.setdefault(g.gather, _decl(spec.tensor(g.gather)))
            body.append(f"  {da_rows}[{', '.join(a_rows)}] = {alpha_factor}{product}")
            text = f"{da_rows}[{', '.join(a_rows)}] = {alpha_factor}{product}; {da} = scatter_add({da_rows}, rows = {g.gather})"
        elif w_grad is None:
            da, op = grad_target(ta.name, a_decl)
            text = f"{da}[{', '.join(a_idx)}] {op} {alpha_factor}{w_factor}{product}"
            body.append(f"  {text}")
        else:
            pre, dw = w_grad
            da = names.fresh(f"d{ta.name}", f"grad_{ta.name}")
            grad_name[ta.name], by_pass[ta.name] = da, g.index
            decls[pre] = f"  tensor {pre} : {grad_type} [{', '.join(ta.dims)}]"
            decls[da] = f"  tensor {da} : {grad_type} [{', '.join(ta.dims)}] = rowscale({pre}, weight = {weight})"
            decls[dw] = f"  tensor {dw} : f32 [{spec.tensor(weight).dims[0]}] = rowdot({pre}, {ta.name})"
            decls.setdefault(ta.name, _decl(ta))
            body.append(f"  {pre}[{', '.join(a_idx)}] = {alpha_factor}{product}")
            text = f"{pre}[{', '.join(a_idx)}] = {alpha_factor}{product}; {da} = rowscale({pre}, weight = {weight})"
        derived.append(Derived(g.index, "dgrad", ta.name, da, text))
        grads_of.setdefault(ta.name, []).append(da)

        # WGRAD: dB = sum over D's rows of dD * A, K-grouped when B is indexed by G(m).
        groups_on_m = [
            (i, idx) for i, idx in enumerate(b_idx) if idx.endswith(f"({g.m.var})")
        ]
        wgrad_why = None
        if len(groups_on_m) > 1:
            wgrad_why = (
                f"it is indexed by nested groups of the rows of statement #{g.index}; its WGRAD "
                "would need one output index per group"
            )
        elif not fp8 and (g.scatter or weight):
            what = " and ".join(w for w in (
                f"scatters its rows through '{g.scatter}'" if g.scatter else "",
                f"weights its rows by '{weight}'" if weight else "",
            ) if w)
            wgrad_why = (
                f"statement #{g.index} {what} in {ta.dtype}: its WGRAD would read the output "
                "gradient's rows gathered and weighted, which only the FP8 requantize pre-pass does "
                "(no 16-bit pass writes them before a statement reads them)"
            )
        if wgrad_why is None and alpha is not None:
            on_m = [i for i in _split_indices(alpha_ref) if re.search(rf"\b{g.m.var}\b", i)]
            if on_m and not (groups_on_m and all(i == groups_on_m[0][1] for i in on_m)):
                wgrad_why = (
                    f"statement #{g.index} scales it by {alpha.access.tensor}[{alpha_ref}], one value per "
                    f"segment of the rows its WGRAD sums over ({tb.name} is not indexed by that group), "
                    "and no pass weighs dD's rows by a per-segment scalar"
                )
        if wgrad_why is None:
            wgrad(g, ta, tb, td, dd, a_idx, b_idx, d_rows, a_rows, weight, groups_on_m, alpha, alpha_ref, alpha_factor)
        else:
            not_derived.setdefault(tb.name, wgrad_why)
        if w_grad is not None:
            pre, dw = w_grad
            text = f"{dw} = rowdot({pre}, {ta.name}): {dw}[{g.m.var}] = sum[{g.k.var}] {pre}[{', '.join(a_idx)}] * {ta.name}[{', '.join(a_idx)}]"
            derived.append(Derived(g.index, "rowdot", weight, dw, text))
        elif weight is not None and _row_dot_reads(ta):
            not_derived.setdefault(weight, (
                f"the row weight of statement #{g.index}, whose rows are split by the capacity "
                f"group '{_capacity_rows(spec, g)}'; its gradient, rowdot of the DGRAD before the "
                f"weight with '{ta.name}', would read the rows past the offsets' end, which no "
                "statement writes"
            ))
        elif weight is not None:
            not_derived.setdefault(weight, (
                f"the row weight of statement #{g.index}; its gradient, row by row the dot "
                f"product of {dd}'s row with the product before the weight, needs that product, "
                "which the forward does not keep"
            ))

    def wgrad(g, ta, tb, td, dd, a_idx, b_idx, d_rows, a_rows, weight, groups_on_m, alpha, alpha_ref, alpha_factor) -> None:
        """The WGRAD of `g`: dB = sum over D's rows of dD * A (K-grouped by G when B is
        indexed by G(m)); dD's operand weighted by the row weight."""
        fp8 = ta.dtype in FP8_TYPES
        m_out = g.out.axis_of_role("m")
        alpha_w = alpha_factor
        m_dim = g.m.dim if g.gather else ta.dims[g.a.axis_of_role("m")]
        if groups_on_m:
            axis, ref = groups_on_m[0]
            group = ref.split("(", 1)[0]
            e = names.fresh(spec.group(group).count_dim.lower(), "e")
            db_idx = [e if i == axis else idx for i, idx in enumerate(b_idx)]
            sums = f"{g.m.var} in {group}({e})"
            seg_layout, per = f"segment_major({group}) pad {WGRAD_PAD}", f" per {group}"
            if alpha is not None:
                alpha_w = f"{alpha.access.tensor}[{', '.join(e if i == ref else i for i in _split_indices(alpha_ref))}] * "
        else:
            db_idx, sums, seg_layout, per = b_idx, g.m.var, f"major({m_dim})", ""
        db, op = grad_target(tb.name, f"  tensor {{}} : f32 [{', '.join(tb.dims)}]")
        a_ref, d_ref = ta.name, dd
        if fp8:
            use_copy = copies and not g.gather
            copy, why_not = _wgrad_copy(spec, ta, group if groups_on_m else None, m_dim) if use_copy else (None, None)
            d_ref = names.fresh(f"{dd}w_q" if weight else f"{dd}_q")
            wanted = [(dd, d_ref, None)]
            if copy is not None:
                # The forward wrote A's 128x1 form already: an input here, no pre-pass.
                a_ref = copy.name
                decls[a_ref] = _decl(copy)
                if (copy.name, copy.name) not in used_copies:
                    used_copies.append((copy.name, copy.name))
            else:
                a_ref = names.fresh(f"{ta.name}_q")
                wanted.insert(0, (ta.name, a_ref, ta))
                decls.setdefault(ta.name, _decl(ta))
                if why_not is not None and all(c != why_not[0] for c, _ in unused_copies):
                    unused_copies.append(why_not)
            for src, q, t in wanted:
                # dD's operand has the statement's rows: D's own, or those scattered D rows
                # read through the index (`rows = dst`), times the row weight; a gathered A's
                # the rows it read (`rows = idx`).
                if t is not None and g.gather:
                    dims = [m_dim, *t.dims[1:]]
                    blocks = ", ".join("128" if i == 0 else "1" for i in range(len(dims)))
                    decls[q] = (
                        f"  tensor {q} : e4m3 [{', '.join(dims)}] layout {seg_layout} "
                        f"scale f32 [{blocks}]{per} = requantize({src}, rows = {g.gather})"
                    )
                    continue
                dims = list(t.dims) if t is not None else [m_dim if i == m_out else d for i, d in enumerate(td.dims)]
                m_axis = dims.index(m_dim)
                blocks = ", ".join("128" if i == m_axis else "1" for i in range(len(dims)))
                options = "".join(
                    f", {key} = {value}"
                    for key, value in (("rows", g.scatter), ("weight", weight))
                    if t is None and value is not None
                )
                decls[q] = (
                    f"  tensor {q} : e4m3 [{', '.join(dims)}] layout {seg_layout} "
                    f"scale f32 [{blocks}]{per} = requantize({src}{options})"
                )
        else:
            decls.setdefault(ta.name, _decl(ta))
        text = f"{db}[{', '.join(db_idx)}] {op} {alpha_w}sum[{sums}] {d_ref}[{', '.join(d_rows)}] * {a_ref}[{', '.join(a_rows)}]"
        body.append(f"  {text}")
        derived.append(Derived(g.index, "wgrad", tb.name, db, text))

    swiglus = [g for g in spec.gemms if g.swiglu and _swiglu_eligible(spec, g) is None]
    # A statement whose output later statements read (16-bit) takes its output's
    # gradient from their DGRADs: derived after them, the last such first.
    chained = [
        g for g in spec.gemms
        if g not in swiglus and _eligible(spec, g) is None and any(g.out.tensor in x.reads for x in spec.gemms if x is not g)
    ]
    for g in spec.gemms:
        if g not in swiglus and g not in chained:
            derive_one(g, None)
    for g in reversed(chained):
        readers = [x for x in spec.gemms if x is not g and g.out.tensor in x.reads]
        as_a = all(x.a.tensor == g.out.tensor and g.out.tensor not in (x.b.tensor, *(e.access.tensor for e in x.epilogue)) for x in readers)
        grads = grads_of.get(g.out.tensor, [])
        if not as_a or len(grads) != len(readers) or g.out.tensor in by_pass:
            why = (
                "a statement reads it as other than its A operand" if not as_a
                else "a statement that reads it has no derived DGRAD" if len(grads) != len(readers)
                else "its gradient is a row pass's target, which no statement reads"
            )
            skipped.append(Skipped(g.index, f"its output '{g.out.tensor}' takes its gradient from the statements that read it, but {why}"))
            continue
        derive_one(g, grads[0])

    for g in swiglus:
        readers = [x for x in spec.gemms if g.out.tensor in x.reads]
        grads = grads_of.get(g.out.tensor, [])
        if readers and len(grads) != len(readers):
            skipped.append(Skipped(g.index, (
                f"its output '{g.out.tensor}' is read by a statement whose gradient is not derived"
            )))
            continue
        if len(set(grads)) > 1:
            skipped.append(Skipped(g.index, (
                f"its output '{g.out.tensor}' is read by {len(grads)} statements; its gradient would be "
                "their DGRADs' sum, which no pass adds"
            )))
            continue
        _swiglu_backward(spec, g, names, decls, body, derived, out_grads, transposed, grads[0] if grads else None)

    if not derived:
        return Backward(name, "", (), tuple(skipped), (), ())
    # Inputs first, then outputs, then derived tensors: the checker needs no order, a
    # reader does.
    order = sorted(decls, key=lambda k: (" = " in decls[k], k in {d.grad for d in derived}))
    source = "\n".join(
        [
            f"# Derived from {spec.name}: DGRAD and WGRAD of its forward statement(s).",
            f"gemm {name} {{",
            *_dims_and_groups(spec, list(decls.values())),
            *(decls[k] for k in order),
            *body,
            "}",
            "",
        ]
    )
    return Backward(
        name,
        source,
        tuple(derived),
        tuple(skipped),
        tuple(out_grads.items()),
        tuple(transposed),
        tuple(used_copies),
        tuple((c, why) for c, why in unused_copies if c not in dict(used_copies)),
        tuple(not_derived.items()),
    )

