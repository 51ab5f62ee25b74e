#!/usr/bin/env python3
"""Where a short decode call's time goes: the ragged E = 8 decode case (T = 128, five
experts with rows, N = 4096) at K = 128, 1024 and 7168, gemmspec beside DeepGEMM (where
importable, on its 128-row padded layout) and a one-element add (what any kernel costs
under the method). Each is timed four ways: triton's do_bench (L2 flushed by
zero-filling 256 MB, as `gemmspec bench` does), CUDA events after that zero fill, after a
256 MB read instead (L2 flushed but clean), and back to back. With `--profile` it then
runs one call of each GEMM between cudaProfilerStart and cudaProfilerStop, for

    ncu --profile-from-start off --metrics gpu__time_duration.sum,... python3 scripts/decode_start.py --profile

Needs a Hopper GPU, torch and triton."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_floor import back_to_back, events  # noqa: E402

from gemmspec.bench import offsets_tensor, random_fp8, random_scales, specs  # noqa: E402
from gemmspec.bench.anchors import deepgemm  # noqa: E402
from gemmspec.bench.cases import DECODE_E8  # noqa: E402

N = 4096


def gemmspec_call(lengths: list[int], k: int):
    """The bench's FP8 decode call (the decode variant at this size) and its inputs."""
    e, t = len(lengths), sum(lengths)
    exe = specs.build_spec(specs.moe_spec("moe_fp8", n=N, k=k, e=e, fp8=True, scales_major_t=True))
    x, xs = random_fp8((t, k)), random_scales((k // 128, t)).t()
    w, ws = random_fp8((e, N, k)), random_scales((e, N // 128, k // 128))
    y = torch.empty((t, N), dtype=torch.bfloat16, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offsets_tensor(lengths))
    run.enqueue()
    torch.cuda.synchronize()
    return run.enqueue, (x, xs, w, ws, y)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="128,1024,7168", help="comma-separated K sizes")
    ap.add_argument("--profile", action="store_true", help="also run one call of each GEMM for a profiler")
    args = ap.parse_args()
    dg = deepgemm.load()
    print(f"DeepGEMM: {deepgemm.version(dg) if dg else 'not importable'}")
    lengths = DECODE_E8
    active = [i for i, m in enumerate(lengths) if m]
    zero_flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    read_flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    one = torch.zeros(1, device="cuda")
    profiled = []
    for k in [int(s) for s in args.ks.split(",")]:
        ours, (x, xs, w, ws, y) = gemmspec_call(lengths, k)
        fns = {"gemmspec": ours}
        if dg is not None:
            call, check, _ = deepgemm.prepare_m_grouped_fp8(dg, x, xs, w, ws, lengths, y)
            print(f"K {k}: DeepGEMM against gemmspec: {check}")
            fns["DeepGEMM"] = call
        fns["one-element add"] = lambda: one.add_(1.0)
        mb = len(active) * N * k / 1e6
        for name, fn in fns.items():
            fn()
            torch.cuda.synchronize()
            bench = do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
            print(f"K {k:5} ({mb:6.1f} MB) {name:27} do_bench {bench:6.1f} us | after zero_ "
                  f"{events(fn, zero_flush.zero_):6.1f} | after a read flush {events(fn, read_flush.sum):6.1f} | "
                  f"back to back {back_to_back(fn):6.1f}", flush=True)
        profiled += [fns["gemmspec"]] + ([fns["DeepGEMM"]] if "DeepGEMM" in fns else [])
    if args.profile:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        for fn in profiled:
            zero_flush.zero_()
            fn()
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
