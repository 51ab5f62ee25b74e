"""Train a small MoE feed-forward block with gemmspec's FP8 grouped GEMMs, beside the
same block in BF16 torch, and print both losses as they go.

The block: a router (linear, softmax, top-1) sends each token to one of 8 experts;
tokens are sorted by expert (ragged segments of any length, none padded), and each
expert applies up-projection, GELU and down-projection, scaled by its router
probability. The FP8 model runs both projections through gemmspec.torch.function:
FP8 forward with 1x128 activation and 128x128 weight scales, and the derived DGRAD
and K-grouped WGRAD (128x1 scales per expert segment) in backward. Every
quantization is a gemmspec kernel: the activations, the weights and the output
gradients by gemmspec.torch.quantize (one launch each), the transposed weights of the
DGRAD and the 128x1 requantization of the WGRAD operands by the pre-passes of the
derived backward spec. The BF16 model is the same block with torch's BF16 grouped GEMM
(`torch._grouped_mm`, forward and backward), from the same initial weights, on the
same data: a teacher MoE's outputs on random tokens (MSE loss, Adam). Each model's
steps are timed apart (CUDA events) and the median step time after a warm-up of a
tenth of the steps is printed for both at the end.

    python examples/train_moe_fp8.py --steps 300 --plot losses.png

Needs a Hopper GPU and torch; `--plot` needs matplotlib, the progress bar uses tqdm
when it is installed.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field

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


def progress(steps: int, show: bool):
    if show:
        try:
            from tqdm import tqdm

            return tqdm(range(steps), file=sys.stdout, dynamic_ncols=True)
        except ImportError:
            pass
    return range(steps)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _blocks(text: str) -> int:
    value = _positive(text)
    if value % 128:
        # Whole 128-wide scale blocks: every quantization then runs gemmspec's kernel
        # (it takes whole column blocks only), and torch._grouped_mm's rows stay 16-byte aligned.
        raise argparse.ArgumentTypeError(f"must be a multiple of 128, got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=_positive, default=300, help="training steps of each model (default 300)")
    p.add_argument("--tokens", type=_positive, default=4096, help="tokens per step")
    p.add_argument("--hidden", type=_blocks, default=1024, help="model width, a multiple of 128")
    p.add_argument("--ffn", type=_blocks, default=1024, help="expert width, a multiple of 128")
    p.add_argument("--experts", type=_positive, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", metavar="FILE.png", help="save both loss curves to a PNG")
    return p.parse_args(argv)


def hopper_problem() -> str | None:
    """Why this machine cannot run the FP8 model (gemmspec's kernels are sm_90a), or None."""
    if not torch.cuda.is_available():
        return "needs a CUDA GPU (Hopper, sm_90a); torch sees none"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs a Hopper GPU (sm_90a); device 0 is sm_{major}{minor} ({torch.cuda.get_device_name()})"
    return None


@dataclass
class Run:
    """Losses of every step and step times (ms) after the warm-up, per model."""

    steps: int
    warmup: int  # steps left out of the step times (compilation, caches)
    losses: dict[str, list[float]] = field(default_factory=lambda: {"bf16": [], "fp8": []})
    step_ms: dict[str, list[float]] = field(default_factory=lambda: {"bf16": [], "fp8": []})
    seconds: float = 0.0

    def final_losses(self) -> tuple[int, dict[str, float]]:
        """(n, mean loss of each model over its last n steps), n a tenth of the steps."""
        tail = max(1, self.steps // 10)
        return tail, {k: sum(v[-tail:]) / len(v[-tail:]) for k, v in self.losses.items()}

    def median_ms(self) -> dict[str, float] | None:
        """Median step time of each model after the warm-up; None without such steps."""
        if not all(self.step_ms.values()):
            return None
        return {k: sorted(v)[len(v) // 2] for k, v in self.step_ms.items()}

    def report(self) -> list[str]:
        tail, mean = self.final_losses()
        gap = abs(mean["fp8"] - mean["bf16"]) / mean["bf16"]
        lines = [
            f"final loss (mean of the last {tail} steps): bf16 {mean['bf16']:.5f}, fp8 {mean['fp8']:.5f} "
            f"({100 * gap:.2f}% apart); {self.seconds:.1f} s for {self.steps} steps of both models"
        ]
        median = self.median_ms()
        if median is None:
            lines.append(f"step time: not measured (only the {self.warmup} warm-up step(s) ran; pass more --steps)")
        else:
            lines.append(
                f"step time (median of {len(self.step_ms['fp8'])} steps after {self.warmup} warm-up): "
                f"bf16 torch._grouped_mm {median['bf16']:.2f} ms, fp8 gemmspec {median['fp8']:.2f} ms"
            )
        return lines


def train(args: argparse.Namespace, device: torch.device, *, show_progress: bool = True) -> Run:
    """Train the BF16 and the FP8 model side by side for `args.steps` steps."""
    torch.manual_seed(args.seed)
    teacher = MoE(args.hidden, args.ffn, args.experts, fp8=False).to(device)
    bf16 = MoE(args.hidden, args.ffn, args.experts, fp8=False).to(device)
    fp8 = MoE(args.hidden, args.ffn, args.experts, fp8=True, init=bf16.state_dict()).to(device)
    opts = [torch.optim.Adam(m.parameters(), lr=args.lr) for m in (bf16, fp8)]
    run = Run(args.steps, warmup=max(1, args.steps // 10))
    cuda = device.type == "cuda"
    start = time.perf_counter()
    bar = progress(args.steps, show_progress)
    for step in bar:
        x = torch.randn(args.tokens, args.hidden, device=device)
        with torch.no_grad():
            target = teacher(x)
        for (name, model), opt in zip((("bf16", bf16), ("fp8", fp8)), opts):
            # Forward, backward and optimizer step, timed by CUDA events on the GPU.
            if cuda:
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
            else:
                began = time.perf_counter()
            loss = torch.nn.functional.mse_loss(model(x), target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if cuda:
                end.record()
            run.losses[name].append(loss.item())  # synchronizes: the events are complete
            if step >= run.warmup:
                run.step_ms[name].append(begin.elapsed_time(end) if cuda else 1e3 * (time.perf_counter() - began))
        line = f"step {step + 1}/{args.steps}  loss bf16 {run.losses['bf16'][-1]:.5f}  fp8 {run.losses['fp8'][-1]:.5f}"
        if hasattr(bar, "set_description"):
            bar.set_description(line)
        elif show_progress and ((step + 1) % 10 == 0 or step == 0):
            print(line, flush=True)
    run.seconds = time.perf_counter() - start
    return run


def plot(run: Run, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, values in run.losses.items():
        ax.plot(range(1, len(values) + 1), values, label=name.upper())
    ax.set_xlabel("step")
    ax.set_ylabel("MSE loss")
    ax.set_yscale("log")
    ax.set_title(f"MoE FFN, {args.experts} experts, hidden {args.hidden}: gemmspec FP8 vs BF16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    problem = hopper_problem()
    if problem is not None:
        sys.exit(f"train_moe_fp8: {problem}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401  (before training, not after it)
        except ImportError:
            sys.exit("train_moe_fp8: --plot needs matplotlib (pip install matplotlib)")
    run = train(args, torch.device("cuda"))
    for line in run.report():
        print(line)
    if args.plot:
        plot(run, args)


if __name__ == "__main__":
    main()
