"""Which experts each rank owns, and what each rank runs and exchanges: the plan of an
expert FFN spec over a process group.

An expert FFN spec (examples/moe_ffn_fp8.gspec, moe_ffn_fp8_train.gspec) is one ragged
group of routed rows over E experts, a token tensor read through a gather index
(`x[src[t], k]`), expert weights whose first dim is E, and an output written through a
scatter index and weighted per row by the router (`y[dst[t], n] = route_w[t] * ...`).
Expert parallelism keeps that spec as written and changes one number per rank: the
rank's local spec is the same text with E set to the number of experts it owns
(contiguous blocks by default), so its grouped GEMMs, their derived backward and its
explain all come from the one declaration. Everything the exchange moves per routed
row follows from the spec's tensors: the token row in its declared type (FP8 rows with
their 1x128 scales where the spec says FP8), the router weight, and the output row back.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from .. import ast
from ..errors import GemmspecError
from ..spec import ELEMENT_BYTES, Spec

__all__ = ["EPPlan", "ExpertFFN", "Placement", "RankPlan", "contiguous", "expert_ffn", "plan"]


@dataclass(frozen=True)
class Placement:
    """Experts owned by each rank: rank r owns the contiguous block of `sizes[r]` experts
    that follows rank r-1's. Contiguous blocks make the sender's expert order its
    destination-rank order too, so one sort lays out every rank's rows."""

    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        if isinstance(self.sizes, list):  # a list of sizes is taken as the tuple
            object.__setattr__(self, "sizes", tuple(self.sizes))
        if not isinstance(self.sizes, tuple):
            raise GemmspecError(f"placement: sizes is one expert count per rank (a tuple of ints), got {self.sizes!r}")
        if not self.sizes or any(type(s) is not int or s < 1 for s in self.sizes):
            raise GemmspecError(f"placement: every rank must own at least one expert, got sizes {list(self.sizes)}")

    @classmethod
    def contiguous(cls, experts: int, world: int) -> Placement:
        """E/world experts per rank, in rank order (the default)."""
        if type(world) is not int:
            raise GemmspecError(f"placement: the number of ranks must be an int, got {world!r}")
        if world < 1 or experts % world:
            raise GemmspecError(
                f"placement: {experts} experts do not split evenly over {world} ranks; "
                f"pass Placement(sizes) with one block size per rank summing to {experts}"
            )
        return cls((experts // world,) * world)

    @property
    def world(self) -> int:
        return len(self.sizes)

    @property
    def experts(self) -> int:
        return sum(self.sizes)

    @cached_property
    def starts(self) -> tuple[int, ...]:
        out, acc = [], 0
        for s in self.sizes:
            out.append(acc)
            acc += s
        return tuple(out)

    def experts_of(self, rank: int) -> range:
        return range(self.starts[rank], self.starts[rank] + self.sizes[rank])

    def owner(self, expert: int) -> int:
        if expert < 0:
            raise IndexError(f"expert {expert} outside the placement's {self.experts}")
        for r in range(self.world):
            if expert < self.starts[r] + self.sizes[r]:
                return r
        raise IndexError(f"expert {expert} outside the placement's {self.experts}")

    def __str__(self) -> str:
        return ", ".join(f"rank {r}: experts {_span(self.experts_of(r))}" for r in range(self.world))


def contiguous(experts: int, world: int) -> Placement:
    """The default placement: contiguous blocks of experts/world experts per rank."""
    return Placement.contiguous(experts, world)


def _span(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


@dataclass(frozen=True)
class ExpertFFN:
    """The roles of an expert FFN spec's names, as expert parallelism needs them."""

    spec: Spec
    group: str  # the ragged group of routed rows
    experts_dim: str  # its count dim (E)
    rows_dim: str  # the routed rows' run-time dim (T)
    offsets: str  # the group's offsets tensor
    tokens: str  # the tensor read through the gather index (x)
    gather: str  # the gather index (src)
    output: str  # the tensor written through the scatter index (y)
    scatter: str  # the scatter index (dst)
    route_weight: str  # the output statement's per-row weight (route_w)
    weights: tuple[str, ...]  # expert weights: first dim E, sharded by the placement

    @property
    def experts(self) -> int:
        return self.spec.group(self.group).count

    @property
    def hidden(self) -> int:
        return self.spec.dim(self.spec.tensor(self.tokens).dims[1]).size

    @property
    def out_columns(self) -> int:
        return self.spec.dim(self.spec.tensor(self.output).dims[1]).size

    def row_bytes(self, name: str, spec: Spec | None = None) -> int:
        """Bytes of one row of `name` (a [rows, C] tensor) with its scales, if any."""
        t = (spec or self.spec).tensor(name)
        cols = (spec or self.spec).dim(t.dims[1]).size
        out = cols * ELEMENT_BYTES[t.dtype]
        if t.scale is not None:
            out += -(-cols // t.scale.block[1]) * ELEMENT_BYTES[t.scale.dtype]
        return out


def _refuse(spec: Spec, what: str) -> GemmspecError:
    return GemmspecError(
        f"{spec.name}: expert parallelism needs an expert FFN spec ({what}); see "
        "examples/moe_ffn_fp8.gspec: one ragged group of routed rows, tokens read through "
        "an index (x[src[t], k]), weights [E, ...] and an output written through an index "
        "with the router weight (y[dst[t], n] = route_w[t] * ...)"
    )


def expert_ffn(spec: Spec) -> ExpertFFN:
    """The roles of `spec`'s names; GemmspecError naming what is missing otherwise."""
    if len(spec.groups) != 1:
        raise _refuse(spec, f"it has {len(spec.groups)} groups, not one")
    g = spec.groups[0]
    if g.kind != "ragged" or g.within is not None:
        raise _refuse(spec, f"group '{g.name}' is {g.kind}{' nested' if g.within else ''}, not a plain ragged group")
    for s in spec.gemms:
        if [a.group for a in s.leaf_axes] != [g.name]:
            raise _refuse(spec, f"statement #{s.index} is not grouped by '{g.name}' alone")
    gathers = [s for s in spec.gemms if s.gather]
    scatters = [s for s in spec.gemms if s.scatter]
    if len(gathers) != 1 or len(scatters) != 1:
        raise _refuse(spec, "exactly one statement must gather the tokens and one scatter the output")
    tokens, out = spec.tensor(gathers[0].a.tensor), spec.tensor(scatters[0].out.tensor)
    row = scatters[0].epilogue_of("row")
    if row is None:
        raise _refuse(spec, f"the statement writing '{out.name}' has no router weight per row")
    weights = tuple(
        t.name for t in spec.tensors
        if t.derived is None and t.name not in spec.written and t.dims and t.dims[0] == g.count_dim
    )
    for t in (tokens, out):
        if t.rank != 2 or spec.dim(t.dims[1]).size is None or t.layout.kind != "strided":
            raise _refuse(spec, f"'{t.name}' must be a strided [rows, fixed columns] tensor")
    known = {g.dim, tokens.dims[0], out.dims[0]}
    extra = [d for d in spec.runtime_dims if d not in known]
    if extra:
        raise _refuse(spec, f"run-time dim(s) {', '.join(extra)} are not rows of the exchange")
    roles = ExpertFFN(
        spec, g.name, g.count_dim, g.dim, g.tensor, tokens.name, gathers[0].gather,
        out.name, scatters[0].scatter, row.access.tensor, weights,
    )
    scales = {t.scale.name for t in spec.tensors if t.scale is not None}
    moved = {roles.offsets, roles.tokens, roles.gather, roles.scatter, roles.route_weight, *weights}
    for name in (n for n in _inputs(spec) if n not in moved and n not in scales):
        raise _refuse(spec, f"input '{name}' is neither moved by the exchange nor an expert weight")
    return roles


def _inputs(spec: Spec) -> list[str]:
    return [t.name for t in spec.tensors if t.derived is None and t.name not in spec.written] + [spec.groups[0].tensor]


def local_file(file: ast.FileAst, spec_name: str, experts_dim: str, count: int, capacity: bool) -> ast.FileAst:
    """`file`'s spec `spec_name` with `count` experts (the group's count, or the dim
    declaration that sizes it) and, for `capacity`, its ragged group as a capacity
    buffer: the local spec of a rank. The text stays the original, so a located error
    points at the declaration as written."""
    spec = next(s for s in file.specs if s.name.text == spec_name)
    groups = []
    for g in spec.groups:
        if g.count_dim.text == experts_dim and g.count is not None:
            g = replace(g, count=count)
        if capacity and g.kind.kind == "ragged":
            g = replace(g, kind=replace(g.kind, capacity=True))
        groups.append(g)
    dims = tuple(replace(d, size=count) if d.name.text == experts_dim and d.size is not None else d for d in spec.dims)
    return replace(file, specs=(replace(spec, dims=dims, groups=tuple(groups)),))


@dataclass(frozen=True)
class RankPlan:
    """What one rank owns and runs: its experts, its local spec (the file with E set to
    their number) and the shapes of its expert weights."""

    rank: int
    experts: range
    file: ast.FileAst
    weight_shapes: tuple[tuple[str, tuple[int, ...]], ...]

    def build(self):
        """The local spec, built (gemmspec.build): its explain is the rank's launches."""
        from ..build import build

        return build(self.file)


@dataclass(frozen=True)
class EPPlan:
    """An expert FFN spec over `placement.world` ranks: the roles, each rank's plan and
    the bytes one routed row moves in each exchange."""

    roles: ExpertFFN
    placement: Placement
    ranks: tuple[RankPlan, ...]
    capacity: bool
    dispatch_bytes: int  # token row (with scales) + router weight, sender to owner
    combine_bytes: int  # output row, owner to sender
    backward_bytes: tuple[int, int] | None  # (output gradient row out, token gradient row + router grad back)

    def __str__(self) -> str:
        r, p = self.roles, self.placement
        spec = r.spec
        tok = spec.tensor(r.tokens)
        lines = [
            f"expert parallelism: {spec.name}, {r.experts} experts ({r.group}) over {p.world} rank(s)"
            + (", capacity buffers (fixed rows per rank pair)" if self.capacity else ""),
            f"  placement: {p}",
            f"  dispatch per routed row: {r.tokens} row ({tok.dtype}"
            + (f", scales {tok.scale.block_text}" if tok.scale else "")
            + f") + {r.route_weight} (f32) = {self.dispatch_bytes} B, sent in expert order; "
            f"the owner's GEMMs read it through {r.gather} and write {r.output} through {r.scatter} "
            "(the exchange makes no permute copy; the gather plan in explain says how the rows are read)",
            f"  combine per routed row: {r.output} row ({spec.tensor(r.output).dtype}) = {self.combine_bytes} B back; "
            "each token's rows summed in slot order (deterministic)",
        ]
        if self.backward_bytes is not None:
            out, back = self.backward_bytes
            lines.append(
                f"  backward per routed row: output gradient {out} B out, token gradient + router weight "
                f"gradient {back} B back; expert weight gradients stay on their owner"
            )
        for rp in self.ranks:
            shapes = ", ".join(f"{n} {list(s)}" for n, s in rp.weight_shapes)
            lines.append(f"  rank {rp.rank}: experts {_span(rp.experts)} ({len(rp.experts)} local): {shapes}")
        return "\n".join(lines)


def plan(spec, world_size: int, placement: Placement | None = None, *, capacity: bool = False,
         name: str | None = None) -> EPPlan:
    """The plan of `spec` (a path, .gspec text or parsed file) over `world_size` ranks:
    printable (`str`), and each rank's `RankPlan.build()` is its local spec."""
    from ..backward import derive_backward
    from ..check import check
    from ..parse import parse
    from ..pipeline import load

    if type(world_size) is not int or world_size < 1:
        raise GemmspecError(f"plan: world_size must be an int >= 1, got {world_size!r}")
    if placement is not None and not isinstance(placement, Placement):
        raise GemmspecError(
            f"plan: placement must be a Placement (Placement(sizes), one expert count per rank), got {placement!r}"
        )
    file = load(Path(spec) if isinstance(spec, Path) else spec)
    specs = check(file)
    if name is not None:
        specs = tuple(s for s in specs if s.name == name)
    if len(specs) != 1:
        names = ", ".join(s.name for s in check(file))
        if name is not None:
            raise GemmspecError(f"no spec named {name!r}: the file holds {names}")
        raise GemmspecError(f"pass name=... to pick one spec of {names}")
    roles = expert_ffn(specs[0])
    placement = placement or Placement.contiguous(roles.experts, world_size)
    if placement.world != world_size or placement.experts != roles.experts:
        raise GemmspecError(
            f"placement {list(placement.sizes)} is for {placement.world} ranks and {placement.experts} "
            f"experts; the group has {roles.experts} experts over {world_size} ranks"
        )
    ranks = []
    for r in range(world_size):
        local = local_file(file, roles.spec.name, roles.experts_dim, placement.sizes[r], capacity)
        shapes = tuple(
            (w, (placement.sizes[r], *(roles.spec.dim(d).size for d in roles.spec.tensor(w).dims[1:])))
            for w in roles.weights
        )
        ranks.append(RankPlan(r, placement.experts_of(r), local, shapes))
    backward = None
    bw = derive_backward(roles.spec)
    if bw.statements and not bw.skipped:
        bspec = check(parse(bw.source))[0]
        grad = dict(bw.output_grads)[roles.output]
        token_grad = next(d.grad for d in bw.statements if d.wrt == roles.tokens)
        backward = (roles.row_bytes(grad, bspec), roles.row_bytes(token_grad, bspec) + 4)
    return EPPlan(
        roles, placement, tuple(ranks), capacity,
        dispatch_bytes=roles.row_bytes(roles.tokens) + 4,
        combine_bytes=roles.row_bytes(roles.output),
        backward_bytes=backward,
    )
