"""examples/train_moe_fp8.py without a GPU: its command line, and that both of its
FP8 projections derive, check and lower their DGRAD and K-grouped WGRAD."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")

from gemmspec.backward import build_backward  # noqa: E402
from gemmspec.build import build  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_moe_fp8.py"


def test_help():
    out = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True)
    assert "--plot FILE.png" in out.stdout and "--steps" in out.stdout


def test_projections_derive_their_backward():
    namespace: dict = {}
    exec(compile(SCRIPT.read_text().split("class MoE")[0], str(SCRIPT), "exec"), namespace)
    for name, n, k in (("up", 1024, 1024), ("down", 1024, 1024)):
        spec = build(namespace["PROJECTION"].format(name=name, n=n, k=k, e=8)).spec
        exe, bw = build_backward(spec)
        assert [d.kind for d in bw.statements] == ["dgrad", "wgrad"]
        assert "sum[t in expert(e)]" in bw.statements[1].text
        assert exe.program.prepasses  # the requantize passes of the WGRAD


def test_bf16_model_uses_grouped_mm_like_a_loop_over_experts():
    import torch

    namespace: dict = {"__name__": "train_moe_fp8"}
    exec(compile(SCRIPT.read_text(), str(SCRIPT), "exec"), namespace)
    torch.manual_seed(0)
    model = namespace["MoE"](64, 32, 4, fp8=False)
    xs = torch.randn(50, 64).to(torch.bfloat16)
    ends = torch.tensor([7, 7, 30, 50], dtype=torch.int32)  # an empty expert, ragged rest
    got = model._bf16_experts(xs, ends)
    parts, start = [], 0
    for e, end in enumerate(ends.tolist()):
        h = torch.nn.functional.gelu((xs[start:end] @ model.w_up[e].to(torch.bfloat16).T).float())
        parts.append((h.to(torch.bfloat16) @ model.w_down[e].to(torch.bfloat16).T).float())
        start = end
    torch.testing.assert_close(got, torch.cat(parts), rtol=2e-2, atol=2e-2)
