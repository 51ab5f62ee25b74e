"""Nest analysis: may the leaves become one flat launch, and should they?

Legality asks whether every leaf shares one kernel signature and whether each
leaf's operands are base + affine offsets of its group indices and run-time
segment starts (so one problem generator describes them all). Profitability asks
whether one tile shape fits every leaf. The answer is a `NestDecision`: the
launches to make, in dependency order, and every reason in words.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from .errors import SourceLocation, SpecError
from .gather_plan import gather_reason
from .spec import (
    ELEMENT_BYTES,
    FP8_TYPES,
    MAX_LAUNCHES,
    MAX_LEAVES_PER_LAUNCH,
    MAX_TILES_PER_LAUNCH,
    Gemm,
    Spec,
)
from .tiling import TileChoice, choose_tile

# Splitting by tile class pays when one tile shape would waste more than this much
# of the tile area on the small leaves.
WASTE_LIMIT = 0.5


@dataclass(frozen=True)
class LaunchPlan:
    statement: int
    pinned: tuple[tuple[str, int], ...]  # leaf axes fixed to one index in this launch
    tile_m: int
    tile_n: int
    why: str = ""
    pair_rows: bool = False  # CTA pairs along M multicasting B (see tiling)


@dataclass(frozen=True)
class NestDecision:
    spec: str
    decision: str  # "flatten" or "split"
    reasons: tuple[str, ...]
    plans: tuple[LaunchPlan, ...]

    def __str__(self) -> str:
        lines = [f"{self.spec}: {self.decision}"]
        lines += [f"  - {r}" for r in self.reasons]
        for p in self.plans:
            pinned = ", ".join(f"{a}={i}" for a, i in p.pinned)
            lines.append(
                f"  launch: statement #{p.statement}"
                + (f" [{pinned}]" if pinned else "")
                + f" tile {p.tile_m}x{p.tile_n}"
            )
        return "\n".join(lines)


def signature_key(spec: Spec, g: Gemm) -> tuple:
    """What a kernel fixes at compile time for this statement."""
    a, b, d = (spec.tensor(x.tensor) for x in (g.loaded_a, g.b, g.out))
    scales = tuple(t.scale.block if t.scale else None for t in (a, b))
    d_scale = (d.scale.block, d.scale.pow2) if d.scale else None  # an FP8 output's, written
    return (a.dtype, b.dtype, d.dtype, g.accumulate, scales, d_scale)


def describe_signature(spec: Spec, g: Gemm) -> str:
    a, b, d = (spec.tensor(x.tensor) for x in (g.a, g.b, g.out))
    if a.dtype in FP8_TYPES:
        ops = f"{a.dtype} x {b.dtype} with scales {a.scale.block_text} x {b.scale.block_text}"
    else:
        ops = f"{a.dtype} x {b.dtype}"
    rows = f", A's rows through {g.gather}" if g.kernel_gather else ""
    rows += f", A's rows copied through {g.gather} by a pre-pass" if g.a_gathered else ""
    rows += f", D's rows through {g.scatter}" if g.scatter else ""
    out = d.dtype + (f" with scales {d.scale.block_text}{' pow2' if d.scale.pow2 else ''}" if d.scale else "")
    return f"{ops} -> {out}{' (+=)' if g.accumulate else ''}{rows}"


def n_extents(spec: Spec, g: Gemm) -> dict[int, int | None]:
    """N extent per index of the group splitting N (or {-1: extent}); None if run-time."""
    role = g.n
    if role.group is not None:
        grp = spec.group(role.group)
        if grp.kind in ("split", "uniform"):
            return dict(enumerate(grp.sizes))
        return {-1: None}
    size = spec.dim(role.dim).size
    # A SwiGLU over gate and up halves: the GEMM runs over D's columns twice (fixed).
    return {-1: 2 * size if g.swiglu_halves and size is not None else size}


def m_bound(spec: Spec, g: Gemm) -> int | None:
    """The most rows a leaf can have, when the spec fixes it."""
    role = g.m
    if role.group is not None:
        grp = spec.group(role.group)
        return max(grp.sizes) if grp.kind in ("split", "uniform") else None
    return spec.dim(role.dim).size  # fixed, or the padded bound of a masked group


def b_scale_block_n(spec: Spec, g: Gemm) -> int:
    """B's scale block along N (1 when B is unscaled)."""
    t = spec.tensor(g.b.tensor)
    if t.scale is None:
        return 1
    for use, block in zip(g.b.uses, t.scale.block):
        if use.kind == "role" and use.role == "n":
            return 1 if isinstance(block, str) else block  # the whole of N: any width will do
    return 1


