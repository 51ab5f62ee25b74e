"""GEMM kernels that build their leaf table themselves: which launches get them, what the
emitted kernel and its manifest step hold, and what `explain` says."""

from __future__ import annotations

import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from gemmspec import bench
from gemmspec.codegen.emit import emit, inline_table_layout, launch_config, whole_maps_possible
from gemmspec.codegen.kernels import (
    INLINE_MAX_BLOCKS,
    INLINE_MAX_LEAVES,
    GemmKernelConfig,
    include_dir,
)
from gemmspec.codegen.manifest import CHECK_FLAGS, TENSOR_MAP_BYTES, launch_manifest
from gemmspec.explain import explain_text
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.gspec"))


def lowered(source):
    return [(x.spec, x.schedule) for x in lower_file(source)]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_single_launches_of_few_leaves_build_their_table(path):
    for spec, schedule in lowered(path):
        program = emit(spec, schedule)
        alone = len(schedule.launches) == 1 and not schedule.prepasses
        for x in program.launches:
            pg = x.launch.problems
            # A SwiGLU over separate gate and up weights keeps its builder (its up map per leaf).
            expected = (alone and pg.leaf_count <= INLINE_MAX_LEAVES and not pg.index_maps
                        and not x.gemm.swiglu_halves)
            assert bool(x.gemm.inline_table) == expected, x.gemm.name
            # and loads A and B through maps of their whole buffers where every leaf's K and
            # row strides allow it.
            assert x.gemm.name.endswith("_inl" + ("_whole" if x.gemm.whole_maps else "")) == expected
            assert x.gemm.whole_maps == (expected and whole_maps_possible(pg))
            # explain reports the configuration emit gives (the symbol adds the spec's name).
            assert replace(launch_config(spec, schedule, x.launch), name=x.gemm.name) == x.gemm
            assert x.gemm.name.endswith(launch_config(spec, schedule, x.launch).name[len("gs_"):])
        text = explain_text(spec, schedule)
        assert ("leaf table built by each block" in text) == any(x.gemm.inline_table for x in program.launches)


def test_many_leaves_keep_a_builder():
    ((spec, schedule),) = lowered(bench.LORA.format(k=576, r=16, l=8, e=8))  # 64 leaves
    (x,) = emit(spec, schedule).launches
    assert not x.gemm.inline_table and x.kernels == (x.table_kernel, x.gemm.name)


def test_the_kernel_builds_the_table_then_runs_the_gemm():
    ((spec, schedule),) = lowered(bench.LORA.format(k=576, r=16, l=2, e=5))
    (x,) = emit(spec, schedule).launches
    cfg, source = x.gemm, x.source
    assert cfg.inline_table and not cfg.programmatic and cfg.inline_static == 0
    # No builder to wait for or to let go.
    assert "gs_grid_dependency_wait();" not in source and "gs_launch_dependents();" not in source
    entry = source[source.index(f'{cfg.name}(GsTensorMap* __restrict__ maps'):]
    # Blocks past the map slots leave; the table is built (not inlined), then the GEMM runs.
    assert entry.index("INLINE_MAX_BLOCKS) return;") < entry.index("_inline(") < entry.index(f"{cfg.name}_run(")
    assert "__noinline__ void gs_lora_shrink_l0_leaves_inline(" in source
    # Block 0 alone writes the flags; every block checks into its own shared memory.
    assert "int* const flags = blockIdx.x == 0 ? check_flags :" in source
    assert "int* const checked_lora_offsets = reinterpret_cast<int*>(copies + " in source
    # The records and copies fit the region the configuration reserves.
    layout = inline_table_layout(x.launch.problems, x.check, cfg.whole_maps)
    assert cfg.inline_table == layout.end and cfg.inline_bytes >= layout.end
    # With whole maps, each leaf's first rows in them (an int2) end the region.
    assert cfg.whole_maps and layout.whole_rows == layout.end - 8 * x.leaf_count


def test_the_manifest_has_one_kernel_step_with_the_builders_inputs():
    ((spec, schedule),) = lowered(bench.LORA.format(k=576, r=16, l=2, e=5))
    program = emit(spec, schedule)
    (x,) = program.launches
    m = launch_manifest(spec, program)
    (step,) = m.kernels
    assert (step.role, step.symbol, step.programmatic) == ("gemm", x.gemm.name, False)
    names = [p.name for p in step.params]
    assert names[:7] == ["maps", "templates", "A", "B", "D", "SA", "SB"]
    assert "check_flags" in names and not any(n.startswith("checked_") for n in names)
    flags = next(p for p in step.params if p.name == "check_flags")
    assert (flags.source.kind, flags.source.ref) == ("workspace", CHECK_FLAGS)
    # No leaf table and no checked copies in global memory; map slots for every block
    # (and split K's counters and partial sums: the shrink splits its K blocks).
    assert [w.name for w in m.workspaces] == [
        CHECK_FLAGS, "launch0.maps", "launch0.templates", "launch0.split_counters", "launch0.split_sums"
    ]
    maps = m.workspace("launch0.maps")  # and each block's pair of whole maps after them
    assert x.gemm.whole_maps
    assert maps.bytes.evaluate({}) == INLINE_MAX_BLOCKS * (x.leaf_count * 2 + 2) * TENSOR_MAP_BYTES
    assert m.offsets_check.symbol == x.gemm.name and m.offsets_check.fused


def test_shared_memory_counts_the_table():
    base = GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16)
    inl = GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, inline_table=4800)
    assert inl.name == base.name.replace(f"s{base.stages}", f"s{inl.stages}") + "_inl"
    assert inl.smem_bytes <= inl.smem_limit and inl.stages <= base.stages
    assert inl.smem_bytes >= 1024 + inl.stages * inl.stage_bytes + inl.inline_bytes
    split = GemmKernelConfig("bf16", "bf16", "f32", tile_m=64, tile_n=16, inline_table=4800, split_k=True)
    assert split.name.endswith("_splitk_inl")
    with pytest.raises(ValueError, match="no index tensors"):
        GemmKernelConfig("bf16", "bf16", "bf16", tile_m=64, tile_n=16, inline_table=4800, scatter=True)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["lora_moe_nested", "moe_fp8_forward", "moe_fp8_wgrad", "moe_masked_decode"])
def test_compiles_spill_free_with_the_pipeline(name):
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    ((spec, schedule),) = lowered(ROOT / "examples" / f"{name}.gspec")
    (x,) = emit(spec, schedule).launches
    assert x.gemm.inline_table
    cubin, log = compile_cubin(x.source, [include_dir()], name=f"{x.gemm.name}.cu")
    assert "warning" not in log, log
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert re.search(r"\bUTMALDG\.2D\b", sass) and "SYNCS" in sass
    assert ("USETMAXREG" in sass) == x.gemm.reallocates_registers
    assert "ACQBULK" not in sass  # no wait for a builder
