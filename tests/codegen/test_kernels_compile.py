"""Emitted kernels compile with NVRTC for sm_90a and use the Hopper pipeline.

CPU only: NVRTC and cuobjdump need no GPU. Each GEMM kernel must compile, its SASS
must hold QGMMA (FP8) or HGMMA (16-bit) of the tile width, TMA loads (UTMALDG),
mbarrier waits (SYNCS...TRYWAIT), register reallocation (USETMAXREG) when it has three
warpgroups, and nothing may spill to local memory (no LDL/STL, 0 bytes of spill in the
ptxas report).
"""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.kernels import (
    GemmKernelConfig,
    QuantizeKernelConfig,
    RequantKernelConfig,
    TransposeKernelConfig,
    include_dir,
    map_specs,
    render_gemm,
    render_quantize,
    render_requant,
    render_transpose,
)

pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")

# The helper sits beside this file; no package __init__ needed under any import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import assert_spill_free, compile_cubin, disassemble  # noqa: E402

GEMM_CONFIGS = {
    "bf16_store": GemmKernelConfig("bf16", "bf16", "bf16"),
    "bf16_f32_acc": GemmKernelConfig("bf16", "bf16", "f32", accumulate=True),
    "bf16_acc_staged": GemmKernelConfig("bf16", "bf16", "bf16", accumulate=True),
    "f16_store": GemmKernelConfig("f16", "f16", "f16"),
    # Forward / DGRAD: 1x128 activations, 128x128 weights.
    "e4m3_1x128_128x128_bf16": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128
    ),
    # WGRAD 1d1d: A = dY^T scaled per channel m (sa_bm=1), B = X^T per channel n (sb_bn=1).
    "e4m3_1d1d_f32_acc": GemmKernelConfig(
        "e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sb_bn=1
    ),
    "e4m3_128x128_both_bf16": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=128, sb_bn=128
    ),
    "e5m2_e4m3_unscaled_f16": GemmKernelConfig("e5m2", "e4m3", "f16"),
    # Wide and odd tile widths, 64-row tiles (one consumer warpgroup), a shallow ring.
    "bf16_wide": GemmKernelConfig("bf16", "bf16", "bf16", tile_n=256, cluster=2),
    "e4m3_pair": GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, cluster=2),
    "e4m3_n192": GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_n=192),
    # The decode variant's 64 x 256 tile: one warpgroup running two 128-column batches per
    # K block, or two warpgroups of 128 columns each (n_split).
    "e4m3_m64_n256": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_m=64, tile_n=256, cluster=1
    ),
    "e4m3_m64_n256_split": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_m=64, tile_n=256, cluster=1, n_split=2
    ),
    "e4m3_1d1d_n144": GemmKernelConfig(
        "e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sb_bn=1, tile_n=144
    ),
    "bf16_skinny_m64": GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16),
    # The producer staging the raw scales (not the default SA x SB products): two B scales
    # per tile in pairs, one on 64 rows.
    "e4m3_n192_rawscales_pair": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_n=192, cluster=2, multicast_b=True,
        staged_products=False,
    ),
    "e4m3_m64_rawscales": GemmKernelConfig(
        "e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sb_bn=128, tile_m=64, staged_products=False
    ),
    "e4m3_m64_s3": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_m=64, stages=3
    ),
    # Fused epilogues: every operand on the staged store, on the widest tiles (the most
    # accumulators live), on BF16 += from registers, on FP8 f32 reduce-adds.
    "bf16_epi_all_staged": GemmKernelConfig(
        "bf16", "bf16", "bf16", epilogue=(("alpha", "f32"), ("row", "f32"), ("bias", "bf16"))
    ),
    "bf16_epi_all_wide": GemmKernelConfig(
        "bf16", "bf16", "bf16", tile_n=256, cluster=2,
        epilogue=(("alpha", "bf16"), ("row", "bf16"), ("bias", "f32")),
    ),
    "bf16_epi_acc_bf16": GemmKernelConfig(
        "bf16", "bf16", "bf16", accumulate=True, epilogue=(("alpha", "f32"), ("row", "f32"))
    ),
    "e4m3_epi_bias_f32_acc": GemmKernelConfig(
        "e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sb_bn=128,
        epilogue=(("bias", "f16"),),
    ),
    "e4m3_n192_epi_row_bias": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_n=192,
        epilogue=(("row", "f32"), ("bias", "bf16")),
    ),
    "bf16_m64_epi_alpha": GemmKernelConfig(
        "bf16", "bf16", "f32", tile_m=64, tile_n=16, epilogue=(("alpha", "f32"),)
    ),
    # SwiGLU (stored from registers): the FP8 forward tile and the widest scaled one with a
    # row weight, the widest BF16 tile in CTA pairs with both factors, a skinny f32 one.
    "e4m3_swiglu_bf16": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, swiglu=True
    ),
    "e4m3_n192_swiglu_row": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_n=192, swiglu=True,
        epilogue=(("row", "f32"),),
    ),
    "bf16_wide_swiglu_all": GemmKernelConfig(
        "bf16", "bf16", "bf16", tile_n=256, cluster=2, swiglu=True,
        epilogue=(("alpha", "f32"), ("row", "bf16")),
    ),
    "bf16_m64_swiglu_f32": GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, swiglu=True),
    # Per-channel scales (sa_bk = sb_bk = 0: one along the whole of K): the unscaled main
    # loop and SA(row) * SB(column) in the epilogue; the widest tile on both store paths,
    # f32 +=, per-128-row A / per-128-column B scales on 64-row tiles.
    "e4m3_rowwise_wide": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0, tile_n=192, cluster=2
    ),
    "e4m3_rowwise_wide_regs": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0, tile_n=192, store_tma=False
    ),
    "e4m3_rowwise_f32_acc": GemmKernelConfig(
        "e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0, tile_n=192
    ),
    "e4m3_rowwise_blocks_m64": GemmKernelConfig(
        "e5m2", "e4m3", "f16", scaled=True, sa_bm=128, sa_bk=0, sb_bn=128, sb_bk=0, tile_m=64, tile_n=96
    ),
    # Per-tensor scales: one block over a whole fixed dim that is no multiple of 128 (the
    # per-channel kernel), and, with K = 128, the blockwise kernel with one B scale block
    # over all of N = 264 (two B scales per tile, split at a column no multiple of 128).
    "e4m3_tensorwise_fixed_blocks": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=400, sa_bk=0, sb_bn=100, sb_bk=0, tile_n=64
    ),
    "e4m3_tensorwise_one_k_block": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=264, tile_n=144, cluster=2
    ),
    # Rows through index tensors: A gathered by the producer (its scales staged with it), D
    # scattered from registers; the widest scaled tile with both and 128-row A blocks.
    "e4m3_gather": GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, gather=True),
    "bf16_scatter": GemmKernelConfig("bf16", "bf16", "bf16", scatter=True),
    "e4m3_n192_gather_scatter": GemmKernelConfig(
        "e4m3", "e4m3", "f32", scaled=True, sa_bm=128, sb_bn=128, tile_n=192, gather=True, scatter=True
    ),
    "bf16_m64_gather": GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, gather=True),
    # Stages of two and four 128-byte swizzle rows of K (one TMA box per row and operand),
    # the unscaled loop leaving two earlier K blocks' wgmma running: the memory-bound tile,
    # a wide staged BF16 tile, per-channel FP8.
    "bf16_m64_two_rows_lag2": GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, tile_k=128, mma_lag=2),
    "bf16_m64_four_rows": GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, tile_k=256),
    "bf16_two_rows_staged": GemmKernelConfig("bf16", "bf16", "bf16", tile_n=128, tile_k=128, mma_lag=2),
    "e4m3_rowwise_two_rows": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0, tile_n=128, tile_k=256
    ),
    # accumulate(fast): per-channel FP8 summed over the whole of K in one accumulator.
    "e4m3_rowwise_fast": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0, tile_n=192, fast_accum=True
    ),
    "e4m3_rowwise_two_rows_fast": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0, tile_n=128, tile_k=256,
        fast_accum=True,
    ),
}


