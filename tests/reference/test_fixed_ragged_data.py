"""Random data for a ragged group over a fixed dim (`dim T = 64`): the offsets end at
the dim's size whatever the seed, and the dim is never taken for a run-time one."""

from __future__ import annotations

import numpy as np
import pytest

from gemmspec.errors import ArgumentError
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import random_inputs, random_runtime
from gemmspec.reference.direct import run_direct

FIXED_T = """\
gemm fixed_ragged {
  dim T = 64
  dim S
  dim N = 32, K = 64
  group expert[E = 3] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  tensor z : bf16 [S, N]
  tensor v : bf16 [S, K]
  tensor u : bf16 [N, K]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
  z[s, n] = sum[k] v[s, k] * u[n, k]
}
"""


@pytest.fixture(scope="module")
def spec():
    (lowered,) = lower_file(FIXED_T)
    return lowered.spec


@pytest.mark.parametrize("seed", range(8))
def test_offsets_end_at_the_fixed_size(spec, seed: int) -> None:
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng)
    offsets = rt.tensors["expert_offsets"]
    assert offsets.dtype == np.int32 and offsets[0] == 0 and offsets[-1] == 64
    assert np.all(np.diff(offsets) >= 0)
    assert set(rt.dims) == {"S"}  # T is fixed; only S is sized at run time
    data = random_inputs(spec, rt, rng)
    assert data["x"].values.shape == (64, 64)
    out = run_direct(spec, rt, data, {"y": np.full((64, 32), np.nan), "z": np.full((rt.dims["S"], 32), np.nan)})
    assert not np.isnan(out["y"]).any()  # every row of T lies in a segment


def test_given_dims_and_lengths(spec) -> None:
    rt = random_runtime(spec, np.random.default_rng(0), dims={"S": 5}, lengths={"expert": [60, 0, 4]})
    assert rt.dims == {"S": 5} and list(rt.tensors["expert_offsets"]) == [0, 60, 60, 64]
    with pytest.raises(ArgumentError, match="add up to 63, not T=64"):
        random_runtime(spec, np.random.default_rng(0), lengths={"expert": [60, 0, 3]})
    with pytest.raises(ArgumentError, match="fixed at 64"):
        random_runtime(spec, np.random.default_rng(0), dims={"T": 64})
