"""The decode variant (codegen/variants.py): which launches get one, the rule that picks
it per call, that both programs' manifests name kernels their sources define, and that
the decode kernels compile for sm_90a without spills (the wide variant's producer issuing
its first TMA load before its scale copies)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gemmspec
import gemmspec.bench
from gemmspec.codegen.emit import with_kernel_config
from gemmspec.codegen.kernels import GemmKernelConfig, include_dir
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.codegen.variants import (
    DECODE_INLINE_MAX_LEAVES,
    DECODE_ROWS_PAIRED,
    DECODE_ROWS_PAIRED_WIDE,
    DECODE_ROWS_SINGLE,
    decode_changes,
    decode_variant,
)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nvrtc_helper import spill_free_sass  # noqa: E402

EXAMPLES = HERE.parents[1] / "examples"
# Qwen3's down projection at 128 experts: the wide variant, its table built in the GEMM.
QWEN3_DOWN = gemmspec.bench.moe_spec("moe_fp8", n=2048, k=768, e=128, fp8=True, scales_major_t=True)
WITH_VARIANT = ["moe_fp8_forward", "moe_bf16_forward", "moe_fp8_rowwise", "moe_swiglu_fp8", "lora_moe_scaled"]
# Masked rows are tiled by their bound already; a K-grouped WGRAD's rows are not ragged;
# gathered rows keep their measured tiling; a compile-time T needs no choice.
WITHOUT_VARIANT = ["moe_masked_decode", "moe_fp8_wgrad", "moe_fp8_gather_scatter", "linear_fp8_training"]


@pytest.mark.parametrize("name", WITH_VARIANT)
def test_ragged_launches_over_a_run_time_dim_get_a_64_row_variant(name):
    exe = gemmspec.build(EXAMPLES / f"{name}.gspec")
    variant = exe.decode
    assert variant is not None
    index = variant.launches[0][0]
    paired = exe.program.launches[index].gemm.cluster > 1
    wide = variant.program.launches[index].gemm.tile_n == 256 and exe.program.launches[index].gemm.tile_n < 256
    assert variant.rule.dim == "T"
    expected = (DECODE_ROWS_PAIRED_WIDE if wide else DECODE_ROWS_PAIRED) if paired else DECODE_ROWS_SINGLE
    assert variant.rule.rows_per_segment == expected
    group = exe.spec.group(variant.rule.group)
    assert variant.rule.segments % group.count == 0
    for index, before, after in variant.launches:
        assert exe.program.launches[index].gemm.name == before
        assert variant.program.launches[index].gemm.name == after
        assert before != after and "_t64x" in after and "c2b" not in after
    # Launches the rule does not change are the compiled ones, source for source.
    changed = {i for i, _, _ in variant.launches}
    for x, y in zip(exe.program.launches, variant.program.launches):
        if x.launch.index not in changed:
            assert x.source == y.source


@pytest.mark.parametrize("name", WITHOUT_VARIANT)
def test_other_launches_have_none(name):
    assert gemmspec.build(EXAMPLES / f"{name}.gspec").decode is None


def test_the_threshold_follows_the_compiled_kernel():
    fp8 = gemmspec.build(EXAMPLES / "moe_fp8_forward.gspec")  # 128 x 192 in CTA pairs
    bf16 = gemmspec.build(EXAMPLES / "moe_bf16_forward.gspec")  # 128 x 256, one CTA per tile
    assert fp8.program.launches[0].gemm.cluster == 2 and bf16.program.launches[0].gemm.cluster == 1
    assert fp8.decode.rule.rows_per_segment == DECODE_ROWS_PAIRED_WIDE == 128
    assert bf16.decode.rule.rows_per_segment == DECODE_ROWS_SINGLE == 32


def test_the_rule_picks_per_call_and_can_be_turned_off():
    exe = gemmspec.build(EXAMPLES / "moe_fp8_forward.gspec")
    limit = DECODE_ROWS_PAIRED_WIDE * 8  # eight experts, CTA pairs as compiled, the wide variant
    assert exe.decode.rule.max_rows == limit
    assert exe.program_for({"T": 0}) is exe.decode.program
    assert exe.program_for({"T": limit}) is exe.decode.program
    assert exe.program_for({"T": limit + 1}) is exe.program
    exe.choose_at_call = False
    assert exe.program_for({"T": 1}) is exe.program


@pytest.mark.parametrize("name", ["moe_fp8_forward", "lora_moe_scaled", "qwen3_down"])
def test_both_manifests_launch_kernels_their_sources_define(name):
    # qwen3_down: the compiled program has a builder before its GEMM, the variant none.
    exe = gemmspec.build(QWEN3_DOWN if name == "qwen3_down" else EXAMPLES / f"{name}.gspec")
    for program in (exe.program, exe.decode.program):
        sources = program.sources()
        manifest = launch_manifest(exe.spec, program, program.spec)
        assert manifest.kernels
        for step in manifest.kernels:
            assert re.search(rf"\b{re.escape(step.symbol)}\b", sources[step.file]), step.symbol


@pytest.mark.parametrize("name", ["moe_fp8_forward", "moe_bf16_forward", "qwen3_down"])
def test_decode_kernels_compile_without_spills(name):
    # qwen3_down: 128 experts, the wide variant with its table built in the GEMM.
    exe = gemmspec.build(QWEN3_DOWN if name == "qwen3_down" else EXAMPLES / f"{name}.gspec")
    for index, _, after in exe.decode.launches:
        source = exe.decode.program.launches[index].source
        sass = spill_free_sass(source, [include_dir()], f"{after}.cu")
        assert re.search(r"\b[QH]GMMA\b", sass)
        if exe.decode.program.launches[index].gemm.n_split > 1:
            # Two column warpgroups: 128-column batches, the producer's registers moved to them.
            assert re.search(r"\bQGMMA\.64x128x32\b", sass) and re.search(r"\bUSETMAXREG\b", sass)


def test_explain_prints_the_rule_and_its_json_carries_it():
    path = str(EXAMPLES / "moe_fp8_forward.gspec")
    text = subprocess.run([sys.executable, "-m", "gemmspec", "explain", path], capture_output=True, text=True,
                          check=True).stdout
    assert "at call time: the decode variant when T <= 128 x 8 segments of 'expert' = 1024 rows" in text
    doc = json.loads(subprocess.run([sys.executable, "-m", "gemmspec", "explain", "--json", path],
                                    capture_output=True, text=True, check=True).stdout)[0]
    choice = doc["run_time_choice"]
    assert choice["max_rows"] == 1024 and choice["dim"] == "T" and choice["group"] == "expert"
    ((launch),) = choice["launches"]
    assert launch["launch"] == 0 and "_t64x256x128_" in launch["decode"] and "c2b" in launch["compiled"]


def test_the_variant_takes_256_columns_in_whole_tiles_where_n_allows():
    # N = 4096 (a multiple of 256): 64 x 256 tiles, whole (no split K), and a table of 128
    # leaves built in the kernel (past the compiled kernels' 32).
    wide = gemmspec.build(gemmspec.bench.moe_spec("moe_fp8", n=4096, k=7168, e=128, fp8=True, scales_major_t=True))
    compiled, decode = wide.program.launches[0].gemm, wide.decode.program.launches[0].gemm
    assert (compiled.tile_m, compiled.tile_n, compiled.inline_table) == (128, 192, 0)
    assert (decode.tile_m, decode.tile_n, decode.cluster, decode.split_k, decode.n_split) == (64, 256, 1, False, 2)
    assert decode.inline_table and wide.decode.program.launches[0].kernels == (decode.name,)
    # N = 576 (not a multiple of 256): the compiled width, split K as compiled.
    narrow = gemmspec.build(gemmspec.bench.moe_spec("moe_fp8", n=576, k=7168, e=8, fp8=True, scales_major_t=True))
    compiled, decode = narrow.program.launches[0].gemm, narrow.decode.program.launches[0].gemm
    assert decode.tile_m == 64 and decode.tile_n == compiled.tile_n and decode.split_k == compiled.split_k
    # 257 leaves: past what the variant's GEMM builds itself, a builder runs before it.
    many = gemmspec.build(gemmspec.bench.moe_spec("moe_fp8", n=4096, k=7168, e=257, fp8=True, scales_major_t=True))
    assert not many.decode.program.launches[0].gemm.inline_table


def test_column_split_warpgroups_only_where_the_kernel_allows_them():
    base = dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bm=1, sb_bn=128, tile_m=64,
                tile_n=256, cluster=1)
    split = GemmKernelConfig(**base, n_split=2)
    assert (split.consumer_warpgroups, split.threads, split.wg_cols, split.mma_parts) == (2, 384, 128, 1)
    assert split.reallocates_registers and not split.staged_products
    one = GemmKernelConfig(**base)
    assert (one.consumer_warpgroups, one.threads, one.wg_cols, one.mma_parts) == (1, 256, 256, 2)
    for changes in ({"tile_m": 128}, {"tile_n": 192}, {"epilogue": (("row", "f32"),)}, {"accumulate": True},
                    {"split_k": True}):
        with pytest.raises(ValueError, match="columns split between two warpgroups"):
            GemmKernelConfig(**{**base, **changes}, n_split=2)
    with pytest.raises(ValueError, match="n_split must be 1 or 2"):
        GemmKernelConfig(**base, n_split=4)


def test_a_launch_whose_epilogue_rules_out_the_split_keeps_one_warpgroup_of_256_columns():
    # The decode FFN's down projection multiplies by the router weights in its epilogue.
    exe = gemmspec.build((EXAMPLES / "moe_ffn_fp8_decode.gspec").read_text())
    variant = exe.decode.program
    down = variant.launches[-1].gemm
    assert down.epilogue and (down.tile_m, down.tile_n, down.n_split) == (64, 256, 1)


def test_decode_variant_is_none_without_ragged_launches():
    (x,) = gemmspec.pipeline.lower_file(EXAMPLES / "moe_masked_decode.gspec")
    from gemmspec.codegen.emit import emit

    assert decode_variant(x.spec, x.schedule, emit(x.spec, x.schedule)) is None


def test_a_tile_directive_keeps_its_tile_at_every_size():
    text = (EXAMPLES / "moe_fp8_forward.gspec").read_text()
    at = text.index("{") + 1
    exe = gemmspec.build(text[:at] + "\n  tile(128, 192)\n" + text[at:])
    assert exe.decode is None and exe.program_for({"T": 1}) is exe.program


def test_masked_groups_of_64_rows_compile_fp8_256_column_tiles_without_spills():
    # Masked decode (32 groups of 64 rows): the compiled kernel itself takes 64 x 256
    # blockwise tiles (two 128-column wgmma halves), no variant needed.
    exe = gemmspec.build(gemmspec.bench.MASKED_SPEC.format(m=64, n=4096, k=7168, e=32))
    (launch,) = exe.program.launches
    assert (launch.gemm.tile_m, launch.gemm.tile_n) == (64, 256) and exe.decode is None
    sass = spill_free_sass(launch.source, [include_dir()], f"{launch.gemm.name}.cu")
    assert set(re.findall(r"\bQGMMA\.\w+", sass)) == {"QGMMA.64x128x32"}  # the two halves' wgmma


def test_the_producer_issues_its_first_tma_load_before_its_scale_copies():
    # The wide variant copies raw scales by cp.async (LDGSTS): its first TMA load (UTMALDG)
    # must not wait on the scales' address arithmetic, the start of every short call.
    exe = gemmspec.build(QWEN3_DOWN)
    launch = exe.decode.program.launches[0]
    assert launch.gemm.n_split == 2 and launch.gemm.inline_table, launch.gemm.name
    sass = spill_free_sass(launch.source, [include_dir()], f"{launch.gemm.name}.cu")
    producer = sass[sass.index("USETMAXREG.DEALLOC") :]  # the producer's branch, after its registers go
    assert "LDGSTS" in producer and "UTMALDG" in producer
    assert producer.index("UTMALDG") < producer.index("LDGSTS")


def _table_build(source: str) -> str:
    """The launch's table build in the GEMM (the `_inline` function) of `source`."""
    start = source.index("__device__ __noinline__ void")
    return source[start : source.index('extern "C" __global__', start)]


