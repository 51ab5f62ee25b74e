"""examples/train_moe_fp8.py without a GPU: its command line (help, bad arguments, a run
on a machine without a Hopper GPU stops with a reason), that both of its FP8 projections
derive, check and lower their DGRAD and K-grouped WGRAD with every FP8 operand made by a
gemmspec kernel (the plans for the example's shapes), and a short training run with the
reference standing in for the kernels, whose FP8 loss tracks the BF16 one."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from reference_ops import CpuKernels  # noqa: E402

import gemmspec.torch as gt  # noqa: E402
from gemmspec.build import build, build_backward  # noqa: E402
from gemmspec.runtime.quantize import plan_quantize  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_moe_fp8.py"


@pytest.fixture(scope="module")
def example():
    """The example as a module (not run)."""
    spec = importlib.util.spec_from_file_location("train_moe_fp8", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe_fp8"] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["train_moe_fp8"]


def _script(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def test_help():
    out = _script("--help")
    assert out.returncode == 0, out.stderr
    assert "--plot FILE.png" in out.stdout and "--steps" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["--steps", "ten"], "argument --steps: invalid"),
        (["--hidden", "1000"], "argument --hidden: must be a multiple of 128, got 1000"),
        (["--tokens", "-5"], "argument --tokens: must be at least 1, got -5"),
    ],
)
def test_bad_arguments_are_usage_errors(args, message):
    out = _script(*args)
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")
def test_without_a_gpu_it_stops_with_a_reason():
    out = _script("--steps", "2")
    assert out.returncode == 1
    assert out.stderr.strip() == "train_moe_fp8: needs a CUDA GPU (Hopper, sm_90a); torch sees none"
    assert "Traceback" not in out.stderr


def test_projections_derive_their_backward(example):
    for name, n, k in (("up", 1024, 1024), ("down", 1024, 1024)):
        spec = build(example.PROJECTION.format(name=name, n=n, k=k, e=8)).spec
        exe, bw = build_backward(spec)
        assert [d.kind for d in bw.statements] == ["dgrad", "wgrad"]
        assert "sum[t in expert(e)]" in bw.statements[1].text
        # Every FP8 operand of the backward that is not passed in is a pre-pass of its
        # spec: the DGRAD's transposed weight and the WGRAD's 128x1 operands.
        passes = [(p.kind, p.source, p.target) for p in exe.schedule.prepasses]
        assert passes == [("transpose", "w", "w_t"), ("requantize", "x", "x_q"), ("requantize", "dy", "dy_q")]
        assert bw.transposed == ()  # no copy left to torch


def test_every_quantization_of_the_example_runs_the_kernel(example):
    """The quantizations gemmspec.torch.function makes per step, and the kernel's plan for
    each at the example's shapes (4096 tokens, hidden = ffn = 1024, 8 experts)."""
    fn = gt.function(example.PROJECTION.format(name="up", n=1024, k=1024, e=8))
    assert [str(q) for q in fn.quantizations] == [
        "forward: x -> e4m3, blocks [1, 128]",
        "forward: w -> e4m3, blocks [1, 128, 128]",
        "backward: dy -> e4m3, blocks [1, 128]",
    ]
    # x and dy in BF16 (the example's activations and output gradients), w the FP32 master.
    shapes = {"x": ("bf16", (4096, 1024)), "w": ("f32", (8, 1024, 1024)), "dy": ("bf16", (4096, 1024))}
    plans = {}
    for q in fn.quantizations:
        source, shape = shapes[q.tensor]
        strides = tuple(int(torch.empty(shape, device="meta").stride()[i]) for i in range(len(shape)))
        plans[q.tensor] = plan_quantize(source, q.dtype, shape, strides, q.block)
    assert {n: p.config.name for n, p in plans.items()} == {
        "x": "gs_sm90a_quantize_bf16_e4m3_b1x128_w256",
        "w": "gs_sm90a_quantize_f32_e4m3_b128x128_w256",
        "dy": "gs_sm90a_quantize_bf16_e4m3_b1x128_w256",
    }
    assert plans["x"].grid == (512, 8, 1) and plans["x"].scale_shape == (4096, 8)  # a warp per row block
    assert plans["w"].grid == (8, 8, 8) and plans["w"].scale_shape == (8, 8, 8)  # a CTA per 128x128 block


def test_bf16_model_uses_grouped_mm_like_a_loop_over_experts(example):
    torch.manual_seed(0)
    model = example.MoE(64, 32, 4, fp8=False)
    xs = torch.randn(50, 64).to(torch.bfloat16)
    ends = torch.tensor([7, 7, 30, 50], dtype=torch.int32)  # an empty expert, ragged rest
    got = model._bf16_experts(xs, ends)
    parts, start = [], 0
    for e, end in enumerate(ends.tolist()):
        h = torch.nn.functional.gelu((xs[start:end] @ model.w_up[e].to(torch.bfloat16).T).float())
        parts.append((h.to(torch.bfloat16) @ model.w_down[e].to(torch.bfloat16).T).float())
        start = end
    torch.testing.assert_close(got, torch.cat(parts), rtol=2e-2, atol=2e-2)


def test_short_training_run_tracks_bf16(example, monkeypatch):
    """Ten steps of both models on the CPU, the FP8 projections' GEMMs by the float64
    reference and every quantization by gemmspec.torch.quantize's torch operations: the
    recipe (FP8 operands, derived backward) keeps the FP8 loss within 1% of the BF16 one
    at every step, and both fall. The report prints both losses and both step times."""
    kernels = CpuKernels()
    init = example.MoE.__init__

    def with_reference(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if self.fp8:
            kernels(self.up)
            kernels(self.down)

    monkeypatch.setattr(example.MoE, "__init__", with_reference)
    args = example.parse_args(["--steps", "10", "--tokens", "256", "--hidden", "128", "--ffn", "128", "--experts", "4"])
    run = example.train(args, torch.device("cpu"), show_progress=False)
    bf16, fp8 = run.losses["bf16"], run.losses["fp8"]
    assert len(bf16) == len(fp8) == 10
    for step, (b, f) in enumerate(zip(bf16, fp8)):
        assert abs(f - b) <= 0.01 * b, (step, b, f)
    assert bf16[-1] < 0.95 * bf16[0] and fp8[-1] < 0.95 * fp8[0], (bf16, fp8)
    assert run.warmup == 1 and len(run.step_ms["fp8"]) == len(run.step_ms["bf16"]) == 9
    final, steps = run.report()
    assert final.startswith("final loss (mean of the last 1 steps): bf16 ") and "% apart" in final
    assert steps.startswith("step time (median of 9 steps after 1 warm-up): bf16 torch._grouped_mm ")
