"""Split K for main loops whose leaves share one K: the default where the kernel can (the
LoRA shrink's memory-bound tiles, over all blocks; the BF16 and blockwise FP8 forwards'
wide tiles, a short last wave in parts of K where that pays, CTA pairs included), its workspaces (counters uploaded as zeros, partial sums sized
by the grid), its parameters in both kinds of launch, and its SASS (an atomic arrival per
warp, no spills)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")

import gemmspec  # noqa: E402
from gemmspec import bench  # noqa: E402
from gemmspec.codegen.emit import emit, with_kernel_config  # noqa: E402
from gemmspec.codegen.host import render_host  # noqa: E402
from gemmspec.codegen.kernels import GemmKernelConfig, include_dir, render_gemm  # noqa: E402
from gemmspec.codegen.manifest import KernelLaunch, Upload, launch_manifest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import assert_spill_free, compile_cubin, disassemble  # noqa: E402

SHRINK = bench.LORA.format(k=4096, r=16, l=4, e=8)
ROOT = Path(__file__).resolve().parents[2]


def test_default_for_the_lora_shrink():
    exe = gemmspec.build(SHRINK)
    cfg = exe.program.launches[0].gemm
    assert cfg.split_k and cfg.inline_table and cfg.name.endswith("_splitk_inl_whole") and not cfg.store_tma
    assert "reduce_split" in exe.program.launches[0].source
    whole = with_kernel_config(exe.spec, exe.program, split_k=False).launches[0].gemm
    assert not whole.split_k and whole.inline_table and "_splitk" not in whole.name


def test_default_for_wide_bf16_tiles():
    # The wide tiles keep their staged epilogue (stored by TMA once the tile is added up)
    # and cut the last waves into parts added up in order (reduce_parts); the memory-bound
    # shrink deals equal runs of K blocks (reduce_split).
    exe = gemmspec.build(ROOT / "examples" / "moe_bf16_forward.gspec")
    cfg = exe.program.launches[0].gemm
    assert cfg.split_k and cfg.store_tma and not cfg.memory_bound and (cfg.tile_m, cfg.tile_n) == (128, 256)
    source = exe.program.launches[0].source
    assert "reduce_parts(acc" in source and "reduce_split(" not in source and "SPLIT_MAX_PARTS = 8" in source
    shrink = gemmspec.build(SHRINK).program.launches[0].source
    assert "reduce_split(acc" in shrink and "reduce_parts(" not in shrink
    # One block per SM of up to 160: two 128 x 256 f32 slots each (one per split tile).
    assert cfg.split_max_blocks == 160 and cfg.split_sums_bytes == 160 * 2 * 128 * 256 * 4
    # explain says which scheme each takes.
    assert "split K where it pays at run time" in exe.explain()
    assert "K blocks of all tiles (whole ones where they fill the blocks) dealt evenly" in gemmspec.build(SHRINK).explain()


def test_default_for_blockwise_fp8_tiles():
    # The FP8 forward's 128 x 192 tiles in CTA pairs along M: the producer stages the scale
    # products from the part's first K block, each CTA of a pair adds its own tile's parts.
    exe = gemmspec.build(ROOT / "examples" / "moe_fp8_forward.gspec")
    cfg = exe.program.launches[0].gemm
    assert cfg.split_k and cfg.blockwise and cfg.staged_products and cfg.cluster == 2
    source = exe.program.launches[0].source
    assert "reduce_parts(acc, split, split_tile, rank, part" in source
    assert "product_factors(ps, kb_begin)" in source and "mainloop_scaled<8>(acc, count," in source
    assert "SPLIT_MAX_BLOCKS / CLUSTER" in source
    # Consumers that load their own scales start at K block 0: no split for them.
    own = with_kernel_config(exe.spec, exe.program, consumer_scales=True).launches[0].gemm
    assert not own.split_k


def test_not_for_staged_add_or_k_grouped_launches():
    # The scaled LoRA expand (a staged 16-bit +=, whose old tile every sharing block would
    # load) and K-grouped WGRAD (leaves of several K).
    for name in ("moe_fp8_wgrad", "lora_moe_scaled"):
        exe = gemmspec.build(ROOT / "examples" / f"{name}.gspec")
        for x in exe.program.launches:
            assert not x.gemm.split_k, x.gemm.name
            assert "reduce_split" not in x.source


@pytest.mark.parametrize("changes", [
    dict(a_type="e4m3", b_type="e4m3", scaled=True, sa_bm=1, sb_bn=128, consumer_scales=True),  # own scale loads
    dict(a_type="e4m3", b_type="e4m3", scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0),  # per-channel
    dict(cluster=2),  # a memory-bound pair
    dict(gather=True),
    dict(d_type="bf16", accumulate=True, tile_m=128, tile_n=128, store_tma=True),  # staged 16-bit +=
])
def test_refused_where_not_implemented(changes):
    args = dict(a_type="bf16", b_type="bf16", d_type="f32", tile_m=64, tile_n=16, split_k=True) | changes
    with pytest.raises(ValueError, match="split K"):
        GemmKernelConfig(**args)


@pytest.mark.parametrize("inline", [True, False])
def test_workspaces_and_parameters(inline):
    exe = gemmspec.build(SHRINK)
    program = emit(exe.spec, exe.schedule, inline_tables=inline)
    cfg = program.launches[0].gemm
    assert cfg.split_k and bool(cfg.inline_table) == inline
    m = launch_manifest(exe.spec, program)
    counters, sums = m.workspace("launch0.split_counters"), m.workspace("launch0.split_sums")
    assert cfg.split_max_blocks == 320  # two blocks per SM of up to 160 SMs
    assert counters.bytes.value == 4 * 2 * 320  # two per block and consumer warpgroup
    assert sums.bytes.value == 320 * 2 * 64 * 16 * 4  # two tile slots per block
    zeros = [s for s in m.steps if isinstance(s, Upload) and s.workspace == "launch0.split_counters"]
    assert len(zeros) == 1 and {v.value for v in zeros[0].int32} == {0}
    gemm = next(s for s in m.steps if isinstance(s, KernelLaunch) and s.role == "gemm")
    assert [p.name for p in gemm.params[-2:]] == ["split_counters", "split_sums"]
    assert [p.source.ref for p in gemm.params[-2:]] == ["launch0.split_counters", "launch0.split_sums"]
    # The kernel's last two parameters are the same two.
    source = program.launches[0].source
    assert "int* __restrict__ split_counters, float* __restrict__ split_sums)" in source
    # The C++ launcher zeroes the counters with one memset (not a chain of small uploads).
    host = render_host(m)
    assert "cudaMemsetAsync" in host and f"{4 * 2 * 320}, stream" in host


@pytest.mark.parametrize("tile", [(64, 16), (128, 256)])
def test_sass_counts_arrivals_without_spills(tile):
    # The wide tile adds its parts beside 128 accumulators per thread.
    cfg = GemmKernelConfig("bf16", "bf16", "bf16", tile_m=tile[0], tile_n=tile[1], split_k=True)
    cubin, log = compile_cubin(render_gemm(cfg), [str(include_dir())])
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert f"HGMMA.64x{tile[1]}x16.F32.BF16" in sass
    if cfg.memory_bound:
        assert "ATOMG.E.ADD" in sass  # the arrival count
    else:  # the parts' counter: an acquire load before the slot is read, a release store after
        assert "LDG.E.STRONG.GPU" in sass and "STG.E.STRONG.GPU" in sass
    plain = disassemble(compile_cubin(render_gemm(GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16)),
                                      [str(include_dir())])[0])
    assert "ATOMG" not in plain


@pytest.mark.parametrize("cluster", [1, 2])
def test_sass_fp8_parts_without_spills(cluster):
    cfg = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_n=192, cluster=cluster,
                           multicast_b=cluster == 2, split_k=True)
    cubin, log = compile_cubin(render_gemm(cfg), [str(include_dir())])
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert "QGMMA.64x192x32.F32.E4M3.E4M3" in sass
    assert "LDG.E.STRONG.GPU" in sass and "STG.E.STRONG.GPU" in sass


def test_refused_for_leaves_of_several_k():
    # K-grouped (each part's tokens): split K would count every leaf's K blocks as the
    # first one's.
    from test_segment_pad_emit import SPLIT

    from gemmspec.codegen.emit import EmitError

    exe = gemmspec.build(SPLIT.replace("dim N = 256", "dim N = 16"))
    assert not exe.program.launches[0].gemm.split_k
    with pytest.raises(EmitError, match="share one K"):
        with_kernel_config(exe.spec, exe.program, split_k=True, tile_m=64, tile_n=16, store_tma=False)
