"""SwiGLU over gate and up rows that are not interleaved (two weights, or stacked halves
of one): the direct semantics spelled out by hand, and the flat schedule (tiles of gate
rows then up rows, as the kernel loads them) equal to it on ragged sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import quantize, random_inputs, random_runtime, real_values
from gemmspec.reference.direct import run_direct

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_schedule_matches_spec import assert_same, both_executors  # noqa: E402

SEPARATE = """
gemm swiglu_separate {
  dim T
  dim F = %(F)d, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : %(A)s [T, K]%(SX)s
  tensor wg : %(A)s [E, F, K]%(SW)s
  tensor wu : %(A)s [E, F, K]%(SW)s
  tensor route_w : f32 [T]
  tensor h : %(D)s [T, F]%(SD)s
  h[t, j] = route_w[t] * silu(sum[k] x[t, k] * wg[expert(t), j, k]) * sum[k] x[t, k] * wu[expert(t), j, k]
}
"""

STACKED = """
gemm swiglu_stacked {
  dim T
  dim N = %(N)d, F = %(F)d, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : %(A)s [T, K]%(SX)s
  tensor w : %(A)s [E, N, K]%(SW)s
  tensor h : %(D)s [T, F]%(SD)s
  h[t, j] = silu(sum[k] x[t, k] * w[expert(t), j, k]) * sum[k] x[t, k] * w[expert(t), F + j, k]
}
"""

FP8 = {"A": "e4m3", "SX": " scale f32 [1, 128]", "SW": " scale f32 [1, 128, 128]"}
BF16 = {"A": "bf16", "SX": "", "SW": ""}
LENGTHS = [[0, 1, 2, 129], [127, 0, 200, 1], [1, 1, 0, 0]]


def separate(f: int, k: int, d: str, fp8: bool) -> str:
    return SEPARATE % {"F": f, "K": k, "D": d, "SD": _out_scale(d), **(FP8 if fp8 else BF16)}


def stacked(f: int, k: int, d: str, fp8: bool) -> str:
    return STACKED % {"N": 2 * f, "F": f, "K": k, "D": d, "SD": _out_scale(d), **(FP8 if fp8 else BF16)}


def _out_scale(d: str) -> str:
    """An FP8 output's scales, one per row and 128 columns (written by the epilogue)."""
    return " scale f32 [1, 128]" if d == "e4m3" else ""


@pytest.mark.parametrize("lengths", LENGTHS)
@pytest.mark.parametrize(
    "text",
    [
        separate(256, 200, "bf16", True),
        separate(128, 128, "e4m3", True),
        separate(72, 40, "f32", False),
        separate(200, 64, "bf16", False),
        stacked(256, 300, "f32", True),
        stacked(40, 72, "bf16", False),
    ],
    ids=["sep-fp8", "sep-fp8-out", "sep-bf16-72", "sep-bf16-200", "stk-fp8", "stk-bf16"],
)
def test_schedule_equals_direct(text, lengths):
    assert_same(*both_executors(text, 7, {"expert": lengths}))


@pytest.mark.parametrize("fp8", [False, True])
def test_separate_by_hand(fp8):
    # route_w[t] * silu(x wg[e]^T) * (x wu[e]^T): the gate from one weight, the up from the
    # other, row j of each for output column j.
    (lowered,) = lower_file(separate(128, 200, "f32", fp8))
    spec = lowered.spec
    rng = np.random.default_rng(3)
    rt = random_runtime(spec, rng, lengths={"expert": [2, 0, 3, 1]})
    data = random_inputs(spec, rt, rng)
    h = run_direct(spec, rt, data, {"h": np.full((6, 128), np.nan)})["h"]
    x, wg, wu = (real_values(spec, rt, spec.tensor(n), data[n]) for n in ("x", "wg", "wu"))
    rw = np.asarray(data["route_w"].values, dtype=np.float64)
    g, u = x[2:5] @ wg[2].T, x[2:5] @ wu[2].T
    with np.errstate(over="ignore"):
        want = rw[2:5, None] * g / (1 + np.exp(-g)) * u
    assert np.allclose(h[2:5], quantize(want, "f32"), rtol=1e-12, atol=1e-12)
    assert not np.isnan(h).any()


def test_stacked_by_hand():
    # The gate from rows j of the weight, the up from rows F + j of the same weight.
    (lowered,) = lower_file(stacked(128, 256, "f32", True))
    spec = lowered.spec
    rng = np.random.default_rng(5)
    rt = random_runtime(spec, rng, lengths={"expert": [0, 3, 0, 2]})
    data = random_inputs(spec, rt, rng)
    h = run_direct(spec, rt, data, {"h": np.full((5, 128), np.nan)})["h"]
    x, w = (real_values(spec, rt, spec.tensor(n), data[n]) for n in ("x", "w"))
    g, u = x[0:3] @ w[1, :128].T, x[0:3] @ w[1, 128:].T
    with np.errstate(over="ignore"):
        want = g / (1 + np.exp(-g)) * u
    assert np.allclose(h[0:3], quantize(want, "f32"), rtol=1e-12, atol=1e-12)


def test_the_up_weight_changes_the_result():
    # The up rows really come from the second weight: changing it changes h.
    (lowered,) = lower_file(separate(72, 40, "f32", False))
    spec = lowered.spec
    rng = np.random.default_rng(1)
    rt = random_runtime(spec, rng, lengths={"expert": [4, 0, 0, 0]})
    data = random_inputs(spec, rt, rng)
    before = run_direct(spec, rt, data, {"h": np.full((4, 72), np.nan)})["h"]
    data["wu"].values[0, 5] = -data["wu"].values[0, 5] + 1.0
    after = run_direct(spec, rt, data, {"h": np.full((4, 72), np.nan)})["h"]
    changed = np.flatnonzero((before != after).any(axis=0))
    assert changed.tolist() == [5]
