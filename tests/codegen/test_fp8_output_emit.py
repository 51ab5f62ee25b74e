"""Launches with an FP8 output: the kernel configuration they get, the GsDScale records
the leaf-table builder writes and the manifest sizes, NVRTC compiling them for sm_90a
without spills (CPU only), and kernels without an FP8 output rendering none of it."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import (
    DSCALE_RECORD_BYTES,
    EPILOGUE_RECORD_BYTES,
    GATHER_RECORD_BYTES,
    emit,
)
from gemmspec.codegen.kernels import GemmKernelConfig, include_dir, render_gemm
from gemmspec.codegen.manifest import (
    DSCALE_BYTES,
    EPILOGUE_BYTES,
    GATHER_BYTES,
    LEAF_BYTES,
    launch_manifest,
)
from gemmspec.pipeline import lower_file

SPEC = """
gemm g {{
  dim T, S
  dim N = 512, F = 256, K = 512, M = 64
  group expert[E = 4] = ragged(T, offsets = offs)
  group batch[B = 2] = masked(M, counts = counts)
  tensor idx : i32 [T]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor xb : bf16 [T, K]
  tensor xm : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wb : bf16 [E, N, K]
  tensor wm : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor rw : f32 [T]
  tensor alpha : f32 [E]
  tensor bias : bf16 [E, N]
  tensor y  : {out} [T, N] scale f32 [1, 128]{pow2}  # pow2: written by the statement
  tensor h  : {out} [T, F] scale f32 [1, 128]
  tensor ym : {out} [B, M, N] scale f32 [1, 1, 128]
  {statement}
}}
"""

GATE = "sum[k] {a} * {w}[expert(t), 2*j, k]"
UP = "sum[k] {a} * {w}[expert(t), 2*j + 1, k]"


def swiglu(a: str, w: str, pre: str = "") -> str:
    return f"h[t, j] = {pre}silu({GATE.format(a=a, w=w)}) * {UP.format(a=a, w=w)}"


CASES = {
    "fp8": ("y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", {}),
    "fp8_e5m2_pow2": ("y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", {"out": "e5m2", "pow2": " pow2"}),
    "fp8_epilogue": ("y[t, n] = alpha[expert(t)] * rw[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]", {}),
    "fp8_swiglu": (swiglu("x[t, k]", "w"), {}),
    # The expert FFN's up-projection: gathered tokens, a router weight, halves.
    "fp8_swiglu_gather_row": (swiglu("xs[idx[t], k]", "w", "rw[t] * "), {}),
    "fp8_swiglu_gather_row_in_the_gemm": (swiglu("xs[idx[t], k]", "w", "rw[t] * ") + "\n  gather(fused)", {}),
    "bf16_swiglu": (swiglu("xb[t, k]", "wb"), {}),
    "bf16_operands": ("y[t, n] = sum[k] xb[t, k] * wb[expert(t), n, k]", {}),
    # A masked batch of 3-D outputs, at most 64 rows each: 64-row tiles.
    "fp8_masked_m64": ("ym[b, m, n] = sum[k] xm[b, m, k] * wm[b, n, k]", {}),
}


def launch_of(key: str, inline_tables: bool = True):
    statement, opts = CASES[key]
    params = {"out": "e4m3", "pow2": ""}
    params.update(opts)
    (x,) = lower_file(SPEC.format(statement=statement, **params))
    program = emit(x.spec, x.schedule, inline_tables=inline_tables)
    (launch,) = program.launches
    return x, program, launch


def test_record_sizes_agree():
    assert DSCALE_RECORD_BYTES == DSCALE_BYTES == 32
    assert (EPILOGUE_RECORD_BYTES, GATHER_RECORD_BYTES) == (EPILOGUE_BYTES, GATHER_BYTES)


@pytest.mark.parametrize("key", sorted(CASES))
def test_kernel_configuration_and_records(key):
    x, program, launch = launch_of(key, inline_tables=False)
    cfg, g = launch.gemm, x.spec.gemms[0]
    out = x.spec.tensor(g.out.tensor)
    assert cfg.fp8_out and cfg.d_type == out.dtype and not cfg.store_tma and not cfg.accumulate
    assert cfg.d_tile_cols % 128 == 0 and cfg.d_scale_pow2 == out.scale.pow2
    assert cfg.name.endswith("_pow2") == out.scale.pow2
    # A blockwise 256-column tile runs two wgmma halves; the others one batch.
    assert cfg.mma_parts == (2 if cfg.blockwise and cfg.tile_n == 256 else 1)
    if g.swiglu:
        assert cfg.tile_n == 256 and cfg.d_tile_cols == 128
    assert cfg.tile_m == (64 if key == "fp8_masked_m64" else 128)
    # The builder writes each leaf's GsDScale record after the other records.
    n = launch.leaf_count
    at = n * ((EPILOGUE_BYTES if g.epilogue else 0) + (GATHER_BYTES if cfg.gather or cfg.scatter else 0))
    assert f"reinterpret_cast<unsigned char*>(leaves + {n + 1}) + {at})[leaf] = S;" in launch.source
    assert "S.sd = SD + " in launch.source and ", float* SD)" in launch.source
    assert "store_tile_fp8(acc, leaves, num_leaves, li, L, D, m0, n0, row, lane);" in launch.source
    manifest = launch_manifest(x.spec, program)
    leaves = manifest.workspace("launch0.leaves")
    assert leaves.bytes.value == (n + 1) * LEAF_BYTES + at + n * DSCALE_BYTES
    assert "output scale addresses" in leaves.purpose
    table = next(k for k in manifest.kernels if k.role == "leaf_table")
    assert (table.params[-1].name, table.params[-1].ctype, table.params[-1].source.ref) == ("SD", "float*", out.scale.name)
    args = {a.name: a for a in manifest.arguments}
    assert args[out.scale.name].role == "scale" and args[out.scale.name].ctype == "float*"
    assert args["x"].ctype.startswith("const") and args["x_scale"].ctype == "const float*"


def test_configs_without_an_fp8_output_render_none_of_it():
    for cfg in (
        GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128),
        GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, tile_n=192, swiglu=True),
        GemmKernelConfig("bf16", "bf16", "bf16", tile_n=256, swiglu=True),
    ):
        source = render_gemm(cfg)
        assert cfg.mma_parts == 1
        assert "GsDScale" not in source and "store_tile_fp8" not in source and "MMA_PARTS" not in source


# ---- NVRTC ---------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(CASES))
def test_emitted_launch_compiles_without_spills(key):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    _, _, launch = launch_of(key)
    cfg = launch.gemm
    cubin, log = compile_cubin(launch.source, [include_dir()], name=f"{cfg.name}.cu")
    assert "warning" not in log, log
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert all(k in sass for k in launch.kernels)
    fp8 = cfg.a_type in ("e4m3", "e5m2")
    part = cfg.tile_n // cfg.mma_parts
    mma = rf"\b{'QGMMA' if fp8 else 'HGMMA'}\.64x{part}x"
    assert re.search(mma, sass), f"no {mma} in SASS"
    # The quantization: saturating FP8 conversions of value pairs, quad shuffles, 4-byte
    # stores from registers, and never a TMA store.
    assert re.search(rf"\bF2FP\.SATFINITE\.{cfg.d_type.upper()}\.F32\.PACK_AB", sass)
    assert re.search(r"\bSHFL\.BFLY\b", sass)
    assert not re.search(r"\bUTMA(STG|REDG)\b", sass)
