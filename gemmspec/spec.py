"""The checked spec: names resolved, every statement classified as a GEMM.

This is what `check` produces and everything after it consumes. Nothing here
refers back to source text except the `line` and `where` fields kept for messages
(`where`: the location the analysis points its errors at, with its source line).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property

from .errors import SourceLocation
from .expr import Poly

FP8_TYPES = ("e4m3", "e5m2")
SIXTEEN_BIT_TYPES = ("bf16", "f16")
ELEMENT_BYTES = {"e4m3": 1, "e5m2": 1, "bf16": 2, "f16": 2, "f32": 4, "i32": 4}
# The element type of index tensors (`x[idx[t], k]`): one int32 row number per row t.
INDEX_TYPE = "i32"
KERNEL_K_BLOCK = 128  # FP8 scales must be constant over K blocks of this width
# An FP8 output is quantized in the GEMM's epilogue with one f32 scale per row and this
# many columns (the quantize pass's [1, 128] blocks).
FP8_OUT_BLOCK = 128

# ---- limits: what the kernels' integer types and the compiler can hold ----------
# The checker and the analysis enforce each one with a located error; docs/language.md
# ("Limits") lists them with their reasons.
MAX_EXTENT = 2**31 - 1  # every dim, and so every M, N, K: the kernels index with int32
MAX_OFFSET = 2**63 - 1  # element and byte offsets: the kernels address with int64
MAX_SCALE_BLOCK = 2**20  # scale block sizes: int template parameters, kept small
MAX_FIXED_SEGMENTS = 1024  # split/uniform: each segment is a constant in the leaf table
MAX_LEAVES_PER_LAUNCH = 65536  # the leaf table is built by one CTA before the GEMM
MAX_LAUNCHES = 4096  # launches of one spec, after splitting
MAX_TILES_PER_LAUNCH = 2**31 - 1  # the tile prefix sum is an int32
MAX_WITHIN_DEPTH = 8  # nested `within` groups: offsets tensors of that many axes
MAX_NAME_LENGTH = 64  # names reach C++ symbols and file names
MAX_RANK = 16  # dims per tensor: bounds a statement's indices and leaf axes


@dataclass(frozen=True)
class Dim:
    name: str
    size: int | None  # None: known at run time

    @property
    def is_runtime(self) -> bool:
        return self.size is None

    def __str__(self) -> str:
        return self.name if self.size is None else f"{self.name}={self.size}"


@dataclass(frozen=True)
class Group:
    """A partition of `dim` into `count` segments (masked: a limit per batch entry)."""

    name: str
    kind: str  # "ragged", "split", "uniform" or "masked"
    count_dim: str
    count: int
    dim: str
    within: str | None = None
    tensor: str | None = None  # ragged: offsets; masked: valid counts
    sizes: tuple[int, ...] = ()  # split/uniform: compile-time segment sizes
    capacity: bool = False  # ragged: offsets may end below the dim (rows past them untouched)

    @property
    def starts(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    def __str__(self) -> str:
        head = f"{self.name}[{self.count_dim}={self.count}] = {self.kind}({self.dim}"
        if self.within:
            head += f" within {self.within}"
        if self.kind == "ragged":
            head += f", offsets={self.tensor}"
            if self.capacity:
                head += ", capacity"
        elif self.kind == "masked":
            head += f", counts={self.tensor}"
        elif self.sizes:
            head += f", sizes={list(self.sizes)}"
        return head + ")"


@dataclass(frozen=True)
class Layout:
    """Where logical element (i0, i1, ...) lives, in elements from the base.

    strided: sum(i_d * strides[d]).
    segment_major: the dim `seg_axis` is cut into `group`'s segments; segment g
    (start s, length n) is a block at s * prod(other dims), in which the other
    dims are row-major with strides scaled by n and the segmented dim is
    contiguous. With `pad` P > 1 every segment's length is rounded up to a multiple
    of P (n' = round_up(n, P)) and the segments follow one another in those lengths:
    segment g starts at p_g * prod(other dims), p_g the sum of n' over the segments
    before it in flat order (outer groups first), and its other dims' strides are
    scaled by n'. The storage then holds `pad_rows` = (P - 1) * segments more rows
    along the segmented dim than the dim has.
    """

    kind: str  # "strided" or "segment_major"
    text: str  # as written (or "row_major")
    strides: tuple[Poly, ...] = ()
    group: str | None = None
    seg_axis: int = -1
    other_strides: tuple[Poly, ...] = ()  # segment_major: strides of the other dims / n
    pad: int = 1  # segment_major: segment lengths rounded up to a multiple of this
    pad_rows: int = 0  # segment_major: rows of storage beyond the dim's size

    @property
    def padded(self) -> bool:
        """A segment_major layout whose segments are padded (pad > 1)."""
        return self.kind == "segment_major" and self.pad > 1

    def storage_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of the buffer a caller passes for a tensor of logical `shape`: the
        logical shape, with `pad_rows` more along the segmented dim of a padded
        segment_major layout (its storage is that many rows, contiguous)."""
        if not self.pad_rows:
            return tuple(shape)
        out = list(shape)
        out[self.seg_axis] += self.pad_rows
        return tuple(out)

    def contiguous_axis(self) -> int | None:
        if self.kind == "segment_major":
            return self.seg_axis
        for i, s in enumerate(self.strides):
            if s.is_const and s.value == 1:
                return i
        return None

    def __str__(self) -> str:
        return self.text


@dataclass(frozen=True)
class Scale:
    name: str
    dtype: str
    # Per logical dim of the tensor: how many consecutive elements share one scale, or the
    # dim's name for one block over the whole of a run-time dim (written `[T, K]`: a
    # per-tensor scale). A fixed dim named in a block stands for its size.
    block: tuple[int | str, ...]
    layout: Layout  # over the grid of scale blocks
    anchor: str | None  # blocks along dims split by this group restart at each segment
    # `scale f32 [...] pow2` on an FP8 output: the epilogue writes power-of-two scales (the
    # rule of quantize(SOURCE, pow2)).
    pow2: bool = False

    def whole(self, axis: int) -> bool:
        """Whether one block covers the whole of a run-time dim along `axis`."""
        return isinstance(self.block[axis], str)

    def blocks_along(self, axis: int, size: int) -> int:
        """Blocks of the grid along `axis` for a dim of `size` elements (not anchored):
        ceil(size / block), or exactly 1 for a whole run-time dim, whatever its size."""
        b = self.block[axis]
        return 1 if isinstance(b, str) else -(-size // b)

    @property
    def block_text(self) -> str:
        """The block as written back: `[1, 128]`, `[T, 7168]`."""
        return "[" + ", ".join(str(b) for b in self.block) + "]"

    def __str__(self) -> str:
        s = f"scale {self.dtype} {self.block_text} layout {self.layout}"
        if self.anchor:
            s += f" per {self.anchor}"
        if self.pow2:
            s += " pow2"
        return s + f" as {self.name}"


@dataclass(frozen=True)
class Derivation:
    # "requantize", "transpose", "quantize", "gather", "swiglu_grad", or "view": no pass,
    # the source's bytes under another shape (see `Tensor.view_of`, `Spec.storage`).
    op: str
    source: str
    # quantize(SOURCE, pow2): every scale the pass writes is a power of two, the least one
    # (at least 2^-127) whose multiple of the FP8 max holds the block's amax.
    pow2: bool = False
    # gather: the rows of SOURCE that this int32 index tensor names, one per entry (the
    # compiler plans it for a statement's gathered A, see gemmspec/gather_plan.py).
    # requantize(SOURCE, rows = IDX): row t of the target is row IDX[t] of SOURCE (a zero
    # row for an entry outside SOURCE's rows).
    index: str | None = None
    # requantize(SOURCE, weight = W): row t is multiplied by the f32 W[t] before it is
    # quantized.
    weight: str | None = None
    # swiglu_grad(GU, DH): the gradient of silu(gate) * up (GU's interleaved columns 2j and
    # 2j + 1) from DH, the gradient of its output column j; quantized like quantize(...).
    other: str | None = None

    @property
    def reads(self) -> tuple[str, ...]:
        """Every tensor its pass reads: the source, then swiglu_grad's second tensor, the
        index and the weight."""
        return tuple(n for n in (self.source, self.other, self.index, self.weight) if n is not None)

    def __str__(self) -> str:
        if self.op == "gather":
            return f"gather({self.source}[{self.index}])"
        if self.op == "swiglu_grad":
            return f"swiglu_grad({self.source}, {self.other})"
        args = [self.source]
        if self.pow2:
            args.append("pow2")
        if self.index:
            args.append(f"rows = {self.index}")
        if self.weight:
            args.append(f"weight = {self.weight}")
        return f"{self.op}({', '.join(args)})"


# `= view(SOURCE)`: another shape of SOURCE's bytes, bound to SOURCE's buffer (no pass).
VIEW_OP = "view"


# Row passes: run after every statement, on whole rows of 2-D tensors that statements
# write or the caller passes; their targets are outputs of the call (see RowPass).
ROW_PASS_OPS = ("rowdot", "rowscale", "scatter_add")


@dataclass(frozen=True)
class RowPass:
    """`= rowdot(A, B)`: target[r] = sum over c of A[r, c] * B[r, c] (B FP8 with [1, 128]
    scales, dequantized, or unscaled), an f32 [R] output accumulated in float32.
    `= rowscale(A, weight = W)`: target[r, c] = W[r] * A[r, c], rounded once to the
    target's 16-bit type. `= scatter_add(A, rows = IDX)`: target[s, c] = sum over the t
    with IDX[t] == s of A[t, c], added in ascending t in float32 and rounded once (a row
    no t names is zero, an entry outside the target's rows adds nothing): the gradient of
    rows read through an index. Each runs once every step that writes what it reads has
    run (after every launch unless a pre-pass reads its target) and writes a tensor of the
    call's outputs, not an operand of a statement."""

    op: str  # "rowdot", "rowscale" or "scatter_add"
    source: str
    other: str | None = None  # rowdot: the second factor
    weight: str | None = None  # rowscale: the f32 weight of each row
    index: str | None = None  # scatter_add: the target row each source row adds into

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(n for n in (self.source, self.other, self.weight, self.index) if n is not None)

    def __str__(self) -> str:
        if self.op == "rowdot":
            return f"rowdot({self.source}, {self.other})"
        if self.op == "scatter_add":
            return f"scatter_add({self.source}, rows = {self.index})"
        return f"rowscale({self.source}, weight = {self.weight})"


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    dims: tuple[str, ...]
    layout: Layout
    scale: Scale | None
    derived: Derivation | None
    line: int
    # `= copy(SOURCE)`: a second FP8 output of the statement that writes the FP8 output
    # SOURCE, quantized in the same epilogue with this tensor's layout and scale blocks
    # (no pre-pass: `derived` is None).
    copy_of: str | None = None
    # `= rowdot(...)`, `= rowscale(...)` or `= scatter_add(...)`: an output written by a
    # row pass after the statements (no pre-pass: `derived` is None, and the caller
    # passes it, as any output).
    row_pass: RowPass | None = None

    @property
    def rank(self) -> int:
        return len(self.dims)

    @property
    def view_of(self) -> str | None:
        """`= view(SOURCE)`: the tensor whose buffer this one reads under its own shape (row
        major over the same elements; the checker saw to it). No pass writes it: it is
        derived so that a caller does not pass it, and what reads it waits for what writes
        its source, as for a pre-pass's target."""
        d = self.derived
        return d.source if d is not None and d.op == VIEW_OP else None

    def __str__(self) -> str:
        s = f"{self.name}: {self.dtype} [{', '.join(self.dims)}] layout {self.layout}"
        if self.scale:
            s += f" {self.scale}"
        if self.derived:
            s += f" = {self.derived}"
        if self.copy_of:
            s += f" = copy({self.copy_of})"
        if self.row_pass:
            s += f" = {self.row_pass}"
        return s


@dataclass(frozen=True)
class AxisUse:
    """What indexes one dim of a tensor inside a statement.

    kind "role": the GEMM's m, n or k index; kind "leaf": a leaf axis (group
    index or batch index), constant inside one leaf. A role read through an index
    tensor (`x[idx[t], k]`, rows only) names it in `index`: row t of the GEMM is
    position idx[t] of this dim.
    """

    kind: str
    role: str | None = None  # "m", "n", "k"
    axis: str | None = None  # leaf axis name
    index: str | None = None  # role "m" gathered (or scattered) through this int32 tensor


@dataclass(frozen=True)
class Access:
    tensor: str
    uses: tuple[AxisUse, ...]

    def axis_of_role(self, role: str) -> int | None:
        for i, u in enumerate(self.uses):
            if u.kind == "role" and u.role == role:
                return i
        return None

    @property
    def row_index(self) -> str | None:
        """The index tensor its rows (role m) are read or written through, if any."""
        axis = self.axis_of_role("m")
        return None if axis is None else self.uses[axis].index


@dataclass(frozen=True)
class LeafAxis:
    """One axis of the leaf index space: a group's segments or a batch dim."""

    name: str  # group name, or the batch index variable
    count: int
    group: str | None  # None for a plain batch dim

    def __str__(self) -> str:
        return f"{self.name}[{self.count}]"


@dataclass(frozen=True)
class RoleDim:
    """The M, N or K extent of a leaf."""

    role: str
    var: str
    dim: str
    group: str | None  # innermost group splitting this dim per leaf, if any
    masked_by: str | None = None  # masked group limiting it, if any


# Epilogue operands by kind, in the order the kernel applies them: the accumulator is
# multiplied by the per-leaf scalar and the per-row weight, then the bias is added.
EPILOGUE_KINDS = ("alpha", "row", "bias")
EPILOGUE_TYPES = ("f32", "bf16", "f16")
SWIGLU_OUTPUT_TYPES = ("bf16", "f32", "e4m3", "e5m2")  # FP8: quantized in the epilogue


@dataclass(frozen=True)
class EpilogueOperand:
    """An element-wise operand fused into a statement's epilogue.

    kind "alpha": indexed by leaf axes only (one value per leaf: a LoRA scaling);
    "row": also by the row index (one value per output row: a router weight);
    "bias": also by the column index, added after the product.
    """

    kind: str
    access: Access
    dtype: str

    @property
    def role(self) -> str | None:
        return {"alpha": None, "row": "m", "bias": "n"}[self.kind]


@dataclass(frozen=True)
class Gemm:
    """One statement as a grouped GEMM: D(m, n) (+)= sum_k A(m, k) * B(n, k) per leaf."""

    index: int
    text: str
    line: int
    out: Access
    a: Access
    b: Access
    accumulate: bool
    m: RoleDim
    n: RoleDim
    k: RoleDim
    leaf_axes: tuple[LeafAxis, ...]
    where: SourceLocation | None = field(default=None, compare=False)  # the output's name
    epilogue: tuple[EpilogueOperand, ...] = ()  # in EPILOGUE_KINDS order, one per kind
    # SwiGLU: the GEMM's columns 2j (gate) and 2j + 1 (up) become output column j,
    # silu(gate) * up, before the epilogue factors; `n` runs over B's interleaved rows.
    swiglu: bool = False
    # A SwiGLU whose up rows are not interleaved with the gate's: up row j is row
    # `swiglu_up_rows` + j of `swiglu_up` (a second weight declared as B is, read with B's
    # indices, or B itself: stacked halves), and B's row j the gate. `n` then runs over
    # D's columns; the kernel's tiles hold gate rows, then as many up rows (see
    # `swiglu_halves`). None: interleaved rows.
    swiglu_up: str | None = None
    swiglu_up_rows: int = 0
    # `T = copy(D)` of this statement's FP8 output D: the epilogue writes T too (its own
    # layout and scale blocks, segment_major over the row group, 128x1 scales).
    copy: str | None = None
    # A's rows gathered by a pre-pass into this derived tensor (planned by the compiler):
    # the kernel loads it as a plain operand; `a` stays the statement as written.
    a_gathered: str | None = None

    @property
    def swiglu_halves(self) -> bool:
        """A SwiGLU over gate and up rows that are not interleaved: its GEMM has twice as
        many columns as `n` has (each tile: gate rows, then the same up rows)."""
        return self.swiglu_up is not None

    @property
    def loaded_a(self) -> Access:
        """The A the kernel loads: the pre-pass's gathered copy (row for row, no index)
        where one is planned, else A as written."""
        if self.a_gathered is None:
            return self.a
        uses = tuple(replace(u, index=None) for u in self.a.uses)
        return Access(self.a_gathered, uses)

    @property
    def kernel_gather(self) -> str | None:
        """The index tensor the kernel itself gathers A's rows through, if any."""
        return None if self.a_gathered else self.gather

    @property
    def writes(self) -> tuple[str, ...]:
        """Every tensor the statement writes: its output, then the output's copy."""
        return (self.out.tensor, self.copy) if self.copy else (self.out.tensor,)

    @property
    def reads(self) -> tuple[str, ...]:
        """Every tensor the statement reads: both factors (a SwiGLU's second weight after
        the first), then its epilogue operands."""
        up = (self.swiglu_up,) if self.swiglu_up not in (None, self.b.tensor) else ()
        return (self.a.tensor, self.b.tensor, *up, *(e.access.tensor for e in self.epilogue))

    @property
    def gather(self) -> str | None:
        """The index tensor A's rows are gathered through (`x[idx[t], k]`), if any."""
        return self.a.row_index

    @property
    def scatter(self) -> str | None:
        """The index tensor D's rows are scattered through (`y[idx[t], n] = ...`), if any."""
        return self.out.row_index

    @property
    def index_tensors(self) -> tuple[str, ...]:
        """The index tensors the statement reads, A's first."""
        return tuple(dict.fromkeys(t for t in (self.gather, self.scatter) if t))

    def epilogue_of(self, kind: str) -> EpilogueOperand | None:
        return next((e for e in self.epilogue if e.kind == kind), None)

    @property
    def leaf_count(self) -> int:
        c = 1
        for ax in self.leaf_axes:
            c *= ax.count
        return c

    def role(self, r: str) -> RoleDim:
        return {"m": self.m, "n": self.n, "k": self.k}[r]


@dataclass(frozen=True)
class Directives:
    force: str | None = None  # "flatten" or "split"
    target: str = "sm_90a"
    tile: tuple[int, int] | None = None
    # How a gathered A's rows are read: "auto" (gemmspec/gather_plan.py decides),
    # "fused" (the GEMM gathers them in its loads) or "prepass" (a pass copies them first).
    gather_rows: str = "auto"
    # How FP8 products without scales per K block (per-channel, per-tensor) are summed:
    # "promoted" (into f32 every 128 of K, the default) or "fast" (the whole of K in the
    # tensor cores' accumulator, about 14 bits of mantissa).
    accumulation: str = "promoted"
    force_where: SourceLocation | None = field(default=None, compare=False)


class FreshNames:
    """Names that collide with nothing in a spec (tensors, scales, groups, offsets, dims),
    for the tensors and specs a later stage adds: `c`, else `c2`, `c3`, ..."""

    def __init__(self, spec: Spec):
        self.taken = {t.name for t in spec.tensors} | {g.name for g in spec.groups}
        self.taken |= {t.scale.name for t in spec.tensors if t.scale}
        self.taken |= {g.tensor for g in spec.groups if g.tensor} | {d.name for d in spec.dims}

    def fresh(self, *candidates: str) -> str:
        """The first free candidate, else the last one numbered from 2."""
        for c in candidates:
            if c not in self.taken:
                self.taken.add(c)
                return c
        i = 2
        while f"{candidates[-1]}{i}" in self.taken:
            i += 1
        self.taken.add(f"{candidates[-1]}{i}")
        return f"{candidates[-1]}{i}"


@dataclass(frozen=True)
class Spec:
    name: str
    path: str
    line: int
    dims: tuple[Dim, ...]
    groups: tuple[Group, ...]
    tensors: tuple[Tensor, ...]
    gemms: tuple[Gemm, ...]
    directives: Directives
    where: SourceLocation | None = field(default=None, compare=False)  # the spec's name

    # Lookups by name are dicts built once: later stages look names up per statement
    # and per launch, and a linear scan each time made large specs quadratic.
    @cached_property
    def _by_name(self) -> tuple[dict[str, Dim], dict[str, Group], dict[str, Tensor]]:
        return (
            {d.name: d for d in self.dims},
            {g.name: g for g in self.groups},
            {t.name: t for t in self.tensors},
        )

    def dim(self, name: str) -> Dim:
        return self._by_name[0][name]

    def group(self, name: str) -> Group:
        return self._by_name[1][name]

    def enclosing(self, name: str) -> tuple[Group, ...]:
        """The group `name` and each group enclosing it (its `within` chain), innermost
        first: the outermost is the last. A tuple, built at once, so an unknown name
        raises here as `group` does, and callers may slice or reverse it."""
        chain = [self.group(name)]
        while chain[-1].within is not None:
            chain.append(self.group(chain[-1].within))
        return tuple(chain)

    def tensor(self, name: str) -> Tensor:
        return self._by_name[2][name]

    def storage(self, name: str) -> str:
        """The tensor whose buffer `name` binds: a view's source, else the tensor itself
        (the checker keeps views of views out)."""
        return self.tensor(name).view_of or name

    @property
    def runtime_dims(self) -> tuple[str, ...]:
        return tuple(d.name for d in self.dims if d.is_runtime)

    @property
    def row_passes(self) -> tuple[Tensor, ...]:
        """The tensors row passes write (`= rowdot(...)`, `= rowscale(...)`,
        `= scatter_add(...)`), in declaration order: outputs of a call, written after
        every statement."""
        return tuple(t for t in self.tensors if t.row_pass is not None)

    @property
    def written(self) -> tuple[str, ...]:
        """Every tensor a call writes, once each: the statements' outputs (an FP8
        output's copy after it), then the row passes' targets."""
        names = [w for g in self.gemms for w in g.writes] + [t.name for t in self.row_passes]
        return tuple(dict.fromkeys(names))

    @property
    def read_groups(self) -> tuple[Group, ...]:
        """The groups known at run time (offsets or counts) whose tensor the spec reads: a
        statement's rows, columns, K or leaves split or masked by it, a layout cut into its
        segments, a scale anchored on it, and the enclosing groups of each (a nested
        group's offsets are checked against its outer's). The tensor of any other group is
        still an argument of a call, but nothing reads it: neither the device check nor a
        launch takes it (with hundreds of such groups, every one a parameter of launch 0's
        kernel made CUDA that does not compile in reasonable time), and the reference does
        not check its values."""
        named: set[str] = set()
        for g in self.gemms:
            for role in (g.m, g.n, g.k):
                named.update(x for x in (role.group, role.masked_by) if x)
            named.update(ax.group for ax in g.leaf_axes if ax.group)
        for t in self.tensors:
            named.update(x for x in (t.layout.group, t.scale and t.scale.anchor, t.scale and t.scale.layout.group) if x)
        named = {outer.name for name in named for outer in self.enclosing(name)}
        return tuple(g for g in self.groups if g.tensor and g.name in named)

    def per_channel(self, g: Gemm) -> bool:
        """Whether statement `g`'s FP8 scales span its whole (compile-time) K: one scale
        per row of A and per column of B, applied once in the epilogue instead of per
        KERNEL_K_BLOCK (the checker accepts only both operands or neither). Per-tensor
        scales (one block over the whole of M or N too) are the special case whose
        scale is the same for every row or column."""
        a = self.tensor(g.a.tensor)
        k_axis = g.a.axis_of_role("k")
        if a.scale is None or k_axis is None:
            return False
        return a.scale.block[k_axis] != KERNEL_K_BLOCK

    def __str__(self) -> str:
        lines = [f"spec {self.name}"]
        lines += [f"  dim {d}" for d in self.dims]
        lines += [f"  group {g}" for g in self.groups]
        lines += [f"  tensor {t}" for t in self.tensors]
        for g in self.gemms:
            lines.append(f"  gemm #{g.index}: {g.text}")
            lines.append(
                f"    m={g.m.var}:{g.m.dim} n={g.n.var}:{g.n.dim} k={g.k.var}:{g.k.dim}"
                f" leaves={' x '.join(str(a) for a in g.leaf_axes) or '1'}"
                + (" swiglu" if g.swiglu else "")
                + (f" up={g.swiglu_up}+{g.swiglu_up_rows}" if g.swiglu_up else "")
                + (f" gather={g.gather}" if g.gather else "")
                + (f" scatter={g.scatter}" if g.scatter else "")
                + (f" copy={g.copy}" if g.copy else "")
            )
        return "\n".join(lines)
