"""examples/moe_ffn_fp8_decode.gspec at small compile-time sizes: the flat schedule (the
gather pre-pass, both launches and the scatter_add combine, on flat memory as the GPU
runs them) equals the spec's direct semantics on top-k routings, and y is each token's
routed rows of y_rows summed in token order (ascending row, float32, one bf16 rounding)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gemmspec.bench.inputs import expert_counts, topk_routing
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import TensorData, dim_size, quantize, random_inputs, random_runtime
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_schedule_matches_spec import assert_same  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_decode.gspec"
EXPERTS = 8


def small_text() -> str:
    text = EXAMPLE.read_text()
    for old, new in (("H = 7168", "H = 256"), ("F = 2048", "F = 256"), ("E = 256", f"E = {EXPERTS}")):
        assert old in text
        text = text.replace(old, new)
    return text


def routed_rows(tokens: int, top_k: int, seed: int) -> tuple[np.ndarray, list[int]]:
    """`src` of the routed rows sorted by expert (tokens ascending within an expert) and
    the expert segment lengths, for a seeded top-k routing."""
    routing = topk_routing(tokens, EXPERTS, top_k, seed)
    src = [s for e in range(EXPERTS) for s, chosen in enumerate(routing) if e in chosen]
    return np.array(src, dtype=np.float64), expert_counts(routing, EXPERTS)


def run_both(tokens: int, top_k: int, seed: int):
    (low,) = lower_file(small_text())
    spec = low.spec
    src, lengths = routed_rows(tokens, top_k, seed)
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths={"expert": lengths}, dims={"S": tokens})
    assert dim_size(spec, rt, "T") == tokens * top_k
    data = random_inputs(spec, rt, rng)
    data["src"] = TensorData(src)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    return src, run_direct(spec, rt, data, init), run_schedule(spec, rt, low.schedule, data, init)


@pytest.mark.parametrize("tokens, top_k, seed", [(1, 8, 0), (5, 2, 1), (40, 4, 2), (70, 8, 3)])
def test_schedule_equals_direct_and_y_is_the_token_order_sum(tokens, top_k, seed):
    src, direct, flat = run_both(tokens, top_k, seed)
    assert_same(direct, flat)
    assert {"h", "y_rows", "y"} <= direct.keys()
    y_rows, y = flat["y_rows"], flat["y"]
    assert y.shape == (tokens, 256) and not np.isnan(y).any() and not np.isnan(y_rows).any()
    # The combine, written out: row s is the float32 sum of its k rows in ascending t.
    want = np.zeros((tokens, 256), dtype=np.float32)
    for t, s in enumerate(src.astype(int)):
        want[s] += y_rows[t].astype(np.float32)
    np.testing.assert_array_equal(y, quantize(want.astype(np.float64), "bf16"))
    assert np.count_nonzero(np.bincount(src.astype(int), minlength=tokens) == top_k) == tokens
