"""On a Hopper GPU with torch: examples/train_moe_fp8.py for 20 steps at its default
sizes (4096 tokens, hidden and expert width 1024, 8 experts). Every quantization of the
FP8 model runs a gemmspec kernel (the torch operations of gemmspec.torch.quantize are
never called), its loss stays within 5% of the BF16 model's at every step and within 2%
over the last five, and both fall; the report prints both losses and both step times."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_moe_fp8.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("train_moe_fp8", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["train_moe_fp8"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["train_moe_fp8"]


def test_fp8_training_tracks_bf16(example, monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("a quantization of the training step fell back to torch operations")

    monkeypatch.setattr(gt, "_quantize_torch", refused)
    args = example.parse_args(["--steps", "20"])
    run = example.train(args, torch.device("cuda"), show_progress=False)
    bf16, fp8 = run.losses["bf16"], run.losses["fp8"]
    for line in run.report():
        print(line)
    print("bf16", " ".join(f"{v:.5f}" for v in bf16))
    print("fp8 ", " ".join(f"{v:.5f}" for v in fp8))
    for step, (b, f) in enumerate(zip(bf16, fp8)):
        assert abs(f - b) <= 0.05 * b, (step, b, f)
    last_b, last_f = sum(bf16[-5:]) / 5, sum(fp8[-5:]) / 5
    assert abs(last_f - last_b) <= 0.02 * last_b, (last_b, last_f)
    assert last_b < 0.95 * bf16[0] and last_f < 0.95 * fp8[0], "the losses do not fall"
    median = run.median_ms()
    assert median is not None and len(run.step_ms["fp8"]) == 18
    # The kernels the step quantized with: activations and gradients per token, the
    # FP32 master weights per 128x128 block.
    configs = {e.launch.plan.config.name for e in gt._QUANTIZER._entries.values() if e.launch is not None}
    assert {"gs_sm90a_quantize_bf16_e4m3_b1x128_w256", "gs_sm90a_quantize_f32_e4m3_b128x128_w256"} <= configs


def test_script_runs(tmp_path):
    import subprocess

    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--steps", "3", "--tokens", "1024"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr
    assert "final loss (mean of the last 1 steps): bf16 " in out.stdout
    assert "step time (median of 2 steps after 1 warm-up): bf16 torch._grouped_mm " in out.stdout
