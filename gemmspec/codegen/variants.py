"""Kernels chosen at call time: the decode variant of launches over ragged rows.

A launch whose rows are the segments of a run-time dim (MoE tokens by expert) is tiled
when the spec is compiled, with no knowledge of how many rows a call brings: 128-row
tiles, in CTA pairs that multicast B where the kernel is blockwise-scaled FP8 (tiling
rule 5). That is right for prefill and training. At decode sizes (a few tokens per
expert) every segment still costs whole 128-row tiles, mostly rows of zeros, and a
pair's second CTA waits on its first: the kernel streams each active expert's weights at
about half the HBM rate. The same launch with 64-row tiles of one CTA each streams them
at three quarters of it (H200, FP8 1x128/128x128, E = 32 and T = 1024: 206 against 318
us; E = 8 and T = 128: 57 against 87 us; see docs/performance.md).

So such a launch is compiled twice, as the spec's tiling chose it and as its decode
variant, and each call picks one on the host from the run-time dim's size, which the
call's shapes give (no device value is read, so the choice is made once per shape and
replays in a CUDA graph):

    decode variant  when  size(dim) <= rows_per_segment x segments

where `segments` counts the group's segments (E for MoE experts; L x E for an expert
group nested in adapters) and `rows_per_segment` is 96 where the compiled kernel runs CTA
pairs and 32 where it runs one CTA per tile (measured: see DECODE_ROWS_PAIRED). A spec with a
`tile(M, N)` directive gets no variant: the tile it asks for is the tile every call runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..lower.schedule import Launch, Schedule
from ..spec import Spec
from .emit import EmittedProgram, with_kernel_config
from .validate import group_chain_count

# The decode variant's tiles: 64 rows (one consumer warpgroup), one CTA per tile.
DECODE_TILE_M = 64
DECODE_CHANGES = {"tile_m": DECODE_TILE_M, "cluster": 1, "multicast_b": False}
# Average rows per segment at or below which a call takes the decode variant, by the
# compiled kernel. Measured on the H200 (scripts/decode_sweep.py, time of the variant over
# the compiled kernel): where the compiled kernel runs CTA pairs (blockwise FP8) the
# variant wins 0.61-0.77x up to 64 rows per expert and 0.89-0.91x at 96, and loses from
# 128 (0.99-1.11x); where it runs one CTA per tile (BF16's 128 x 256) the variant wins
# 0.91-0.99x up to 32 rows and loses 1.05-1.06x at 64.
DECODE_ROWS_PAIRED = 96
DECODE_ROWS_SINGLE = 32


def decode_rows_per_segment(launch: Launch) -> int:
    """The rule's threshold for a launch, by whether its compiled kernel runs CTA pairs."""
    return DECODE_ROWS_PAIRED if launch.signature.cluster > 1 else DECODE_ROWS_SINGLE
# The decode variant's leaf-table builders (where a launch has one) are named with this
# tag: their tables count 64-row tiles, so they are other kernels than the compiled ones.
DECODE_TABLE_TAG = "decode"


@dataclass(frozen=True)
class DecodeRule:
    """When a call takes the decode variant: `dim`'s size at most `rows_per_segment`
    times `segments` (the segments of `group` that share the dim)."""

    dim: str
    group: str
    segments: int
    rows_per_segment: int

    @property
    def max_rows(self) -> int:
        return self.rows_per_segment * self.segments

    def picks_decode(self, dims: dict[str, int]) -> bool:
        return dims.get(self.dim, self.max_rows + 1) <= self.max_rows

    def describe(self) -> str:
        return (
            f"{self.dim} <= {self.rows_per_segment} x {self.segments} segments of '{self.group}' "
            f"= {self.max_rows} rows"
        )


@dataclass(frozen=True)
class DecodeVariant:
    """The program with every eligible launch re-emitted as its decode variant, the rule
    that picks it, and which launches differ (their kernel names, compile-time choice
    first)."""

    program: EmittedProgram
    rule: DecodeRule
    launches: tuple[tuple[int, str, str], ...]  # (launch index, kernel as compiled, decode kernel)

    def to_json(self) -> dict:
        """The rule and the changed launches, as `explain --json` and the manifest give them."""
        return decode_json(self.rule, self.launches)


def decode_json(rule: DecodeRule, launches: tuple[tuple[int, str, str], ...]) -> dict:
    """The rule and each changed launch's two kernels as JSON (`run_time_choice`)."""
    return {
        "dim": rule.dim,
        "group": rule.group,
        "segments": rule.segments,
        "rows_per_segment": rule.rows_per_segment,
        "max_rows": rule.max_rows,
        "rule": rule.describe(),
        "launches": [{"launch": i, "compiled": before, "decode": after} for i, before, after in launches],
    }


def _ragged_rows(spec: Spec, launch: Launch) -> tuple[str, str, int] | None:
    """(dim, group, segments) where the launch's rows are the segments of a ragged group
    over a run-time dim; None otherwise."""
    m = launch.problems.extents[0]
    if m.kind != "segment" or m.group_kind != "ragged" or m.group is None:
        return None
    if spec.dim(m.dim).size is not None:
        return None
    group = spec.group(m.group)
    return m.dim, group.name, group_chain_count(spec, group.name) * group.count


def _eligible(launch: Launch) -> bool:
    sig = launch.signature
    # A copy's [128, 1] scale blocks are 128-row tiles; gathered or scattered rows and
    # SwiGLU over separate weights keep the tiling they were measured with.
    return sig.tile_m > DECODE_TILE_M and not (sig.copy or sig.gather or sig.scatter or sig.swiglu_halves)


def decode_variant(spec: Spec, schedule: Schedule, program: EmittedProgram) -> DecodeVariant | None:
    """The decode variant of `program`, or None where no launch has one. One rule serves
    a program: the launches over the first eligible launch's dim and group."""
    if spec.directives.tile is not None:
        return None  # a tile the spec asks for is the tile every call runs
    rule: DecodeRule | None = None
    changed: list[tuple[int, str, str]] = []
    variant = program
    for launch in schedule.launches:
        rows = _ragged_rows(spec, launch)
        if rows is None or not _eligible(launch):
            continue
        if rule is None:
            rule = DecodeRule(*rows, decode_rows_per_segment(launch))
        elif (rule.dim, rule.group, rule.segments) != rows:
            continue
        try:
            candidate = with_kernel_config(
                spec, variant, launch.index, table_tag=DECODE_TABLE_TAG, **DECODE_CHANGES
            )
        except ValueError:  # the narrower tile does not fit this kernel's options
            continue
        before = program.launches[launch.index].gemm.name
        after = candidate.launches[launch.index].gemm.name
        variant = candidate
        changed.append((launch.index, before, after))
    if rule is None or not changed:
        return None
    return DecodeVariant(variant, rule, tuple(changed))
