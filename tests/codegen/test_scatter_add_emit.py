"""scatter_add as emitted: its configuration and kernel names, the five manifest steps
after the launches (zero, count, scan, place, the sum) with their workspaces and grids
as formulas of T and S, the host launcher issuing them in that order, and every type
combination compiled for sm_90a without spills, with 16-byte loads."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.codegen.emit import emit
from gemmspec.codegen.host import render_host
from gemmspec.codegen.kernels import RowPassKernelConfig, include_dir, render_row_pass
from gemmspec.codegen.manifest import KernelLaunch, launch_manifest
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from scatter_add_spec import SCATTER_ADD_SPEC  # noqa: E402

SPEC = SCATTER_ADD_SPEC
BASE = "gs_sa_q0_sm90a_scatter_add_bf16_bf16_w256"
ROLES = ["scatter_zero", "scatter_count", "scatter_scan", "scatter_place", "scatter_add"]


def manifest():
    (low,) = lower_file(SPEC)
    prog = emit(low.spec, low.schedule)
    return prog, launch_manifest(low.spec, prog)


def test_the_configuration_names_its_kernels():
    cfg = RowPassKernelConfig("scatter_add", "bf16", "bf16", False, "f32")
    assert cfg.name == "gs_sm90a_scatter_add_bf16_f32_w256"
    assert cfg.rows_per_cta == 8
    prog, _ = manifest()
    assert [p.kernel for p in prog.postpasses] == [BASE, "gs_sa_q1_sm90a_scatter_add_f16_f32_w256"]
    assert prog.postpasses[0].kernels == (
        f"{BASE}_zero", f"{BASE}_count", f"{BASE}_scan", f"{BASE}_place", BASE,
    )
    assert list(prog.sources())[-2:] == ["sa_postpass0.cu", "sa_postpass1.cu"]


def test_the_steps_come_after_the_launches_with_their_workspaces():
    _, m = manifest()
    kernels = [s for s in m.steps if isinstance(s, KernelLaunch)]
    assert [(s.role, s.owner) for s in kernels][-10:] == [(r, "postpass 0") for r in ROLES] + [
        (r, "postpass 1") for r in ROLES
    ]
    assert kernels[-11].role == "gemm"
    zero, count, scan, place, add = kernels[-10:-5]
    assert [q.name for q in zero.params] == ["COUNTS", "CURSORS", "S"]
    assert [q.name for q in count.params] == ["IDX", "T", "S", "COUNTS"]
    assert [q.name for q in scan.params] == ["COUNTS", "S"]
    assert [q.name for q in place.params] == ["IDX", "T", "S", "COUNTS", "CURSORS", "SLOTS"]
    assert [q.name for q in add.params] == ["A", "lda", "COUNTS", "SLOTS", "ORDER", "S", "C", "Y", "ldy"]
    ws = {w.name: w for w in m.workspaces}
    env = {"T": 1000, "S": 37}
    assert {n: ws[f"postpass0.{n}"].bytes.evaluate(env) for n in ("counts", "cursors", "slots", "order")} == {
        "counts": 4 * 38, "cursors": 4 * 37, "slots": 4000, "order": 4000,
    }
    by = {q.name: q for q in add.params}
    assert (by["A"].source.ref, by["Y"].source.ref, by["Y"].ctype) == ("dxr", "dx", "__nv_bfloat16*")
    assert (by["COUNTS"].source.ref, by["SLOTS"].source.ref, by["ORDER"].source.ref) == (
        "postpass0.counts", "postpass0.slots", "postpass0.order",
    )
    assert {q.source.ref for q in place.params if q.name in ("IDX", "COUNTS", "CURSORS", "SLOTS")} == {
        "src", "postpass0.counts", "postpass0.cursors", "postpass0.slots",
    }
    assert {q.name: q.source.value.evaluate(env) for q in add.params if q.name in ("lda", "C", "ldy")} == {
        "lda": 136, "C": 136, "ldy": 136,
    }
    assert {q.name: q.source.value.evaluate(env) for q in kernels[-1].params if q.name == "lda"} == {"lda": 139}
    grids = {s.role: s.grid[0] for s in (zero, count, scan, place, add)}
    assert [grids[r].evaluate(env) for r in ROLES] == [1, 4, 1, 4, 5]
    assert [zero.block, count.block, scan.block, place.block, add.block] == [256, 256, 1024, 256, 256]
    # No entries or no target rows: the grids that would divide them are empty (skipped),
    # the zeroing and the scan still run.
    assert [grids[r].evaluate({"T": 0, "S": 5}) for r in ROLES] == [1, 0, 1, 0, 1]
    assert [grids[r].evaluate({"T": 9, "S": 0}) for r in ROLES] == [1, 1, 1, 1, 0]


def test_the_host_launcher_issues_the_steps_in_order():
    _, m = manifest()
    host = render_host(m)
    at = [host.index(f"{BASE}{suffix}<<<") for suffix in ("_zero", "_count", "_scan", "_place", "")]
    assert at == sorted(at)
    assert "// an empty grid has nothing to do" in host


def test_the_manifest_validates_against_its_schema():
    import json

    jsonschema = pytest.importorskip("jsonschema")
    _, m = manifest()
    doc = json.loads(json.dumps(m.to_json()))
    schema = json.loads((Path(gemmspec.__file__).parent / "codegen" / "manifest.schema.json").read_text())
    jsonschema.validate(doc, schema)


CONFIGS = {
    f"{a}_{b}": RowPassKernelConfig("scatter_add", a, a, False, b)
    for a, b in [("bf16", "bf16"), ("bf16", "f32"), ("f16", "f16"), ("f16", "f32"), ("f32", "bf16"), ("f32", "f32")]
}


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_the_kernels_compile_spill_free(key):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    cfg = CONFIGS[key]
    sass = spill_free_sass(render_row_pass(cfg), [include_dir()], f"{cfg.name}.cu")
    for suffix in ("_zero", "_count", "_scan", "_place", ""):
        assert f"Function : {cfg.name}{suffix}\n" in sass
    assert "LDG.E.128" in sass  # the 16-byte loads of the aligned path


def test_the_emitted_pass_compiles_spill_free():
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    prog, _ = manifest()
    p = prog.postpasses[0]
    cubin, log = compile_cubin(p.source, [include_dir()], name=f"{p.kernel}.cu")
    assert_spill_free(log, disassemble(cubin))


def test_the_compiled_schedule_json_names_the_five_kernels():
    from gemmspec.explain import schedule_json

    (low,) = lower_file(SPEC)
    doc = schedule_json(low.spec, low.schedule, emit(low.spec, low.schedule))
    p = doc["postpasses"][0]
    assert (p["kind"], p["index"], p["symbol"]) == ("scatter_add", "src", BASE)
    assert p["symbols"] == [f"{BASE}_zero", f"{BASE}_count", f"{BASE}_scan", f"{BASE}_place", BASE]
