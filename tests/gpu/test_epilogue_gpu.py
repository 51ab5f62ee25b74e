"""On a Hopper GPU: fused epilogues (per-leaf scalar, per-row weight, per-column bias,
+= into BF16 and FP32) against the float64 reference, outputs poisoned first, ragged
segments of 0, 1, 127 and 129 rows. Both store paths are exercised: the staged TMA
store (BF16 =, FP32 +=) and the register path (BF16 +=, tiles that stage nothing)."""

from __future__ import annotations

import pytest

import gemmspec
from gemmspec.runtime.verify import run_random

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129]

SPEC = """
gemm {name} {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : {t} [T, K]{xs}
  tensor w : {t} [E, N, K]{ws}
  tensor alpha : f32 [E]
  tensor route_w : {rt} [T]
  tensor bias : {bt} [E, N]
  tensor y : {o} [T, N]
  y[t, n] {op} {pre}sum[k] x[t, k] * w[expert(t), n, k]{post}
  {directive}
}}
"""

# id -> (statement parts and types)
CASES = {
    "alpha_bf16_store": dict(pre="alpha[expert(t)] * ", post="", op="=", o="bf16"),
    "row_bf16_store": dict(pre="route_w[t] * ", post="", op="=", o="bf16"),
    "bias_bf16_store_staged": dict(
        pre="", post=" + bias[expert(t), n]", op="=", o="bf16", directive="tile(128, 128)"
    ),
    "bias_bf16_store_registers": dict(pre="", post=" + bias[expert(t), n]", op="=", o="bf16"),
    "all_bf16_store_staged": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="=", o="bf16",
        directive="tile(128, 128)",
    ),
    "all_bf16_store": dict(pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="=", o="bf16"),
    "all_bf16_acc_registers": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="+=", o="bf16"
    ),
    "all_f32_acc_tma_reduce": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="+=", o="f32"
    ),
    "all_f32_store_register_tile": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="=", o="f32",
        directive="tile(128, 40)",
    ),
    "all_fp8_bf16_store": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="=", o="bf16", fp8=True
    ),
    "row_fp8_f32_acc_wide": dict(pre="route_w[t] * ", post="", op="+=", o="f32", fp8=True, n=576),
}


def spec_text(name: str, case: dict, k: int) -> str:
    fp8 = case.get("fp8", False)
    return SPEC.format(
        name=name,
        n=case.get("n", 264), k=k, t="e4m3" if fp8 else "bf16",
        xs=" scale f32 [1, 128]" if fp8 else "", ws=" scale f32 [1, 128, 128]" if fp8 else "",
        rt="bf16" if case["o"] == "bf16" else "f32", bt="bf16", o=case["o"], op=case["op"],
        pre=case["pre"], post=case["post"], directive=case.get("directive", ""),
    )


@pytest.mark.parametrize("k", [128, 200])
@pytest.mark.parametrize("name", sorted(CASES))
def test_epilogue_matches_reference(name, k):
    exe = gemmspec.build(spec_text(f"epi_{name}_k{k}", CASES[name], k))
    report = run_random(exe, lengths={"expert": RAGGED}, seed=7, repeats=0)
    lines = [f"{c.tensor}: err {c.rel_error:.3e} < {c.tolerance:.0e}, unwritten {c.unwritten}" for c in report.checks]
    print(f"{name} K={k}: " + "; ".join(lines))
    assert report.ok, lines
