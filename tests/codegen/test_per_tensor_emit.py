"""Per-tensor FP8 scales emit CUDA that NVRTC compiles for sm_90a (CPU only): the
leaf-table builders with their zero scale strides and the kernels they launch, for the
shapes the GPU tests run beside the shipped example (examples/moe_fp8_tensorwise.gspec,
compiled with every example): K = 128 (the blockwise kernel with one K block and one B
scale block over all of N = 264) and whole fixed dims that are no multiple of 128
across the segments of a capacity group and a split."""

from __future__ import annotations

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.pipeline import lower_file
from gemmspec.runtime.nvrtc import compile_cubin, disassemble

SPECS = {
    "one_k_block": """
gemm tensorwise_k128 {
  dim T
  dim N = 264, K = 128
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [T, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
""",
    "fixed_dims": """
gemm tensorwise_fixed {
  dim T = 400
  dim N = 100, K = 200
  group part[P = 4] = ragged(T, offsets = offs, capacity)
  group slice[S = 3] = split(N, sizes = [60, 24, 16])
  tensor x : e4m3 [T, S, K] scale f32 [T, 1, K]
  tensor w : e4m3 [P, N, K] layout strides(N * (K + 16), K + 16, 1) scale f32 [1, N, K]
  tensor y : f32 [T, N]
  y[t, n] = sum[k] x[t, slice(n), k] * w[part(t), n, k]
}
""",
}


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SPECS))
def test_per_tensor_launches_compile(key, tmp_path):
    (lowered,) = lower_file(SPECS[key])
    (launch,) = emit(lowered.spec, lowered.schedule).launches
    cubin = compile_cubin(launch.source, name=launch.gemm.name, include_dirs=[include_dir()], cache_dir=str(tmp_path))
    assert "warning" not in cubin.log, cubin.log
    sass = disassemble(cubin.cubin)
    assert "QGMMA" in sass and all(k in sass for k in launch.kernels)
    assert "LDL" not in sass and "STL" not in sass, "local-memory spill"
    if key == "one_k_block":
        # x's one scale: every leaf reads it at offset 0 with a zero stride along its rows.
        assert "L.sa_off = 0LL;" in launch.source and "L.sa_sm = 0LL;" in launch.source
        assert launch.gemm.blockwise and launch.gemm.sb_mode == 1 and launch.gemm.sb_bn == 264
    else:
        # Whole fixed dims keep their sizes as blocks: row / 400 and column / 100 are 0.
        assert launch.gemm.per_channel and (launch.gemm.sa_bm, launch.gemm.sb_bn) == (400, 100)
