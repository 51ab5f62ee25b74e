"""On a Hopper GPU: GEMMs that build their leaf table and load A and B through maps of
their whole buffers (kernels.py, ``whole_maps``) compute what the same kernels with a map
per leaf compute, each judged element by element against the float64 reference (guard
bytes included, gemmspec.runtime.verify), on leaves of 0, 1, 2, 7, 8, 9, 63, 64, 65, 127
and 129 rows:

- FP8 blockwise and BF16 MoE GEMMs, compiled and as their decode variant (one and two
  column warpgroups), where a tile's rows past a leaf's last are the next leaf's tokens;
- masked groups (rows past a group's count are its padding);
- an FP8 output over 384 columns in 256-column tiles: the leaves' last tiles would read
  columns past the leaf into what the row's FP8 scale sees, so each leaf keeps maps of its
  own (the fallback), in the same kernel.

(CUDA-graph replay with new counts on the decode variant, whole maps included:
test_decode_variant_gpu.py.)

Skipped without a Hopper GPU (conftest.py)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

import gemmspec
from gemmspec import bench
from gemmspec.codegen.emit import emit_launch, inline_table_layout, with_kernel_config
from gemmspec.codegen.variants import DECODE_TABLE_TAG
from gemmspec.runtime.verify import check_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode_variant_gpu import COUNTS, spec_text  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
EDGES = [0, 1, 2, 7, 8, 9, 63, 64, 65, 127, 129]

# An FP8 output over 384 columns (tiled 256 wide below: no leaf's columns are whole tiles).
FP8_OUT = bench.moe_spec("whole_fp8_out", n=384, k=300, e=11, fp8=True, out="e4m3")

# Eleven experts, one per leaf size of EDGES.
MOE = {dtype: bench.moe_spec(f"whole_{dtype}", n=512, k=576, e=11, fp8=dtype == "e4m3") for dtype in ("e4m3", "bf16")}


def ok(exe, lengths, seed=0):
    report = check_random(exe, lengths=lengths, seed=seed).report
    assert report.ok, report.describe()


def per_leaf_maps(spec, program, table_tag=""):
    """`program` with launch 0 in the same configuration but its whole maps off (a map per
    leaf); `table_tag` as the program's builder has it (the decode variant's)."""
    x = program.launches[0]
    cfg = replace(x.gemm, whole_maps=False, inline_table=inline_table_layout(x.launch.problems, x.check).end, name="")
    launch = emit_launch(spec, x.launch, cfg, x.check, table_tag=table_tag)
    assert not launch.gemm.whole_maps and launch.gemm.tile_n == x.gemm.tile_n
    return replace(program, launches=(launch, *program.launches[1:]))


def both_ways(text, lengths, seed, **changes):
    """A fresh executable with whole maps (as compiled, or with launch 0's `changes`), then
    a fresh one with a map per leaf, each running its compiled program (not the decode
    variant) once: a call's plan stays with its executable, so each way gets its own."""
    for whole in (True, False):
        exe = gemmspec.build(text)
        exe.choose_at_call = False
        if changes:
            exe.program = with_kernel_config(exe.spec, exe.program, 0, **changes)
        assert exe.program.launches[0].gemm.whole_maps and exe.program.launches[0].gemm.inline_table
        if not whole:
            exe.program = per_leaf_maps(exe.spec, exe.program)
        ok(exe, lengths, seed)
        yield exe


@pytest.mark.parametrize("dtype", sorted(MOE))
def test_moe_whole_and_per_leaf_maps(dtype):
    list(both_ways(MOE[dtype], {"expert": EDGES}, 1))


@pytest.mark.parametrize("kind", ["fp8", "fp8_wide", "bf16"])
@pytest.mark.parametrize("counts", ["edges_low", "small"])
def test_decode_variant_whole_and_per_leaf_maps(kind, counts):
    lengths = COUNTS[counts]
    for whole in (True, False):
        exe = gemmspec.build(spec_text(kind))
        picked = exe.program_for({"T": sum(lengths)})
        assert picked is exe.decode.program, f"{kind} {counts}: the rule no longer picks the decode variant"
        assert picked.launches[0].gemm.whole_maps
        if not whole:
            exe.decode = replace(exe.decode, program=per_leaf_maps(exe.spec, exe.decode.program, DECODE_TABLE_TAG))
            assert exe.program_for({"T": sum(lengths)}) is exe.decode.program
        ok(exe, {"expert": lengths}, seed=2)


def test_masked_groups():
    list(both_ways((ROOT / "examples" / "moe_masked_decode.gspec").read_text(), None, 5))


def test_fp8_output_leaves_keep_maps_of_their_own():
    # 384 columns in 256-column tiles: no leaf takes the whole maps.
    (exe, _) = both_ways(FP8_OUT, {"expert": EDGES}, 3, tile_m=64, tile_n=256)
    assert "L.n % 256 == 0" in exe.program.launches[0].source
