"""Tile shapes for a launch: a small, documented heuristic.

The kernels compute an output tile of TILE_M x TILE_N per CTA iteration, with one
consumer warpgroup per 64 rows (TILE_M = 64 or 128) and any multiple of 8 columns up to
the wgmma limit. The choice trades three things, in this order:

1. **Rows per leaf.** When no leaf can have more than 64 rows (a masked or fixed M of at
   most 64), a 128-row tile would compute half zeros: take 64. When N is tiny (at most
   32 columns) the GEMM is bound by reading A once; 64-row tiles double the CTAs in
   flight, which is what a memory-bound kernel needs, and such a kernel runs two blocks
   per SM (half the ring each) so that every tile of a small problem is in flight at once.
2. **Bytes per FLOP.** Each output tile reads (TILE_M + TILE_N) x K operand bytes for
   TILE_M x TILE_N x K multiply-adds, so wider tiles move fewer bytes through L2 and
   shared memory per FLOP; but columns past N are wasted. Over the candidate widths the
   cost ceil(N / TILE_N) x (TILE_M + TILE_N) (operand rows loaded per TILE_M output rows,
   padding included) is minimized; a run-time N takes the widest candidate.
3. **Registers and scales.** Unscaled kernels keep one f32 accumulator tile (TILE_N / 2
   registers per thread): up to 256 columns. Scaled FP8 kernels keep two (the K block's
   and the promoted sum): up to 192 columns. They read one B scale per tile and K block
   when the tile lies inside one B scale block, and two when it straddles at most one
   block boundary: with 128-column weight blocks that allows 144, 160 and 192 columns
   (TILE_N - 128 <= gcd(TILE_N, 128)) beside the divisors of 128. When B scales change
   per column, widths are at most 128. Per-channel scales (one along the whole of K) run
   the unscaled main loop and scale once in the epilogue: the unscaled widths up to 192
   (at 256 the epilogue's scale loads beside the accumulators spill).
   Where no leaf has more than 64 rows (masked decode: a few tokens per expert, each
   expert's weights read once), blockwise FP8 with 128-column weight blocks also takes
   256 columns when every N is a multiple of 256, as two 128-column wgmma halves (rule
   4): the kernel streams weights, and a wider tile reads each token's row fewer times
   and has fewer tiles to start. Measured on the H200 (E = 32 groups of 64 rows, 38-64
   valid): 247 against 259 us (N = 4096, K = 7168) and 135 against 142 us (N = 7168,
   K = 2048); 128 columns ran 252 / 136.

4. **FP8 outputs.** An FP8 output is quantized in the epilogue with one scale per row
   and 128 of its columns, so a tile must cover whole 128-column blocks of the output,
   from tile origins at multiples of 128: 128 columns (256 where the unscaled kernels'
   cost prefers it), and for a SwiGLU, whose output tile is half the GEMM tile, 256
   (128 gate/up pairs). A blockwise-scaled 256-column tile runs each K block's wgmma in
   two 128-column halves, promoted one after the other, since two 256-column accumulator
   tiles would not fit the registers.

5. **CTA pairs along M.** Blockwise-scaled FP8 kernels with 128-row tiles run as clusters
   of two CTAs that own neighbouring row blocks of the same columns and share (multicast)
   their B tile: each CTA loads half of B for both, a third less L2 traffic per tile.
   Measured on the H200 against single CTAs in the same runs: +2 % on the FP8 M-grouped
   headline and +2-3 % on the FP8 WGRAD. A leaf with an odd number of row blocks leaves
   its last pair's second CTA computing zeros, so leaves of at most 128 rows never pair,
   nor do masked rows (counts below a bound known only at run time: 5.5 % slower on the
   masked decode case, 6 x at most 1024 rows, where the idle halves and the pairs' coarser
   waves outweigh the saving); neither do gathered rows (no A tile per row block to pair),
   a fused bias, a SwiGLU and FP8 outputs (not measured; a per-leaf scalar or row weight
   pairs: the expert FFN's down projection, with its row weights, ran as fast in pairs).
   Pairs along N that multicast A were 1.5-3 % slower (the kernels are not L2-bound
   there, and a pair's CTAs wait on each other's stages);
   `GemmKernelConfig(cluster=2)` keeps them for probes.

The ring depth is then as many stages as shared memory holds (see GemmKernelConfig).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

UNSCALED_WIDTHS = (256, 192, 128, 96, 64, 48, 32, 16)
SCALED_WIDTHS = (192, 160, 144, 128, 96, 64, 48, 32, 16)
# Blockwise FP8 leaves of at most 64 rows: 256 columns too, as two 128-column halves.
SCALED_DECODE_WIDTH = 256
PER_COLUMN_SCALED_WIDTHS = (128, 96, 64, 48, 32, 16)
# Per-channel scales: one accumulator tile like the unscaled kernels, but 256 columns
# leave too few registers for the epilogue's scale loads (ptxas spills).
PER_CHANNEL_WIDTHS = tuple(w for w in UNSCALED_WIDTHS if w <= 192)


@dataclass(frozen=True)
class TileChoice:
    tile_m: int
    tile_n: int
    reason: str
    pair_rows: bool = False  # CTA pairs along M multicasting B (rule 5)


MAX_BIAS_WIDTH = 128
# The columns of an FP8 output that share one scale, and the SwiGLU tile that covers
# them: 128 gate/up pairs.
FP8_OUT_BLOCK = 128
FP8_OUT_SWIGLU_WIDTH = 2 * FP8_OUT_BLOCK


def candidate_widths(scaled: bool, sb_block_n: int, per_channel: bool = False) -> tuple[int, ...]:
    if per_channel:
        return PER_CHANNEL_WIDTHS
    if not scaled:
        return UNSCALED_WIDTHS
    # One or two B scales per tile (see GemmKernelConfig.sb_mode); else one per column.
    few = tuple(
        w
        for w in SCALED_WIDTHS
        if sb_block_n % w == 0 or (sb_block_n % 8 == 0 and w <= sb_block_n + math.gcd(w, sb_block_n))
    )
    return few or PER_COLUMN_SCALED_WIDTHS


def _cost(n_extents: list[int], tile_m: int, tile_n: int) -> int:
    return sum(-(-n // tile_n) * (tile_m + tile_n) for n in n_extents)


def choose_tile(
    n_extents: list[int | None],
    m_bound: int | None,
    scaled: bool,
    sb_block_n: int = 1,
    bias: bool = False,
    swiglu: bool = False,
    per_channel: bool = False,
    gather: bool = False,
    fp8_out: bool = False,
    copy: bool = False,
    masked: bool = False,
    halves: bool = False,
) -> TileChoice:
    """Tile for one launch. `n_extents`: N of each leaf class (None: known at run time);
    `m_bound`: the most rows any leaf can have (None: unbounded or run-time); `swiglu`:
    columns pair up (gate 2j, up 2j + 1), so a tile must hold whole pairs; `gather`: A's
    rows come through an index tensor, copied row by row (no A tile to multicast); `fp8_out`:
    the output is FP8, quantized per row and 128 of its columns in the epilogue; `copy`: the
    epilogue writes its segment-major copy too, whose [128, 1] scale blocks are 128-row tiles;
    `masked`: a leaf's rows are a count below `m_bound` known only at run time; `halves`: a
    SwiGLU's tile holds gate rows, then as many up rows (not interleaved pairs)."""
    known = [n for n in n_extents if n is not None]
    skinny = bool(known) and len(known) == len(n_extents) and max(known) <= 32
    if copy:
        tile_m, why_m = 128, "128-row tiles (one [128, 1] scale block of the copy each)"
    elif m_bound is not None and m_bound <= 64:
        tile_m, why_m = 64, f"64-row tiles (no leaf has more than {m_bound} rows)"
    elif skinny:
        tile_m, why_m = 64, (
            f"64-row tiles (N <= {max(known)}: the leaves are bound by reading A, and "
            "smaller tiles put more CTAs in flight)"
        )
    else:
        tile_m, why_m = 128, "128-row tiles"
    widths = candidate_widths(scaled, sb_block_n, per_channel)
    if bias:
        # A bias adds two loads per column pair to the epilogue: wider tiles' accumulators
        # and those together exceed the registers (ptxas spills), so at most 128.
        widths = tuple(w for w in widths if w <= MAX_BIAS_WIDTH)
    if swiglu:
        # Tiles start at multiples of their width: an even width never splits a gate/up
        # pair between two tiles (every candidate is a multiple of 8 today).
        widths = tuple(w for w in widths if w % 2 == 0)
    if halves:
        # Each half whole 8-column wgmma blocks; scaled, each half one 128-row scale block
        # of its weight (the checker makes B's blocks 128 rows), two wgmma halves per K block.
        widths = (FP8_OUT_SWIGLU_WIDTH,) if scaled and not per_channel else tuple(w for w in widths if w % 16 == 0)
    if fp8_out:
        # Whole 128-column scale blocks of the output per tile (tiles start at multiples of
        # their width): the output tile of a SwiGLU is half the GEMM tile.
        if swiglu and scaled and not per_channel:
            widths = (FP8_OUT_SWIGLU_WIDTH,)  # two 128-column wgmma halves per K block
        widths = tuple(w for w in widths if (w // 2 if swiglu else w) % FP8_OUT_BLOCK == 0)
        assert widths, "the checker admits FP8 outputs that some tile width serves"
    decode_wide = (
        scaled and not per_channel and sb_block_n == 128 and tile_m == 64 and m_bound is not None
        and not (bias or swiglu or halves or fp8_out or gather or copy)
        and bool(known) and len(known) == len(n_extents) and all(n % SCALED_DECODE_WIDTH == 0 for n in known)
    )
    if decode_wide:
        widths = (SCALED_DECODE_WIDTH, *widths)
    if len(known) < len(n_extents) or not known:
        tile_n = widths[0]
        why_n = f"{tile_n} columns (N is known only at run time: the widest tile)"
    else:
        tile_n = min(widths, key=lambda w: (_cost(known, tile_m, w), -w))
        why_n = (
            f"{tile_n} columns (fewest operand bytes per output for N = "
            f"{', '.join(str(n) for n in sorted(set(known)))} among widths "
            f"{', '.join(map(str, widths))})"
        )
    if decode_wide and tile_n == SCALED_DECODE_WIDTH:
        why_n += (
            f"; leaves of at most {m_bound} rows stream their weights, and a blockwise tile of "
            f"{tile_n} runs each K block's wgmma in two {tile_n // 2}-column halves"
        )
    if fp8_out:
        why_n += (
            f"; an FP8 output is quantized per row and {FP8_OUT_BLOCK} columns in the epilogue, so "
            f"a tile covers whole {FP8_OUT_BLOCK}-column blocks of it"
            + (f" ({tile_n // 2} output columns of a SwiGLU)" if swiglu else "")
            + (
                f", and runs each K block's wgmma in two {tile_n // 2}-column halves (two "
                f"{tile_n}-column accumulator tiles would not fit the registers)"
                if scaled and not per_channel and tile_n > max(SCALED_WIDTHS)
                else ""
            )
        )
    blockwise = scaled and not per_channel
    pair_rows = (blockwise and tile_m == 128 and not (gather or bias or swiglu or fp8_out or copy or masked)
                 and (m_bound is None or m_bound > tile_m))
    if pair_rows:
        why_c = "CTA pairs along M that multicast their B tile (a third less L2 traffic per tile)"
    else:
        why_c = "one CTA per tile"
        if gather:
            why_c += " (A's rows are gathered row by row: no shared A tile to multicast)"
        elif blockwise and tile_m == 128 and masked:
            why_c += " (masked rows: pairs measured slower, their second blocks past the counts)"
        elif blockwise and tile_m == 128 and m_bound is not None and m_bound <= tile_m:
            why_c += f" (no leaf has more than {m_bound} rows: a pair's second CTA would idle)"
    return TileChoice(tile_m, tile_n, f"{why_m}, {why_n}, {why_c}", pair_rows)
