"""Train a small MoE feed-forward block with gemmspec's FP8 grouped GEMMs, beside the
same block in BF16 torch, and print both losses as they go.

The block: a router (linear, softmax, top-1) sends each token to one of 8 experts;
tokens are sorted by expert (ragged segments of any length, none padded), and each
expert applies up-projection, GELU and down-projection, scaled by its router
probability. The FP8 model runs both projections through gemmspec.torch.function:
FP8 forward with 1x128 activation and 128x128 weight scales, and the derived DGRAD
and K-grouped WGRAD (128x1 scales per expert segment) in backward. The BF16 model is
the same block with torch's BF16 grouped GEMM (`torch._grouped_mm`, forward and
backward), from the same initial weights, on the same data: a teacher MoE's outputs on
random tokens (MSE loss, Adam). Each model's steps are timed apart (CUDA events, after
a warm-up) and both step times are printed at the end.

    python examples/train_moe_fp8.py --steps 300 --plot losses.png

Needs a Hopper GPU and torch; `--plot` needs matplotlib, the progress bar uses tqdm
when it is installed.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

import gemmspec.torch as gt

PROJECTION = """
gemm moe_{name} {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""


class MoE(torch.nn.Module):
    """Top-1 MoE FFN; `fp8` picks gemmspec FP8 projections or BF16 torch ones."""

    def __init__(self, hidden: int, ffn: int, experts: int, fp8: bool, init: dict | None = None):
        super().__init__()
        self.experts, self.fp8 = experts, fp8
        self.router = torch.nn.Linear(hidden, experts, bias=False)
        self.w_up = torch.nn.Parameter(torch.randn(experts, ffn, hidden) / hidden**0.5)
        self.w_down = torch.nn.Parameter(torch.randn(experts, hidden, ffn) / ffn**0.5)
        if init is not None:
            self.load_state_dict(init)
        if fp8:
            self.up = gt.function(PROJECTION.format(name="up", n=ffn, k=hidden, e=experts))
            self.down = gt.function(PROJECTION.format(name="down", n=hidden, k=ffn, e=experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.router(x.float()), dim=-1)
        gate, expert = probs.max(dim=-1)
        order = torch.argsort(expert)
        counts = torch.bincount(expert, minlength=self.experts)
        offs = torch.zeros(self.experts + 1, dtype=torch.int32, device=x.device)
        offs[1:] = torch.cumsum(counts, 0)
        xs = x[order].to(torch.bfloat16)
        if self.fp8:
            h = torch.nn.functional.gelu(self.up(x=xs, w=self.w_up, offs=offs).float())
            ys = self.down(x=h.to(torch.bfloat16), w=self.w_down, offs=offs).float()
        else:
            ys = self._bf16_experts(xs, offs[1:])
        out = torch.empty_like(ys)
        out[order] = ys
        return out * gate[:, None]

    def _bf16_experts(self, xs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        # torch's grouped GEMM: 2-D tokens x 3-D expert weights, groups ending at `ends`.
        w_up = self.w_up.to(torch.bfloat16).transpose(-2, -1)
        w_down = self.w_down.to(torch.bfloat16).transpose(-2, -1)
        h = torch.nn.functional.gelu(torch._grouped_mm(xs, w_up, offs=ends).float())
        return torch._grouped_mm(h.to(torch.bfloat16), w_down, offs=ends).float()


def progress(steps: int):
    try:
        from tqdm import tqdm

        return tqdm(range(steps), file=sys.stdout, dynamic_ncols=True)
    except ImportError:
        return range(steps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per step")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE.png", help="save both loss curves to a PNG")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("train_moe_fp8: needs a CUDA GPU (Hopper, sm_90a)")
    torch.manual_seed(args.seed)
    dev = torch.device("cuda")
    teacher = MoE(args.hidden, args.ffn, args.experts, fp8=False).to(dev)
    bf16 = MoE(args.hidden, args.ffn, args.experts, fp8=False).to(dev)
    fp8 = MoE(args.hidden, args.ffn, args.experts, fp8=True, init=bf16.state_dict()).to(dev)
    opts = [torch.optim.Adam(m.parameters(), lr=args.lr) for m in (bf16, fp8)]
    losses: dict[str, list[float]] = {"bf16": [], "fp8": []}
    # Step time of each model (forward, backward, optimizer), from CUDA events, after a
    # warm-up of a tenth of the steps (compilation, caches).
    warmup = max(1, args.steps // 10)
    step_ms: dict[str, list[float]] = {"bf16": [], "fp8": []}
    start = time.perf_counter()
    bar = progress(args.steps)
    for step in bar:
        x = torch.randn(args.tokens, args.hidden, device=dev)
        with torch.no_grad():
            target = teacher(x)
        for (name, model), opt in zip((("bf16", bf16), ("fp8", fp8)), opts):
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            loss = torch.nn.functional.mse_loss(model(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            end.record()
            losses[name].append(loss.item())  # synchronizes: the events are complete
            if step >= warmup:
                step_ms[name].append(begin.elapsed_time(end))
        line = f"step {step + 1}/{args.steps}  loss bf16 {losses['bf16'][-1]:.5f}  fp8 {losses['fp8'][-1]:.5f}"
        if hasattr(bar, "set_description"):
            bar.set_description(line)
        elif (step + 1) % 10 == 0 or step == 0:
            print(line, flush=True)
    elapsed = time.perf_counter() - start
    tail = max(1, args.steps // 10)
    mean = {k: sum(v[-tail:]) / tail for k, v in losses.items()}
    gap = abs(mean["fp8"] - mean["bf16"]) / mean["bf16"]
    print(
        f"final loss (mean of the last {tail} steps): bf16 {mean['bf16']:.5f}, fp8 {mean['fp8']:.5f} "
        f"({100 * gap:.2f}% apart); {elapsed:.1f} s for {args.steps} steps of both models"
    )
    if all(step_ms.values()):
        median = {k: sorted(v)[len(v) // 2] for k, v in step_ms.items()}
        print(
            f"step time (median of {len(step_ms['fp8'])} steps after {warmup} warm-up): "
            f"bf16 torch._grouped_mm {median['bf16']:.2f} ms, fp8 gemmspec {median['fp8']:.2f} ms"
        )
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for name, values in losses.items():
            ax.plot(range(1, len(values) + 1), values, label=name.upper())
        ax.set_xlabel("step")
        ax.set_ylabel("MSE loss")
        ax.set_yscale("log")
        ax.set_title(f"MoE FFN, {args.experts} experts, hidden {args.hidden}: gemmspec FP8 vs BF16")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
