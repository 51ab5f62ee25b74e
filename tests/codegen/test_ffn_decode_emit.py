"""examples/moe_ffn_fp8_decode.gspec as emitted: one call is the gather pre-pass, the two
grouped launches (each after its leaf-table builder; in the decode variant the second
builds its table in its GEMM, from the offsets the first builder checked) and
scatter_add's five kernels, in that order, in the program as compiled and in its decode
variant; every kernel file of both compiles for sm_90a with NVRTC, without warnings or
spills, and defines the symbols the manifest launches."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.codegen.kernels import include_dir
from gemmspec.codegen.manifest import launch_manifest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from nvrtc_helper import spill_free_sass  # noqa: E402

EXAMPLE = HERE.parents[1] / "examples" / "moe_ffn_fp8_decode.gspec"
COMBINE = ["scatter_zero", "scatter_count", "scatter_scan", "scatter_place", "scatter_add"]
ROLES = ["gather", "leaf_table", "gemm", "leaf_table", "gemm", *COMBINE]
DECODE_ROLES = ["gather", "leaf_table", "gemm", "gemm", *COMBINE]


def programs():
    exe = gemmspec.build(EXAMPLE)
    assert exe.decode is not None, "the down-projection's ragged rows over T get a decode variant"
    return exe, (exe.program, exe.decode.program)


def test_one_call_runs_every_step_in_order():
    exe, progs = programs()
    for program, roles in zip(progs, (ROLES, DECODE_ROLES)):
        steps = launch_manifest(exe.spec, program, program.spec).kernels
        assert [s.role for s in steps] == roles
        assert [s.owner for s in steps][-5:] == ["postpass 0"] * 5
    # The decode variant takes 64 x 256 tiles in both launches, whole; the second builds
    # its table in the GEMM. A call takes it up to 16 rows per expert (the threshold of
    # SwiGLU over separate weights, the lower of the two launches').
    (up, down) = exe.decode.launches
    assert [up[0], down[0]] == [0, 1]
    assert "_t64x256x" in up[2] and "_t128x256x" in up[1] and "_swiglu_halves" in up[2]
    assert "_t64x256x" in down[2] and "_t128x192x" in down[1] and down[2].endswith("_inl_whole")
    assert exe.decode.rule.rows_per_segment == 16


@pytest.mark.slow
def test_every_kernel_of_both_programs_compiles_for_sm90a():
    exe, progs = programs()
    compiled: dict[str, str] = {}
    for program in progs:
        sources = program.sources()
        for step in launch_manifest(exe.spec, program, program.spec).kernels:
            source = sources[step.file]
            if source not in compiled:
                compiled[source] = spill_free_sass(source, [include_dir()], step.file)
            assert re.search(rf"\b{re.escape(step.symbol)}\b", compiled[source]), step.symbol
            if step.role == "gemm":
                assert re.search(r"\bQGMMA\b", compiled[source]), step.symbol
    assert len(compiled) == 6  # pre-pass, two launches, their decode variant's two, the combine


def test_the_down_projection_builds_its_table_from_the_checked_offsets():
    # Launch 1's GEMM builds its table itself in the decode variant: it must read the
    # copies of the offsets launch 0's builder checked (with bad offsets they make it
    # compute nothing), never the caller's tensor. Only that builder reads the tensor.
    exe, (_, variant) = programs()
    kernels = launch_manifest(exe.spec, variant, variant.spec).kernels
    down = next(k for k in kernels if k.role == "gemm" and k.owner == "launch 1")
    offsets = {p.name: p.source for p in down.params if p.name.endswith("expert_offsets")}
    assert {(s.kind, s.ref) for s in offsets.values()} == {("workspace", "check.expert_offsets")}
    readers = [k.owner for k in kernels for p in k.params if (p.source.kind, p.source.ref) == ("tensor", "expert_offsets")]
    assert readers == ["launch 0"]
