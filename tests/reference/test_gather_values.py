"""Rows read or written through an index tensor: the reference semantics against a plain
numpy formulation, the errors it raises for indices a caller must not pass, and the flat
schedule (executed as the kernels would) against the spec on random ragged sizes."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import (
    Runtime,
    TensorData,
    dim_size,
    expand_scales,
    index_bound,
    quantize,
    random_index,
    random_inputs,
    random_runtime,
)
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_schedule_matches_spec import assert_same  # noqa: E402

EDGE_LENGTHS = st.sampled_from([0, 1, 2, 127, 128, 129, 200])
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])

GATHER_FP8 = """
gemm gather_fp8 {
  dim T, S
  dim N = 72, K = %(K)d
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [%(BM)d, 128] layout %(SL)s
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""

SCATTER_BF16 = """
gemm scatter_bf16 {
  dim T, S
  dim N = 96, K = 200
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor src : i32 [T]
  tensor h : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor route_w : f32 [T]
  tensor y : bf16 [S, N]
  y[src[t], n] = route_w[t] * sum[k] h[t, k] * w[expert(t), n, k]
}
"""

BOTH = """
gemm both {
  dim T, S
  dim N = 40, K = 136
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : e5m2 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : f32 [S, N] layout major(S)
  y[idx[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""

SWIGLU = """
gemm swiglu_gather {
  dim T, S
  dim N = 64, F = 32, K = 128
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [E, N, K]
  tensor h : bf16 [T, F]
  h[t, j] = silu(sum[k] x[idx[t], k] * w[expert(t), 2*j, k]) * sum[k] x[idx[t], k] * w[expert(t), 2*j + 1, k]
}
"""

NESTED = """
gemm nested_gather {
  dim T, S
  dim K = 200, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor idx : i32 [T]
  tensor x  : bf16 [S, K]
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[idx[t], k] * wa[lora(t), expert(t), r, k]
}
"""

MASKED = """
gemm masked_gather {
  dim M = 130, N = 48, K = 256
  group expert[E = 3] = masked(M, counts = counts)
  tensor rows : i32 [M]
  tensor x : e4m3 [E, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [E, M, N]
  y[e, m, n] = sum[k] x[e, rows[m], k] * w[e, n, k]
}
"""

DENSE = """
gemm dense_gather {
  dim T, S
  dim N = 24, K = 64
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x : f16 [S, K]
  tensor w : f16 [N, K]
  tensor y : f16 [S, N]
  y[src[t], n] = sum[k] x[idx[t], k] * w[n, k]
}
"""

CAPACITY = """
gemm capacity_gather {
  dim T, S
  dim N = 32, K = 128
  group expert[E = 2] = ragged(T, offsets = offs, capacity)
  tensor idx : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [S, N]
  y[idx[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""


def fp8(k=256, bm=1, layout="row_major"):
    return GATHER_FP8 % {"K": k, "BM": bm, "SL": layout}


def with_prepass(text: str) -> str:
    """`text` with its gathered rows copied by the pre-pass (where it can copy them)."""
    body = text.rstrip()
    assert body.endswith("}")
    return body[:-1] + "  gather(prepass)\n}\n"


def run_both(text: str, seed: int, lengths=None, dims=None, edit=None, prepass=False):
    (lowered,) = lower_file(with_prepass(text) if prepass else text)
    spec, schedule = lowered.spec, lowered.schedule
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths=lengths, dims=dims)
    data = random_inputs(spec, rt, rng)
    if edit is not None:
        edit(spec, rt, data)
    init = {}
    for g in spec.gemms:
        t = spec.tensor(g.out.tensor)
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        init[t.name] = np.full(shape, np.nan)
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, schedule, data, init)
    return spec, rt, data, direct, flat


# ---- the reference against numpy ------------------------------------------------------------


def test_gathered_fp8_rows_and_their_scales_come_through_the_index():
    spec, rt, data, direct, _ = run_both(fp8(), 1, {"expert": [3, 0, 130, 5]}, {"S": 300})
    x = data["x"].values * expand_scales(spec, rt, spec.tensor("x"), data["x"].scale_grid)
    w = data["w"].values * expand_scales(spec, rt, spec.tensor("w"), data["w"].scale_grid)
    idx = data["idx"].values.astype(int)
    offs = rt.tensors["offs"]
    want = np.concatenate([x[idx[offs[e]:offs[e + 1]]] @ w[e].T for e in range(4)])
    y_type = spec.tensor("y").dtype  # y is stored in its type
    np.testing.assert_allclose(direct["y"], quantize(want, y_type), rtol=1e-12)
    # The scale of row idx[t] is x_scale[idx[t], k / 128]: the gathered row keeps its own.
    t = 7
    one = sum(data["x"].values[idx[t], k] * data["x"].scale_grid[idx[t], k // 128] * w[2, 0, k] for k in range(256))
    assert direct["y"][t, 0] == quantize(np.array(one), y_type)


def test_scattered_rows_land_on_their_index_and_nothing_else_is_written():
    spec, rt, data, direct, flat = run_both(SCATTER_BF16, 2, {"expert": [0, 129, 1]}, {"S": 200})
    src = data["src"].values.astype(int)
    offs = rt.tensors["offs"]
    y = direct["y"]
    for e in range(3):
        rows = np.arange(offs[e], offs[e + 1])
        want = data["route_w"].values[rows, None] * (data["h"].values[rows] @ data["w"].values[e].T)
        np.testing.assert_allclose(y[src[rows]], quantize(want, spec.tensor("y").dtype), rtol=1e-12)
    untouched = np.setdiff1d(np.arange(200), src)
    assert len(untouched) == 200 - 130 and np.isnan(y[untouched]).all()
    assert_same(direct, flat)


def test_random_index_is_a_permutation_of_distinct_rows():
    (lowered,) = lower_file(SCATTER_BF16)
    spec = lowered.spec
    rng = np.random.default_rng(0)
    rt = random_runtime(spec, rng, lengths={"expert": [5, 6, 7]}, dims={"S": 18})
    idx = random_index(spec, rt, rng, "src")
    assert sorted(idx) == list(range(18))  # as many rows as entries: a permutation
    rt = random_runtime(spec, rng, lengths={"expert": [5, 6, 7]})
    assert rt.dims["S"] >= 18 and index_bound(spec, rt, "src") == rt.dims["S"]
    idx = random_index(spec, rt, rng, "src")
    assert len(set(idx.tolist())) == 18 and idx.max() < rt.dims["S"]
    with pytest.raises(ValueError, match="distinct indices need at least as many rows"):
        random_index(spec, random_runtime(spec, rng, lengths={"expert": [5, 6, 7]}, dims={"S": 10}), rng, "src")


def test_a_gather_may_read_one_row_many_times():
    def repeat(spec, rt, data):
        data["idx"] = TensorData(np.zeros(dim_size(spec, rt, "T")))  # every row reads row 0

    spec, rt, data, direct, flat = run_both(fp8(), 3, {"expert": [2, 3, 0, 1]}, {"S": 4}, repeat)
    assert np.allclose(direct["y"][0], direct["y"][1])  # rows 0, 1: one expert, one row
    assert_same(direct, flat)


def test_duplicate_scattered_rows_are_an_error():
    def collide(spec, rt, data):
        v = data["src"].values.copy()
        v[5] = v[4]  # rows 4 and 5 (expert 0's) write one row
        data["src"] = TensorData(v)

    with pytest.raises(ValueError, match="sends rows 4 and 5 to row"):
        run_both(SCATTER_BF16, 4, {"expert": [10, 5, 5]}, {"S": 40}, collide)

    def across_leaves(spec, rt, data):
        v = data["src"].values.copy()
        v[12] = v[1]  # expert 1's row 12 onto expert 0's row 1
        data["src"] = TensorData(v)

    with pytest.raises(ValueError, match="rows of two leaves to one element"):
        run_both(SCATTER_BF16, 4, {"expert": [10, 5, 5]}, {"S": 40}, across_leaves)


@pytest.mark.parametrize("value", [-1, 40])
def test_an_index_outside_the_rows_is_an_error(value):
    def out_of_range(spec, rt, data):
        v = data["idx"].values.copy()
        v[3] = value
        data["idx"] = TensorData(v)

    with pytest.raises(ValueError, match=f"'idx' holds {value} at row 3, outside the 40 rows of 'x'"):
        run_both(fp8(), 5, {"expert": [2, 3, 0, 1]}, {"S": 40}, out_of_range)


@pytest.mark.parametrize("prepass", [False, True])
def test_the_schedule_skips_indices_outside_the_rows_as_the_kernels_do(prepass):
    # What the kernels do with an index the device check flags: the row reads zeros.
    (lowered,) = lower_file(with_prepass(fp8()) if prepass else fp8())
    assert bool(lowered.schedule.prepasses) == prepass
    spec = lowered.spec
    rng = np.random.default_rng(6)
    rt = random_runtime(spec, rng, lengths={"expert": [4, 0, 0, 0]}, dims={"S": 10})
    data = random_inputs(spec, rt, rng)
    v = data["idx"].values.copy()
    v[2] = 10
    data["idx"] = TensorData(v)
    flat = run_schedule(spec, rt, lowered.schedule, data, {"y": np.full((4, 72), np.nan)})
    assert (flat["y"][2] == 0).all() and not (flat["y"][[0, 1, 3]] == 0).all()


def test_lowered_offsets_skip_the_leaf_start_and_name_the_index():
    (lowered,) = lower_file(BOTH)
    (launch,) = lowered.schedule.launches
    pg = launch.problems
    assert str(pg.a.offset) == "0" and str(pg.d.offset) == "0"  # rows found by number
    assert pg.a.rows.tensor == pg.d.rows.tensor == "idx"
    assert str(pg.a.rows.offset) == "start.m" and str(pg.a.rows.bound) == "S"
    assert str(pg.sa.offset) == "0" and pg.sa.rows == pg.a.rows
    assert pg.runtime_tensors == ("offs", "idx") and "S" in pg.runtime_dims
    assert launch.signature.gather and launch.signature.scatter
    assert launch.signature.name.endswith("_gather_scatter")
    text = str(launch)
    assert "x(m, k) = x_base[0 + idx[start.m + m]*(136) + k*(1)]" in text
    assert "loads: A gathered through idx: rows loaded by TMA, a box of one row each" in text
    assert "stores: D scattered through idx" in text


# ---- the schedule against the spec --------------------------------------------------------


@SETTINGS
@given(
    lengths=st.lists(EDGE_LENGTHS, min_size=4, max_size=4),
    k=st.sampled_from([128, 200, 300]),
    scales=st.sampled_from([(1, "row_major"), (1, "major(S)"), (128, "row_major")]),
    extra=st.integers(0, 40),
    seed=st.integers(0, 2**16),
    prepass=st.booleans(),
)
def test_gathered_fp8(lengths, k, scales, extra, seed, prepass):
    bm, layout = scales  # [1, 128] (MN-major too) or [128, 128] blocks over S's rows
    dims = {"S": sum(lengths) + extra}
    assert_same(*run_both(fp8(k, bm, layout), seed, {"expert": lengths}, dims, prepass=prepass)[3:])


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3), extra=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_scattered_bf16(lengths, extra, seed):
    direct, flat = run_both(SCATTER_BF16, seed, {"expert": lengths}, {"S": sum(lengths) + extra})[3:]
    assert_same(direct, flat)
    assert np.isnan(direct["y"]).all(axis=1).sum() == extra  # rows no index names


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3), seed=st.integers(0, 2**16), prepass=st.booleans())
def test_gathered_and_scattered_through_one_index(lengths, seed, prepass):
    assert_same(*run_both(BOTH, seed, {"expert": lengths}, prepass=prepass)[3:])


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=2, max_size=2), seed=st.integers(0, 2**16), prepass=st.booleans())
def test_gathered_swiglu(lengths, seed, prepass):
    assert_same(*run_both(SWIGLU, seed, {"expert": lengths}, prepass=prepass)[3:])


