"""The row passes as emitted (`rowdot`, `rowscale`): their kernel configurations and
names, the post-pass files and manifest steps after the launches (parameters in the
documented order, targets the call's outputs), the derived backward of the training FFN
example with them, and every configuration compiled for sm_90a without spills."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.build import build_backward
from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import RowPassKernelConfig, include_dir, render_row_pass
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from row_pass_spec import ROW_PASS_SPEC  # noqa: E402

SPEC = ROW_PASS_SPEC


def test_the_configurations_name_their_kernels():
    assert RowPassKernelConfig("rowdot", "bf16", "e4m3", True, "f32").name == "gs_sm90a_rowdot_bf16_e4m3_scaled_w256"
    assert RowPassKernelConfig("rowdot", "f32", "bf16", False, "f32").name == "gs_sm90a_rowdot_f32_bf16_w256"
    assert RowPassKernelConfig("rowscale", "bf16", "bf16", False, "bf16").name == "gs_sm90a_rowscale_bf16_bf16_w256"
    assert RowPassKernelConfig().rows_per_cta == 8
    with pytest.raises(ValueError):
        RowPassKernelConfig("rowsum")


def test_the_postpasses_come_after_the_launches_in_files_and_steps():
    (low,) = lower_file(SPEC)
    prog = emit(low.spec, low.schedule)
    assert [p.kernel for p in prog.postpasses] == [
        "gs_rp_q0_sm90a_rowdot_bf16_e4m3_scaled_w256",
        "gs_rp_q1_sm90a_rowscale_bf16_bf16_w256",
    ]
    assert list(prog.sources())[-2:] == ["rp_postpass0.cu", "rp_postpass1.cu"]
    # A single launch with row passes after it keeps its leaf-table builder (the call is
    # not one launch).
    assert not prog.launches[0].gemm.inline_table
    manifest = launch_manifest(low.spec, prog)
    kernels = [s for s in manifest.steps if hasattr(s, "role")]
    assert [(s.role, s.owner) for s in kernels][-2:] == [("rowdot", "postpass 0"), ("rowscale", "postpass 1")]
    dot, scale = kernels[-2:]
    assert [q.name for q in dot.params] == ["A", "lda", "B", "ldb", "SB", "sb_r", "sb_c", "R", "C", "Y"]
    assert [q.name for q in scale.params] == ["A", "lda", "W", "R", "C", "Y", "ldy"]
    by = {q.name: q for q in dot.params}
    assert (by["A"].source.ref, by["B"].source.ref, by["SB"].source.ref, by["Y"].source.ref) == ("g", "h", "h_scale", "drw")
    assert by["Y"].ctype == "float*" and by["A"].ctype.startswith("const ")
    assert dot.block == 256 and dot.grid[0].evaluate({"T": 129}) == 17
    by = {q.name: q for q in scale.params}
    assert (by["W"].source.ref, by["Y"].source.ref, by["Y"].ctype) == ("rw", "dh", "__nv_bfloat16*")
    assert {a.name: a.role for a in manifest.arguments if a.name in ("drw", "dh")} == {"drw": "output", "dh": "output"}


def test_the_manifest_validates_against_its_schema():
    import json

    jsonschema = pytest.importorskip("jsonschema")
    (low,) = lower_file(SPEC)
    doc = json.loads(json.dumps(launch_manifest(low.spec, emit(low.spec, low.schedule)).to_json()))
    schema = json.loads((Path(gemmspec.__file__).parent / "codegen" / "manifest.schema.json").read_text())
    jsonschema.validate(doc, schema)


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"

CONFIGS = {
    "rowdot_bf16_e4m3_scaled": RowPassKernelConfig("rowdot", "bf16", "e4m3", True, "f32"),
    "rowdot_bf16_e5m2_scaled": RowPassKernelConfig("rowdot", "bf16", "e5m2", True, "f32"),
    "rowdot_f16_f16": RowPassKernelConfig("rowdot", "f16", "f16", False, "f32"),
    "rowdot_f32_bf16": RowPassKernelConfig("rowdot", "f32", "bf16", False, "f32"),
    "rowscale_bf16_bf16": RowPassKernelConfig("rowscale", "bf16", "bf16", False, "bf16"),
    "rowscale_f16_f32": RowPassKernelConfig("rowscale", "f16", "f16", False, "f32"),
    "rowscale_f32_bf16": RowPassKernelConfig("rowscale", "f32", "f32", False, "bf16"),
}


@pytest.mark.parametrize("key", sorted(CONFIGS))
def test_the_row_pass_kernels_compile_spill_free(key):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    cfg = CONFIGS[key]
    sass = spill_free_sass(render_row_pass(cfg), [include_dir()], f"{cfg.name}.cu")
    assert cfg.name in sass


def test_the_example_backward_row_passes_compile_spill_free():
    """The row passes of examples/moe_ffn_fp8_train.gspec's derived backward (dh and
    droute_w from the DGRAD before route_w) as emitted, header included."""
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    exe, _ = build_backward(gemmspec.build(EXAMPLE).spec)
    assert [p.kernel for p in exe.program.postpasses] == [
        "gs_moe_ffn_fp8_train_backward_q0_sm90a_rowscale_bf16_bf16_w256",
        "gs_moe_ffn_fp8_train_backward_q1_sm90a_rowdot_bf16_e4m3_scaled_w256",
        "gs_moe_ffn_fp8_train_backward_q2_sm90a_scatter_add_bf16_bf16_w256",  # the gathered x's rows
    ]
    for p in exe.program.postpasses:
        cubin, log = compile_cubin(p.source, [include_dir()], name=f"{p.kernel}.cu")
        assert_spill_free(log, disassemble(cubin))
