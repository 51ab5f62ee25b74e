"""TMA tensor-map templates, encoded on the host through the CUDA driver.

A grouped GEMM launch loads each leaf's A and B tiles through that leaf's own tensor
map. What every leaf's map shares (element type, box, 128-byte swizzle, zero fill) is
encoded here once per kernel configuration; the launch's leaf-table builder copies the
template and patches the leaf's base address, extents and row stride on the device,
so group sizes never travel to the host.
"""

from __future__ import annotations

import ctypes

import numpy as np
from cuda.bindings import driver

from ..codegen.kernels import SWIZZLE_BYTES, GemmKernelConfig, map_specs
from ..errors import GemmspecError

TENSOR_MAP_BYTES = 128

# FP8 moves as bytes: TMA only copies, and zero is zero in every 8-bit encoding.
_DATA_TYPE = {
    "e4m3": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    "e5m2": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_UINT8,
    "bf16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
    "f16": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
    "f32": driver.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT32,  # outputs (TMA reduce-add)
}


def encode_tile_map(dtype: str, box_rows: int, box_k: int, address: int) -> bytes:
    """128 bytes of a rank-2 map whose box is box_rows x box_k elements (K innermost,
    one 128-byte swizzle row), placed at a 16-byte aligned `address`. Its extents and
    stride are placeholders the device replaces."""
    u64, u32 = driver.cuuint64_t, driver.cuuint32_t
    err, tmap = driver.cuTensorMapEncodeTiled(
        _DATA_TYPE[dtype],
        2,
        address,
        [u64(box_k), u64(box_rows)],
        [u64(SWIZZLE_BYTES)],
        [u32(box_k), u32(box_rows)],
        [u32(1), u32(1)],
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        driver.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B,
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GemmspecError(
            f"cuTensorMapEncodeTiled({dtype}, box {box_rows}x{box_k}) failed: {err.name}"
        )
    return ctypes.string_at(tmap.getPtr(), TENSOR_MAP_BYTES)


def operand_templates(cfg: GemmKernelConfig, address: int) -> np.ndarray:
    """The templates of every per-leaf map of a GEMM configuration, back to back
    (128 bytes each, in ``map_specs`` order)."""
    maps = b"".join(encode_tile_map(m.dtype, m.box_rows, m.box_inner, address) for m in map_specs(cfg))
    return np.frombuffer(maps, dtype=np.uint8)
