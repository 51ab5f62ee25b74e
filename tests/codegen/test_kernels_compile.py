"""Emitted kernels compile with NVRTC for sm_90a and use the tensor-core path.

CPU only: NVRTC and cuobjdump need no GPU. Each kernel must compile, its SASS must
hold QGMMA (FP8) or HGMMA (16-bit) where it multiplies, and nothing may spill to
local memory (no LDL/STL, 0 bytes of spill in the ptxas report).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.kernels import (
    GemmKernelConfig,
    RequantKernelConfig,
    TransposeKernelConfig,
    include_dir,
    render_gemm,
    render_requant,
    render_transpose,
)

pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")

# The helper sits beside this file; no package __init__ needed under any import mode.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import compile_cubin, disassemble  # noqa: E402

GEMM_CONFIGS = {
    "bf16_store": GemmKernelConfig("bf16", "bf16", "bf16"),
    "bf16_f32_acc": GemmKernelConfig("bf16", "bf16", "f32", accumulate=True),
    "f16_store": GemmKernelConfig("f16", "f16", "f16"),
    # Forward / DGRAD: 1x128 activations, 128x128 weights.
    "e4m3_1x128_128x128_bf16": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128
    ),
    # WGRAD 1d1d: A = dY^T scaled per channel m (sa_bm=1), B = X^T per channel n (sb_bn=1).
    "e4m3_1d1d_f32_acc": GemmKernelConfig(
        "e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sb_bn=1
    ),
    "e4m3_128x128_both_bf16": GemmKernelConfig(
        "e4m3", "e4m3", "bf16", scaled=True, sa_bm=128, sb_bn=128
    ),
    "e5m2_e4m3_unscaled_f16": GemmKernelConfig("e5m2", "e4m3", "f16"),
}


@pytest.fixture(scope="module")
def compiled():
    """Compile each kernel once per module: name -> (source, ptxas log, SASS)."""
    cache: dict[str, tuple[str, str, str]] = {}

    def get(key: str, source: str) -> tuple[str, str, str]:
        if key not in cache:
            cubin, log = compile_cubin(source, [include_dir()], name=f"{key}.cu")
            cache[key] = (source, log, disassemble(cubin))
        return cache[key]

    return get


def _spill_free(log: str, sass: str) -> None:
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills, f"no ptxas resource report in log:\n{log}"
    assert all(s == ("0", "0") for s in spills), f"register spills:\n{log}"
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory traffic in SASS"


@pytest.mark.parametrize("key", sorted(GEMM_CONFIGS))
def test_gemm_compiles_to_tensor_cores(compiled, key: str) -> None:
    cfg = GEMM_CONFIGS[key]
    source, log, sass = compiled(key, render_gemm(cfg))
    assert f'extern "C" __global__ void __launch_bounds__({cfg.threads}, 1)' in source
    _spill_free(log, sass)
    fp8 = cfg.a_type in ("e4m3", "e5m2")
    ops = set(re.findall(r"\b[HQ]GMMA\.[0-9x]+\.F32(?:\.[A-Z0-9]+)*", sass))
    sass_type = {"e4m3": ".E4M3", "e5m2": ".E5M2", "bf16": ".BF16", "f16": ""}  # F16 is implicit
    if fp8:
        want = f"QGMMA.64x{cfg.tile_n}x32.F32{sass_type[cfg.a_type]}{sass_type[cfg.b_type]}"
    else:
        want = f"HGMMA.64x{cfg.tile_n}x16.F32{sass_type[cfg.a_type]}"
    assert ops == {want}, ops


def test_requant_compiles(compiled) -> None:
    _, log, sass = compiled("requant", render_requant(RequantKernelConfig()))
    _spill_free(log, sass)


def test_transpose_compiles(compiled) -> None:
    _, log, sass = compiled("transpose", render_transpose(TransposeKernelConfig()))
    _spill_free(log, sass)


# ----------------------------------------------------------------------------- no compiler
def test_names_are_procedural_and_distinct() -> None:
    names = {cfg.name for cfg in GEMM_CONFIGS.values()}
    assert len(names) == len(GEMM_CONFIGS)
    cfg = GEMM_CONFIGS["e4m3_1x128_128x128_bf16"]
    assert cfg.name == "gs_sm90a_e4m3e4m3_bf16_sa1x128_sb128x128_t128x128x128_w256s2_store"
    assert GEMM_CONFIGS["bf16_store"].tile_k == 64
    assert all(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", n) for n in names)


def test_render_is_deterministic() -> None:
    cfg = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    same = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    assert cfg == same and render_gemm(cfg) == render_gemm(same)
    # Unscaled configs ignore scale block sizes: equal kernels compare equal.
    assert GemmKernelConfig("bf16", "bf16", "bf16", sb_bn=7) == GemmKernelConfig(
        "bf16", "bf16", "bf16"
    )


def test_smem_bytes_matches_layout() -> None:
    fp8 = GEMM_CONFIGS["e4m3_1x128_128x128_bf16"]
    assert fp8.smem_bytes == 1024 + 2 * (256 * 128 + 256 * 4)
    bf = GEMM_CONFIGS["bf16_store"]
    assert bf.smem_bytes == 1024 + 2 * (256 * 64 * 2)


def test_sources_include_only_toolkit_headers() -> None:
    header = Path(include_dir(), "gemmspec_ptx.cuh").read_text()
    assert set(re.findall(r'#include\s+[<"]([^>"]+)', header)) <= {
        "cuda_fp8.h",
        "cuda_bf16.h",
        "cuda_fp16.h",
    }
    for src in (render_gemm(GEMM_CONFIGS["bf16_store"]), render_requant(), render_transpose()):
        assert re.findall(r'#include\s+[<"]([^>"]+)', src) == ["gemmspec_ptx.cuh"]


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(a_type="bf16", b_type="e4m3", d_type="bf16"),
        dict(a_type="e4m3", b_type="e4m3", d_type="e4m3"),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", scaled=True),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", scaled=True, sa_bk=64),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", tile_n=96),
        dict(a_type="e4m3", b_type="e4m3", d_type="bf16", tile_m=96),
        dict(a_type="bf16", b_type="bf16", d_type="bf16", tile_k=32),
    ],
)
def test_bad_configs_are_rejected(kwargs) -> None:
    with pytest.raises(ValueError):
        GemmKernelConfig(**kwargs)
