"""On a Hopper GPU: GEMM kernels that build their leaf table themselves (one launch per
call: every block checks the offsets, builds the table in its shared memory and writes
the tensor maps of the leaves it computes) match the float64 reference, as the same
launch with a leaf-table builder before it does, on ragged leaves with 0, 1, 127 and 129
rows: nested LoRA leaves (many tiles and several leaves per block), K-grouped staged
16-bit `+=` with empty segments, maps of D per consumer warpgroup (TMA-stored epilogues),
CTA pairs, masked FP8 decode, fused epilogue records, a SwiGLU, the FP8 WGRAD (anchored
scale rows in the check); blocks past the map slots leave. (Bad offsets raising through
block 0's flags: test_gpu.py's test_bad_offsets_are_rejected, whose spec builds its table.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec import bench
from gemmspec.codegen.emit import emit
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_gpu import BF16_WGRAD  # noqa: E402  (a K-grouped BF16 +=, stored staged)

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
EDGE = [0, 1, 127, 129, 300]
NESTED_COUNTS = [[0, 1, 127, 129, 300], [64, 65, 0, 2, 511]]
NESTED = {"lora": [sum(c) for c in NESTED_COUNTS], "expert": [c for row in NESTED_COUNTS for c in row]}



def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


def both_ways(text, **kwargs) -> None:
    """The default build (its GEMM builds the table) and the same launch after a builder,
    each against the reference on the same random inputs."""
    inline = gemmspec.build(text)
    (launch,) = inline.program.launches
    assert launch.gemm.inline_table and launch.kernels == (launch.gemm.name,), launch.gemm.name
    report_ok(run_random(inline, repeats=0, **kwargs))
    builder = gemmspec.build(text)
    builder.program = emit(builder.spec, builder.schedule, inline_tables=False)
    assert not builder.program.launches[0].gemm.inline_table
    report_ok(run_random(builder, repeats=0, **kwargs))


@pytest.mark.parametrize("k", [64, 576, 4096])
def test_nested_lora_leaves(k):
    both_ways(bench.LORA.format(k=k, r=16, l=2, e=5), lengths=NESTED, seed=k)


def test_many_tiles_and_leaves_per_block():
    # 32 leaves, 40000 rows: each block walks tiles of several leaves (a map slot each).
    both_ways(bench.LORA.format(k=256, r=16, l=4, e=8), dims={"T": 40000}, seed=3)


def test_k_grouped_staged_add_with_empty_segments():
    both_ways(BF16_WGRAD, lengths={"expert": [0, 300, 0, 129, 0, 1]}, seed=19)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8 (CTA pairs)"])
def test_m_grouped_tma_stored(fp8):
    both_ways(bench.moe_spec(n=384, k=576, e=5, fp8=fp8, out="bf16"), lengths={"expert": EDGE}, seed=7)


@pytest.mark.parametrize(
    "name", ["moe_masked_decode", "lora_moe_scaled", "moe_swiglu_fp8", "moe_bf16_forward", "moe_fp8_wgrad"]
)
def test_examples(name):
    both_ways((ROOT / "examples" / f"{name}.gspec").read_text(), seed=11)


def test_blocks_past_the_map_slots_leave(monkeypatch):
    # Fewer map slots than blocks (the H200's grid is 132 or 264 blocks): the blocks past
    # them leave at once and the others walk every tile.
    from gemmspec.codegen import kernels, manifest

    monkeypatch.setattr(kernels, "INLINE_MAX_BLOCKS", 40)
    monkeypatch.setattr(manifest, "INLINE_MAX_BLOCKS", 40)
    text = bench.LORA.format(k=576, r=16, l=2, e=5)
    exe = gemmspec.build(text)
    assert "INLINE_MAX_BLOCKS = 40;" in exe.program.launches[0].source
    report_ok(run_random(exe, lengths=NESTED, seed=9, repeats=0))
    text = bench.moe_spec(n=384, k=576, e=5, fp8=True, out="bf16")  # CTA pairs: whole pairs leave
    report_ok(run_random(gemmspec.build(text), lengths={"expert": EDGE}, seed=9, repeats=0))
