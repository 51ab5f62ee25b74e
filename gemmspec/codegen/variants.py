"""Kernels chosen at call time: the decode variant of launches over ragged rows.

A launch whose rows are the segments of a run-time dim (MoE tokens by expert) is tiled
when the spec is compiled, with no knowledge of how many rows a call brings: 128-row
tiles, in CTA pairs that multicast B where the kernel is blockwise-scaled FP8 (tiling
rule 5). That is right for prefill and training. At decode sizes (a few tokens per
expert) every segment still costs whole 128-row tiles, mostly rows of zeros, and a
pair's second CTA waits on its first: the kernel streams each active expert's weights at
about half the HBM rate. The same launch with 64-row tiles of one CTA each streams them
at three quarters of it (H200, FP8 1x128/128x128, E = 32 and T = 1024: 206 against 318
us; E = 8 and T = 128: 57 against 87 us), and in 256-column whole tiles with the table
built in the GEMM, two consumer warpgroups of 128 columns each, at 64-103 % of the 4.2 TB/s
copy rate (E = 32: 190 us; DeepSeek-V3's 256 experts at T = 64: 1.48 ms for 6.4 GB; see
docs/performance.md). In a program of
several launches (the decode expert FFN: SwiGLU up, then the weighted down projection)
every such launch takes its variant, and a launch after the first builds its table in
its GEMM from the offsets the first launch's builder checked: DeepSeek-V3's FFN at T =
64 in 2.50 against 2.75 ms.

So such a launch is compiled twice, as the spec's tiling chose it and as its decode
variant, and each call picks one on the host from the run-time dim's size, which the
call's shapes give (no device value is read, so the choice is made once per shape and
replays in a CUDA graph):

    decode variant  when  size(dim) <= rows_per_segment x segments

where `segments` counts the group's segments (E for MoE experts; L x E for an expert
group nested in adapters) and `rows_per_segment` is 128 where the compiled kernel runs CTA
pairs and the variant takes 256-column whole tiles, 96 where it runs CTA pairs and the
variant keeps the compiled width, 32 where it runs one CTA per tile, and 16 for SwiGLU
over separate weights (measured: see DECODE_ROWS_PAIRED); a program whose launches differ
takes the lowest, so that no launch runs its variant where it loses.
A spec with a `tile(M, N)` directive gets no variant: the tile it asks for is the tile
every call runs. Launches that gather or scatter rows in the GEMM and a copy's 128-row
scale blocks keep their tiling.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..lower.schedule import Launch, Schedule
from ..spec import Spec
from .emit import EmittedProgram, with_kernel_config
from .validate import group_chain_count

# The decode variant's tiles: 64 rows (one consumer warpgroup), one CTA per tile; for a
# launch compiled in CTA pairs (blockwise FP8), 256 columns in whole tiles (no split K)
# where N is a multiple of 256; else the compiled width and split K as the compiled
# kernel has it.
# Measured on the H200 (scripts/pipeline_probe.py --decode, FP8 1x128/128x128, against 64 x
# 192 with split K where its cost model says it pays): 64 x 256 took 54.6 against 56.4 us
# (E 8, T 128, N 4096, K 7168), 191.8 against 202.7 (E 32, T 1024), 101.6 against 115.4
# (the same, N 7168, K 2048), 74.1 against 76.5 and 117.6 against 121.2 (Qwen3 down and
# gate/up, T 128), 1508 against 1654 (DeepSeek-V3 gate/up, T 64); whole tiles were 1-5 %
# faster than the split kernel on every case (a split tile's partial sums, 48 KB of f32
# for 64 x 192, written and read back, cost more than the weights' bytes a part saves:
# with the cost model off, parts took 69 against 56 us at E 8). Dealing all K blocks
# evenly to the blocks (the LoRA shrink's plan) was slower still: 64 against 56 us at E 8,
# 252 against 203 at E 32.
DECODE_TILE_M = 64
DECODE_TILE_N = 256
DECODE_CHANGES = {"tile_m": DECODE_TILE_M, "cluster": 1, "multicast_b": False}
# The wide tiles' columns split between two consumer warpgroups of 128 (GemmKernelConfig.
# n_split) where the launch has no fused epilogue. One warpgroup ran each K block's two
# 128-column batches one after the other and was busy about 90 % of its tile's main loop
# (E 8: 1200 cycles per K block, waiting on loads for 11 %); two run them side by side.
# Measured on the H200 (scripts/pipeline_probe.py --idle 150, against one warpgroup in the
# same process): E 8 58.9 against 62.6 us, E 32 189.5 against 203.2 (N 4096, K 7168) and
# 100.6 against 117.6 (N 7168, K 2048), Qwen3 down 66.6 against 80.9 and gate/up 113.3
# against 130.2 (T 128), DeepSeek-V3 gate/up 1468 against 1519 (T 64).
DECODE_N_SPLIT = 2
# The most leaves whose table the variant's GEMM builds itself (the compiled kernels: 32),
# where the launch is the program's only one or comes after the first (see
# emit.table_in_gemm_allowed). Every block then builds all of them in its
# shared memory (which costs a ring stage from about 100 leaves on) but no builder runs
# before the GEMM. Measured on the H200 (scripts/pipeline_probe.py --decode, FP8): Qwen3
# 128 experts 86.7 -> 76.5 us (N 2048, K 768) and 132.9 -> 122.7 us (N 1536, K 2048);
# DeepSeek-V3 256 experts (N 7168, K 2048) 819.7 -> 766.1 us.
DECODE_INLINE_MAX_LEAVES = 256
# Average rows per segment at or below which a call takes the decode variant, by the
# compiled kernel and the variant. Measured on the H200 (scripts/decode_sweep.py, time of
# the variant over the compiled kernel). Where the compiled kernel runs CTA pairs
# (blockwise FP8), E 8 N 4096 K 7168 / E 32 N 7168 K 2048: the wide 64 x 256 variant wins
# 0.70 / 0.60 at 64 rows per expert, 0.70 / 0.70 at 96 and 0.93 / 0.82 at 128, and loses
# at 192 (1.12 / 1.03); the 64 x 192 one wins 0.61-0.77 up to 64 rows and 0.89-0.91 at
# 96, and loses from 128 (0.99-1.11). Where it runs one CTA per tile (BF16's 128 x 256; E
# 8 N 4096 K 7168 / E 128 N 1536 K 2048): the variant wins 0.96-0.97 / 0.91-0.92 up to 32
# rows and is mixed at 64 (1.07 / 0.95).
# At DeepSeek-V3's 256 experts (N 4096, K 7168) the wide variant (one warpgroup) still
# wins at the bound: 0.54, 0.62, 0.78 and 0.87 of the compiled kernel at 32, 64, 96 and
# 128 rows per expert.
# SwiGLU over separate weights (compiled 128 x 256, one CTA per tile): its 64 x 256
# variant won at 8 and 16 rows per expert (E 8, F 2048, K 7168: 80.2 against 82.5 us and
# 80.6 against 82.1; in the DeepSeek-V3 and Qwen3 decode FFN at 2-16 rows, with its down
# projection, 2.50 against 2.75 ms, 3.01 against 3.31 ms and 279 against 316 us) and lost
# at 32 (106.5 against 83.2 us).
DECODE_ROWS_PAIRED_WIDE = 128
DECODE_ROWS_PAIRED = 96
DECODE_ROWS_SINGLE = 32
DECODE_ROWS_SWIGLU_HALVES = 16


def decode_rows_per_segment(launch: Launch, wide: bool) -> int:
    """The rule's threshold for a launch, by whether its compiled kernel runs CTA pairs
    and whether its variant takes the wide whole tiles (a SwiGLU over separate weights
    has its own)."""
    if launch.signature.swiglu_halves:
        return DECODE_ROWS_SWIGLU_HALVES
    if launch.signature.cluster == 1:
        return DECODE_ROWS_SINGLE
    return DECODE_ROWS_PAIRED_WIDE if wide else DECODE_ROWS_PAIRED
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


def decode_changes(launch: Launch) -> list[dict]:
    """The kernel configurations the decode variant of `launch` may take, best first: the
    first that the kernel's options allow is its variant. The wide whole tiles where they
    were measured (see DECODE_TILE_N): a launch compiled in CTA pairs (blockwise FP8), N a
    multiple of 256. (SwiGLU over separate weights is 256 columns wide as compiled: its
    variant keeps that width, in whole tiles.)"""
    n = launch.problems.extents[1].size
    sig = launch.signature
    wide = sig.cluster > 1 and n.is_const and n.value % DECODE_TILE_N == 0 and sig.tile_n < DECODE_TILE_N
    wide_tiles = {**DECODE_CHANGES, "tile_n": DECODE_TILE_N, "split_k": False}
    # Two consumer warpgroups of 128 columns each where the kernel allows it (no fused
    # epilogue: see DECODE_N_SPLIT), else one of 256.
    return ([{**wide_tiles, "n_split": DECODE_N_SPLIT}, wide_tiles] if wide else []) + [dict(DECODE_CHANGES)]


def _eligible(launch: Launch) -> bool:
    sig = launch.signature
    # A copy's [128, 1] scale blocks are 128-row tiles; rows gathered or scattered in the
    # GEMM keep the tiling they were measured with.
    return sig.tile_m > DECODE_TILE_M and not (sig.copy or sig.gather or sig.scatter)


def _first_fitting(spec: Spec, program: EmittedProgram, launch: Launch) -> tuple[EmittedProgram, bool] | None:
    """`program` with `launch` re-emitted in the first of its decode configurations that
    the kernel's options allow, and whether that is the wide one; None if none fits."""
    for changes in decode_changes(launch):
        try:
            emitted = with_kernel_config(
                spec, program, launch.index, table_tag=DECODE_TABLE_TAG, inline_leaves=DECODE_INLINE_MAX_LEAVES,
                **changes,
            )
        except ValueError:
            continue
        return emitted, "tile_n" in changes
    return None


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
        if rule is not None and (rule.dim, rule.group, rule.segments) != rows:
            continue
        fitted = _first_fitting(spec, variant, launch)
        if fitted is None:  # no narrower tile fits this kernel's options
            continue
        candidate, wide = fitted
        if rule is None:
            rule = DecodeRule(*rows, decode_rows_per_segment(launch, wide))
        else:  # the lowest threshold of the launches: none takes its variant where it loses
            rule = replace(rule, rows_per_segment=min(rule.rows_per_segment, decode_rows_per_segment(launch, wide)))
        before = program.launches[launch.index].gemm.name
        after = candidate.launches[launch.index].gemm.name
        variant = candidate
        changed.append((launch.index, before, after))
    if rule is None or not changed:
        return None
    return DecodeVariant(variant, rule, tuple(changed))
