"""On a Hopper GPU: per-channel ("rowwise") FP8 scales, one per token and one per
(expert, output column) over the whole of K, against the float64 reference; outputs
poisoned first, ragged segments of 0, 1, 127 and 129 rows, K a multiple of 128 or not,
both store paths (staged TMA for BF16 =, registers for BF16 +=) and f32 +=."""

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
  tensor x : {xt} [T, K] scale f32 [1, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, {wn}, K]
  tensor y : {o} [T, N]
  y[t, n] {op} sum[k] x[t, k] * w[expert(t), n, k]
  {directive}
}}
"""

# id -> format fields: output type and op, B's block along N, tile directive.
CASES = {
    "bf16_store": dict(o="bf16", op="="),
    "bf16_store_n192": dict(o="bf16", op="=", n=576),
    "bf16_acc_registers": dict(o="bf16", op="+="),
    "f32_acc": dict(o="f32", op="+="),
    "f16_store_e5m2_a": dict(o="f16", op="=", xt="e5m2"),
    "bf16_store_b_per_128_columns": dict(o="bf16", op="=", wn=128),
    "bf16_store_narrow_tile": dict(o="bf16", op="=", directive="tile(64, 40)"),
}


def spec_text(name: str, case: dict, k: int) -> str:
    return SPEC.format(
        name=name, n=case.get("n", 264), k=k, xt=case.get("xt", "e4m3"), wn=case.get("wn", 1),
        o=case["o"], op=case["op"], directive=case.get("directive", ""),
    )


@pytest.mark.parametrize("k", [128, 200, 1024])
@pytest.mark.parametrize("name", sorted(CASES))
def test_rowwise_matches_reference(name, k):
    exe = gemmspec.build(spec_text(f"rowwise_{name}_k{k}", CASES[name], k))
    report = run_random(exe, lengths={"expert": RAGGED}, seed=11, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