def tile_for(spec: Spec, g: Gemm, n_extents: list[int | None]) -> TileChoice:
    scaled = spec.tensor(g.loaded_a.tensor).scale is not None
    bias = g.epilogue_of("bias") is not None
    return choose_tile(
        n_extents, m_bound(spec, g), scaled, b_scale_block_n(spec, g), bias, swiglu=g.swiglu,
        per_channel=spec.per_channel(g), gather=g.kernel_gather is not None,
        fp8_out=spec.tensor(g.out.tensor).dtype in FP8_TYPES, copy=g.copy is not None,
        masked=g.m.masked_by is not None, halves=g.swiglu_halves,
    )


def _where(spec: Spec, at: SourceLocation | None) -> SourceLocation:
    return at or spec.where or SourceLocation(spec.path, spec.line, 1)


def dependency_order(spec: Spec) -> list[int]:
    """Statement order that puts every writer before its readers (source order otherwise).

    Kahn's algorithm over statements and the tensors between them, taking the
    lowest-numbered ready statement each time: O(S log S) for S statements, however
    many of them write or read one tensor.
    """
    writers: dict[str, list[int]] = {}
    for g in spec.gemms:
        for w in g.writes:  # an FP8 output's copy is written with it
            writers.setdefault(w, []).append(g.index)
    unwritten = {t: len(ws) for t, ws in writers.items()}  # writers of t still to run
    readers: dict[str, list[int]] = {}
    waiting = [0] * len(spec.gemms)  # tensors a statement reads that are not final yet
    for g in spec.gemms:
        for t in _reads_through_passes(spec, g.reads):
            # A statement's own output is no dependency (the checker forbids reading it).
            if t in writers and t not in g.writes:
                readers.setdefault(t, []).append(g.index)
                waiting[g.index] += 1
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    order: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        order.append(i)
        for t in spec.gemms[i].writes:
            unwritten[t] -= 1
            if unwritten[t] == 0:
                for r in readers.get(t, ()):
                    waiting[r] -= 1
                    if waiting[r] == 0:
                        heapq.heappush(ready, r)
    if len(order) < len(spec.gemms):
        _raise_cycle(spec, set(order), unwritten, writers)
    return order


def _reads_through_passes(spec: Spec, reads: tuple[str, ...]) -> set[str]:
    """`reads`, and what the passes that write them read, transitively: a statement that
    reads swiglu_grad(GU, DH) waits for the statements that write GU and DH."""
    seen: set[str] = set()
    todo = list(reads)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        t = spec.tensor(name)
        if t.derived is not None:
            todo += list(t.derived.reads)
        elif t.row_pass is not None:
            todo += list(t.row_pass.reads)
    return seen


def _raise_cycle(
    spec: Spec, done: set[int], unwritten: dict[str, int], writers: dict[str, list[int]]
) -> None:
    """Walk from a blocked statement to a writer it waits for until a statement
    repeats: that loop is a cycle. Located at its first statement."""
    pending = {t: next(w for w in ws if w not in done) for t, ws in writers.items() if unwritten[t]}
    path: list[int] = []
    on_path: dict[int, int] = {}
    i = min(g.index for g in spec.gemms if g.index not in done)
    while i not in on_path:
        on_path[i] = len(path)
        path.append(i)
        g = spec.gemms[i]
        t = next(t for t in g.reads if t in pending and t not in g.writes)
        i = pending[t]
    cycle = path[on_path[i]:]
    steps = []
    for j, s in enumerate(cycle):
        w = cycle[(j + 1) % len(cycle)]
        g = spec.gemms[s]
        t = next(t for t in g.reads if t in spec.gemms[w].writes)
        steps.append(f"#{s} reads '{t}', written by #{w}")
    first = min(cycle)
    if len(steps) > 6:
        steps = steps[:5] + [f"... ({len(steps) - 5} more)"]
    raise SpecError(
        f"statements of '{spec.name}' read each other's outputs in a cycle: "
        + "; ".join(steps),
        _where(spec, spec.gemms[first].where),
        "no launch order can run every writer before its readers; break the cycle",
    )


