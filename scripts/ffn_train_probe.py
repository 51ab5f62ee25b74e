#!/usr/bin/env python3
"""Time one training step of examples/moe_ffn_fp8_train.gspec through gemmspec.torch.function
(needs a Hopper GPU + torch): the forward, and the forward plus the derived backward (the
down-projection's DGRAD, WGRAD and row passes, the SwiGLU up-projection's recomputed
gate/up columns, swiglu_grad, DGRAD, WGRAD and scatter_add), per call quantizing the
high-precision inputs as the function does. Beside it, where torch has it, the same FFN in
BF16 through torch._grouped_mm with autograd (the SwiGLU and the router weight in torch).

    python3 scripts/ffn_train_probe.py [--tokens S] [--top-k K] [--repeat N] [--profile]

Prints milliseconds (median of N steps after a warm-up) and TFLOPS of the step's GEMM
work: forward 2T(NH + HF), backward 4T(NH + HF) for the gradients plus 2TNH for the
recomputed gate/up columns (counted apart), T = S * K routed rows. With --profile, one
more step runs under torch.profiler and the CUDA time of each kernel is printed, largest
first (gemmspec's kernels are named gs_<spec>_l<i> for launch i, _p<i> for pre-pass i,
_q<i> for row pass i).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec.torch as gt  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "moe_ffn_fp8_train.gspec"


def timed(fn, repeat: int) -> float:
    """Median milliseconds of `fn` over `repeat` calls after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def routing(tokens: int, top_k: int, experts: int, gen):
    """Routed rows sorted by expert: row r reads token src[r] and writes y row dst[r]."""
    choice = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    order = torch.argsort(choice.reshape(-1), stable=True)
    src = (order // top_k).to(torch.int32).cuda()
    dst = torch.randperm(tokens * top_k, generator=gen).to(torch.int32).cuda()
    counts = torch.bincount(choice.reshape(-1), minlength=experts)
    offs = torch.cat([torch.zeros(1, dtype=torch.int64), counts.cumsum(0)]).to(torch.int32).cuda()
    return src, dst, offs, counts.tolist()


def torch_bf16_step(x, w_up, w_down, rw, src, dst, offs, dy):
    """The same FFN in BF16 with torch._grouped_mm and autograd."""
    xs = x[src.long()]
    gu = torch._grouped_mm(xs, w_up.transpose(-2, -1), offs=offs[1:])
    h = torch.nn.functional.silu(gu[:, 0::2]) * gu[:, 1::2]
    rows = torch._grouped_mm(h, w_down.transpose(-2, -1), offs=offs[1:]) * rw[:, None]
    y = torch.zeros_like(rows).index_copy(0, dst.long(), rows)
    y.backward(dy)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--profile", action="store_true", help="print each kernel's CUDA time in one step")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 1
    fn = gt.function(EXAMPLE)
    dims = {d.name: d.size for d in fn.spec.dims}
    e, hid, n, f = dims["E"], dims["H"], dims["N"], dims["F"]
    gen = torch.Generator().manual_seed(0)
    src, dst, offs, counts = routing(args.tokens, args.top_k, e, gen)
    t = sum(counts)
    x = torch.randn(args.tokens, hid, generator=gen).to(torch.bfloat16).cuda().requires_grad_(True)
    w_up = (torch.randn(e, n, hid, generator=gen) / 64).to(torch.bfloat16).cuda().requires_grad_(True)
    w_down = (torch.randn(e, hid, f, generator=gen) / 64).to(torch.bfloat16).cuda().requires_grad_(True)
    rw = torch.rand(t, generator=gen).cuda().requires_grad_(True)
    dy = torch.randn(t, hid, generator=gen).to(torch.bfloat16).cuda()
    call = dict(x=x, w_up=w_up, w_down=w_down, route_w=rw, src=src, dst=dst, expert_offsets=offs)

    def forward():
        with torch.no_grad():
            fn(**call)

    def step():
        outs = fn(**call)
        dict(zip(fn.forward_op.outputs, outs))["y"].backward(dy)

    fwd_flops = 2.0 * t * (n * hid + hid * f)
    grad_flops = 2.0 * fwd_flops
    recompute = 2.0 * t * n * hid
    f_ms, s_ms = timed(forward, args.repeat), timed(step, args.repeat)
    b_ms = s_ms - f_ms
    print(f"routed rows T = {t} ({args.tokens} tokens x top-{args.top_k}), experts {counts}")
    print(f"gemmspec FP8 forward        {f_ms:8.3f} ms  {fwd_flops / f_ms / 1e9:7.1f} TFLOPS")
    print(
        f"gemmspec FP8 backward       {b_ms:8.3f} ms  {grad_flops / b_ms / 1e9:7.1f} TFLOPS of gradients "
        f"({(grad_flops + recompute) / b_ms / 1e9:.1f} with the recomputed gate/up)"
    )
    print(f"gemmspec FP8 step           {s_ms:8.3f} ms  {(fwd_flops + grad_flops) / s_ms / 1e9:7.1f} TFLOPS")
    if hasattr(torch, "_grouped_mm"):
        xb, wub, wdb, rwb = (v.detach().clone().requires_grad_(True) for v in (x, w_up, w_down, rw))
        try:
            ms = timed(lambda: torch_bf16_step(xb, wub, wdb, rwb, src, dst, offs, dy), args.repeat)
        except RuntimeError as err:  # no autograd or no kernel for these shapes
            print(f"torch BF16 _grouped_mm step: not run ({str(err).splitlines()[0]})")
        else:
            print(f"torch BF16 _grouped_mm step {ms:8.3f} ms  {(fwd_flops + grad_flops) / ms / 1e9:7.1f} TFLOPS")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        rows = sorted(
            ((e.key, e.device_time_total / 1e3, e.count) for e in prof.key_averages() if e.device_time_total > 0),
            key=lambda r: -r[1],
        )
        print(f"one step's kernels: {sum(r[1] for r in rows):.3f} ms in all")
        for name, ms, count in rows[:24]:
            print(f"  {ms:8.3f} ms  x{count:<3d} {name[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