@pytest.fixture(scope="module")
def compiled():
    """Compile each kernel once per module: name -> (source, ptxas log, SASS)."""
    cache: dict[str, tuple[str, str, str]] = {}

    def get(key: str, source: str) -> tuple[str, str, str]:
        if key not in cache:
            cubin, log = compile_cubin(source, [include_dir()], name=f"{key}.cu")
            cache[key] = (source, log, disassemble(cubin))
        return cache[key]

    return get



@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(GEMM_CONFIGS))
def test_gemm_compiles_to_tensor_cores(compiled, key: str) -> None:
    cfg = GEMM_CONFIGS[key]
    source, log, sass = compiled(key, render_gemm(cfg))
    assert f'extern "C" __global__ void __launch_bounds__({cfg.threads}, {cfg.ctas_per_sm})' in source
    assert_spill_free(log, sass)
    assert re.search(r"\bUTMALDG\.2D\b", sass), "no TMA loads"
    assert re.search(r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b", sass), "no mbarrier waits"
    realloc = set(re.findall(r"\bUSETMAXREG\.(\w+)", sass))
    assert realloc == ({"DEALLOC", "TRY_ALLOC"} if cfg.reallocates_registers else set()), realloc
    # No block-wide barrier inside the loops: the only one follows the mbarrier
    # initialisation (a cluster barrier instead when CTAs pair up). Named barriers only
    # sync one warpgroup (a staged epilogue, the producer's copies by hand).
    assert len(re.findall(r"\bBAR\.SYNC(?:\.DEFER_BLOCKING)? 0x0\b", sass)) == (0 if cfg.cluster > 1 else 1)
    # A staged f32 += reduce-adds; a staged 16-bit += loads its old tile (a TMA load of D
    # beside A's and B's) and stores the sums.
    tma_store = "UTMAREDG" if cfg.accumulate and not cfg.staged_add else "UTMASTG"
    assert bool(re.search(rf"\b{tma_store}\.2D\b", sass)) == cfg.store_tma, f"{tma_store} iff staged epilogue"
    assert not re.search(r"\bUTMAREDG\b", sass) if cfg.staged_add else True
    if cfg.cluster > 1:
        assert re.search(r"\bUTMALDG\.2D\.MULTICAST\b", sass), "A is not multicast"
    fp8 = cfg.a_type in ("e4m3", "e5m2")
    ops = set(re.findall(r"\b[HQ]GMMA\.[0-9x]+\.F32(?:\.[A-Z0-9]+)*", sass))
    sass_type = {"e4m3": ".E4M3", "e5m2": ".E5M2", "bf16": ".BF16", "f16": ""}  # F16 is implicit
    mma_n = cfg.wg_cols // cfg.mma_parts  # one wgmma's columns
    if fp8:
        want = f"QGMMA.64x{mma_n}x32.F32{sass_type[cfg.a_type]}{sass_type[cfg.b_type]}"
    else:
        want = f"HGMMA.64x{mma_n}x16.F32{sass_type[cfg.a_type]}"
    assert ops == {want}, ops
    # SwiGLU: one fast exponential per output element, lanes pairing up their columns.
    exps = len(re.findall(r"\bMUFU\.EX2\b", sass))
    assert exps == (cfg.tile_n // 4 if cfg.swiglu else 0), exps
    assert bool(re.search(r"\bSHFL\.BFLY\b", sass)) == cfg.swiglu


def _ops_inside_batches(sass: str, op_name: str) -> int:
    """`op_name` instructions (shared loads, multiplies) between a wgmma batch's
    warpgroup.arrive and its wait."""
    ops = re.findall(rf"\b(WARPGROUP\.ARRIVE|WARPGROUP\.DEPBAR|QGMMA|{op_name})\b", sass)
    inside, count = False, 0
    for op in ops:
        if op == "WARPGROUP.ARRIVE":
            inside = True
        elif op == "WARPGROUP.DEPBAR":
            inside = False
        elif op == op_name and inside:
            count += 1
    return count


# Per-column B scales (the WGRAD) are read from the stage before the K block's wgmma issue:
# read after it, ptxas put the loads between the batch's first and second wgmma, with the
# SA x SB products waiting on them there. One or two B scales are read after the issue.
@pytest.mark.slow
@pytest.mark.parametrize("key", ["e4m3_1d1d_f32_acc", "e4m3_1d1d_n144"])
def test_per_column_scales_are_read_before_the_wgmma_issue(compiled, key: str) -> None:
    cfg = GEMM_CONFIGS[key]
    assert cfg.scales_before_issue and not GEMM_CONFIGS["e4m3_n192"].scales_before_issue
    assert _ops_inside_batches(compiled(key, render_gemm(cfg))[2], "LDS") == 0
    late = dataclasses.replace(cfg, scales_before_issue=False)
    assert _ops_inside_batches(compiled(f"{key}_late", render_gemm(late))[2], "LDS") > 0


# One or two B scales per tile: the producer stages each row's SA x SB products, so no
# multiply sits between a K block's wgmma (with raw scales ptxas put the four products
# there, waiting on the shared loads and holding up the rest of the batch's issue).
@pytest.mark.slow
@pytest.mark.parametrize("key", ["e4m3_n192", "e4m3_pair", "e4m3_1x128_128x128_bf16"])
def test_scale_products_stay_out_of_the_wgmma_issue(compiled, key: str) -> None:
    cfg = GEMM_CONFIGS[key]
    assert cfg.staged_products and cfg.sb_mode in (0, 1)
    assert _ops_inside_batches(compiled(key, render_gemm(cfg))[2], "FMUL") == 0
    raw = dataclasses.replace(cfg, name="", stages=0, staged_products=False)
    assert _ops_inside_batches(compiled(f"{key}_raw", render_gemm(raw))[2], "FMUL") > 0


def test_requant_compiles(compiled) -> None:
    _, log, sass = compiled("requant", render_requant(RequantKernelConfig()))
    assert_spill_free(log, sass)


QUANTIZE_CONFIGS = {
    f"{i}_{o}_b{r}{'_pow2' if p else ''}": QuantizeKernelConfig(in_type=i, out_type=o, block_r=r, pow2=p)
    for i, o in (("bf16", "e4m3"), ("f16", "e5m2"), ("f32", "e4m3"))
    for r in (1, 128)
    for p in (False, True)
}


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(QUANTIZE_CONFIGS))
def test_quantize_compiles(compiled, key: str) -> None:
    cfg = QUANTIZE_CONFIGS[key]
    _, log, sass = compiled(f"quantize_{key}", render_quantize(cfg))
    assert_spill_free(log, sass)
    # Saturating FP8 conversions (two lanes' worth per instruction) and a true division:
    # the IEEE path, not the approximate MUFU.RCP-only one.
    assert re.search(r"\bF2FP\.SATFINITE\.E[45]M[23]\.F32\.PACK_AB", sass), "no saturating FP8 conversion"
    assert re.search(r"\bFCHK\b", sass) and re.search(r"\bCALL\.REL", sass), "no IEEE division"
    assert re.search(r"\bSHFL\.BFLY\b", sass), "no warp max"
    vector = {"bf16": "LDG.E.64.", "f16": "LDG.E.64.", "f32": "LDG.E.128."}[cfg.in_type]
    assert vector in sass, "no vector loads"
    assert bool(re.search(r"\bBAR\.SYNC", sass)) == (cfg.block_r > 1)
    # Power-of-two scales come from integer work on amax's bits: no log2 or exp2 unit,
    # and no division of amax, only one per element a thread holds (x / scale).
    assert not re.search(r"\bMUFU\.(LG2|EX2)\b", sass)
    per_thread = 4 * (cfg.block_r // (cfg.threads // 32) if cfg.block_r > 1 else 1)
    assert len(re.findall(r"\bFCHK\b", sass)) == per_thread + (0 if cfg.pow2 else 1)


def test_quantize_names() -> None:
    names = {c.name for c in QUANTIZE_CONFIGS.values()}
    assert len(names) == len(QUANTIZE_CONFIGS)
    assert QuantizeKernelConfig().name == "gs_sm90a_quantize_bf16_e4m3_b1x128_w256"
    assert QuantizeKernelConfig(pow2=True).name == "gs_sm90a_quantize_bf16_e4m3_b1x128_w256_pow2"
    with pytest.raises(ValueError):
        QuantizeKernelConfig(in_type="e4m3")
    with pytest.raises(ValueError):
        QuantizeKernelConfig(block_r=64)


def test_transpose_compiles(compiled) -> None:
    _, log, sass = compiled("transpose", render_transpose(TransposeKernelConfig()))
    assert_spill_free(log, sass)


# ----------------------------------------------------------------------------- no compiler
def test_names_are_procedural_and_distinct() -> None:
    names = {cfg.name for cfg in GEMM_CONFIGS.values()}
    assert len(names) == len(GEMM_CONFIGS)
    cfg = GEMM_CONFIGS["e4m3_1x128_128x128_bf16"]
    assert cfg.name == "gs_sm90a_e4m3e4m3_bf16_sa1x128_sb128x128_t128x128x128_w384s5_store_tma"
    consumers = dataclasses.replace(cfg, name="", stages=0, consumer_scales=True, prefetch_scales=None, ring_rounds=None)
    assert consumers.name.endswith("_store_tma_consumerscales")
    assert dataclasses.replace(cfg, name="", ring_rounds=False).name.endswith("_store_tma_norounds")
    assert GEMM_CONFIGS["bf16_store"].tile_k == 64
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names)


def test_swiglu_code_only_in_swiglu_kernels() -> None:
    for key, cfg in GEMM_CONFIGS.items():
        source = render_gemm(cfg)
        assert ("silu" in source) == cfg.swiglu, key
        assert ("_swiglu" in cfg.name) == cfg.swiglu, key
    plain = dataclasses.replace(GEMM_CONFIGS["e4m3_swiglu_bf16"], swiglu=False, name="", stages=0, store_tma=None)
    assert plain == GEMM_CONFIGS["e4m3_1x128_128x128_bf16"]


def test_render_is_deterministic() -> None:
    cfg = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    same = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    assert cfg == same and render_gemm(cfg) == render_gemm(same)
    # Unscaled configs ignore scale block sizes: equal kernels compare equal.
    assert GemmKernelConfig("bf16", "bf16", "bf16", sb_bn=7) == GemmKernelConfig(
        "bf16", "bf16", "bf16"
    )


def test_smem_bytes_matches_layout() -> None:
    # Alignment slack, the epilogue staging (a whole D tile), then per stage: A and B
    # tiles, the scales, two mbarriers.
    fp8 = GEMM_CONFIGS["e4m3_1x128_128x128_bf16"]
    # The producer stages each stage's SA x SB products: one per row (one B scale per tile).
    assert fp8.store_tma and fp8.sb_mode == 0 and not fp8.consumer_scales and fp8.stages == 5
    assert fp8.staged_products and fp8.ring_rounds
    assert fp8.smem_bytes == 1024 + 128 * 128 * 2 + 5 * (256 * 128 + 128 * 4 + 16)
    # Two per row where the tile straddles a B scale block.
    wide = GEMM_CONFIGS["e4m3_n192"]
    assert wide.sb_mode == 1 and wide.sb_splits == (8, 16) and wide.stages == 4
    assert wide.smem_bytes == 1024 + 128 * 192 * 2 + 4 * (320 * 128 + 2 * 128 * 4 + 16)
    # The raw scales instead: 128 SA and the B scale(s), padded to 132 floats.
    raw = dataclasses.replace(wide, name="", stages=0, staged_products=False)
    assert raw.smem_bytes == 1024 + 128 * 192 * 2 + 4 * (320 * 128 + 132 * 4 + 16)
    # Read by the consumers from global memory instead (one or two B scales per tile only):
    # no scale slots; the one-block loop.
    consumers = dataclasses.replace(wide, name="", stages=0, consumer_scales=True, prefetch_scales=None, ring_rounds=None,
                                    staged_products=None)
    assert consumers.prefetch_scales and not consumers.ring_rounds and not consumers.staged_products
    assert consumers.smem_bytes == 1024 + 128 * 192 * 2 + 4 * (320 * 128 + 16)
    # Per-column B scales: staged per stage by the producer (a float per row and column).
    per_column = GEMM_CONFIGS["e4m3_1d1d_n144"]
    assert per_column.sb_mode == 2 and not per_column.consumer_scales
    assert not per_column.store_tma  # 144 f32 columns are not whole 32-column boxes
    assert per_column.scale_bytes == (128 + 144) * 4
    # BF16 128 x 256 keeps 3 stages beside its 64 KB staged tile; with an f32 output (128 KB)
    # only 2 would remain, so that one stores from registers.
    bf = GEMM_CONFIGS["bf16_wide"]
    assert bf.store_tma and bf.stages == 3 and bf.smem_bytes == 1024 + 128 * 256 * 2 + 3 * (384 * 64 * 2 + 16)
    # A 16-bit D += goes through the staging too (old tile loaded, added to, stored back),
    # with an mbarrier per consumer warpgroup for the loads.
    add = GemmKernelConfig("bf16", "bf16", "bf16", accumulate=True)
    assert add.store_tma and add.staged_add and not GemmKernelConfig("bf16", "bf16", "f32", accumulate=True).staged_add
    assert add.smem_bytes == 1024 + 128 * 128 * 2 + add.stages * (256 * 64 * 2 + 16) + 2 * 8
    bf32 = GemmKernelConfig("bf16", "bf16", "f32", tile_n=256)
    assert not bf32.store_tma and bf32.stages == 4
    # A SwiGLU stores from registers: no staging, so the ring is deeper than the staged
    # kernel's of the same tile.
    sw = GEMM_CONFIGS["e4m3_swiglu_bf16"]
    assert not sw.store_tma and sw.staging_bytes == 0 and sw.stages == 6
    assert sw.smem_bytes == 1024 + 6 * (256 * 128 + 128 * 4 + 16)  # staged products, one per row
    # Two swizzle rows of K per stage: twice the operand bytes per stage, half the stages
    # in the same shared memory (two blocks per SM: half of it each).
    two = GEMM_CONFIGS["bf16_m64_two_rows_lag2"]
    one = GEMM_CONFIGS["bf16_skinny_m64"]
    assert (two.k_atoms, two.stage_bytes, one.stage_bytes) == (2, 80 * 128 * 2, 80 * 128)
    assert two.smem_bytes == 1024 + two.stages * (80 * 256 + 16) and two.stages == one.stages // 2
    # Each TMA box stays one swizzle row wide.
    assert {m.box_inner for m in map_specs(two)} == {64}
    loads = [m for m in map_specs(GEMM_CONFIGS["e4m3_rowwise_two_rows"]) if m.operand in "ab"]
    assert [m.box_inner for m in loads] == [128, 128]
    assert "x128_" in two.name and two.name.endswith("_lag2")
    # The deepest ring is capped; every ring fits the 227 KB a block may use.
    assert dataclasses.replace(GEMM_CONFIGS["bf16_skinny_m64"], name="", stages=0, ctas_per_sm=1).stages == 12
    assert all(c.smem_bytes <= 232448 for c in GEMM_CONFIGS.values())
    # A memory-bound 64-row tile runs two blocks per SM: each ring gets half the SM's
    # 228 KB less the 1 KB reserved per block.
    skinny = GEMM_CONFIGS["bf16_skinny_m64"]
    assert skinny.ctas_per_sm == 2 and skinny.smem_bytes <= 233472 // 2 - 1024
    assert skinny.stages == (233472 // 2 - 1024 - 1024) // (80 * 64 * 2 + 16)


def test_sources_include_only_toolkit_headers() -> None:
    header = Path(include_dir(), "gemmspec_ptx.cuh").read_text()
    assert set(re.findall(r'#include\s+[<"]([^>"]+)', header)) <= {
        "cuda_fp8.h",
        "cuda_bf16.h",
        "cuda_fp16.h",
    }
    for src in (render_gemm(GEMM_CONFIGS["bf16_store"]), render_requant(), render_transpose(), render_quantize()):
        assert re.findall(r'#include\s+[<"]([^>"]+)', src) == ["gemmspec_ptx.cuh"]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(a_type="bf16", b_type="e4m3", d_type="bf16"),
        dict(a_type="e4m3", b_type="e4m3", d_type="i32"),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", scaled=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bk=64),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", tile_n=100),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", tile_n=264),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", tile_m=96),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", tile_m=256),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_k=32),
        # Several swizzle rows of K per stage: 2 or 4, no blockwise scales, one CTA per
        # tile, rows not gathered; a lagging release keeps a stage for the producer.
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_k=192),
        dict(a_type="bf16", b_type="bf16", d_type="f32", tile_m=64, tile_n=16, tile_k=512),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sb_bn=128, tile_k=256),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_k=128, cluster=2),
        dict(a_type="bf16", b_type="bf16", d_type="f32", tile_m=64, tile_n=16, tile_k=128, gather=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sb_bn=128, mma_lag=2),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", mma_lag=3),
        dict(a_type="bf16", b_type="bf16", d_type="f32", tile_m=64, tile_n=16, tile_k=256, mma_lag=2, stages=2),
        # 256 scaled columns only as two blockwise wgmma halves, with one or two B scales.
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bk=0, sb_bk=0, sb_bn=1, tile_n=256),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sb_bn=64, tile_n=256),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", stages=1),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_n=256, stages=5),
        # Two blocks per SM: 128 registers per thread, too few for 256-column accumulators.
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_m=64, tile_n=256, ctas_per_sm=2),
        # A staged epilogue stores whole 128-byte boxes (a 16-bit += too: it loads them).
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_n=96, store_tma=True),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_n=96, accumulate=True, store_tma=True),
        # Consumers read one or two B scales per tile, never per-column ones.
        dict(a_type="e4m3", b_type="e4m3", d_type="f32", scaled=True, sa_bm=1, sb_bn=1, consumer_scales=True),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", consumer_scales=True),
        # A SwiGLU stores BF16 or F32 from registers, with no bias.
        dict(a_type="bf16", b_type="bf16", d_type="f32", accumulate=True, swiglu=True),
        dict(a_type="bf16", b_type="bf16", d_type="f16", swiglu=True),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", swiglu=True, store_tma=True),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", swiglu=True, epilogue=(("bias", "f32"),)),
        # An FP8 D is stored (=) at its own rows from registers, in whole 128-column blocks.
        dict(a_type="e4m3", b_type="e4m3", d_type="e4m3", scaled=True, accumulate=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="e4m3", scaled=True, scatter=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="e4m3", scaled=True, store_tma=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="e4m3", scaled=True, tile_n=192),
        dict(a_type="e4m3", b_type="e4m3", d_type="e5m2", scaled=True, tile_n=128, swiglu=True),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", d_scale_pow2=True),
        # Fast accumulation: FP8 without scales per K block only; a promoting loop has no lag.
        dict(a_type="bf16", b_type="bf16", d_type="bf16", fast_accum=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, fast_accum=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bk=0, sb_bk=0, sb_bn=1, mma_lag=2),
    ],
)
def test_bad_configs_are_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        GemmKernelConfig(**kwargs)


