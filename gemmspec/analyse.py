"""Nest analysis: may the leaves become one flat launch, and should they?

Legality asks whether every leaf shares one kernel signature and whether each
leaf's operands are base + affine offsets of its group indices and run-time
segment starts (so one problem generator describes them all). Profitability asks
whether one tile shape fits every leaf. The answer is a `NestDecision`: the
launches to make, in dependency order, and every reason in words.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SourceLocation, SpecError
from .spec import FP8_TYPES, Gemm, Spec
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
    cluster: int = 1


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
                + (f" cluster {p.cluster}" if p.cluster > 1 else "")
            )
        return "\n".join(lines)


def signature_key(spec: Spec, g: Gemm) -> tuple:
    """What a kernel fixes at compile time for this statement."""
    a, b, d = (spec.tensor(x.tensor) for x in (g.a, g.b, g.out))
    scales = tuple(t.scale.block if t.scale else None for t in (a, b))
    return (a.dtype, b.dtype, d.dtype, g.accumulate, scales)


def describe_signature(spec: Spec, g: Gemm) -> str:
    a, b, d = (spec.tensor(x.tensor) for x in (g.a, g.b, g.out))
    if a.dtype in FP8_TYPES:
        ops = f"{a.dtype} x {b.dtype} with scales {list(a.scale.block)} x {list(b.scale.block)}"
    else:
        ops = f"{a.dtype} x {b.dtype}"
    return f"{ops} -> {d.dtype}{' (+=)' if g.accumulate else ''}"


def n_extents(spec: Spec, g: Gemm) -> dict[int, int | None]:
    """N extent per index of the group splitting N (or {-1: extent}); None if run-time."""
    role = g.n
    if role.group is not None:
        grp = spec.group(role.group)
        if grp.kind in ("split", "uniform"):
            return dict(enumerate(grp.sizes))
        return {-1: None}
    return {-1: spec.dim(role.dim).size}


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
            return block
    return 1


def tile_for(spec: Spec, g: Gemm, n_extents: list[int | None]) -> TileChoice:
    scaled = spec.tensor(g.a.tensor).scale is not None
    return choose_tile(n_extents, m_bound(spec, g), scaled, b_scale_block_n(spec, g))


def dependency_order(spec: Spec) -> list[int]:
    """Statement order that puts every writer before its readers (source order otherwise)."""
    writers: dict[str, list[int]] = {}
    for g in spec.gemms:
        writers.setdefault(g.out.tensor, []).append(g.index)
    deps = {
        g.index: {
            w for t in (g.a.tensor, g.b.tensor) for w in writers.get(t, []) if w != g.index
        }
        for g in spec.gemms
    }
    order: list[int] = []
    while len(order) < len(spec.gemms):
        ready = [i for i in deps if i not in order and deps[i] <= set(order)]
        if not ready:
            raise SpecError(
                f"statements of '{spec.name}' read each other's outputs in a cycle",
                SourceLocation(spec.path, spec.line, 1),
            )
        order.append(min(ready))
    return order


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
                SourceLocation(spec.path, spec.line, 1),
            )

    for g in gemms:
        plans.extend(_plan_statement(spec, g, reasons, forced, single=len(gemms) == 1))

    decision = "flatten" if len(plans) == 1 else "split"
    if decision == "split" and len(gemms) > 1:
        reasons.append(f"split into {len(plans)} flat grouped launches, run in order")
    return NestDecision(spec.name, decision, tuple(reasons), tuple(plans))


def _plan_statement(spec: Spec, g: Gemm, reasons: list[str], forced: str | None, single: bool) -> list[LaunchPlan]:
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
        for x in (g.a, g.b, g.out)
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
    if strided_by_leaf:
        loader += (
            f"; {', '.join(strided_by_leaf)} {'has' if len(strided_by_leaf) == 1 else 'have'} "
            "the segment length as row stride, so segments whose length is not a multiple of "
            "16 bytes take that path"
        )
    reasons.append(loader)
    if spec.directives.tile:
        tile_m, chosen = spec.directives.tile
        reasons.append(f"{prefix}tile {tile_m}x{chosen} from the tile directive")
        return [LaunchPlan(g.index, (), tile_m, chosen)]
    choice = tile_for(spec, g, list(extents.values()))
    tile_m, widest = choice.tile_m, choice.tile_n
    tiles = {i: tile_for(spec, g, [n]) for i, n in extents.items()}
    if len({t.tile_n for t in tiles.values()}) > 1 and g.n.group is not None:
        known = {i: n for i, n in extents.items() if n is not None}
        area = sum(-(-n // widest) * widest for n in known.values())
        waste = 1 - sum(known.values()) / area
        if (waste > WASTE_LIMIT or forced == "split") and forced != "flatten":
            reasons.append(
                f"{prefix}not profitable as one launch: N per '{g.n.group}' segment is "
                f"{sorted(set(known.values()))}; one {widest}-wide tile would waste "
                f"{waste:.0%} of the tile area, so each segment gets its own tile width"
            )
            return [
                LaunchPlan(
                    g.index, ((g.n.group, i),), tile_m, tiles[i].tile_n, f"N = {extents[i]}", tiles[i].cluster
                )
                for i in sorted(tiles)
            ]
        reasons.append(
            f"{prefix}one {widest}-wide tile fits every N segment (waste {waste:.0%} of tile area)"
        )
    if forced == "split" and len(g.leaf_axes) > 1 and single:
        outer = g.leaf_axes[0]
        reasons.append(
            f"split requested: one launch per '{outer.name}' index, each over the inner "
            f"{' x '.join(str(a) for a in g.leaf_axes[1:])} leaves"
        )
        return [
            LaunchPlan(g.index, ((outer.name, i),), tile_m, widest, "", choice.cluster)
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
    return [LaunchPlan(g.index, (), tile_m, widest, "", choice.cluster)]
