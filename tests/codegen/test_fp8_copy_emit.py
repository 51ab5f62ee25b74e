"""Launches that write D's copy (`T = copy(D)`): the GsCopy records the leaf-table builder
writes, the manifest's sizes and parameters, NVRTC compiling the FFN up-projection with a
copy (a scaled SwiGLU, gathered rows, a router weight, two 128-column halves) and a plain
M-grouped FP8 one for sm_90a without spills or local memory; configurations without a
copy render none of it and compile to the same SASS as before the switch existed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import COPY_RECORD_BYTES, DSCALE_RECORD_BYTES, GATHER_RECORD_BYTES, emit
from gemmspec.codegen.kernels import COPY_COL_PITCH, GemmKernelConfig, include_dir, render_gemm
from gemmspec.codegen.manifest import COPY_BYTES, LEAF_BYTES, launch_manifest
from gemmspec.pipeline import lower_file

SPEC = """
gemm g {{
  dim T, S
  dim H = 1024, N = 1024, F = 512, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor src : i32 [T]
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor xs  : e4m3 [S, H] scale f32 [1, 128]
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor w_up : e4m3 [E, N, H] scale f32 [1, 128, 128]
  tensor rw  : f32 [T]
  tensor y   : {out} [T, N] scale f32 [1, 128]
  tensor h   : {out} [T, F] scale f32 [1, 128]
  {copy}
  {statement}
}}
"""
FFN_UP = (
    "h[t, j] = rw[t] * silu(sum[k] xs[src[t], k] * w_up[expert(t), 2*j, k]) * sum[k] xs[src[t], k] * w_up[expert(t), 2*j + 1, k]"
)
FFN_COPY = "tensor h_t : {out} [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = copy(h)"
CASES = {
    "ffn_up": (FFN_UP, FFN_COPY),
    # The same with the tokens gathered in the GEMM's loads instead of by the pre-pass.
    "ffn_up_gathered_in_the_gemm": (FFN_UP + "\n  gather(fused)", FFN_COPY),
    "ffn_up_pow2_e5m2": (
        FFN_UP,
        "tensor h_t : {out} [T, F] layout segment_major(expert) scale f32 [128, 1] per expert pow2 = copy(h)",
        "e5m2",
    ),
    "plain": (
        "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]",
        "tensor y_t : {out} [T, N] layout segment_major(expert) pad 8 scale f32 [128, 1] per expert = copy(y)",
    ),
}


def launch_of(key: str, inline_tables: bool = True):
    statement, copy, *rest = CASES[key]
    out = rest[0] if rest else "e4m3"
    (x,) = lower_file(SPEC.format(out=out, copy=copy.format(out=out), statement=statement))
    program = emit(x.spec, x.schedule, inline_tables=inline_tables)
    (launch,) = program.launches
    return x, program, launch


def test_record_sizes_agree():
    assert COPY_RECORD_BYTES == COPY_BYTES == 32


@pytest.mark.parametrize("key", sorted(CASES))
def test_kernel_configuration_records_and_manifest(key):
    x, program, launch = launch_of(key, inline_tables=False)  # the builder's records
    cfg, g = launch.gemm, x.spec.gemms[0]
    c_t = x.spec.tensor(g.copy)
    assert cfg.copy and cfg.copy_pow2 == c_t.scale.pow2 and cfg.tile_m == 128
    assert cfg.name.endswith("_copy128x1" + ("pow2" if c_t.scale.pow2 else ""))
    assert cfg.copy_bytes == cfg.d_tile_cols * (COPY_COL_PITCH + 4 * 8 + 4)
    assert cfg.smem_bytes <= 232448
    n = launch.leaf_count
    # A gather record where the kernel itself reads rows through an index.
    at = n * ((48 if g.epilogue else 0) + (GATHER_RECORD_BYTES if cfg.gather or cfg.scatter else 0) + DSCALE_RECORD_BYTES)
    assert f"reinterpret_cast<unsigned char*>(leaves + {n + 1}) + {at})[leaf] = Y;" in launch.source
    assert "Y.sc = SC + " in launch.source and ", void* C, float* SC)" in launch.source
    assert "cbstart_m += (e - s + 127) / 128;" in launch.source
    assert "store_tile_copy(acc, leaves, num_leaves, li, L, smem + COPY_OFFSET, m0, n0, row, lane);" in launch.source
    manifest = launch_manifest(x.spec, program)
    leaves = manifest.workspace("launch0.leaves")
    assert leaves.bytes.value == (n + 1) * LEAF_BYTES + at + n * COPY_BYTES
    table = next(k for k in manifest.kernels if k.role == "leaf_table")
    assert [(p.name, p.ctype, p.source.ref) for p in table.params[-2:]] == [
        ("C", "void*", g.copy), ("SC", "float*", c_t.scale.name)
    ]
    args = {a.name: a for a in manifest.arguments}
    assert args[g.copy].role == "output" and args[c_t.scale.name].ctype == "float*"


def test_configs_without_a_copy_render_none_of_it():
    for cfg in (
        GemmKernelConfig("e4m3", "e4m3", "e4m3", scaled=True, sa_bm=1, sb_bn=128),
        GemmKernelConfig("e4m3", "e4m3", "e4m3", scaled=True, sa_bm=1, sb_bn=128, tile_n=256, swiglu=True, gather=True, gather_tma=True),
    ):
        source = render_gemm(cfg)
        for word in ("GsCopy", "COPY_", "store_tile_copy", "copy_scale_of", "copy_value", "leaf_copy", "copy128x1"):
            assert word not in source
        assert cfg.copy_bytes == 0


def test_a_copy_needs_an_fp8_d_in_128_row_tiles():
    with pytest.raises(ValueError, match="copy belongs to an FP8 D"):
        GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, copy=True)
    with pytest.raises(ValueError, match="copy belongs to an FP8 D"):
        GemmKernelConfig("e4m3", "e4m3", "e4m3", scaled=True, sa_bm=1, sb_bn=128, tile_m=64, copy=True)


# ---- NVRTC ---------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _compile(source: str, name: str):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import compile_cubin, disassemble

    cubin, log = compile_cubin(source, [include_dir()], name=name)
    return cubin, log, disassemble


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(CASES))
def test_emitted_launch_compiles_without_spills(key):
    _, _, launch = launch_of(key)
    cfg = launch.gemm
    cubin, log, disassemble = _compile(launch.source, f"{cfg.name}.cu")
    assert "warning" not in log, log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), log
    sass = disassemble(cubin)
    assert not re.search(r"\b(LDL|STL)\b", sass), "local memory traffic in SASS"
    assert all(k in sass for k in launch.kernels)
    # The copy: a consumer-only named barrier, 16-byte stores of the staged columns, and
    # never a block-wide __syncthreads in the GEMM kernel's epilogue.
    assert re.search(r"\bBAR\.SYNC(\.DEFER_BLOCKING)? 0x4, 0x100\b", sass), "no consumer barrier 4"
    assert re.search(r"\bSTG\.E\.128\b", sass)
