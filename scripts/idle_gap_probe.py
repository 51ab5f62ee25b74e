#!/usr/bin/env python3
"""Time the FP8 headline GEMM (gemmspec and torch._scaled_grouped_mm, same inputs) back to
back and with the GPU idle before each launch (needs a Hopper GPU + torch).

Sustained FP8 GEMMs run the card into its power and thermal limits: the SM clock drops
and the same kernel takes longer than after a pause. This shows by how much, so that
rates from different runs (or different points of one run) are read with that in mind.
Each line is the median of 60 launches, each between its own pair of CUDA events, with
L2 flushed before each (as `gemmspec bench --idle MS` does).

    python3 scripts/idle_gap_probe.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402
from gemmspec.bench import moe_spec, offsets_tensor, random_fp8, random_scales, timed_launches  # noqa: E402

E, M, N, K = 8, 4096, 4096, 7168
LAUNCHES = 60


def main() -> int:
    t = E * M
    x, w = random_fp8((t, K)), random_fp8((E, N, K))
    xs, ws = random_scales((K // 128, t)).t(), random_scales((E, N // 128, K // 128))
    exe = gemmspec.build(moe_spec("moe_fp8", n=N, k=K, e=E, fp8=True, scales_major_t=True))
    y = torch.empty((t, N), dtype=torch.bfloat16, device="cuda")
    offs = offsets_tensor([M] * E)
    run = exe.prepare(torch.cuda.current_stream(), y=y, offs=offs, x=x, x_scale=xs, w=w, w_scale=ws)
    sa, sb = random_scales((t,)), random_scales((E, N))
    ends = offs[1:].contiguous()

    def torch_mm():
        return torch._scaled_grouped_mm(x, w.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16)

    for _ in range(3):
        run.enqueue()
        torch_mm()
    torch.cuda.synchronize()
    flops = 2.0 * t * N * K
    plan = [("gemmspec", run.enqueue, 0), ("gemmspec", run.enqueue, 2), ("torch", torch_mm, 0), ("torch", torch_mm, 2)]
    for name, fn, idle in plan * 2:  # twice: the card's state drifts over the run
        ms = timed_launches(fn, LAUNCHES, idle)
        how = "back to back" if not idle else f"{idle} ms idle before each"
        print(f"{name:9} {how:26} {ms:.3f} ms {flops / ms / 1e9:7.1f} TFLOPS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