def analyse(spec: Spec) -> NestDecision:
    reasons: list[str] = []
    plans: list[LaunchPlan] = []
    forced = spec.directives.force
    order = dependency_order(spec)
    gemms = [spec.gemms[i] for i in order]

    if len(gemms) > 1:
        by_sig: dict[tuple, list[Gemm]] = {}
        for g in gemms:
            by_sig.setdefault(signature_key(spec, g), []).append(g)
        if len(by_sig) > 1:
            kinds = "; ".join(
                f"{', '.join('#' + str(g.index) for g in gs)}: {describe_signature(spec, gs[0])}"
                for gs in by_sig.values()
            )
            reasons.append(
                f"not legal as one launch: the statements differ in what a kernel fixes at "
                f"compile time ({kinds})"
            )
        for gs in by_sig.values():
            if len(gs) > 1:
                reasons.append(
                    f"{', '.join('#' + str(g.index) for g in gs)} share a kernel signature but read "
                    "different base tensors; one launch would need a per-leaf pointer table, "
                    "which the kernel ABI does not have, so each gets its own launch"
                )
        if order != sorted(order):
            reasons.append(
                "launch order follows data dependencies: "
                + " -> ".join(f"#{i}" for i in order)
            )
        if forced == "flatten":
            raise SpecError(
                f"'flatten' was requested for '{spec.name}', but its statements cannot share "
                "one launch (see `gemmspec explain`)",
                _where(spec, spec.directives.force_where),
            )
        if len(gemms) > MAX_LAUNCHES:
            raise SpecError(
                f"'{spec.name}' has {len(gemms)} statements, and each needs its own launch: "
                f"more than the {MAX_LAUNCHES} launches one spec may make",
                _where(spec, spec.gemms[MAX_LAUNCHES].where),
            )

    for g in gemms:
        plans.extend(_plan_statement(spec, g, reasons, forced, len(gemms) == 1, len(plans)))

    decision = "flatten" if len(plans) == 1 else "split"
    if decision == "split" and len(gemms) > 1:
        reasons.append(f"split into {len(plans)} flat grouped launches, run in order")
    return NestDecision(spec.name, decision, tuple(reasons), tuple(plans))


def _check_launches(
    spec: Spec, g: Gemm, launches: int, leaves_each: int, planned: int, by_split: bool
) -> None:
    """Bound what a statement's plan would make before making it: a split of a huge
    outer axis would otherwise build one plan per index (millions of them)."""
    if planned + launches > MAX_LAUNCHES:
        what = (
            f"the split directive makes one launch per '{g.leaf_axes[0].name}' index"
            if by_split
            else f"statement #{g.index} needs {launches} launch{'es' if launches != 1 else ''}"
        )
        raise SpecError(
            f"{what}: {planned + launches} launches in all, more than the {MAX_LAUNCHES} one "
            "spec may make",
            _where(spec, spec.directives.force_where if by_split else g.where),
            "use fewer groups or segments, or drop the split directive" if by_split else None,
        )
    if leaves_each > MAX_LEAVES_PER_LAUNCH:
        axes = " x ".join(str(a) for a in g.leaf_axes)
        raise SpecError(
            f"statement #{g.index} has {leaves_each} leaf GEMMs in one launch ({axes}), more "
            f"than {MAX_LEAVES_PER_LAUNCH}: a launch's leaf table is built by one CTA before "
            "the GEMM runs",
            _where(spec, g.where),
            "use fewer or smaller groups or batch dims"
            + (", or `split` to launch once per outer index" if len(g.leaf_axes) > 1 else ""),
        )


def _extent_bound(spec: Spec, g: Gemm, role: str, sizes: dict[str, int]) -> int | None:
    """The most elements one leaf can have along `role`; None when only run time knows
    (`sizes`: the run-time dims known so far)."""
    rd = g.role(role)
    if rd.group is not None:
        grp = spec.group(rd.group)
        if grp.kind in ("split", "uniform"):
            return max(grp.sizes)
    size = spec.dim(rd.dim).size  # a fixed dim, a masked padded size, or a ragged dim's whole
    if role == "n" and g.swiglu_halves and size is not None:
        return 2 * size  # gate rows, then up rows
    return sizes.get(rd.dim) if size is None else size