def test_the_wide_variants_consumers_write_its_d_maps_while_its_first_loads_fly():
    # late_d_maps: the table's build writes no D map and initialises the ring's mbarriers
    # (its last barrier publishes them: the GEMM's entry keeps no barrier of its own), so the
    # producer starts once the table and the whole maps are ready; the consumers write the
    # D maps at their start, in their staging. The compiled kernel (split K, CTA pairs)
    # keeps its D maps in the table's build, before its entry's barrier.
    exe = gemmspec.build(EXAMPLES / "moe_fp8_forward.gspec")
    variant, compiled = exe.decode.program.launches[0], exe.program.launches[0]
    assert variant.gemm.whole_maps and compiled.gemm.whole_maps
    assert variant.gemm.late_d_maps and not compiled.gemm.late_d_maps
    late, early = _table_build(variant.source), _table_build(compiled.source)
    assert f"{variant.gemm.name}_init_ring();" in late and "shared_templates + 2, D," not in late
    assert "_init_ring" not in early and "shared_templates + 2, D," in early
    run = variant.source[variant.source.index(f"void {variant.gemm.name}_run(") :]
    assert "__syncthreads()" not in run[: run.index("if (threadIdx.x >= CONSUMER_THREADS)")]
    assert "write_d_maps(own + LEAF_MAPS * leaf, slot, d_template, D, L);" in variant.source
    spill_free_sass(variant.source, [include_dir()], f"{variant.gemm.name}.cu")