@SETTINGS
@given(lengths=st.lists(st.sampled_from([0, 1, 5, 127, 129]), min_size=6, max_size=6), seed=st.integers(0, 2**16))
def test_gathered_nested(lengths, seed):
    outer = [sum(lengths[:3]), sum(lengths[3:])]
    for prepass in (False, True):
        assert_same(*run_both(NESTED, seed, {"lora": outer, "expert": lengths}, prepass=prepass)[3:])


@SETTINGS
@given(counts=st.lists(st.sampled_from([0, 1, 127, 129, 130]), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_gathered_masked(counts, seed):
    assert_same(*run_both(MASKED, seed, {"expert": counts})[3:])


@SETTINGS
@given(t=st.sampled_from([1, 63, 64, 129]), extra=st.integers(0, 9), seed=st.integers(0, 2**16))
def test_gathered_and_scattered_without_groups(t, extra, seed):
    for prepass in (False, True):
        assert_same(*run_both(DENSE, seed, dims={"T": t, "S": t + extra}, prepass=prepass)[3:])


@SETTINGS
@given(lengths=st.lists(EDGE_LENGTHS, min_size=2, max_size=2), spare=st.integers(0, 30), seed=st.integers(0, 2**16))
@pytest.mark.parametrize("prepass", [False, True])
def test_gathered_and_scattered_capacity(lengths, spare, seed, prepass):
    # Rows past the offsets' end are never read: their indices need not even be valid
    # (the pre-pass copies zero rows for them).
    (lowered,) = lower_file(with_prepass(CAPACITY) if prepass else CAPACITY)
    spec = lowered.spec
    used, t = sum(lengths), sum(lengths) + spare
    rt = Runtime({"T": t, "S": t}, {"offs": np.array([0, *np.cumsum(lengths)], dtype=np.int64)})
    rng = np.random.default_rng(seed)
    data = random_inputs(spec, rt, rng)
    v = data["idx"].values.copy()
    v[used:] = -7
    data["idx"] = TensorData(v)
    init = {"y": np.full((t, 32), np.nan)}
    direct = run_direct(spec, rt, data, init)
    assert_same(direct, run_schedule(spec, rt, lowered.schedule, data, init))
    assert np.isnan(direct["y"]).all(axis=1).sum() == spare


SPLIT = """
gemm split_gather {
  dim T = 256, S
  dim N = 32, K = 128
  group part[P = 2] = split(T, sizes = [100, 156])
  tensor idx : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [P, N, K]
  tensor y : bf16 [S, N]
  y[idx[t], n] = sum[k] x[idx[t], k] * w[part(t), n, k]
}
"""


@SETTINGS
@given(extra=st.integers(0, 40), seed=st.integers(0, 2**16))
def test_gathered_and_scattered_split_rows(extra, seed):
    assert_same(*run_both(SPLIT, seed, dims={"S": 256 + extra})[3:])
