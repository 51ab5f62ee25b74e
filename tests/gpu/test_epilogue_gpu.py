"""On a Hopper GPU: fused epilogues (per-leaf scalar, per-row weight, per-column bias,
+= into BF16 and FP32, SwiGLU over interleaved gate/up rows) against the float64
reference, outputs poisoned first, ragged segments of 0, 1, 127 and 129 rows. Both store
paths are exercised: the staged TMA store (BF16 =, FP32 += by reduce-add, BF16 += by
loading the old tile into the staging) and the register path (BF16 += on rows TMA cannot
describe, tiles that stage nothing, every SwiGLU)."""

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
    "all_bf16_acc": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="+=", o="bf16"
    ),
    # Whole 64-column boxes: the old tile is loaded into the staging, added to, stored back.
    "all_bf16_acc_staged": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="+=", o="bf16",
        directive="tile(128, 128)",
    ),
    # An odd N: D's rows are not 16-byte multiples apart, so the += goes from registers.
    "all_bf16_acc_registers_odd_n": dict(
        pre="alpha[expert(t)] * route_w[t] * ", post=" + bias[expert(t), n]", op="+=", o="bf16", n=263
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
    # FP8 operands with a BF16 += in CTA pairs along M (a row weight pairs; a bias would not):
    # the staged add in a paired kernel.
    "row_fp8_bf16_acc_pairs": dict(pre="route_w[t] * ", post="", op="+=", o="bf16", fp8=True, n=576),
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
    print(report.describe())
    assert report.ok, report.describe()


# ---- SwiGLU ---------------------------------------------------------------------------

SWIGLU = """
gemm {name} {{
  dim T
  dim N = {n}, F = {f}, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : {t} [T, K]{xs}
  tensor w : {t} [E, N, K]{ws}
  tensor alpha : f32 [E]
  tensor route_w : f32 [T]
  tensor h : {o} {shape}{layout}
  {out} = {pre}silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]
  {directive}
}}
"""

# id -> statement parts and types. h has F = N / 2 columns; N = 528 gate/up rows end
# part-way through a 192- or 128-wide tile, so those cases store a partial column block.
SWIGLU_CASES = {
    "fp8_bf16": dict(fp8=True, o="bf16"),
    "fp8_bf16_row": dict(fp8=True, o="bf16", pre="route_w[t] * "),
    "fp8_f32_alpha_row": dict(fp8=True, o="f32", pre="alpha[expert(t)] * route_w[t] * "),
    # 4096 rows: 192-wide tiles in CTA pairs (22 column blocks).
    "fp8_bf16_pairs": dict(fp8=True, o="bf16", n=4096),
    "fp8_bf16_tile128": dict(fp8=True, o="bf16", directive="tile(128, 128)"),
    "bf16_bf16": dict(o="bf16"),
    # 1024 rows: 256-wide tiles in CTA pairs.
    "bf16_bf16_pairs_alpha": dict(o="bf16", n=1024, pre="alpha[expert(t)] * "),
    "bf16_f32_skinny": dict(o="f32", directive="tile(64, 16)"),
    # Odd row stride: every other row's pairs are misaligned (element-wise stores).
    "bf16_bf16_odd_stride": dict(o="bf16", layout=" layout strides(265, 1)"),
    # Transposed output: D's columns are not contiguous (element-wise stores).
    "bf16_bf16_transposed": dict(o="bf16", transposed=True, pre="route_w[t] * "),
}


def swiglu_text(name: str, case: dict, k: int) -> str:
    fp8 = case.get("fp8", False)
    n = case.get("n", 528)
    transposed = case.get("transposed", False)
    return SWIGLU.format(
        name=name, n=n, f=n // 2, k=k, t="e4m3" if fp8 else "bf16",
        xs=" scale f32 [1, 128]" if fp8 else "", ws=" scale f32 [1, 128, 128]" if fp8 else "",
        o=case["o"], shape="[F, T]" if transposed else "[T, F]", layout=case.get("layout", ""),
        out="h[j, t]" if transposed else "h[t, j]", pre=case.get("pre", ""),
        directive=case.get("directive", ""),
    )


@pytest.mark.parametrize("k", [128, 200])
@pytest.mark.parametrize("name", sorted(SWIGLU_CASES))
def test_swiglu_matches_reference(name, k):
    exe = gemmspec.build(swiglu_text(f"swiglu_{name}_k{k}", SWIGLU_CASES[name], k))
    assert exe.program.launches[0].gemm.swiglu
    report = run_random(exe, lengths={"expert": RAGGED}, seed=11, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
