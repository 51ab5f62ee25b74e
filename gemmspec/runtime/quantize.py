"""The quantize pass launched on its own, outside any spec: a bf16, f16 or f32 tensor
into FP8 with [1, 128] or [128, 128] block scales, by the kernel a spec's `quantize(x)`
pre-pass runs (templates/quantize.cu.jinja), under the same rule (docs/language.md,
section 7).

`plan_quantize` decides from a tensor's element type, shape and strides whether the
kernel takes it and how (a `QuantizePlan`: the kernel configuration, the [B, R, C] view
it reads, the grid) or says why not; the caller then quantizes some other way.
`QuantizeLaunch` is a plan bound to a device and a stream: its parameters are checked
and packed once, and each launch writes three pointers and calls the driver, as a
spec's planned run does. Kernels are compiled once per configuration (NVRTC, cubins
cached on disk) and loaded once per device.

Torch-free: gemmspec.torch builds its `quantize` on this module.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from ..codegen.emit import HEADER
from ..codegen.kernels import (
    FP8_TYPES,
    QUANTIZE_IN_TYPES,
    QuantizeKernelConfig,
    include_dir,
    render_quantize,
)
from .launch import ArgumentCells, LoadedKernel
from .nvrtc import CompiledCubin, compile_cubin
from .streams import on_device

__all__ = ["QuantizeLaunch", "QuantizePlan", "plan_quantize", "quantize_source"]

BLOCK_C = 128  # columns per scale block: a warp of 32 lanes, four elements each
_INT_MAX = 2**31 - 1  # B, R and C are int parameters of the kernel
_GRID_YZ_MAX = 65535  # CUDA grids: column blocks along y, batch entries along z


@dataclass(frozen=True)
class QuantizePlan:
    """How the quantize kernel runs on one tensor geometry, or why it does not.

    The value is read as [batch, rows, cols] with the columns contiguous: element
    (b, r, c) at b * batch_stride + r * row_stride + c. The FP8 output is dense
    row-major in the value's shape; the scales are dense row-major in `scale_shape`
    (the value's rank, one entry per block). `config` is None when the kernel does not
    take the tensor, and `reason` says why.
    """

    config: QuantizeKernelConfig | None
    reason: str = ""
    batch: int = 0
    rows: int = 0
    cols: int = 0
    batch_stride: int = 0
    row_stride: int = 0
    scale_shape: tuple[int, ...] = ()
    grid: tuple[int, int, int] = (0, 0, 0)

    @property
    def empty(self) -> bool:
        """Nothing to quantize: no launch (the outputs have no elements)."""
        return self.batch * self.rows * self.cols == 0

    def __str__(self) -> str:
        if self.config is None:
            return f"no quantize kernel: {self.reason}"
        return (
            f"{self.config.name}: [{self.batch}, {self.rows}, {self.cols}] (strides "
            f"{self.batch_stride}, {self.row_stride}, 1) -> scales {list(self.scale_shape)}, grid {self.grid}"
        )


def _refused(reason: str) -> QuantizePlan:
    return QuantizePlan(None, reason)


def plan_quantize(
    in_dtype: str,
    out_dtype: str,
    shape: tuple[int, ...],
    strides: tuple[int, ...],
    block: tuple[int, ...],
    pow2: bool = False,
) -> QuantizePlan:
    """The kernel's plan for quantizing a tensor of `in_dtype`, `shape` and element
    `strides` into `out_dtype` with scale blocks `block` (one per dim), or a refusal.

    The kernel takes what a spec's `quantize(x)` takes: 2-D [R, C] with blocks
    [1, 128] or [128, 128], or 3-D [B, R, C] with [1, 1, 128] or [1, 128, 128]; the
    columns contiguous (the other strides free, not negative) and a whole number of
    128-column blocks (the rows may end in a short block).
    """
    if out_dtype not in FP8_TYPES:
        return _refused(f"the kernel writes e4m3 or e5m2, not {out_dtype}")
    if in_dtype not in QUANTIZE_IN_TYPES:
        return _refused(f"the kernel reads bf16, f16 or f32, not {in_dtype}")
    rank = len(shape)
    if rank not in (2, 3) or len(strides) != rank or len(block) != rank:
        return _refused(f"the kernel takes 2-D or 3-D tensors with one block size per dim, not shape {list(shape)} with blocks {list(block)}")
    if not all(isinstance(b, int) and not isinstance(b, bool) for b in block):
        return _refused(f"blocks {list(block)} are not all sizes (a whole run-time dim is one block)")
    block_r, block_c = block[-2], block[-1]
    if block_c != BLOCK_C or block_r not in (1, BLOCK_C) or any(b != 1 for b in block[:-2]):
        return _refused(
            f"the kernel writes [1, 128] or [128, 128] blocks (3-D: [1, 1, 128] or [1, 128, 128]), not {list(block)}"
        )
    batch = shape[0] if rank == 3 else 1
    rows, cols = shape[-2], shape[-1]
    if cols % BLOCK_C:
        # The language's quantize takes whole column blocks only, and the kernel was
        # proven (against the numpy rule, on the GPU) for those.
        return _refused(f"{cols} columns are not a whole number of {BLOCK_C}-column blocks")
    if any(s < 0 for s in strides):
        return _refused(f"negative strides {list(strides)}")
    if strides[-1] != 1 and rows * cols * batch > 0:
        return _refused(f"the columns are not contiguous (strides {list(strides)})")
    if max(batch, rows, cols) > _INT_MAX:
        return _refused(f"shape {list(shape)} has a dim past the kernel's 32-bit sizes")
    config = QuantizeKernelConfig(in_type=in_dtype, out_type=out_dtype, block_r=block_r, pow2=pow2)
    grid = (-(-rows // config.rows_per_cta), cols // BLOCK_C, batch)
    if grid[1] > _GRID_YZ_MAX or grid[2] > _GRID_YZ_MAX or grid[0] > _INT_MAX:
        return _refused(f"shape {list(shape)} needs a grid of {grid} blocks, more than CUDA allows")
    scale_shape = (*shape[:-2], -(-rows // block_r), cols // BLOCK_C)
    return QuantizePlan(
        config,
        batch=batch,
        rows=rows,
        cols=cols,
        batch_stride=strides[0] if rank == 3 else 0,
        row_stride=strides[-2],
        scale_shape=scale_shape,
        grid=grid,
    )


def quantize_source(config: QuantizeKernelConfig) -> str:
    """The CUDA source of a standalone quantize kernel (symbol `config.name`)."""
    return HEADER + render_quantize(config)


_CUBINS: dict[QuantizeKernelConfig, CompiledCubin] = {}
_KERNELS: dict[tuple[QuantizeKernelConfig, int], LoadedKernel] = {}
_LOCK = threading.Lock()  # one compile and one load per configuration and device


def _kernel(config: QuantizeKernelConfig, device: int) -> LoadedKernel:
    key = (config, device)
    kernel = _KERNELS.get(key)
    if kernel is None:
        with _LOCK:
            kernel = _KERNELS.get(key)
            if kernel is None:
                cubin = _CUBINS.get(config)
                if cubin is None:
                    cubin = _CUBINS[config] = compile_cubin(
                        quantize_source(config), name=config.name, include_dirs=[include_dir()]
                    )
                kernel = _KERNELS[key] = LoadedKernel(cubin, config.name, device=device)
    return kernel


class QuantizeLaunch:
    """A plan (not refused, not empty) bound to `device` and the stream `stream` (a
    handle, or anything `runtime.launch.current_stream` takes): `launch(x, y, sy)`
    quantizes the value at x into y and its scales into sy."""

    __slots__ = ("plan", "device", "_cells", "_bound", "_switch")

    def __init__(self, plan: QuantizePlan, device: int, stream: object):
        if plan.config is None or plan.empty:
            raise ValueError(f"nothing to launch for this plan ({plan})")
        self.plan, self.device = plan, device
        self._switch = on_device(device)
        with self._switch:
            kernel = _kernel(plan.config, device)
            self._cells = ArgumentCells(3)  # X, Y, SY
            args = (
                None,
                np.int64(plan.batch_stride),
                np.int64(plan.row_stride),
                None,
                None,
                np.int32(plan.batch),
                np.int32(plan.rows),
                np.int32(plan.cols),
            )
            self._bound = kernel.bind(
                plan.grid, plan.config.threads, 0, stream, args, {0: 0, 3: 1, 4: 2}, self._cells
            )

    def launch(self, x: int, y: int, sy: int) -> None:
        """Quantize: the value at `x`, the FP8 output at `y`, its scales at `sy`
        (device pointers). Does not wait for the GPU."""
        with self._cells.lock, self._switch:
            self._cells.write((x, y, sy))
            self._bound.launch()