@pytest.mark.parametrize(
    "name, index, late",
    [
        ("moe_fp8_rowwise", None, True),  # the compiled kernel: whole tiles, a plain TMA-stored epilogue
        ("moe_fp8_forward", None, False),  # split K
        ("moe_ffn_fp8_decode", 0, False),  # SwiGLU halves: no whole maps
    ],
)
def test_which_kernels_write_their_d_maps_late(name, index, late):
    exe = gemmspec.build(EXAMPLES / f"{name}.gspec")
    program = exe.program if index is None else exe.decode.program
    assert program.launches[index or 0].gemm.late_d_maps is late


# E8 T128's shape (N 4096, K 7168) in FP8: its decode variant, as the options tests start from.
E8_SPEC = gemmspec.bench.moe_spec("moe_fp8", n=4096, k=7168, e=8, fp8=True, scales_major_t=True)


def _e8_decode_launch(**options):
    """Launch 0 of E8's program re-emitted as its decode variant, with `options`."""
    exe = gemmspec.build(E8_SPEC)
    changes = decode_changes(exe.schedule.launches[0])[0]
    return with_kernel_config(exe.spec, exe.program, inline_leaves=DECODE_INLINE_MAX_LEAVES, **changes,
                              **options).launches[0]


def _tma_loads(sass: str) -> tuple[int, int]:
    """(TMA loads with an L2 cache policy, TMA loads without one) in `sass`."""
    loads = re.findall(r"\bUTMALDG[^;]*;", sass)
    hinted = [x for x in loads if "desc[" in x]
    return len(hinted), len(loads) - len(hinted)