def tile_bound(
    spec: Spec, g: Gemm, plan: LaunchPlan, leaves_each: int, sizes: dict[str, int] | None = None
) -> int | None:
    """The most output tiles one launch of `g` under `plan` can have, with `sizes` for
    the run-time dims; None when a run-time dim it depends on is not given."""
    sizes = sizes or {}
    m = _extent_bound(spec, g, "m", sizes)
    pinned = dict(plan.pinned)
    if g.n.group is not None and g.n.group in pinned:
        n: int | None = spec.group(g.n.group).sizes[pinned[g.n.group]]
    else:
        n = _extent_bound(spec, g, "n", sizes)
    if m is None or n is None:
        return None
    rows = leaves_each * -(-m // plan.tile_m)
    if g.m.group is not None and spec.group(g.m.group).kind == "ragged":
        # Ragged leaves share their dim: their rows add up to it once per other leaf axis.
        chain = math.prod(grp.count for grp in spec.enclosing(g.m.group))
        rows = min(rows, -(-m * max(g.leaf_count // chain, 1) // plan.tile_m) + leaves_each)
    return rows * -(-n // plan.tile_n)


def _check_tiles(spec: Spec, g: Gemm, plan: LaunchPlan, leaves_each: int) -> None:
    """A launch counts its output tiles in an int32 (the leaf table's prefix sum). Checked
    here where the extents are known at compile time; the executor checks the run-time
    sizes of each call the same way."""
    tiles = tile_bound(spec, g, plan, leaves_each)
    if tiles is not None and tiles > MAX_TILES_PER_LAUNCH:
        raise SpecError(
            f"a launch of statement #{g.index} can have up to {tiles} output tiles of "
            f"{plan.tile_m}x{plan.tile_n}, more than 2^31 - 1: the kernels "
            "count tiles in 32-bit signed integers",
            _where(spec, g.where),
            "use smaller dims or fewer leaves",
        )


def _plan_statement(
    spec: Spec, g: Gemm, reasons: list[str], forced: str | None, single: bool, planned: int
) -> list[LaunchPlan]:
    plans = _plan_launches(spec, g, reasons, forced, single, planned)
    counts = {a.name: a.count for a in g.leaf_axes}
    for p in plans:
        pinned = 1
        for axis, _ in p.pinned:
            pinned *= counts[axis]
        _check_tiles(spec, g, p, g.leaf_count // pinned)
    return plans


def _plan_launches(
    spec: Spec, g: Gemm, reasons: list[str], forced: str | None, single: bool, planned: int
) -> list[LaunchPlan]:
    extents = n_extents(spec, g)
    leaves = g.leaf_count
    axes = " x ".join(str(a) for a in g.leaf_axes) or "a single problem"
    prefix = f"#{g.index}: " if not single else ""
    reasons.append(
        f"{prefix}{leaves} leaf GEMM{'s' if leaves != 1 else ''} ({axes}) share one kernel "
        f"signature: {describe_signature(spec, g)}"
    )
    strided_by_leaf = [
        spec.tensor(x.tensor).name
        for x in (g.loaded_a, g.b, g.out)
        if spec.tensor(x.tensor).layout.kind == "segment_major"
    ]
    if strided_by_leaf:
        reasons.append(
            f"{prefix}every leaf is base + affine offsets of its group indices and segment "
            f"starts; {', '.join(strided_by_leaf)} {'is' if len(strided_by_leaf) == 1 else 'are'} "
            "stored per segment, so strides differ per leaf (each leaf's tensor maps carry its own; still one launch)"
        )
    else:
        reasons.append(
            f"{prefix}every leaf is base + affine offsets of its group indices and segment "
            "starts, with strides shared by all leaves (one problem generator describes them all)"
        )
    loader = (
        f"{prefix}loads: TMA through a tensor map per leaf and operand, built on the device from "
        "the run-time offsets with the leaf's exact bounds (rows and K past the leaf arrive as "
        "zeros); a leaf whose operand base or row stride is not a multiple of 16 bytes is copied "
        "by the producer warpgroup with masked loads instead (correct, slower)"
    )
    # A padded segment_major operand has the padded length as row stride: whole 16-byte
    # rows when pad * element size is a multiple of 16, whatever the segment's length.
    aligned = [
        n for n in strided_by_leaf
        if (spec.tensor(n).layout.pad * ELEMENT_BYTES[spec.tensor(n).dtype]) % 16 == 0
    ]
    unaligned = [n for n in strided_by_leaf if n not in aligned]
    if unaligned:
        loader += (
            f"; {', '.join(unaligned)} {'has' if len(unaligned) == 1 else 'have'} "
            "the segment length as row stride, so segments whose length is not a multiple of "
            "16 bytes take that path"
        )
        padded = [n for n in unaligned if spec.tensor(n).layout.padded]
        if padded:
            loader += (
                f" (rounded up to its pad for {', '.join(padded)}; a pad of 16 bytes' worth "
                "of elements would make every segment load by TMA)"
            )
    if aligned:
        pads = sorted({spec.tensor(n).layout.pad for n in aligned})
        loader += (
            f"; {', '.join(aligned)} {'is' if len(aligned) == 1 else 'are'} stored with padded "
            f"segments (segment_major pad {', '.join(map(str, pads))}): each segment starts at "
            "a multiple of the pad and its rows are whole 16-byte units apart, so every leaf "
            "loads by TMA whatever its length"
        )
    if g.kernel_gather:
        sa = spec.tensor(g.a.tensor).scale
        loader = (
            f"{prefix}loads: A ('{g.a.tensor}') gathered through {g.gather}: rows loaded by TMA, a "
            f"box of one row each (each producer thread issues its tile row's box at the row number "
            f"{g.gather} gives, through a map over all of A's rows; a number outside them reads "
            "zeros), where TMA can describe A (base and row stride multiples of 16 bytes), else "
            "copied by the producer warpgroup (16-byte cp.async copies into the swizzled stage, "
            "several stages in flight); one CTA per tile (no A tile to multicast)"
            + (f"; its {list(sa.block)} scales read through {g.gather} too, staged by the producer" if sa else "")
            + f"; B ('{g.b.tensor}') by TMA through a tensor map per leaf built on the device (copied "
            "by hand where its base or row stride is not a multiple of 16 bytes)"
        )
    reasons.append(loader)
    if g.gather:
        reasons.append(f"{prefix}gathered rows of '{g.a.tensor}': {gather_reason(spec, g)}")
    out_t = spec.tensor(g.out.tensor)
    fp8_out = out_t.dtype in FP8_TYPES
    if g.swiglu:
        where = (
            "each tile's columns 2j (gate) and 2j + 1 (up, the weight's interleaved rows) become "
            "output column j"
            if not g.swiglu_halves else
            f"each tile loads the gate rows of its output columns from '{g.b.tensor}' and the same "
            f"up rows from '{g.swiglu_up}'"
            + (f" ({g.swiglu_up_rows} rows on)" if g.swiglu_up_rows else "")
            + ", two TMA boxes per stage into the tile's halves (each half with its own scales), and "
            "the epilogue pairs column c with c + tile_n/2 (a quad shuffle then lays the results out "
            "as the interleaved form's)"
        )
        reasons.append(
            f"{prefix}SwiGLU: {where}, silu(gate) * up in f32, so the output "
            "tile is half the GEMM tile's width"
            + (
                "; stores straight from registers, masked at the leaf's edges (neighbouring lanes "
                "swap halves so each stores two adjacent columns)"
                if not fp8_out else ""
            )
        )
    if fp8_out:
        rule = "2^ceil(log2(amax / FP8 max))" if out_t.scale.pow2 else "amax / FP8 max"
        reasons.append(
            f"{prefix}stores: D ('{g.out.tensor}') is {out_t.dtype}, quantized in the epilogue as the "
            f"quantize pass would quantize a bf16 result: each value rounded to bf16, then per row "
            f"and 128 columns amax (the four lanes of a quad hold a row's columns of a block: two "
            f"shuffles), scale = {rule}, values divided and converted with saturation; stored "
            f"from registers (lanes swap values so each stores 4 bytes of one row), the scales "
            f"into '{out_t.scale.name}' by one lane per row; rows past the leaf are not stored"
        )
        if g.copy is not None:
            c_t = spec.tensor(g.copy)
            rule = "2^ceil(log2(amax / FP8 max))" if c_t.scale.pow2 else "amax / FP8 max"
            pad = f", segments padded to multiples of {c_t.layout.pad} rows" if c_t.layout.padded else ""
            reasons.append(
                f"{prefix}copy: the statement writes '{g.copy}' = copy({g.out.tensor}) in the same epilogue: "
                f"the same bf16 values quantized per column and 128 rows of each '{g.m.group}' segment "
                f"(blocks from the segment's first row, the last one short), scale = {rule}, stored "
                f"{c_t.layout} (each segment's rows contiguous per column{pad}), the scales into "
                f"'{c_t.scale.name}' ([128, 1] per {g.m.group}); equal, bit for bit, to a bf16 output "
                f"quantized into that layout, without the pass"
            )
    elif g.scatter:
        reasons.append(
            f"{prefix}stores: D ('{g.out.tensor}') scattered through {g.scatter}: each row stored "
            f"straight from registers at the row {g.scatter} names (masked at the leaf's edges); the "
            f"entries of {g.scatter} must be distinct, or two rows would race for one"
        )
    elif not g.swiglu:
        reasons.append(
            f"{prefix}stores: each consumer warpgroup stages its output rows in shared memory and "
            "stores them by TMA through a per-leaf map of the output (f32 += reduce-adds; a 16-bit += "
            "first loads the old tile into the staging by TMA and adds to it), when the "
            "tile is whole 128-byte boxes wide and the ring keeps 3 stages beside it; otherwise, and "
            "for leaves whose output base or row stride is not a multiple of 16 bytes, straight from "
            "registers, masked at the leaf's edges"
        )
    if spec.directives.tile:
        tile_m, chosen = spec.directives.tile
        reasons.append(f"{prefix}tile {tile_m}x{chosen} from the tile directive")
        _check_launches(spec, g, 1, leaves, planned, False)
        return [LaunchPlan(g.index, (), tile_m, chosen)]
    choice = tile_for(spec, g, list(extents.values()))
    tile_m, widest = choice.tile_m, choice.tile_n
    tiles = {i: tile_for(spec, g, [n]) for i, n in extents.items()}
    if len({t.tile_n for t in tiles.values()}) > 1 and g.n.group is not None:
        known = {i: n for i, n in extents.items() if n is not None}
        area = sum(-(-n // widest) * widest for n in known.values())
        waste = 1 - sum(known.values()) / area
        if (waste > WASTE_LIMIT or forced == "split") and forced != "flatten":
            _check_launches(spec, g, len(tiles), leaves // len(tiles), planned, False)
            reasons.append(
                f"{prefix}not profitable as one launch: N per '{g.n.group}' segment is "
                f"{sorted(set(known.values()))}; one {widest}-wide tile would waste "
                f"{waste:.0%} of the tile area, so each segment gets its own tile width"
            )
            return [
                LaunchPlan(g.index, ((g.n.group, i),), tile_m, tiles[i].tile_n, f"N = {extents[i]}",
                           tiles[i].pair_rows)
                for i in sorted(tiles)
            ]
        reasons.append(
            f"{prefix}one {widest}-wide tile fits every N segment (waste {waste:.0%} of tile area)"
        )
    if forced == "split" and len(g.leaf_axes) > 1 and single:
        outer = g.leaf_axes[0]
        _check_launches(spec, g, outer.count, leaves // outer.count, planned, True)
        reasons.append(
            f"split requested: one launch per '{outer.name}' index, each over the inner "
            f"{' x '.join(str(a) for a in g.leaf_axes[1:])} leaves"
        )
        return [
            LaunchPlan(g.index, ((outer.name, i),), tile_m, widest, "", choice.pair_rows)
            for i in range(outer.count)
        ]
    if forced == "split" and single:
        reasons.append("split requested, but a single flat grouped launch has nothing to split")
    n_desc = "run-time N" if None in extents.values() else f"N up to {max(n for n in extents.values())}"
    runtime = [
        r.upper() for r in "mnk"
        if g.role(r).group and spec.group(g.role(r).group).kind == "ragged"
        or g.role(r).masked_by
        or spec.dim(g.role(r).dim).size is None
    ]
    known = (
        f"{' and '.join(runtime)} extents are known only at run time"
        if runtime
        else "all extents are known at compile time"
    )
    reasons.append(
        f"{prefix}profitable as one launch: tile {tile_m}x{widest} for {n_desc}; {known}, tiles "
        "never straddle leaves and ragged edges are masked"
    )
    reasons.append(f"{prefix}tile choice: {choice.reason}")
    _check_launches(spec, g, 1, leaves, planned, False)
    return [LaunchPlan(g.index, (), tile_m, widest, "", choice.pair_rows)]
