"""The gather pre-pass as emitted: its kernel (compiled for sm_90a, spill-free), its
manifest step and workspaces, and the GEMM that then loads a dense A."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import GatherRowsKernelConfig, include_dir, render_gather_rows
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))

SPEC = """\
gemm moe_gather {
  dim T, S
  dim N = 4096, K = 7168
  group expert[E = 8] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""


def program():
    (low,) = lower_file(SPEC)
    return low, emit(low.spec, low.schedule)


def test_the_prepass_runs_a_gather_kernel_and_the_gemm_loads_a_dense_a():
    low, prog = program()
    (p,) = prog.prepasses
    assert p.config == GatherRowsKernelConfig(elem_bytes=1, scaled=True, name=p.kernel)
    assert "gather_rows_e1_scaled" in p.kernel
    gemm = prog.launches[0].gemm
    assert not gemm.gather and not gemm.name.endswith("_gather")
    manifest = launch_manifest(low.spec, prog)
    step = next(s for s in manifest.steps if getattr(s, "role", None) == "gather")
    names = [q.name for q in step.params]
    assert names == ["X", "ldx", "idx", "T", "S", "C", "Y", "ldy", "SX", "sx_r", "sx_c", "SY", "sy_r", "sy_c"]
    assert step.params[2].source.ref == "idx" and step.params[0].source.ref == "x"
    rows = manifest.workspace("prepass0.x_idx_rows")
    scales = manifest.workspace("prepass0.x_idx_rows_scale")
    assert rows.bytes.evaluate({"T": 1000}) == 1000 * 7168
    assert scales.bytes.evaluate({"T": 1000}) == 1000 * 56 * 4
    # The prepass comes before the launch's builder and GEMM, which read its workspaces.
    roles = [s.role for s in manifest.steps if hasattr(s, "role")]
    assert roles.index("gather") < roles.index("leaf_table") < roles.index("gemm")


@pytest.mark.parametrize("cfg", [GatherRowsKernelConfig(1, True), GatherRowsKernelConfig(2, False)])
def test_the_gather_kernel_compiles_spill_free_with_16_byte_copies(cfg):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    source = render_gather_rows(cfg)
    cubin, log = compile_cubin(source, [include_dir()], name=f"{cfg.name}.cu")
    assert "warning" not in log, log
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert cfg.name in sass
    assert re.search(r"\bLDG\.E\.128", sass) and re.search(r"\bSTG\.E\.128", sass)


def test_the_emitted_prepass_source_compiles():
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import compile_cubin

    _, prog = program()
    (p,) = prog.prepasses
    cubin, log = compile_cubin(p.source, [include_dir()], name=f"{p.kernel}.cu")
    assert cubin and "warning" not in log, log