@pytest.mark.parametrize("name", ["e8", "ffn_swiglu_halves"])
def test_weights_that_evict_first_put_the_policy_on_b_loads_and_nowhere_else(name):
    # b_evict_first: B's (and a SwiGLU's up weight's) TMA loads carry an evict-first L2
    # policy, A's none; the kernel is another one (its name says so); without it no load
    # has a policy (the decode variant as it runs by default).
    if name == "e8":
        plain, first = _e8_decode_launch(), _e8_decode_launch(b_evict_first=True)
    else:
        exe = gemmspec.build(EXAMPLES / "moe_ffn_fp8_decode.gspec")
        plain, first = (with_kernel_config(exe.spec, exe.decode.program, 0, table_tag="bfirst", **options).launches[0]
                        for options in ({}, {"b_evict_first": True}))
    gemm = first.gemm
    assert gemm.b_evict_first and not plain.gemm.b_evict_first
    assert "_bfirst" in gemm.name and "_bfirst" not in plain.gemm.name
    assert gemm.swiglu_halves is (name != "e8")
    hinted, unhinted = _tma_loads(spill_free_sass(first.source, [include_dir()], f"{gemm.name}.cu"))
    assert hinted and unhinted, (hinted, unhinted)  # B's (and U's) loads, then A's
    policies = [x.source.count("gs_policy_evict_first()") for x in (first, plain)]
    assert policies[0] - policies[1] == (2 if gemm.swiglu_halves else 1)
    assert _tma_loads(spill_free_sass(plain.source, [include_dir()], "plain.cu"))[0] == 0


