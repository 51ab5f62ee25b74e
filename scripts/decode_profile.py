#!/usr/bin/env python3
"""One FP8 decode call, bracketed for a profiler: the bench's ragged decode cases (E = 8 at
T = 128 and E = 32 at T = 1024, N = 4096, K = 7168; E = 32 also at N = 7168, K = 2048;
DeepSeek-V3 gate/up at 64 tokens top-8 of 256 experts) are built, warmed up, then called
`--calls` times between cudaProfilerStart and cudaProfilerStop, so that

    ncu --profile-from-start off --section SpeedOfLight ... python3 scripts/decode_profile.py

profiles exactly the kernels of those calls (offsets check, leaf-table builder, GEMM: each
call's whole critical path). Without a profiler it prints each case's kernels per call and
the median time of a call (CUDA events, L2 not flushed). Needs a Hopper GPU and torch."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemmspec.bench import offsets_tensor, random_fp8, random_scales, specs  # noqa: E402
from gemmspec.bench.cases import DECODE_E8, DECODE_E32  # noqa: E402
from gemmspec.bench.inputs import routed_counts  # noqa: E402

CASES = {
    "e8": (DECODE_E8, 4096, 7168),
    "e32": (DECODE_E32, 4096, 7168),
    "e32_n7168": (DECODE_E32, 7168, 2048),
    "dsv3_t64": (routed_counts(64, 256, 8), 4096, 7168),
}


def prepared(lengths: list[int], n: int, k: int):
    e, t = len(lengths), sum(lengths)
    exe = specs.build_spec(specs.moe_spec("moe_fp8", n=n, k=k, e=e, fp8=True, scales_major_t=True))
    y = torch.empty((t, n), dtype=torch.bfloat16, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=random_fp8((t, k)), x_scale=random_scales((k // 128, t)).t(),
                      w=random_fp8((e, n, k)), w_scale=random_scales((e, n // 128, k // 128)), y=y,
                      offs=offsets_tensor(lengths))
    return exe, run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, of " + ", ".join(CASES))
    ap.add_argument("--calls", type=int, default=2, help="calls between profiler start and stop, per case")
    args = ap.parse_args()
    runs = {}
    for name in args.cases.split(","):
        lengths, n, k = CASES[name]
        exe, run = prepared(lengths, n, k)
        for _ in range(20):
            run.enqueue()
        torch.cuda.synchronize()
        times = []
        for _ in range(50):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run.enqueue()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e3)
        kernels = list(run.program.sources())
        print(f"{name}: T={sum(lengths)} active experts {sum(1 for c in lengths if c)}, "
              f"median {sorted(times)[len(times) // 2]:.1f} us per call, kernels {kernels}")
        runs[name] = run
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    for run in runs.values():
        for _ in range(args.calls):
            run.enqueue()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
