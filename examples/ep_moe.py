"""Train an expert-parallel MoE layer over N processes and check it against the same
layer in one process.

Every rank holds its own tokens, the replicated router and its block of the experts
(contiguous blocks of E/N, gemmspec.ep's default placement) of an expert FFN spec
(examples/moe_ffn_fp8_train.gspec, at the dims given here). A step routes each token to
its top-k experts, dispatches FP8 token rows (with their 1x128 scales) and router
weights to the ranks owning those experts, runs each rank's local grouped GEMMs
through gemmspec.torch, combines the results back in token order, and in backward runs
the derived DGRAD/WGRAD on each rank with the reverse exchanges. The router's gradient
is all-reduced (it is replicated); the expert weights' stay where they live. The data:
a teacher MoE's outputs on random tokens (MSE loss, Adam).

Before training, the first step of every rank (outputs, gradients of the tokens, of the
router and of the rank's experts) is checked element-wise against the same layer on one
process that holds every token and every expert (rank 0 runs it). At the end it prints
the median step time with and without chunked overlap, the bytes each rank sent to the
others per step, and with --plot the time per phase (measured with a synchronization
around each phase, one chunk).

    torchrun --nproc-per-node 8 examples/ep_moe.py --steps 300        # GPUs, NCCL
    torchrun --nproc-per-node 2 examples/ep_moe.py --device cpu --steps 20   # CPUs, gloo

On GPUs it needs Hopper (sm_90a) GPUs, one per process; on the CPU (gloo) the local
GEMMs are gemmspec's float64 reference (slow: keep the dims small). --plot needs
matplotlib.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from gemmspec.ep import SINGLE, EPMoE

SPEC = Path(__file__).resolve().parent / "moe_ffn_fp8_train.gspec"


def spec_text(args) -> str:
    text = SPEC.read_text()
    for old, new in (("H = 7168", f"H = {args.hidden}"), ("N = 4096", f"N = {2 * args.ffn}"),
                     ("F = 2048", f"F = {args.ffn}"), ("E = 8", f"E = {args.experts}")):
        assert old in text, old
        text = text.replace(old, new)
    return text


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank (default 4096 on GPUs, 64 on the CPU)")
    p.add_argument("--hidden", type=int, default=None, help="model width, a multiple of 128")
    p.add_argument("--ffn", type=int, default=None, help="expert width, a multiple of 128")
    p.add_argument("--experts", type=int, default=None, help="experts in all (a multiple of the ranks)")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--chunks", type=int, default=4, help="token chunks that overlap exchanges with GEMMs")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE.png", help="draw the time per phase (rank 0 writes it)")
    args = p.parse_args(argv)
    cpu = args.device == "cpu"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    args.tokens = args.tokens or (64 if cpu else 4096)
    args.hidden = args.hidden or (128 if cpu else 2048)
    args.ffn = args.ffn or (128 if cpu else 1024)
    args.experts = args.experts or (2 * world if cpu else 8 * world)
    for name in ("hidden", "ffn"):
        if getattr(args, name) % 128:
            p.error(f"--{name} must be a multiple of 128")
    return args


def close(got, want, name, rtol, atol, rank):
    """Element-wise |got - want| <= rtol * |want| + atol * rms(want); raise otherwise."""
    want = want.double()
    rms = want.square().mean().sqrt() if want.numel() else 0.0
    err = (got.double() - want).abs()
    bound = rtol * want.abs() + atol * rms
    if not bool((err <= bound).all()):
        worst = float((err - bound).max())
        raise SystemExit(f"rank {rank}: {name} differs from one process: worst excess {worst:.3e}")


def check_first_step(args, spec, group, rank, world, device):
    """Every rank's first step against the one-process layer (rank 0 computes it)."""
    layer = EPMoE(spec, top_k=args.top_k, group=group, seed=args.seed).to(device)
    gen = torch.Generator().manual_seed(args.seed + 1)
    xs = [torch.randn(args.tokens, args.hidden, generator=gen) for _ in range(world)]
    grads = [torch.randn(args.tokens, args.hidden, generator=gen) for _ in range(world)]
    x = xs[rank].to(device, copy=True).requires_grad_(True)
    out = layer(x)
    out.backward(grads[rank].to(device))
    router = layer.router.grad.clone()
    dist.all_reduce(router, group=group)
    mine = {"out": out.detach(), "x": x.grad, "router": router,
            **{w: getattr(layer, w).grad for w in layer.ep.roles.weights}}
    gathered = [None] * world
    dist.all_gather_object(gathered, {k: v.cpu() for k, v in mine.items()}, group=group)
    if rank != 0:
        dist.barrier(group=group)
        return
    # One process, every token and every expert, the same weights (chunks don't matter
    # for the outputs; the reference uses one chunk as the ranks do here).
    one = EPMoE(spec, top_k=args.top_k, group=SINGLE, seed=args.seed).to(device)
    xa = torch.cat(xs).to(device).requires_grad_(True)
    oa = one(xa)
    oa.backward(torch.cat(grads).to(device))
    t = args.tokens
    for r, got in enumerate(gathered):
        close(got["out"], oa.detach()[r * t:(r + 1) * t].cpu(), "output", 2**-7, 2**-9, r)
        close(got["x"], xa.grad[r * t:(r + 1) * t].cpu(), "token gradient", 2**-7, 2**-9, r)
        close(got["router"], one.router.grad.cpu(), "router gradient", 2**-6, 2**-8, r)
        e = layer.ep.plan.ranks[r].experts
        for w in layer.ep.roles.weights:
            close(got[w], getattr(one, w).grad[e.start:e.stop].cpu(), f"{w} gradient", 2**-6, 2**-8, r)
    print(f"first step: every rank's output and gradients match the one-process layer ({world} ranks)", flush=True)
    dist.barrier(group=group)