def test_weights_evict_first_only_where_no_other_policy_or_multicast_applies():
    base = dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bm=1, sb_bn=128)
    assert GemmKernelConfig(**base, tile_m=64, tile_n=256, b_evict_first=True).b_evict_first
    with pytest.raises(ValueError, match="not both"):  # memory-bound tiles keep B (evict last)
        GemmKernelConfig(**base, tile_m=64, tile_n=32, b_evict_first=True)
    with pytest.raises(ValueError, match="multicast"):
        GemmKernelConfig(**base, tile_m=128, tile_n=192, cluster=2, b_evict_first=True)


def test_the_first_tiles_weights_are_asked_of_l2_once_the_table_is_built():
    # prefetch_k_blocks: after the table's barrier the block's warps (but the whole maps'
    # writer's) ask L2 for their first tile's B rows (cp.async.bulk.prefetch, UBLKPF in
    # SASS), that many K blocks of each; the kernel is another one (its name says so), the
    # default asks for nothing.
    plain, ahead = _e8_decode_launch(), _e8_decode_launch(prefetch_k_blocks=4)
    assert ahead.gemm.name == plain.gemm.name + "_pf4"
    table = _table_build(ahead.source)
    at = table.index("the table is whole")
    assert "gs_prefetch_l2(" in table[at:] and "4LL * gemm::TILE_K" in table[at:]
    assert table.index("gs_prefetch_l2(") < table.index("__syncthreads();  // the maps are written")
    assert "gs_prefetch_l2(" not in plain.source.replace("void gs_prefetch_l2(", "")
    assert re.search(r"\bUBLKPF\.L2\b", spill_free_sass(ahead.source, [include_dir()], f"{ahead.gemm.name}.cu"))
    assert not re.search(r"\bUBLKPF\b", spill_free_sass(plain.source, [include_dir()], f"{plain.gemm.name}.cu"))

    # A kernel that splits K (the masked decode's as compiled) asks for its first unit: a
    # whole tile, or a part of a split one from that part's first K block.
    masked = gemmspec.build(gemmspec.bench.MASKED_SPEC.format(m=64, n=4096, k=7168, e=32))
    split = with_kernel_config(masked.spec, masked.program, prefetch_k_blocks=4).launches[0]
    assert split.gemm.split_k and split.gemm.name.endswith("_splitk_inl_whole_pf4")
    table = _table_build(split.source)
    assert table.index("const gemm::SplitPlan plan = work->plan;") < table.index("gs_prefetch_l2(")
    assert "const int tile = first_tile, kb = first_kb;" in table
    assert re.search(r"\bUBLKPF\.L2\b", spill_free_sass(split.source, [include_dir()], f"{split.gemm.name}.cu"))


def test_the_first_tiles_prefetch_only_with_whole_maps_one_cta_and_no_memory_bound_tile():
    base = dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bm=1, sb_bn=128, tile_m=64, tile_n=256,
                inline_table=4096, whole_maps=True)
    assert GemmKernelConfig(**base, prefetch_k_blocks=4).prefetch_k_blocks == 4
    assert GemmKernelConfig(**base, split_k=True, prefetch_k_blocks=4).name.endswith("_splitk_inl_whole_pf4")
    for changes in ({"whole_maps": False}, {"tile_n": 32}):
        with pytest.raises(ValueError, match="L2 prefetch takes whole maps"):
            GemmKernelConfig(**{**base, **changes}, prefetch_k_blocks=4)
    with pytest.raises(ValueError, match="prefetch_k_blocks must be in"):
        GemmKernelConfig(**base, prefetch_k_blocks=17)


def test_ctas_that_leave_on_read_wait_for_their_stores_reads_only():
    # exit_on_read: the consumers' last wait on their TMA stores is the read of the
    # staging (wait_group.read), not the writes' completion; only a TMA-stored epilogue.
    plain, leaving = _e8_decode_launch(), _e8_decode_launch(exit_on_read=True)
    assert leaving.gemm.name == plain.gemm.name + "_xr"
    tail = "if (threadIdx.x % 128 == 0) gs_bulk_wait"
    assert f"{tail}();" in plain.source and f"{tail}_read();" not in plain.source.split("no CTA exits")[1][:400]
    assert f"{tail}_read();" in leaving.source.split("no CTA exits")[1][:400] and f"{tail}();" not in leaving.source
    spill_free_sass(leaving.source, [include_dir()], f"{leaving.gemm.name}.cu")
    with pytest.raises(ValueError, match="exit_on_read is about a TMA-stored epilogue"):
        _e8_decode_launch(store_tma=False, exit_on_read=True)
