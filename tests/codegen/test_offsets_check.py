"""Where the device check of the offsets runs (no GPU): in launch 0's leaf-table builder,
which then builds its table from the copies it checked, unless a pre-pass reads the
checked offsets before that builder; then it is a kernel of its own that runs first.
The emitted sources, the manifests and the explain output say the same, and the
builders that check compile for sm_90a without spills."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from gemmspec.cli import main
from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.codegen.manifest import CHECK_FLAGS, launch_manifest
from gemmspec.codegen.validate import FUNCTION, check_placement, validation_kernel
from gemmspec.explain import explain_text
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import assert_spill_free, compile_cubin, disassemble  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.gspec"))

# MoE WGRAD whose operands a requantize pass lays out per expert segment: the pass reads
# the (checked) expert offsets before any leaf-table builder runs.
REQUANT_FIRST = """
gemm wgrad_requant {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = requantize(dy)
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert = requantize(x)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


def lowered(path: Path):
    return [(x.spec, x.schedule) for x in lower_file(path)]


def builder_text(source: str) -> str:
    return source[source.index("// Leaf table builder") :]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_launch_0s_builder_runs_the_check(path):
    for spec, schedule in lowered(path):
        program = emit(spec, schedule, inline_tables=False)
        v = validation_kernel(spec)
        if v is None:
            assert program.check is None and check_placement(spec, schedule) is None
            assert not any(FUNCTION in x.source for x in program.launches)
            continue
        # No example has a pre-pass that reads offsets: the check is fused everywhere.
        assert program.check.fused and program.check.kernel == v
        first, *rest = program.launches
        assert first.check == v and all(x.check is None for x in rest)
        table = builder_text(first.source)
        # Defined once and called once, before the table, after which a barrier publishes
        # the checked copies to the whole block.
        assert table.count(f"{FUNCTION}(") == 2
        call = table.index(f"  {v.call()}")
        assert table.index("__syncthreads();", call) < table.index("for (int leaf = first;")
        # The table reads the checked copies (and the index tensors), never the inputs.
        for t in first.table_params:
            source = f"checked_{t}" if t in v.tensors else f"index_{t}"
            assert f"const int* const p_{t} = {source};" in table
        assert not re.search(r"in_\w+\[", table)
        assert not any(FUNCTION in x.source for x in rest)
        assert not any(name.endswith("_check.cu") for name in program.sources())


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fused_manifest_has_one_step_fewer(path):
    for spec, schedule in lowered(path):
        fused = launch_manifest(spec, emit(spec, schedule, inline_tables=False))
        alone = launch_manifest(spec, emit(spec, schedule, fuse_check=False))
        steps = lambda m: [(k.role, k.symbol) for k in m.kernels]  # noqa: E731
        if fused.offsets_check is None:
            assert alone.offsets_check is None and steps(fused) == steps(alone)
            continue
        assert steps(alone) == [("check", f"gs_{spec.name}_check"), *steps(fused)]
        assert len(alone.steps) == len(fused.steps) + 1
        assert fused.workspaces == alone.workspaces and fused.workspaces[0].name == CHECK_FLAGS
        check = alone.kernels[0]
        builder = next(k for k in fused.kernels if k.role == "leaf_table")
        # The builder takes exactly the check's parameters (in place of its own tensors).
        assert [p for p in builder.params if p in check.params] == list(check.params)
        plain = next(k for k in alone.kernels if k.symbol == builder.symbol)
        kept = [p for p in plain.params if not p.name.startswith("p_")]
        assert [p for p in builder.params if p not in check.params] == kept
        # Every later kernel is the same step, reading the checked copies.
        later = [[k for k in m.kernels if k.role != "check" and k.symbol != builder.symbol] for m in (fused, alone)]
        assert later[0] == later[1]
        offsets = {p.source.ref for k in later[0] for p in k.params if p.name.startswith("p_")}
        names = {a.name: a.role for a in fused.arguments}
        assert all(names.get(t) == "index" or t.startswith("check.") for t in offsets)
        assert fused.offsets_check.fused and fused.offsets_check.symbol == builder.symbol
        assert not alone.offsets_check.fused and alone.offsets_check.symbol == check.symbol
        assert fused.offsets_check.checks == alone.offsets_check.checks == validation_kernel(spec).checks


def test_a_prepass_that_reads_offsets_keeps_the_check_first():
    ((spec, schedule),) = lowered(parse(REQUANT_FIRST, "wgrad_requant.gspec"))
    placement = check_placement(spec, schedule)
    assert not placement.fused and "pre-pass 0 (requantize dy -> dy_q) reads the checked 'offs'" in str(placement)
    program = emit(spec, schedule)
    assert not program.check.fused and all(x.check is None for x in program.launches)
    assert "wgrad_requant_check.cu" in program.sources() and FUNCTION not in program.launches[0].source
    m = launch_manifest(spec, program)
    roles = [k.role for k in m.kernels]
    assert roles == ["check", "requantize", "requantize", "leaf_table", "gemm"]
    # Every reader of the offsets reads the checked copy the check step writes.
    (copy,) = [p.source.ref for p in m.kernels[0].params if p.name == "checked_offs"]
    readers = [p for k in m.kernels[1:] for p in k.params if p.name in ("offsets", "p_offs")]
    assert len(readers) == 3 and all(p.source.ref == copy == "check.offs" for p in readers)
    assert "offsets check (on the device): a kernel of its own, first" in explain_text(spec, schedule)


def test_explain_says_where_the_check_runs(capsys):
    path = ROOT / "examples" / "split_nest.gspec"
    ((spec, schedule),) = lowered(path)
    text = explain_text(spec, schedule)
    assert "offsets check (on the device): in launch 0's leaf-table builder" in text
    assert main(["explain", "--json", str(path)]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["offsets_check"] == {"fused": True, "where": str(check_placement(spec, schedule))}
    ((spec, schedule),) = lowered(ROOT / "examples" / "linear_fp8_training.gspec")
    assert "offsets check" not in explain_text(spec, schedule)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_fp8_wgrad", "moe_fp8_gather_scatter", "split_nest", "moe_masked_decode"])
def test_builders_that_check_compile_without_spills(name):
    """The builders of every kind of check (anchored scale rows, index tensors, nested
    and masked groups): no warning, no spill, and the launch's GEMM still there."""
    ((spec, schedule),) = lowered(ROOT / "examples" / f"{name}.gspec")
    first = emit(spec, schedule, inline_tables=False).launches[0]
    cubin, log = compile_cubin(first.source, [include_dir()], name=first.table_kernel)
    assert "warning" not in log, log
    assert_spill_free(log)
    sass = disassemble(cubin)
    assert first.table_kernel in sass and first.gemm.name in sass


def test_the_check_of_its_own_compiles():
    ((spec, schedule),) = lowered(parse(REQUANT_FIRST, "wgrad_requant.gspec"))
    v = emit(spec, schedule).check.kernel
    cubin, log = compile_cubin(v.source, [include_dir()], name=v.name)
    assert "warning" not in log, log
    assert v.name in disassemble(cubin)


def test_anchored_scale_rows_are_extents_the_cpp_launcher_leaves_out():
    ((spec, schedule),) = lowered(ROOT / "examples" / "moe_fp8_wgrad.gspec")
    m = launch_manifest(spec, emit(spec, schedule))
    rows = [p for k in m.kernels for p in k.params if p.source.kind == "extent"]
    assert [(p.name, p.source.ref, p.source.axis) for p in rows] == [
        ("rows_dy_scale_0", "dy_scale", 0), ("rows_x_scale_0", "x_scale", 0),
    ]
    from gemmspec.codegen.host import render_host

    host = render_host(m)
    assert host.count("static_cast<long long>(-1)") == 2
    # The kernel leaves a rule out whose length is unknown (negative), and only that one.
    v = validation_kernel(spec)
    assert v.function.count(">= 0 && counted > (unsigned long long)rows") == 2