def train(args, spec, group, rank, world, device, chunks, steps):
    """`steps` steps of the layer with `chunks`; per-step times (s) and bytes sent."""
    torch.manual_seed(args.seed)
    teacher = EPMoE(spec, top_k=args.top_k, group=group, seed=args.seed + 100).to(device)
    model = EPMoE(spec, top_k=args.top_k, group=group, chunks=chunks, seed=args.seed).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 10 + rank)
    times, losses = [], []
    for step in range(steps):
        x = torch.randn(args.tokens, args.hidden, generator=gen).to(device)
        with torch.no_grad():
            target = teacher(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        began = time.perf_counter()
        model.ep.exchange.bytes_sent = 0
        loss = torch.nn.functional.mse_loss(model(x), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        dist.all_reduce(model.router.grad, group=group)  # replicated: average over ranks
        model.router.grad /= world
        opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - began)
        losses.append(loss.item())
        if rank == 0 and (step % max(1, steps // 10) == 0 or step == steps - 1):
            print(f"chunks {chunks} step {step + 1}/{steps} loss {losses[-1]:.5f}", flush=True)
    return times, model.ep.exchange.bytes_sent, losses, model


def phases(args, spec, group, device):
    """Seconds per phase of one step, each phase synchronized (no overlap), one chunk."""
    model = EPMoE(spec, top_k=args.top_k, group=group, seed=args.seed).to(device)
    x = torch.randn(args.tokens, args.hidden, device=device)
    model(x).square().mean().backward()  # warm-up
    model.ep.phases = {}
    model(x).square().mean().backward()
    return model.ep.phases


def main(argv=None):
    args = parse_args(argv)
    device = torch.device(args.device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        if not torch.cuda.is_available():
            sys.exit("ep_moe: --device cuda needs GPUs (pass --device cpu to run on the CPU over gloo)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    group = dist.group.WORLD
    spec = spec_text(args)
    if rank == 0:
        from gemmspec.ep import plan

        print(plan(spec, world), flush=True)
    check_first_step(args, spec, group, rank, world, device)
    warm = max(1, args.steps // 10)
    base, sent, _, _ = train(args, spec, group, rank, world, device, 1, args.steps)
    over, _, losses, _ = train(args, spec, group, rank, world, device, args.chunks, args.steps)
    median = {k: statistics.median(v[warm:] or v) for k, v in (("plain", base), ("overlap", over))}
    stats = torch.tensor([median["plain"], median["overlap"], float(sent)], dtype=torch.float64)
    every = [torch.zeros_like(stats) for _ in range(world)]
    dist.all_gather(every, stats.to(device) if backend == "nccl" else stats, group=group)
    timing = phases(args, spec, group, device) if args.plot else None
    if rank == 0:
        slow = max(float(s[0]) for s in every), max(float(s[1]) for s in every)
        print(f"final loss {losses[-1]:.5f} (first {losses[0]:.5f})")
        print(f"step time (median after {warm} warm-up, slowest rank): 1 chunk {1e3 * slow[0]:.2f} ms, "
              f"{args.chunks} chunks {1e3 * slow[1]:.2f} ms: overlap gain {100 * (1 - slow[1] / slow[0]):.1f}%")
        print("bytes sent to other ranks per step: " + ", ".join(
            f"rank {r} {int(s[2]) / 2**20:.2f} MiB" for r, s in enumerate(every)))
        if timing is not None:
            plot(timing, args, world)
    dist.destroy_process_group()


def plot(timing: dict[str, float], args, world: int) -> None:
    try:
        import matplotlib
    except ImportError:
        print("--plot needs matplotlib (pip install matplotlib); time per phase (ms): " +
              ", ".join(f"{k} {1e3 * v:.2f}" for k, v in timing.items()))
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(timing)
    ax.barh(names, [1e3 * timing[n] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel("ms (rank 0, each phase synchronized, one chunk)")
    ax.set_title(f"EP MoE step over {world} ranks: {args.tokens} tokens/rank, hidden {args.hidden}")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
