"""On a Hopper GPU: a SwiGLU over gate and up rows that are not interleaved (two weights
declared alike, or stacked halves of one), BF16 and FP8 (1x128 activations, 128x128
weights), BF16, f32 and FP8 outputs, against the float64 reference's direct semantics
(the gate from one weight's rows, the up from the other's). Ragged segments of 0, 1,
127 and 129 rows, outputs poisoned and between guard bytes, every element within the
output type's tolerance (gemmspec.runtime.verify's element-wise rule); K of 100 or 200
elements leaves rows whose stride TMA cannot describe, so the producer copies both halves
by hand there. Skipped without a Hopper GPU (conftest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec
from gemmspec.runtime.verify import run_random

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SEPARATE = """
gemm {name} {{
  dim T
  dim F = {f}, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : {a} [T, K]{sx}
  tensor wg : {a} [E, F, K]{sw}
  tensor wu : {a} [E, F, K]{sw}
  tensor rw : f32 [T]
  tensor h : {d} [T, F]{sd}
  h[t, j] = {pre}silu(sum[k] x[t, k] * wg[expert(t), j, k]) * sum[k] x[t, k] * wu[expert(t), j, k]
}}
"""

STACKED = """
gemm {name} {{
  dim T
  dim N = {n}, F = {f}, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : {a} [T, K]{sx}
  tensor w : {a} [E, N, K]{sw}
  tensor rw : f32 [T]
  tensor h : {d} [T, F]{sd}
  h[t, j] = {pre}silu(sum[k] x[t, k] * w[expert(t), j, k]) * sum[k] x[t, k] * w[expert(t), F + j, k]
}}
"""

# id -> (form, F, K, operands FP8, output type, row weight)
CASES = {
    "sep_bf16_f200_k128": ("separate", 200, 128, False, "bf16", False),
    "sep_bf16_f72_k100_f32": ("separate", 72, 100, False, "f32", True),
    "sep_fp8_f256_k256": ("separate", 256, 256, True, "bf16", True),
    "sep_fp8_f384_k200": ("separate", 384, 200, True, "bf16", False),
    "sep_fp8_out": ("separate", 256, 384, True, "e4m3", False),
    "stk_bf16_f40_k64": ("stacked", 40, 64, False, "bf16", False),
    "stk_fp8_f256_k300": ("stacked", 256, 300, True, "f32", True),
    "stk_fp8_out": ("stacked", 384, 256, True, "e4m3", False),
}


def spec_text(name: str) -> str:
    form, f, k, fp8, d, row = CASES[name]
    return (SEPARATE if form == "separate" else STACKED).format(
        name=f"halves_{name}", n=2 * f, f=f, k=k,
        a="e4m3" if fp8 else "bf16",
        sx=" scale f32 [1, 128]" if fp8 else "",
        sw=" scale f32 [1, 128, 128]" if fp8 else "",
        d=d, sd=" scale f32 [1, 128]" if d == "e4m3" else "",
        pre="rw[t] * " if row else "",
    )


@pytest.mark.parametrize("name", sorted(CASES))
def test_halves_match_the_reference(name):
    exe = gemmspec.build(spec_text(name))
    (launch,) = exe.schedule.launches
    assert launch.signature.swiglu_halves
    report = run_random(exe, lengths={"expert": RAGGED}, seed=len(name), repeats=0)
    print(report.describe())
    assert report.ok, report.describe()


def test_example_with_deepseek_shapes():
    exe = gemmspec.build(EXAMPLES / "moe_swiglu_fp8_separate.gspec")
    report = run_random(exe, lengths={"expert": [0, 1, 129, 7, 256, 0, 33, 64]}, seed=2, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
