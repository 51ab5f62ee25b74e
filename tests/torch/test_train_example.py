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
