"""On a Hopper GPU: ring stages of more than one 128-byte swizzle row of K (``tile_k`` of
2 or 4 rows: as many TMA boxes per operand and stage) and an unscaled main loop that
leaves two earlier K blocks' wgmma running (``mma_lag`` 2), against the float64
reference: the memory-bound LoRA shrink (split K and whole tiles, the table built in the
kernel and by a builder) on nested ragged leaves of 0, 1, 127 and 129 rows, K of one
block, a K that ends inside a stage's second or fourth swizzle row (zero-filled by TMA)
and rows that are not 16-byte aligned (copied by hand, chunk by chunk), wide BF16 tiles
with a staged epilogue, and per-channel FP8 (the unscaled loop on FP8 operands)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec import bench
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The split-K tests' nested ragged leaves (0, 1, 127, 129 rows) and their LoRA shrink.
from test_split_k_gpu import EDGE_LENGTHS, report_ok, shrink  # noqa: E402

pytestmark = pytest.mark.gpu


def variant(text: str, inline: bool = True, **changes):
    from gemmspec.codegen.emit import emit, with_kernel_config

    exe = gemmspec.build(text)
    if not inline:
        exe.program = emit(exe.spec, exe.schedule, inline_tables=False)
    exe.program = with_kernel_config(exe.spec, exe.program, **changes)
    cfg = exe.program.launches[0].gemm
    for key, value in changes.items():
        assert getattr(cfg, key) == value, (key, cfg.name)
    return exe


@pytest.mark.parametrize("split", [True, False], ids=["split K", "whole tiles"])
@pytest.mark.parametrize("tile_k, lag", [(128, 1), (128, 2), (64, 2), (256, 1)])
@pytest.mark.parametrize("k", [64, 200, 576, 4096])
def test_shrink_stages_of_several_rows(k, tile_k, lag, split):
    # K = 200: 400-byte rows, 16-byte aligned (TMA), a K edge inside the stage's rows.
    exe = variant(shrink(k), tile_k=tile_k, mma_lag=lag, split_k=split)
    report_ok(run_random(exe, lengths=EDGE_LENGTHS, seed=k + tile_k + lag, repeats=0))


@pytest.mark.parametrize("tile_k, lag", [(128, 2), (256, 1)])
def test_shrink_rows_copied_by_hand(tile_k, lag):
    # K = 100: 200-byte rows, not 16-byte multiples: no tensor map, the producer copies.
    exe = variant(shrink(100), tile_k=tile_k, mma_lag=lag)
    report_ok(run_random(exe, lengths=EDGE_LENGTHS, seed=tile_k, repeats=0))


def test_shrink_builder_table():
    exe = variant(shrink(576), inline=False, tile_k=128, mma_lag=2)
    report_ok(run_random(exe, lengths=EDGE_LENGTHS, seed=3, repeats=0))


@pytest.mark.parametrize("k", [128, 576])
def test_wide_bf16_tiles(k):
    text = bench.moe_spec("wide_k_atoms", n=264, k=k, e=4, fp8=False)
    exe = variant(text, tile_n=128, tile_k=128, mma_lag=2)
    assert exe.program.launches[0].gemm.store_tma
    report_ok(run_random(exe, lengths={"expert": [0, 1, 127, 129]}, seed=k, repeats=0))


def test_per_channel_fp8():
    text = """
gemm rowwise_atoms {
  dim T
  dim N = 264, K = 1000
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, 1, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
    exe = variant(text, tile_k=256)  # two 128-byte rows of FP8
    assert exe.program.launches[0].gemm.per_channel
    report_ok(run_random(exe, lengths={"expert": [0, 1, 127, 129]}, seed=9, repeats=0))
