#!/usr/bin/env python3
"""Where the decode variant pays: time a ragged MoE launch as compiled and as its decode
variant (64-row tiles of one CTA, codegen/variants.py) over a range of rows per expert
(needs a Hopper GPU + torch).

For each shape and each average of rows per expert, the token counts are drawn by routing
T tokens to the experts at random (seeded; some experts get none), both programs run on
the same inputs, their outputs must agree (each run's output also fully written), and the
median times (triton's do_bench) are printed with their ratio and the decode rule's pick.

    python3 scripts/decode_sweep.py [--shapes fp8_e32_4096x7168,...] [--rows 1,2,4,...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402
from gemmspec.bench import moe_spec, offsets_tensor, random_fp8, random_scales  # noqa: E402

# name -> (experts, N, K, FP8)
SHAPES = {
    "fp8_e32_4096x7168": (32, 4096, 7168, True),
    "fp8_e8_4096x7168": (8, 4096, 7168, True),
    "fp8_e32_7168x2048": (32, 7168, 2048, True),
    "fp8_e128_1536x2048": (128, 1536, 2048, True),
    # DeepSeek-V3's gate/up: where `gemmspec bench --sweep decode` ends (128 rows per
    # expert on average, the rule's bound) the variant ran at 66 % of the copy rate.
    "fp8_e256_4096x7168": (256, 4096, 7168, True),
    "bf16_e8_4096x7168": (8, 4096, 7168, False),
    "bf16_e128_1536x2048": (128, 1536, 2048, False),
}
ROWS = (1, 4, 16, 32, 48, 64, 96, 128, 192, 256, 512)


def routed_counts(tokens: int, experts: int, seed: int) -> list[int]:
    g = torch.Generator(device="cpu").manual_seed(seed)
    picks = torch.randint(0, experts, (tokens,), generator=g)
    return torch.bincount(picks, minlength=experts).tolist()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated names of " + ", ".join(SHAPES))
    ap.add_argument("--rows", default=",".join(map(str, ROWS)), help="average rows per expert to sweep")
    args = ap.parse_args()
    for shape in args.shapes.split(","):
        e, n, k, fp8 = SHAPES[shape]
        text = moe_spec(f"sweep_{shape}", n=n, k=k, e=e, fp8=fp8, scales_major_t=fp8)
        compiled = gemmspec.build(text)
        compiled.choose_at_call = False
        decode = gemmspec.build(text)
        decode.program, decode.choose_at_call = decode.decode.program, False
        rule = gemmspec.build(text).decode.rule
        print(f"{shape}: compiled {compiled.program.launches[0].gemm.name}", flush=True)
        print(f"{shape}: decode   {decode.program.launches[0].gemm.name}; rule {rule.describe()}", flush=True)
        for per in map(int, args.rows.split(",")):
            t = per * e
            counts = routed_counts(t, e, seed=per)
            if fp8:
                x, w = random_fp8((t, k)), random_fp8((e, n, k))
                tensors = {"x": x, "x_scale": random_scales((k // 128, t)).t(), "w": w,
                           "w_scale": random_scales((e, n // 128, k // 128))}
            else:
                tensors = {"x": torch.randn((t, k), device="cuda", dtype=torch.bfloat16),
                           "w": (torch.randn((e, n, k), device="cuda") / 16).to(torch.bfloat16)}
            offs = offsets_tensor(counts)
            outs, times = [], []
            for exe in (compiled, decode):
                y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
                run = exe.prepare(torch.cuda.current_stream(), y=y, offs=offs, **tensors)
                run.enqueue()
                torch.cuda.synchronize()
                outs.append(y)
                times.append(do_bench(run.enqueue, warmup=25, rep=200, return_mode="median"))
            written = all(bool(torch.isfinite(o.float()).all()) for o in outs)
            diff = float((outs[0].float() - outs[1].float()).norm() / outs[0].float().norm().clamp_min(1e-30))
            active = sum(1 for c in counts if c)
            gbytes = (active * n * k * (1 if fp8 else 2) + t * k * (1 if fp8 else 2) + 2 * t * n) / 1e9
            pick = "decode" if rule.picks_decode({"T": t}) else "compiled"
            print(
                f"{shape:22} rows/expert {per:4} T {t:6} active {active:3}  compiled {times[0] * 1e3:8.1f} us "
                f"({gbytes / times[0]:5.2f} TB/s)  decode {times[1] * 1e3:8.1f} us ({gbytes / times[1]:5.2f} TB/s)  "
                f"decode/compiled {times[1] / times[0]:5.2f}  rule picks {pick:8}  "
                f"{'agree' if written and diff < 4e-3 else 'DIFFER'} (rel {diff:.1e}, written {written})",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
