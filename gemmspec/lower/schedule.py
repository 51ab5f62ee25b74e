"""The flat grouped schedule: the IR between lowering and code generation.

A schedule is pre-passes, an ordered list of launches and post-passes (run in that
order unless a pass reads what a later step writes: `Schedule.order`). Each launch is one
kernel signature and a *problem generator*: for leaf number i it says, through
polynomials over per-leaf symbols, where that leaf's A, B, D and scales live and
how large its M, N and K are. Per-leaf symbols:

- `g.<axis>`      the leaf's index along a leaf axis (group or batch dim)
- `start.<r>`     first element of the leaf along role r (m, n or k)
- `len.<r>`       the leaf's extent along role r
- `bstart.<r>`    index of the leaf's first scale block along role r (anchored
                  blocks: a prefix sum of ceil(len/block) over earlier segments)
- `pstart<P>.<r>` first storage row of the leaf's segment in a `segment_major(G) pad P`
                  operand: a prefix sum of round_up(len, P) over earlier segments
- `plen<P>.<r>`   round_up(len.r, P), the row pitch inside that segment

plus run-time dims by name. The reference executor and the device-side table
builder both evaluate exactly these formulas.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..expr import ZERO, Poly
from ..spec import LeafAxis

ROLES = ("m", "n", "k")


@dataclass(frozen=True)
class Extent:
    """How a leaf's range along one role is found.

    kind "fixed": [0, size). kind "segment": the segment of `group` picked by the
    leaf's indices of `index_axes` (ragged: read from the run-time `tensor`,
    shaped [outer counts..., count + 1]; split/uniform: the compile-time
    `starts`/`sizes`). kind "masked": [0, min(counts[g], size)).
    """

    role: str
    dim: str
    kind: str
    size: Poly  # fixed: the extent; masked: the padded bound; segment: the whole dim
    group: str | None = None
    group_kind: str | None = None
    tensor: str | None = None
    index_axes: tuple[str, ...] = ()  # leaf axes indexing the offsets/counts tensor
    starts: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"{self.role}: [0, {self.size})"
        if self.kind == "masked":
            return f"{self.role}: [0, min({self.tensor}[g.{self.group}], {self.size}))"
        if self.group_kind == "ragged":
            idx = ", ".join(f"g.{a}" for a in self.index_axes)
            return (
                f"{self.role}: [{self.tensor}[{idx}], {self.tensor}[{idx} + 1])"
                f"  ({self.group} segments of {self.dim})"
            )
        return (
            f"{self.role}: {self.group_kind} segments of {self.dim}, starts {list(self.starts)}, "
            f"sizes {list(self.sizes)} by g.{self.group}"
        )


@dataclass(frozen=True)
class IndexMap:
    """Rows read or written through an index tensor: row i of a leaf is row
    `tensor[offset + i]` of the operand (`x[idx[t], k]`, `y[idx[t], n] = ...`). A value
    outside [0, bound) (the operand's rows) is skipped: the row is read as zeros or not
    stored."""

    tensor: str
    offset: Poly  # start.m when the rows are split per leaf, else 0
    bound: Poly  # rows of the operand's dim the index picks from

    def row(self, var: str) -> str:
        """Row `var` of the leaf as a row of the operand: `idx[start.m + m]`."""
        at = var if not self.offset.terms else f"{self.offset} + {var}"
        return f"{self.tensor}[{at}]"


# The per-leaf symbol of a copy's first [128, 1] scale block (its blocks are anchored at
# every segment, while D's one-per-row blocks start at `bstart.m`).
COPY_BLOCK_START = "cbstart"


@dataclass(frozen=True)
class SegmentPad:
    """An operand stored `segment_major(G) pad P` along role `role`: its segments take
    round_up(len, P) rows each, one after another, so a leaf's block starts at row
    `pstart<P>.<role>` and its rows are `plen<P>.<role>` apart. The storage holds
    `extra_rows` more rows than the dim; the table builder keeps every leaf's block
    inside dim + extra_rows rows even for malformed offsets."""

    role: str
    pad: int
    extra_rows: int

    @property
    def start(self) -> str:
        return f"pstart{self.pad}.{self.role}"

    @property
    def length(self) -> str:
        return f"plen{self.pad}.{self.role}"


@dataclass(frozen=True)
class OperandMap:
    """Element (i, j) of a leaf's operand lives at base + offset + i*stride_i + j*stride_j;
    with `rows`, at base + offset + rows(i)*stride_i + j*stride_j, rows(i) read from an
    index tensor (then `offset` has no part of the leaf's first row)."""

    tensor: str
    dtype: str
    roles: tuple[str, str]  # ("m","k") for A, ("n","k") for B, ("m","n") for D
    offset: Poly
    strides: tuple[Poly, Poly]
    rows: IndexMap | None = None  # A's rows gathered or D's scattered through an index tensor
    pad: SegmentPad | None = None  # stored segment_major with padded segments
    # The elements of the buffer `tensor` binds (its storage shape's product): how far a map
    # over the whole buffer may reach (a kernel's whole-tensor maps, kernels.py).
    elements: Poly = ZERO

    def __str__(self) -> str:
        r0, r1 = self.roles
        first = self.rows.row(r0) if self.rows is not None else r0
        return (
            f"{self.tensor}({r0}, {r1}) = {self.tensor}_base[{self.offset} + {first}*({self.strides[0]})"
            f" + {r1}*({self.strides[1]})]"
        )


@dataclass(frozen=True)
class ScaleMap:
    """Scale of element (i, j): base[offset + (i/bi)*stride_i + (j/bj)*stride_j].

    `anchors[r]` names the group whose segments restart the blocks along role r,
    or None when blocks are aligned to the dim's origin (then bstart.r = start.r / block).
    """

    tensor: str
    roles: tuple[str, str]
    block: tuple[int, int]
    offset: Poly
    strides: tuple[Poly, Poly]
    anchors: tuple[str | None, str | None]
    rows: IndexMap | None = None  # the operand's rows are gathered: so are their scales

    def __str__(self) -> str:
        r0, r1 = self.roles
        b0, b1 = self.block
        anchored = [f"{r} per {a}" for r, a in zip(self.roles, self.anchors) if a]
        extra = f"  (blocks anchored: {', '.join(anchored)})" if anchored else ""
        first = self.rows.row(r0) if self.rows is not None else r0
        return (
            f"{self.tensor}[{self.offset} + ({first}/{b0})*({self.strides[0]}) + "
            f"({r1}/{b1})*({self.strides[1]})]{extra}"
        )


@dataclass(frozen=True)
class EpilogueMap:
    """An epilogue operand of a leaf: base[offset] (kind "alpha"), or element i along its
    role at base[offset + i*stride] (kind "row": i a row of the leaf, "bias": a column)."""

    kind: str  # "alpha", "row" or "bias" (spec.EPILOGUE_KINDS)
    tensor: str
    dtype: str
    offset: Poly
    stride: Poly  # zero for "alpha"

    @property
    def role(self) -> str | None:
        return {"alpha": None, "row": "m", "bias": "n"}[self.kind]

    def __str__(self) -> str:
        if self.role is None:
            return f"{self.kind} {self.tensor} = {self.tensor}_base[{self.offset}]"
        return f"{self.kind} {self.tensor}({self.role}) = {self.tensor}_base[{self.offset} + {self.role}*({self.stride})]"


@dataclass(frozen=True)
class ProblemGenerator:
    leaf_axes: tuple[LeafAxis, ...]
    fixed_axes: tuple[tuple[str, int], ...]  # axes pinned to one index in this launch
    extents: tuple[Extent, Extent, Extent]  # m, n, k
    a: OperandMap
    b: OperandMap
    d: OperandMap
    sa: ScaleMap | None
    sb: ScaleMap | None
    runtime_tensors: tuple[str, ...]
    runtime_dims: tuple[str, ...]
    epilogue: tuple[EpilogueMap, ...] = ()  # in spec.EPILOGUE_KINDS order
    # An FP8 D's scales, which the epilogue writes: one per row and 128 of D's columns.
    sd: ScaleMap | None = None
    # `T = copy(D)`: the epilogue writes D's second FP8 copy T too, segment_major over the
    # row group (the leaf's rows contiguous per column), and its [128, 1] scales anchored at
    # the leaf's first row: block i of the leaf is scale row `cbstart.m + i`.
    c: OperandMap | None = None
    sc: ScaleMap | None = None
    # A SwiGLU over gate and up rows not interleaved: where up row n lies (`u`, strides
    # B's) and its scales (`su`). B holds the gate rows; the kernel's tile n0 covers D's
    # columns n0/2 .. n0/2 + tile_n/2: those gate rows, then the same up rows.
    u: OperandMap | None = None
    su: ScaleMap | None = None

    @property
    def scale_maps(self) -> tuple[ScaleMap, ...]:
        """A's, B's and D's scale maps, those the launch has."""
        return tuple(s for s in (self.sa, self.sb, self.sd) if s is not None)

    @property
    def index_maps(self) -> tuple[IndexMap, ...]:
        """A's gathered rows, then D's scattered ones."""
        return tuple(op.rows for op in (self.a, self.d) if op.rows is not None)

    @property
    def pads(self) -> tuple[SegmentPad, ...]:
        """The padded segment_major operands' paddings, each once (A, B, D order)."""
        ops = (self.a, self.b, self.d) + ((self.c,) if self.c is not None else ())
        return tuple(dict.fromkeys(op.pad for op in ops if op.pad is not None))

    @property
    def free_axes(self) -> tuple[LeafAxis, ...]:
        pinned = dict(self.fixed_axes)
        return tuple(a for a in self.leaf_axes if a.name not in pinned)

    @property
    def leaf_count(self) -> int:
        c = 1
        for a in self.free_axes:
            c *= a.count
        return c

    def extent(self, role: str) -> Extent:
        return self.extents[ROLES.index(role)]

    def leaf_indices(self, leaf: int) -> dict[str, int]:
        """Mixed-radix decode of a leaf number, outermost axis first."""
        idx = dict(self.fixed_axes)
        rest = leaf
        for ax in reversed(self.free_axes):
            idx[ax.name] = rest % ax.count
            rest //= ax.count
        return idx

    def __str__(self) -> str:
        axes = " x ".join(str(a) for a in self.free_axes) or "1"
        lines = [f"leaves: {axes} = {self.leaf_count} (outermost first)"]
        for ax, i in self.fixed_axes:
            lines.append(f"  pinned: g.{ax} = {i}")
        lines += [f"  {e}" for e in self.extents]
        lines += [f"  A {self.a}", f"  B {self.b}", f"  D {self.d}"]
        if self.u is not None:
            lines.append(f"  up {self.u}  (the up rows; B holds the gate rows)")
        if self.sa:
            lines.append(f"  scale A {self.sa}")
        if self.sb:
            lines.append(f"  scale B {self.sb}")
        if self.su:
            lines.append(f"  scale up {self.su}")
        if self.sd:
            lines.append(f"  scale D {self.sd}  (written)")
        if self.c is not None and self.sc is not None:
            lines.append(f"  copy C {self.c}  (written)")
            lines.append(
                f"  scale C {self.sc}  (written; cbstart.m = [128, 1] blocks of the segments before the leaf's)"
            )
        lines += [f"  epilogue {e}" for e in self.epilogue]
        for p in self.pads:
            lines.append(
                f"  padded segments: {p.start} = sum of round_up(len.{p.role}, {p.pad}) over the "
                f"segments before the leaf's, {p.length} = round_up(len.{p.role}, {p.pad})"
            )
        if self.runtime_tensors:
            lines.append(f"  reads at run time: {', '.join(self.runtime_tensors)}")
        return "\n".join(lines)


def unit_shape(tile_m: int, tile_n: int, cluster: int, multicast_b: bool) -> tuple[int, int]:
    """Rows and columns of one work unit (what a cluster computes): a CTA pair owns two
    row blocks when it shares B, two column blocks when it shares A."""
    return (tile_m * cluster, tile_n) if multicast_b else (tile_m, tile_n * cluster)


def cluster_suffix(cluster: int, multicast_b: bool) -> str:
    """The kernel name's cluster part: `c2` for a pair sharing A, `c2b` sharing B."""
    return f"c{cluster}" + ("b" if multicast_b else "") if cluster > 1 else ""


@dataclass(frozen=True)
class KernelSignature:
    """Everything a kernel fixes at compile time; equal signatures can share a launch."""

    a_type: str
    b_type: str
    d_type: str
    accumulate: bool
    scaled: bool
    sa_block: tuple[int, int]  # (m, k) block of A's scales; (1, 1) when unscaled
    sb_block: tuple[int, int]  # (n, k)
    a_k_major: bool
    b_k_major: bool
    tile_m: int
    tile_n: int
    tile_k: int
    cluster: int = 1  # CTAs per cluster: along N multicasting A, or along M multicasting B
    multicast_b: bool = False  # the cluster's CTAs own neighbouring row blocks and share B
    epilogue: tuple[tuple[str, str], ...] = ()  # (kind, element type) of each epilogue operand
    # Columns 2j (gate) and 2j + 1 (up) of a tile become D's column j, silu(gate) * up;
    # D's offset and strides address D's own columns.
    swiglu: bool = False
    # The gate and up rows not interleaved (a SwiGLU over two weights, or stacked halves of
    # B): a tile's B rows are D's columns' gate rows, then their up rows, loaded from B and
    # from the up weight (B itself, `swiglu_up_rows` rows on, for stacked halves).
    swiglu_halves: bool = False
    swiglu_up_rows: int = 0
    # A's rows read through an index tensor (copied by the producer, no TMA map for A), and
    # D's rows written through one (stored from registers).
    gather: bool = False
    scatter: bool = False
    # An FP8 D (d_type e4m3/e5m2) is quantized in the epilogue, one scale per row and 128
    # columns; with power-of-two scales when this is set.
    d_scale_pow2: bool = False
    # `T = copy(D)`: the epilogue also writes D's segment-major copy with [128, 1] scales
    # per segment (power-of-two scales when copy_scale_pow2 is set).
    copy: bool = False
    copy_scale_pow2: bool = False
    # FP8 without scales per K block: the whole of K in the tensor cores' accumulator
    # (`accumulate(fast)`), not promoted into f32 every 128 of K.
    fast_accum: bool = False

    @property
    def epilogue_name(self) -> str:
        """`_e` plus one letter and type per operand (empty without an epilogue), then
        `_swiglu` for a SwiGLU, `_gather` and `_scatter` for rows through index tensors."""
        name = "_e" + "".join(f"{k[0]}{t}" for k, t in self.epilogue) if self.epilogue else ""
        name += "_swiglu" if self.swiglu else ""
        name += ("_halves" + (f"{self.swiglu_up_rows}" if self.swiglu_up_rows else "")) if self.swiglu_halves else ""
        name += ("_gather" if self.gather else "") + ("_scatter" if self.scatter else "")
        name += "_pow2" if self.d_scale_pow2 else ""
        return name + ("_copy128x1" + ("pow2" if self.copy_scale_pow2 else "") if self.copy else "")

    @property
    def unit_shape(self) -> tuple[int, int]:
        return unit_shape(self.tile_m, self.tile_n, self.cluster, self.multicast_b)

    @property
    def name(self) -> str:
        """Procedural name spelling every choice, used for symbols and cache keys."""
        scale = (
            f"s{self.sa_block[0]}x{self.sa_block[1]}_{self.sb_block[0]}x{self.sb_block[1]}"
            if self.scaled
            else "ns"
        )
        majors = ("k" if self.a_k_major else "m") + ("k" if self.b_k_major else "n")
        mode = "acc" if self.accumulate else "store"
        return (
            f"gs_sm90a_{self.a_type}{self.b_type}_{self.d_type}_{scale}_{majors}_"
            f"t{self.tile_m}x{self.tile_n}x{self.tile_k}{cluster_suffix(self.cluster, self.multicast_b)}_{mode}"
            f"{self.epilogue_name}{'_fastacc' if self.fast_accum else ''}"
        )

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class Launch:
    index: int
    statement: int
    statement_text: str
    signature: KernelSignature
    problems: ProblemGenerator
    note: str = ""

    @property
    def leaf_count(self) -> int:
        return self.problems.leaf_count

    def __str__(self) -> str:
        head = f"launch {self.index}: statement #{self.statement}: {self.statement_text}"
        lines = [head, f"  kernel {self.signature.name}"]
        if self.note:
            lines.append(f"  {self.note}")
        if self.signature.swiglu_halves:
            lines.append(
                "  swiglu: D(m, j) = silu(B rows) * up rows: tile n0's columns are gate rows j = n0/2 .. "
                "n0/2 + tile_n/2 of B, then the same rows of up; D's n below is j"
            )
        elif self.signature.swiglu:
            lines.append("  swiglu: D(m, j) = silu(acc(m, 2j)) * acc(m, 2j + 1); D's n below is j")
        pg = self.problems
        if pg.a.rows is not None:
            scales = f", its scales read through {pg.a.rows.tensor} too" if pg.sa is not None else ""
            lines.append(
                f"  loads: A gathered through {pg.a.rows.tensor}: rows loaded by TMA, a box of one "
                f"row each at {pg.a.rows.row('m')} (copied by the producer where TMA cannot describe "
                f"A){scales}; B by TMA where it can describe it"
            )
        if pg.sd is not None:
            lines.append(
                f"  stores: D quantized in the epilogue: rounded to bf16, then per row and 128 columns "
                f"amax, scale and FP8 values as the quantize pass makes them; scales into {pg.sd.tensor}"
            )
        if pg.d.rows is not None:
            lines.append(
                f"  stores: D scattered through {pg.d.rows.tensor}: each row stored from registers "
                f"at row {pg.d.rows.row('m')} of {pg.d.tensor}"
            )
        lines += ["  " + ln for ln in str(self.problems).splitlines()]
        return "\n".join(lines)


@dataclass(frozen=True)
class PrePass:
    """A pass that produces a derived operand before the launches that read it.

    kind "requantize": dequantize `source` with its scales, transpose so the new
    contracted dim is contiguous, and quantize again with the target's blocks, in
    one FP8-in, FP8-out pass. kind "transpose": move bytes only, scales kept.
    kind "quantize": quantize an unscaled bf16/f16/f32 source into FP8 with fresh
    scales (the source has no scale: `source_scale` is None, `source_block` empty);
    with `pow2` each scale is rounded up to a power of two.
    kind "gather": row t of the target is row index[t] of the source (a zero row for an
    entry outside the source's rows), its [1, 128] scales copied with it (none for an
    unscaled source); bytes move, nothing is requantized.
    kind "swiglu_grad": the gradient of a SwiGLU's gate/up columns (the source, unscaled,
    2j the gate and 2j + 1 the up) from the gradient `other` of its output column j,
    quantized into FP8 with [1, 128] scales as kind "quantize" quantizes; it may read
    what launches and post-passes write, and then runs after them.
    A requantize with `index` reads row t of its target from row index[t] of the source
    (a zero row outside the source's rows); with `weight` it multiplies row t by
    weight[t] before quantizing it.
    """

    kind: str
    source: str
    target: str
    source_layout: str
    target_layout: str
    source_scale: str | None
    target_scale: str | None
    source_block: tuple[int, ...]
    target_block: tuple[int, ...]
    anchor: str | None
    reads_before: tuple[int, ...] = field(default=())  # launches that read the target
    pow2: bool = False  # quantize: power-of-two scales
    index: str | None = None  # gather, requantize: the int32 index tensor naming the source rows
    weight: str | None = None  # requantize: the f32 weight of each target row
    other: str | None = None  # swiglu_grad: the gradient of the SwiGLU's output

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(n for n in (self.source, self.other, self.index, self.weight) if n is not None)

    def describe(self) -> str:
        if self.kind == "swiglu_grad":
            per = f" per {self.anchor}" if self.anchor else ""
            how = (
                "per column in blocks of 128 tokens, each segment's tokens contiguous (the "
                "requantize pass's layout)" if self.target_block == (128, 1) else "as the quantize pass does"
            )
            return (
                f"swiglu_grad {self.source} (gate, up interleaved), {self.other} -> {self.target} "
                f"({self.target_layout}, scales {list(self.target_block)}{per}): per pair, "
                f"d gate = d h * up * silu'(gate), d up = d h * silu(gate), rounded to bf16, then "
                f"quantized {how}, one pass"
            )
        if self.kind == "gather":
            scales = f", scales {list(self.source_block)} with them" if self.source_scale else ""
            return (
                f"gather {self.source} ({self.source_layout}) rows through {self.index} -> "
                f"{self.target} ({self.target_layout}){scales}: row t is row {self.index}[t], "
                "copied once for every launch that reads it"
            )
        if self.kind == "transpose":
            return (
                f"transpose {self.source} ({self.source_layout}) -> {self.target} "
                f"({self.target_layout}); scales {list(self.source_block)} move with it"
            )
        if self.kind == "quantize":
            rule = "2^ceil(log2(amax / FP8 max))" if self.pow2 else "amax / FP8 max"
            return (
                f"quantize {self.source} ({self.source_layout}) -> {self.target} "
                f"({self.target_layout}, scales {list(self.target_block)}): amax per block, "
                f"scale = {rule}, one pass"
            )
        anchor = f" per {self.anchor}" if self.anchor else ""
        rows = f" rows through {self.index}" if self.index else ""
        weight = f", row t times {self.weight}[t]" if self.weight else ""
        return (
            f"requantize {self.source} ({self.source_layout}, scales {list(self.source_block)}){rows} "
            f"-> {self.target} ({self.target_layout}, scales {list(self.target_block)}{anchor}): "
            f"dequantize{weight}, transpose, quantize in one FP8-in FP8-out pass"
        )

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class PostPass:
    """A row pass on rows of 2-D tensors the caller passes or the statements write, run
    after every launch unless a pre-pass waits for it (Schedule.order says where); its
    target is an output of the call.

    kind "rowdot": target[r] = sum over c of source[r, c] * other[r, c] (other FP8 with
    [1, 128] scales `other_scale`, dequantized, or unscaled), float32 accumulation in a
    fixed order (deterministic). kind "rowscale": target[r, c] = weight[r] * source[r, c],
    rounded once to the target's type. kind "scatter_add": target[s, c] = sum over the t
    with index[t] == s of source[t, c], in ascending t in float32, rounded once (zero where
    no t names s; an entry outside the target's rows adds nothing): deterministic, the
    rows found through an inverse index of `index`, not by atomic adds of values.
    """

    kind: str
    source: str
    target: str
    other: str | None = None
    other_scale: str | None = None
    weight: str | None = None
    index: str | None = None

    @property
    def reads(self) -> tuple[str, ...]:
        return tuple(n for n in (self.source, self.other, self.weight, self.index) if n is not None)

    def describe(self) -> str:
        if self.kind == "scatter_add":
            return (
                f"scatter_add {self.source} -> {self.target}: row t added into row {self.index}[t] "
                "(entries outside the rows skipped), in ascending t in float32 through an inverse "
                f"index of {self.index} (deterministic)"
            )
        if self.kind == "rowdot":
            scaled = f" (dequantized with {self.other_scale})" if self.other_scale else ""
            return (
                f"rowdot {self.source} . {self.other}{scaled} -> {self.target}: one float32 dot "
                "product per row, summed in a fixed order"
            )
        return f"rowscale {self.source} -> {self.target}: row r times {self.weight}[r]"

    def __str__(self) -> str:
        return self.describe()


# The kinds of a schedule's steps, in their default order.
STEP_KINDS = ("prepass", "launch", "postpass")


@dataclass(frozen=True)
class Schedule:
    spec: str
    decision: str  # "flatten" or "split"
    reasons: tuple[str, ...]
    prepasses: tuple[PrePass, ...]
    launches: tuple[Launch, ...]
    postpasses: tuple[PostPass, ...] = ()
    # The order the steps run in, as (kind, index) pairs, where it is not the default
    # (every pre-pass, every launch, every post-pass): a pre-pass that reads what a launch
    # or a post-pass writes runs after it (see gemmspec.lower.lowering.step_order).
    order: tuple[tuple[str, int], ...] = ()

    def default_order(self) -> tuple[tuple[str, int], ...]:
        return tuple(
            (kind, i) for kind, items in zip(STEP_KINDS, (self.prepasses, self.launches, self.postpasses))
            for i in range(len(items))
        )

    def steps(self) -> tuple[tuple[str, int, object], ...]:
        """Every step in the order it runs: (kind, its index among its kind, the PrePass,
        Launch or PostPass)."""
        items = {"prepass": self.prepasses, "launch": self.launches, "postpass": self.postpasses}
        return tuple((kind, i, items[kind][i]) for kind, i in (self.order or self.default_order()))

    def __str__(self) -> str:
        lines = [f"schedule {self.spec}: {self.decision}"]
        lines += [f"  reason: {r}" for r in self.reasons]
        for kind, i, x in self.steps():
            lines.append(str(x) if kind == "launch" else f"{kind} {i}: {x}")
        return "\n".join(lines)
