"""Whole-tensor maps (kernels.py, ``whole_maps``): which launches take them, the
configuration's and emitter's refusals, the table region and map slots they add, and that
a kernel with them compiles for sm_90a without spills, its TMA issuer acquiring and
prefetching the block's two maps (UTMACCTL.IV / .PF). On the GPU: test_whole_maps_gpu.py."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import gemmspec
from gemmspec import bench
from gemmspec.codegen.emit import EmitError, emit_launch, inline_table_layout, whole_maps_possible
from gemmspec.codegen.kernels import INLINE_MAX_BLOCKS, GemmKernelConfig, include_dir
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.expr import Poly
from gemmspec.runtime.tensormap import TENSOR_MAP_BYTES

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nvrtc_helper import spill_free_sass  # noqa: E402

EXAMPLES = HERE.parents[1] / "examples"


def first_launch(text: str):
    exe = gemmspec.build(text)
    return exe, exe.program.launches[0]


@pytest.mark.parametrize(
    "name, whole",
    [
        ("moe_fp8_forward", True),  # ragged tokens, experts' weights: rows and experts are coordinates
        ("moe_masked_decode", True),  # masked groups: a group's first row
        ("lora_moe_scaled", True),
        ("moe_fp8_wgrad", False),  # K-grouped: the leaves' K differ
    ],
)
def test_which_launches_take_them(name, whole):
    exe, x = first_launch((EXAMPLES / f"{name}.gspec").read_text())
    assert whole_maps_possible(x.launch.problems) == whole
    assert x.gemm.whole_maps == (whole and bool(x.gemm.inline_table))
    assert x.gemm.name.endswith("_whole") == x.gemm.whole_maps
    assert ("through one map of each whole buffer" in exe.explain()) == x.gemm.whole_maps  # explain says so


def test_a_swiglu_over_separate_weights_keeps_its_maps():
    exe = gemmspec.build((EXAMPLES / "moe_swiglu_fp8_separate.gspec").read_text())
    x = exe.program.launches[0]
    assert x.gemm.swiglu_halves and not whole_maps_possible(x.launch.problems) and not x.gemm.whole_maps


def test_first_rows_are_exact_quotients():
    t, k, e, n = (Poly.sym(s) for s in ("start.m", "K", "g.expert", "N"))
    assert (t * k).exact_quotient(k) == t
    assert (e * n * k + t * k * 4).exact_quotient(k * 2) is None  # e * n / 2 is not whole
    assert (e * n * k + t * k * 4).exact_quotient(k) == e * n + t * 4
    assert (t * 300).exact_quotient(Poly.const(7)) is None
    assert (t * 300 + 5).exact_quotient(Poly.const(300)) is None  # a leaf starting mid-row
    assert t.exact_quotient(Poly.const(0)) is None and t.exact_quotient(t + k) is None


def test_the_configuration_refuses_them_without_a_table_in_the_kernel():
    with pytest.raises(ValueError, match="whole-tensor maps"):
        GemmKernelConfig(a_type="bf16", b_type="bf16", d_type="bf16", whole_maps=True)


def test_the_emitter_refuses_them_where_the_leaves_differ():
    _, x = first_launch((EXAMPLES / "moe_fp8_wgrad.gspec").read_text())
    assert x.gemm.inline_table and not x.gemm.whole_maps
    cfg = replace(x.gemm, whole_maps=True, name="")
    with pytest.raises(EmitError, match="whole buffers"):
        emit_launch(gemmspec.build((EXAMPLES / "moe_fp8_wgrad.gspec").read_text()).spec, x.launch, cfg, x.check)


def test_region_rows_and_map_slots():
    exe, x = first_launch(bench.moe_spec(n=512, k=576, e=11, fp8=True))
    cfg, pg = x.gemm, x.launch.problems
    layout = inline_table_layout(pg, x.check, whole_maps=True)
    plain = inline_table_layout(pg, x.check)
    # The rows (an int2 per leaf) end the region, after everything a table without them has.
    assert cfg.inline_table == layout.end == layout.whole_rows + 8 * pg.leaf_count
    assert layout.whole_rows >= plain.end and layout.whole_rows % 16 == 0
    source = x.source
    assert f"reinterpret_cast<unsigned char*>(leaves) + {layout.whole_rows})[leaf] = first_rows;" in source
    assert f"reinterpret_cast<const unsigned char*>(leaves) + {cfg.inline_table} -" in source
    # The whole buffers' extents: T rows of A, E x N rows of B, K columns; a leaf's first
    # rows there are formulas (no division on the device).
    assert "gemm::whole_maps(A, B, (dim_T), (576LL),\n" in source
    assert "(5632LL), (576LL), (576LL));" in source  # 11 experts x 512 rows of w
    assert "const long long a_row = (start_m), b_row = (512LL * g_expert);" in source
    maps = launch_manifest(exe.spec, exe.program).workspace("launch0.maps")
    per_leaf = 2 + (cfg.consumer_warpgroups if cfg.store_tma else 0)
    assert maps.bytes.evaluate({}) == INLINE_MAX_BLOCKS * (per_leaf * x.leaf_count + 2) * TENSOR_MAP_BYTES


def test_an_fp8_output_takes_them_only_where_tiles_end_at_the_leaf():
    _, x = first_launch(bench.moe_spec(n=512, k=576, e=4, fp8=True, out="e4m3"))
    assert x.gemm.fp8_out and x.gemm.whole_maps
    # Rows past a leaf's are never quantized with its rows; columns past it would be.
    assert f"L.n % {x.gemm.tile_n} == 0" in x.source and "L.m % " not in x.source


def test_the_decode_variant_compiles_spill_free_with_the_issuer_prefetching():
    exe = gemmspec.build(bench.moe_spec(n=512, k=576, e=8, fp8=True))
    x = exe.decode.program.launches[0]
    assert x.gemm.whole_maps and x.gemm.n_split == 2, x.gemm.name
    sass = spill_free_sass(x.source, [include_dir()], "decode_whole.cu")
    assert sass.count("UTMACCTL.PF") >= 2  # the block's A and B maps, fetched ahead
