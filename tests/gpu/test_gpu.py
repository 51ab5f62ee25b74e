"""On a Hopper GPU: every example and random ragged cases match the float64
reference of the dequantized inputs; outputs are poisoned first and must come
back fully written (and nothing else touched). Skipped elsewhere, with a reason."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec
from gemmspec import bench
from gemmspec.errors import ArgumentError
from gemmspec.runtime.verify import run_random

pytestmark = pytest.mark.gpu
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EDGE = [0, 1, 127, 129, 4097]

# example -> (explicit segment lengths, run-time dims)
EXAMPLE_CASES = {
    "moe_fp8_forward": ({"expert": [*EDGE, 300, 1000, 512]}, {}),
    # 6166 routed rows read from and written to 6200 tokens through random permutations.
    "moe_fp8_gather_scatter": ({"expert": [*EDGE, 300, 1000, 512]}, {"S": 6200}),
    # The expert FFN: FP8 intermediate with its scales written by the up-projection's epilogue.
    "moe_ffn_fp8": ({"expert": [*EDGE, 300, 1000, 512]}, {"S": 6200}),
    "moe_bf16_forward": ({"expert": [*EDGE, 300, 1000, 512]}, {}),
    "moe_bf16_in_fp8": ({"expert": [*EDGE, 300, 1000, 512]}, {}),
    "moe_masked_decode": ({"expert": [0, 1, 127, 129, 256, 200, 64, 3]}, {}),
    "moe_swiglu_fp8": ({"expert": [*EDGE, 300, 1000, 512]}, {}),
    "lora_moe_nested": (None, {"T": 3000}),
    "lora_moe_scaled": ({"lora": [0, 1, 4097, 1813], "expert": None}, {}),
    "lora_qkv_slices": ({"lora": [0, 129, 4097, 1]}, {}),
    "split_nest": ({"expert": [*EDGE, 300, 1000, 512], "lora": [127, 129, 4097, 1813]}, {}),
    "moe_fp8_wgrad": ({"expert": [*EDGE, 300, 1000, 512]}, {}),
    "linear_fp8_training": (None, {"T": 1000}),
}


def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


@pytest.mark.parametrize("name", sorted(EXAMPLE_CASES))
def test_example_matches_reference(name):
    lengths, dims = EXAMPLE_CASES[name]
    exe = gemmspec.build(EXAMPLES / f"{name}.gspec")
    report_ok(run_random(exe, dims=dims, lengths=lengths, seed=1, repeats=0))


# The benchmark's spec templates: the GPU tests run the same specs on edge cases.
WGRAD = bench.WGRAD
MASKED = bench.MASKED_SPEC


def nested(k, loras, experts):
    return bench.LORA.format(k=k, r=16, l=loras, e=experts)


def moe(n, k, e, fp8, out="bf16"):
    return bench.moe_spec(n=n, k=k, e=e, fp8=fp8, out=out)


@pytest.mark.parametrize("k", [576, 7168])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_random_moe_ragged(k, fp8):
    exe = gemmspec.build(moe(200, k, 5, fp8))
    report_ok(run_random(exe, lengths={"expert": EDGE}, seed=k, repeats=0))


# Leaves around the 64- and 128-row tile edges, K of one block, an odd block count and
# the full DeepSeek width; the pipeline must mask every edge without padding.
PIPELINE_EDGE = [0, 1, 63, 64, 65, 127, 129]


@pytest.mark.parametrize("k", [128, 576, 7168])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_pipeline_row_edges(k, fp8):
    exe = gemmspec.build(moe(136, k, len(PIPELINE_EDGE), fp8))
    report_ok(run_random(exe, lengths={"expert": PIPELINE_EDGE}, seed=3 * k + fp8, repeats=0))


# An FP8 operand whose row stride (K = 200 bytes) TMA cannot describe: the producer
# copies it with masked loads, beside [1, 128] scales with a short last K block; two
# column blocks (N = 264) and one (N = 100).
@pytest.mark.parametrize("n", [264, 100])
@pytest.mark.parametrize("k", [200, 328])
def test_fp8_rows_not_16_byte_aligned(k, n):
    exe = gemmspec.build(moe(n, k, 4, True))
    report_ok(run_random(exe, lengths={"expert": [0, 1, 127, 129]}, seed=k + n, repeats=0))


def with_tile(spec: str, tile_m: int, tile_n: int) -> str:
    return spec.rstrip().rstrip("}") + f"  tile({tile_m}, {tile_n})\n}}\n"


# Wide FP8 tiles straddle a 128-column B scale block boundary at a column that depends on
# the tile (two scales per tile); N = 520 leaves a partial last column block, N = 100 a
# D row stride TMA cannot describe (200 bytes: the epilogue stores from registers).
@pytest.mark.parametrize("tile_n", [144, 160, 192])
@pytest.mark.parametrize("n", [520, 100])
def test_scaled_wide_tiles(tile_n, n):
    exe = gemmspec.build(with_tile(moe(n, 576, len(PIPELINE_EDGE), True), 128, tile_n))
    (launch,) = exe.program.launches
    assert launch.gemm.tile_n == tile_n and launch.gemm.sb_mode == 1
    report_ok(run_random(exe, lengths={"expert": PIPELINE_EDGE}, seed=tile_n + n, repeats=0))


# CTA pairs that multicast their shared A tile: a kernel option the tile heuristic does
# not choose (measured slower), kept correct on ragged row edges.
@pytest.mark.parametrize("fp8, n", [(True, 768), (False, 512)], ids=["fp8", "bf16"])
def test_cta_pairs_option(fp8, n):
    from gemmspec.codegen.emit import with_kernel_config

    exe = gemmspec.build(moe(n, 576, len(PIPELINE_EDGE), fp8))
    exe.program = with_kernel_config(exe.spec, exe.program, cluster=2)
    assert exe.program.launches[0].gemm.cluster == 2
    report_ok(run_random(exe, lengths={"expert": PIPELINE_EDGE}, seed=n + fp8, repeats=0))


# CTA pairs along M that multicast B (a kernel option, DeepGEMM's pairing): leaves with odd
# row-block counts leave a pair's second block past the leaf (its rows load as zeros and
# are never stored); FP8 with one and two B scales per tile, BF16, and the FP8 WGRAD.
@pytest.mark.parametrize("fp8, n, tile_n", [(True, 768, 192), (True, 520, 128), (False, 512, 256)],
                         ids=["fp8_192", "fp8_128", "bf16_256"])
def test_cta_pairs_multicasting_b(fp8, n, tile_n):
    from gemmspec.codegen.emit import with_kernel_config

    exe = gemmspec.build(with_tile(moe(n, 576, len(PIPELINE_EDGE) + 1, fp8), 128, tile_n))
    exe.program = with_kernel_config(exe.spec, exe.program, tile_n=tile_n, cluster=2, multicast_b=True)
    assert exe.program.launches[0].gemm.multicast_b
    report_ok(run_random(exe, lengths={"expert": [*PIPELINE_EDGE, 300]}, seed=n + tile_n, repeats=0))


def test_wgrad_cta_pairs_multicasting_b():
    from gemmspec.codegen.emit import with_kernel_config

    exe = gemmspec.build(WGRAD.format(n=264, k=576, e=5))  # 3 row blocks: one pair half past the leaf
    exe.program = with_kernel_config(exe.spec, exe.program, cluster=2, multicast_b=True)
    report_ok(run_random(exe, lengths={"expert": [1, 127, 129, 0, 1000]}, seed=17, repeats=0))


# The producer staging each row's SA x SB products (the default) or the raw scales (an
# option): one B scale per tile (128 wide) and two (192 wide, a block boundary inside the
# tile), CTA pairs along M, and rows that are not 16-byte aligned (K = 200: copied by hand).
@pytest.mark.parametrize("products", [True, False], ids=["products", "rawscales"])
@pytest.mark.parametrize("n, k, tile_n, pairs", [(520, 576, 192, True), (520, 7168, 128, False),
                                                 (264, 200, 192, False), (264, 200, 128, True)])
def test_staged_scale_products(n, k, tile_n, pairs, products):
    from gemmspec.codegen.emit import with_kernel_config

    exe = gemmspec.build(with_tile(moe(n, k, len(PIPELINE_EDGE) + 1, True), 128, tile_n))
    exe.program = with_kernel_config(exe.spec, exe.program, tile_n=tile_n, cluster=2 if pairs else 1,
                                     multicast_b=pairs, staged_products=products)
    assert exe.program.launches[0].gemm.staged_products == products
    report_ok(run_random(exe, lengths={"expert": [*PIPELINE_EDGE, 300]}, seed=n + k + tile_n, repeats=0))


def test_pipeline_64_row_tiles():
    # M of at most 64 per leaf picks 64-row tiles (one consumer warpgroup).
    spec = MASKED.format(m=64, n=200, k=576, e=5)
    exe = gemmspec.build(spec)
    assert all(x.gemm.tile_m == 64 for x in exe.program.launches)
    report_ok(run_random(exe, lengths={"expert": [0, 1, 63, 64, 17]}, seed=11, repeats=0))


@pytest.mark.parametrize("n", [512, 768])
def test_masked_64_rows_fp8_takes_256_column_tiles(n):
    # Blockwise FP8 leaves of at most 64 rows, N a multiple of 256: 64 x 256 tiles (two
    # 128-column wgmma halves per K block), every count from empty to full, K over
    # several blocks with a partial 128-column scale block at its end.
    exe = gemmspec.build(MASKED.format(m=64, n=n, k=1088, e=6))
    assert [(x.gemm.tile_m, x.gemm.tile_n) for x in exe.program.launches] == [(64, 256)]
    report_ok(run_random(exe, lengths={"expert": [0, 1, 63, 64, 17, 2]}, seed=n, repeats=0))


def test_wgrad_counts_not_multiples_of_128():
    exe = gemmspec.build(WGRAD.format(n=136, k=200, e=5))
    report_ok(run_random(exe, lengths={"expert": [1, 127, 129, 0, 1000]}, seed=12, repeats=0))


# A BF16 K-grouped += (staged: each tile's old output loaded by TMA when the tile starts)
# with empty segments among others, and more tiles than SMs: a tile whose leaf has no K
# adds nothing, so it must load nothing either (the next tile waits for its own load).
BF16_WGRAD = """
gemm wgrad_bf16 {
  dim T
  dim N = 1024, K = 1024
  group expert[E = 6] = ragged(T, offsets = offs)
  tensor dy : bf16 [T, N] layout segment_major(expert)
  tensor x  : bf16 [T, K] layout segment_major(expert)
  tensor dw : bf16 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""


def test_bf16_wgrad_staged_add_with_empty_segments():
    exe = gemmspec.build(BF16_WGRAD)
    assert exe.program.launches[0].gemm.staged_add
    report_ok(run_random(exe, lengths={"expert": [0, 300, 0, 129, 0, 1]}, seed=19, repeats=0))


def test_nest_of_2048_leaves():
    exe = gemmspec.build(nested(192, 16, 128))
    assert exe.program.launches[0].leaf_count == 2048
    report_ok(run_random(exe, dims={"T": 6000}, seed=13, repeats=0))


def test_random_moe_single_expert_f32_out():
    exe = gemmspec.build(moe(328, 1000, 1, True, out="f32"))
    report_ok(run_random(exe, lengths={"expert": [1037]}, seed=5, repeats=0))


@pytest.mark.parametrize("k", [576, 7168])
def test_random_wgrad_k_grouped(k):
    exe = gemmspec.build(WGRAD.format(n=200, k=k, e=5))
    report_ok(run_random(exe, lengths={"expert": EDGE}, seed=k + 1, repeats=0))


# Per-column B scales are staged in four lane classes and read four at a time; tiles with an
# odd count of 8-column groups (40, 136) read a padded last quad.
@pytest.mark.parametrize("tile_n", [40, 136])
def test_wgrad_per_column_scale_tiles(tile_n):
    exe = gemmspec.build(with_tile(WGRAD.format(n=200, k=576, e=5), 128, tile_n))
    (launch,) = exe.program.launches
    assert launch.gemm.tile_n == tile_n and launch.gemm.sb_mode == 2
    report_ok(run_random(exe, lengths={"expert": EDGE}, seed=tile_n, repeats=0))


@pytest.mark.parametrize("loras,experts", [(1, 1), (2, 3)])
def test_random_nested(loras, experts):
    exe = gemmspec.build(nested(576, loras, experts))
    report_ok(run_random(exe, dims={"T": 4500}, seed=loras * 10 + experts, repeats=0))


# The bench's separate-launch spec for the scaled LoRA expand: the example's 32 leaves
# with no epilogue, on empty, single-token and tile-edge segments.
def test_lora_expand_separate_spec():
    exe = gemmspec.build(bench.LORA_EXPAND.format(n=4096, r=16, l=4, e=8))
    counts = [c for row in bench.LORA_EXPAND_COUNTS for c in row]
    report_ok(run_random(exe, lengths={"lora": [sum(row) for row in bench.LORA_EXPAND_COUNTS], "expert": counts},
                         seed=16, repeats=0))


def test_bad_offsets_are_rejected():
    import numpy as np

    from gemmspec.runtime.arrays import DeviceBuffer

    exe = gemmspec.build(moe(128, 128, 2, False))
    assert exe.program.launches[0].gemm.inline_table  # the GEMM's block 0 writes the flags
    x = DeviceBuffer(10 * 128 * 2).view((10, 128), "bf16")
    w = DeviceBuffer(2 * 128 * 128 * 2).view((2, 128, 128), "bf16")
    y = DeviceBuffer(10 * 128 * 2).view((10, 128), "bf16")
    for bad, fragment in (([0, 3, 5], "end at T"), ([0, 8, 5], "non-decreasing"), ([1, 5, 10], "start at 0")):
        offs = DeviceBuffer.from_numpy(np.array(bad, np.int32)).view((3,), "i32")
        with pytest.raises(ArgumentError, match=fragment):
            exe(x=x, w=w, y=y, offs=offs, check=True)  # the device found it
        with pytest.raises(ArgumentError, match=fragment):
            exe.prepare(x=x, w=w, y=y, offs=offs)  # the host reads the offsets
