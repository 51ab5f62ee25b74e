"""swiglu_grad as emitted: its kernel configuration and name, the manifest step after
the launch and the row pass it reads and before the launch that reads its target (its
parameters in the documented order), and the kernel compiled for sm_90a without spills."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import QuantizeKernelConfig, include_dir, render_quantize
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from swiglu_grad_spec import SWIGLU_GRAD_SPEC  # noqa: E402


def test_the_configuration_names_its_kernel_and_refuses_other_blocks():
    cfg = QuantizeKernelConfig(swiglu_grad=True)
    assert cfg.name == "gs_sm90a_swiglu_grad_bf16_bf16_e4m3_b1x128_w256"
    assert QuantizeKernelConfig(in_type="f32", swiglu_grad=True, dh_type="f16").name == (
        "gs_sm90a_swiglu_grad_f32_f16_e4m3_b1x128_w256"
    )
    with pytest.raises(ValueError):
        QuantizeKernelConfig(block_r=128, swiglu_grad=True)
    with pytest.raises(ValueError):
        QuantizeKernelConfig(pow2=True, swiglu_grad=True)


def test_the_manifest_runs_it_between_the_launches():
    (low,) = lower_file(SWIGLU_GRAD_SPEC)
    prog = emit(low.spec, low.schedule)
    (p,) = prog.prepasses
    assert p.kernel == "gs_swg_p0_sm90a_swiglu_grad_bf16_bf16_e4m3_b1x128_w256"
    kernels = [s for s in launch_manifest(low.spec, prog).steps if hasattr(s, "role")]
    roles = [(s.role, s.owner) for s in kernels if s.role != "leaf_table"]
    assert roles == [
        ("gemm", "launch 0"), ("gemm", "launch 1"), ("rowscale", "postpass 0"),
        ("swiglu_grad", "prepass 0"), ("gemm", "launch 2"),
    ]
    step = next(s for s in kernels if s.role == "swiglu_grad")
    assert [q.name for q in step.params] == ["X", "x_bs", "x_ldr", "Y", "SY", "B", "R", "C", "DH", "dh_ldr"]
    by = {q.name: q for q in step.params}
    assert (by["X"].source.ref, by["DH"].source.ref) == ("gu", "dh")
    assert by["DH"].ctype == "const __nv_bfloat16*"
    assert step.grid[0].evaluate({"T": 129}) == 17 and step.grid[1].evaluate({"T": 129}) == 4
    # The GEMM reading dgu reads the pass's workspaces.
    by = {q.name: q.source for q in kernels[-1].params}
    assert (by["A"].kind, by["A"].ref, by["SA"].ref) == ("workspace", "prepass0.dgu", "prepass0.dgu_scale")


@pytest.mark.parametrize("in_type, dh_type", [("bf16", "bf16"), ("f32", "bf16"), ("f16", "f16")])
def test_the_kernel_compiles_spill_free(in_type, dh_type):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    cfg = QuantizeKernelConfig(in_type=in_type, swiglu_grad=True, dh_type=dh_type)
    sass = spill_free_sass(render_quantize(cfg), [include_dir()], f"{cfg.name}.cu")
    assert cfg.name in sass and "MUFU.EX2" in sass  # the fast exponential


def test_the_wgrad_form_is_the_requantize_kernel_reading_both_sources():
    from swiglu_grad_spec import SWIGLU_GRAD_WGRAD_SPEC

    from gemmspec.codegen.kernels import RequantKernelConfig

    (low,) = lower_file(SWIGLU_GRAD_WGRAD_SPEC)
    prog = emit(low.spec, low.schedule)
    (p,) = [p for p in prog.prepasses if p.prepass.kind == "swiglu_grad"]
    assert isinstance(p.config, RequantKernelConfig) and p.config.swiglu and p.config.pad == 16
    assert p.kernel == f"gs_swgw_p{prog.prepasses.index(p)}_sm90a_swiglu_grad_bf16_bf16_e4m3_sy128x1_c128_w256_p16"
    step = next(s for s in launch_manifest(low.spec, prog).steps if getattr(s, "role", "") == "swiglu_grad")
    assert [q.name for q in step.params] == ["X", "ldx", "DH", "dh_ld", "offsets", "G", "T", "C", "Y", "SY"]
    by = {q.name: q.source for q in step.params}
    assert (by["X"].ref, by["DH"].ref, by["offsets"].ref) == ("gu", "dh", "check.offs")  # the checked copy
    with pytest.raises(ValueError):
        RequantKernelConfig(in_type="bf16", swiglu=True, gather_rows=True)


@pytest.mark.parametrize("pad", [1, 16])
def test_the_wgrad_form_kernel_compiles_spill_free(pad):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import spill_free_sass

    from gemmspec.codegen.kernels import RequantKernelConfig, render_requant

    cfg = RequantKernelConfig(in_type="bf16", pad=pad, swiglu=True)
    sass = spill_free_sass(render_requant(cfg), [include_dir()], f"{cfg.name}.cu")
    assert cfg.name in sass and "MUFU.EX2" in sass
