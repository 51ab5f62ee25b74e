"""On a Hopper GPU: per-tensor FP8 scales (one for all of x, one per expert for w) and
mixed recipes (per-tensor beside per-channel, either way round) against the float64
reference; outputs poisoned first, ragged segments of 0, 1, 127 and 129 rows, K a
multiple of 128 or not (K = 128: the blockwise kernel with one K block), both store
paths (staged TMA for BF16 =, registers for BF16 +=) and f32 +=. Then one block over
whole fixed dims that are no multiple of 128, across the segments of a capacity group
of T and a split of N, with weight rows the producer copies by hand."""

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
  tensor x : {xt} [T, K] scale f32 [{xs}]
  tensor w : e4m3 [E, N, K] scale f32 [{ws}]
  tensor y : {o} [T, N]
  y[t, n] {op} sum[k] x[t, k] * w[expert(t), n, k]
  {directive}
}}
"""

# id -> format fields: x's and w's scale blocks, output type and op, tile directive.
CASES = {
    "tensor_expert_bf16_store": dict(xs="T, K", ws="1, N, K", o="bf16", op="="),
    "tensor_expert_bf16_store_n192": dict(xs="T, K", ws="1, N, K", o="bf16", op="=", n=576),
    "tensor_expert_bf16_acc_registers": dict(xs="T, K", ws="1, N, K", o="bf16", op="+="),
    "tensor_expert_f32_acc": dict(xs="T, K", ws="1, N, K", o="f32", op="+="),
    "tensor_expert_f16_store_e5m2_a": dict(xs="T, K", ws="1, N, K", o="f16", op="=", xt="e5m2"),
    "tensor_channel_bf16_store": dict(xs="T, K", ws="1, 1, K", o="bf16", op="="),
    "token_expert_bf16_store": dict(xs="1, K", ws="1, N, K", o="bf16", op="="),
    "tensor_expert_narrow_tile": dict(xs="T, K", ws="1, N, K", o="bf16", op="=", directive="tile(64, 40)"),
}


def spec_text(name: str, case: dict, k: int) -> str:
    return SPEC.format(
        name=name, n=case.get("n", 264), k=k, xt=case.get("xt", "e4m3"), xs=case["xs"], ws=case["ws"],
        o=case["o"], op=case["op"], directive=case.get("directive", ""),
    )


def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


@pytest.mark.parametrize("k", [128, 200, 1024])
@pytest.mark.parametrize("name", sorted(CASES))
def test_per_tensor_matches_reference(name, k):
    exe = gemmspec.build(spec_text(f"tensorwise_{name}_k{k}", CASES[name], k))
    report_ok(run_random(exe, lengths={"expert": RAGGED}, seed=13, repeats=0))


FIXED = """
gemm tensorwise_fixed_{out} {{
  dim T = 400
  dim N = 100, K = 200
  group part[P = 4] = ragged(T, offsets = offs, capacity)
  group slice[S = 3] = split(N, sizes = [60, 24, 16])
  tensor x : e4m3 [T, S, K] scale f32 [T, 1, K]
  tensor w : e4m3 [P, N, K] layout strides(N * (K + 16), K + 16, 1) scale f32 [1, N, K]
  tensor y : {out} [T, N]
  y[t, n] = sum[k] x[t, slice(n), k] * w[part(t), n, k]
}}
"""


@pytest.mark.parametrize("out", ["bf16", "f32"])
def test_per_tensor_over_fixed_dims_and_segments(out):
    # 257 of the 400 rows are in segments: the rest must stay poisoned.
    exe = gemmspec.build(FIXED.format(out=out))
    report_ok(run_random(exe, lengths={"part": RAGGED}, seed=17, repeats=0))
