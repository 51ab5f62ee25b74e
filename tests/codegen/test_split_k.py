"""Split K, a kernel option for memory-bound tiles: what it accepts, where its counters and
partial sums live (after the leaf table's records, zeroed by the builder), and its SASS
(an atomic arrival per warp, no spills). Not chosen by default: the examples' kernels
have no split code."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")

import gemmspec  # noqa: E402
from gemmspec import bench  # noqa: E402
from gemmspec.codegen.emit import split_area_at, with_kernel_config  # noqa: E402
from gemmspec.codegen.kernels import SPLIT_SLOTS, GemmKernelConfig, include_dir, render_gemm  # noqa: E402
from gemmspec.codegen.manifest import launch_manifest  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import assert_spill_free, compile_cubin, disassemble  # noqa: E402

SHRINK = bench.LORA.format(k=4096, r=16, l=4, e=8)


def test_not_the_default():
    exe = gemmspec.build(SHRINK)
    cfg = exe.program.launches[0].gemm
    assert not cfg.split_k and "_splitk" not in cfg.name
    assert "reduce_split" not in render_gemm(cfg)


@pytest.mark.parametrize("changes", [
    dict(a_type="e4m3", b_type="e4m3", scaled=True, sa_bm=1, sb_bn=128),  # blockwise promotion
    dict(cluster=2),
    dict(gather=True),
    dict(tile_n=32, store_tma=True),
])
def test_refused_where_not_implemented(changes):
    args = dict(a_type="bf16", b_type="bf16", d_type="f32", tile_m=64, tile_n=16, split_k=True) | changes
    with pytest.raises(ValueError, match="split K"):
        GemmKernelConfig(**args)


def test_workspace_and_builder():
    exe = gemmspec.build(SHRINK)
    program = with_kernel_config(exe.spec, exe.program, split_k=True)
    launch = program.launches[0]
    cfg = launch.gemm
    assert cfg.split_k and cfg.name.endswith("_splitk") and not cfg.store_tma
    at = split_area_at(launch.leaf_count, epilogue=False)
    assert at % 256 == 0 and at >= (launch.leaf_count + 1) * 144
    leaves = launch_manifest(exe.spec, program).workspace("launch0.leaves")
    assert leaves.bytes.value == at + cfg.split_counter_bytes + SPLIT_SLOTS * 64 * 16 * 4
    assert "split K" in leaves.purpose
    # The builder zeroes one counter per consumer warp of every tile that can be split.
    assert f"+ {at});" in launch.source and f"i < {SPLIT_SLOTS // 2 * 4};" in launch.source


def test_sass_counts_arrivals_without_spills():
    cfg = GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, split_k=True)
    cubin, log = compile_cubin(render_gemm(cfg), [str(include_dir())])
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert "ATOMG.E.ADD" in sass and "HGMMA.64x16x16.F32.BF16" in sass
    plain = disassemble(compile_cubin(render_gemm(GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16)),
                                      [str(include_dir())])[0])
    assert "ATOMG" not in plain