@pytest.mark.parametrize("tile_n", [16, 32, 48, 64, 96, 128, 144, 160, 192])
@pytest.mark.parametrize("sb_bn", [64, 128, 256, 264])
def test_every_boundary_column_has_its_main_loop(tile_n, sb_bn):
    # The kernel dispatches `first = (SB_BN - n0 % SB_BN) / 8` to the main loops compiled for
    # sb_splits[:-1], the last one serving every other value: each tile must land on the loop
    # whose first-scale column groups are min(first, TILE_N / 8).
    cfg = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=sb_bn, tile_n=tile_n)
    if cfg.sb_mode != 1:
        assert cfg.sb_splits == ()
        return
    for n0 in range(0, 8 * sb_bn * tile_n, tile_n):
        first = (sb_bn - n0 % sb_bn) // 8
        compiled = first if first in cfg.sb_splits[:-1] else cfg.sb_splits[-1]
        assert compiled == min(first, tile_n // 8), (n0, first, cfg.sb_splits)


@pytest.mark.parametrize("key", ["e4m3_rowwise_wide", "e4m3_rowwise_two_rows", "e4m3_rowwise_fast"])
def test_per_channel_fp8_promotes_unless_fast(compiled, key: str) -> None:
    """Promoting: a fresh accumulator per 128 of K (a QGMMA batch whose first instruction
    does not read the accumulator: no `.DISABLE_INPUT`-free chain over the stage's rows)
    and an f32 add of it; fast: one accumulator chain over the whole stage."""
    cfg = GEMM_CONFIGS[key]
    source, _, sass = compiled(key, render_gemm(cfg))
    assert cfg.promotes == (not cfg.fast_accum)
    assert ("mma_k_atom" in source) == cfg.promotes
    # Promoting kernels wait for every row's batch (depth 0) before adding it; the fast
    # loop keeps one batch in flight (depth 1).
    depths = set(re.findall(r"\bWARPGROUP\.DEPBAR\.LE gsb0, 0x([0-9a-f]+)", sass))
    assert ("1" in depths) == (not cfg.promotes), depths
