#!/usr/bin/env python3
"""A timeline of the decode variant's blocks: a ragged decode case (the bench's E = 8 at
T = 128 by default; N = 4096) at a given K, its GEMM (which builds its leaf table itself)
re-emitted with %globaltimer stamps taken by thread 0 of every block at each phase of its
start (entry, offsets checked, table built, tensor maps written, ring initialised), when
its first tile's main loop starts and ends, and when it is done; thread 128 (the
producer's TMA issuer) stamps its way from the ready ring to its first TMA issue (past its
register reallocation, into its first tile, the leaf found and the tile placed, the whole
maps' first rows added) and the issue itself. One call's stamps are printed per block, in
ns after the earliest block's entry, after half a second of matmuls, with the first tile's
cycles (clock64) in its main loop and waiting on full and empty ring stages, then each
column's median over the blocks with a tile. clock64 cycles over the main loop's ns give
the SM clock the call ran at (the matmuls leave the card at its power cap). A probe, not a
product path: the stamps cost a few shared-memory stores and one printf per block.
Needs a Hopper GPU and torch:

    python3 scripts/decode_timeline.py [--k 7168] [--variant n_split=1,tile_n=160,split_k=0] [--warm]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gemmspec  # noqa: E402
from gemmspec.bench import offsets_tensor, random_fp8, random_scales, specs  # noqa: E402
from gemmspec.bench.cases import DECODE_E8, DECODE_E32, DECODE_TOP_K, DSV3_EXPERTS  # noqa: E402
from gemmspec.bench.inputs import routed_counts  # noqa: E402

N = 4096
PHASES = ("entry", "offsets", "table", "maps", "ring", "loop0", "loop1", "done", "tma0")
# The producer's way from the ready ring to its first TMA issue (thread 128's stamps):
# past its register reallocation, into its first tile, the leaf found and the tile placed,
# the loads' first rows in the whole maps added.
PRODUCER_STEPS = ("p_regs", "p_tile", "p_leaf", "p_rows")
# Inside the table and maps phases (kernels with whole-buffer maps; -1 where a stamp's
# place is not in the kernel): the whole maps' writer done writing them, past its release
# and past its acquires and prefetches; the consumers past their D maps' release (in the
# GEMM, a barrier of theirs); the last thread to reach the barrier after the table's scan.
MAPS_STEPS = ("w_written", "w_released", "w_acquired", "d_maps", "scan_last")
# Cycle counts (clock64) of the first tile: its main loop, the consumer waiting for full
# stages and the producer waiting for empty ones.
CYCLES = ("wait_full", "wait_empty", "loop_cyc")
PRELUDE = """
extern "C" __device__ int printf(const char*, ...);
__shared__ unsigned long long gs_probe_stamps[24];
__device__ __forceinline__ unsigned long long gs_probe_now() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ void gs_probe_timed_wait(unsigned bar, unsigned phase, int slot, bool who) {
  const long long c0 = clock64();
  gs_mbar_wait(bar, phase);
  if (who) gs_probe_stamps[slot] += clock64() - c0;
}
#define GS_STAMP(i) do { if (threadIdx.x == 0) gs_probe_stamps[i] = gs_probe_now(); } while (0)
"""


def stamped(source: str) -> str:
    """`source` with the stamps placed (each anchor must be found once)."""
    edits = [
        (r"(__device__ __noinline__ void \w+_leaves_\w*inline\([^{]*\{\n)", r"\1  if (threadIdx.x == 0) for (int i = 0; i < 24; ++i) gs_probe_stamps[i] = 0;\n  GS_STAMP(0);\n"),
        (r"(  __syncthreads\(\);  // the templates and the checked copies are the block's\n)", r"\1  GS_STAMP(1);\n"),
        (r"(  __syncthreads\(\);  // the table is whole\n)", r"\1  GS_STAMP(2);\n"),
        (r"(  __syncthreads\(\);  // the maps are written[^\n]*\n)", r"\1  GS_STAMP(3);\n"),
        # (Where the table's build initialised the ring, no barrier of the entry's is left.)
        (r"(  if constexpr \(CLUSTER > 1\) gs_cluster_sync\(\);(?: else __syncthreads\(\);)?\n)(  if \(threadIdx\.x >= CONSUMER)",
         r"\1  GS_STAMP(4);\n\2"),
        (r"(\n)(      switch \(first\) \{\n(?:.*\n)*?      \}\n)", r"\1      if (tile == unit0) GS_STAMP(5);\n\2"
         r"      if (tile == unit0) GS_STAMP(6);\n"),
        # The issuer's first TMA issue: after its expect_tx, where the loads go out before the
        # scale copies (raw scales by cp.async), else in its block after the stage's branch.
        (r"((?:          gs_mbar_arrive_expect_tx\(full, tx\);\n|      if \(ptid == 0\) \{\n)(?= +load_operands\())",
         r"\1          if (kb == 0 && tile == unit0) gs_probe_stamps[8] = gs_probe_now();\n"),
        (r"      gs_mbar_wait\(empty0 \+ 8 \* stage, phase \^ 1\);\n",
         r"      gs_probe_timed_wait(empty0 + 8 * stage, phase ^ 1, 10, ptid == 0);\n"),
        (r"    gs_mbar_wait\(full0 \+ 8 \* st, ph\);\n", r"    gs_probe_timed_wait(full0 + 8 * st, ph, 9, threadIdx.x == 0);\n"),
        (r"(      if \(tile == unit0\) GS_STAMP\(5\);\n)", r"\1      if (tile == unit0 && threadIdx.x == 0) gs_probe_stamps[11] = clock64();\n"),
        (r"(      if \(tile == unit0\) GS_STAMP\(6\);\n)", r"\1      if (tile == unit0 && threadIdx.x == 0) gs_probe_stamps[11] = clock64() - gs_probe_stamps[11];\n"),
        (r"(    if constexpr \(REALLOC\) gs_setmaxnreg_dec<PRODUCER_REGS>\(\);\n)",
         r"\1    if (threadIdx.x == CONSUMER_THREADS) gs_probe_stamps[12] = gs_probe_now();\n"),
        (r"(    const int li = find_leaf\(leaves, num_leaves, tile\);\n)",
         r"    if (ptid == 0 && tile == unit0) gs_probe_stamps[13] = gs_probe_now();\n\1"),
        (r"(    ScaleCopies scs;\n)", r"    if (ptid == 0 && tile == unit0) gs_probe_stamps[14] = gs_probe_now();\n\1"),
        (r"(    if \(!by_hand\) announce_all\(\);\n)",
         r"    if (ptid == 0 && tile == unit0) gs_probe_stamps[15] = gs_probe_now();\n\1"),
        (r"(    gs_write_map\(whole_ab \+ 1, [^;]*;\n)", r"\1    gs_probe_stamps[16] = gs_probe_now();\n", False),
        (r"(  __syncthreads\(\);  // the table is whole\n)", r"  atomicMax(&gs_probe_stamps[20], gs_probe_now());\n\1"),
        (r"(    gs_tensormap_release\(\);\n)(    gs_tensormap_acquire\(whole_ab\);\n)",
         r"\1    gs_probe_stamps[17] = gs_probe_now();\n\2", False),
        (r"(    gs_tensormap_prefetch\(whole_ab \+ 1\);\n)", r"\1    gs_probe_stamps[18] = gs_probe_now();\n", False),
        (r"(    gs_named_barrier\(D_MAPS_BARRIER, CONSUMER_THREADS\);\n)",
         r"\1    if (threadIdx.x == 0) gs_probe_stamps[19] = gs_probe_now();\n", False),
        (r"(\w+_run\(maps, [^;]*;\n)(\})",
         r'\1  __syncthreads();\n  GS_STAMP(7);\n  if (threadIdx.x == 0) { const unsigned long long* s = gs_probe_stamps; '
         r'printf("stamps %d' + " %llu" * 21 + r'\\n", (int)blockIdx.x, ' + ", ".join(f"s[{i}]" for i in range(21))
         + r'); }\n\2'),
    ]
    out = source.replace('#include "gemmspec_ptx.cuh"\n', '#include "gemmspec_ptx.cuh"\n' + PRELUDE, 1)
    for pattern, repl, *required in edits:
        out, n = re.subn(pattern, repl, out, count=1)
        if n != 1 and (not required or required[0]):
            raise SystemExit(f"anchor not found: {pattern[:60]}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=7168)
    ap.add_argument("--case", choices=("e8", "e32", "dsv3"), default="e8",
                    help="token counts: the bench's E 8 or E 32 decode, or DeepSeek-V3 at 64 tokens")
    ap.add_argument("--warm", action="store_true",
                    help="keep the L2 cache between calls (by default a 256 MB write evicts it before each call, "
                    "as the bench's timing does)")
    ap.add_argument("--variant", default="", help="kernel option changes, e.g. n_split=1,tile_n=160,split_k=0")
    args = ap.parse_args()
    changes = {}
    for item in filter(None, args.variant.split(",")):
        key, value = item.split("=")
        changes[key] = bool(int(value)) if key in ("store_tma", "split_k", "whole_maps") else int(value)
    lengths = {"e8": DECODE_E8, "e32": DECODE_E32,
               "dsv3": routed_counts(64, DSV3_EXPERTS, DECODE_TOP_K, seed=64)}[args.case]
    k = args.k
    e, t = len(lengths), sum(lengths)
    from pipeline_probe import variant  # imports triton, which stamped() alone does not need

    exe = gemmspec.build(specs.moe_spec("moe_fp8", n=N, k=k, e=e, fp8=True, scales_major_t=True))
    cfg = variant(exe, decode=True, **changes)
    launch = exe.program.launches[0]
    exe.program = replace(exe.program, launches=(replace(launch, source=stamped(launch.source)),))
    x, xs = random_fp8((t, k)), random_scales((k // 128, t)).t()
    w, ws = random_fp8((e, N, k)), random_scales((e, N // 128, k // 128))
    y = torch.empty((t, N), dtype=torch.bfloat16, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offsets_tensor(lengths))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    a = torch.randn((8192, 8192), device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # half a second of matmuls: the clocks ramp up before the calls
        a @ a
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as log:
        os.dup2(log.fileno(), 1)  # the kernel's printf writes to the process's stdout
        try:
            for _ in range(5):
                if not args.warm:
                    flush.zero_()
                run.enqueue()
            torch.cuda.synchronize()
        finally:
            os.dup2(saved, 1)
        log.seek(0)
        lines = log.read().decode().splitlines()
    print(f"{args.case}, {cfg.name}, K {k}")
    print_stamps([line for line in lines if line.startswith("stamps ")][-132:])
    return 0


def print_stamps(lines: list[str]) -> None:
    """The stamps the kernel printed (one line per block), in ns after the earliest entry,
    then each column's median over the blocks that had a tile."""
    rows = {}
    for line in lines:
        if line.startswith("stamps "):
            b, *vals = map(int, line.split()[1:])
            rows[b] = vals
    base = min(v[0] for v in rows.values())
    times_of = {b: [(v - base) if v else -1 for v in vals[: len(PHASES)]]
                + [(v - base) if v else -1 for v in vals[len(PHASES) + len(CYCLES) :]] for b, vals in rows.items()}
    cycles_of = {b: vals[len(PHASES) : len(PHASES) + len(CYCLES)] for b, vals in rows.items()}
    names = PHASES + PRODUCER_STEPS + MAPS_STEPS
    print("block  " + " ".join(f"{p:>8}" for p in names) + " " + " ".join(f"{c:>10}" for c in CYCLES))
    for b in sorted(rows):
        print(f"{b:5}  " + " ".join(f"{v:8d}" for v in times_of[b]) + " " + " ".join(f"{c:10d}" for c in cycles_of[b]))
    worked = [b for b in rows if times_of[b][PHASES.index("tma0")] >= 0]
    if worked:
        medians = [statistics.median(times_of[b][i] for b in worked) for i in range(len(names))]
        cycles = [statistics.median(cycles_of[b][i] for b in worked) for i in range(len(CYCLES))]
        print(f"median over {len(worked)} blocks with a tile:")
        print("       " + " ".join(f"{v:8.0f}" for v in medians) + " " + " ".join(f"{c:10.0f}" for c in cycles))


if __name__ == "__main__":
    sys.exit(main())
