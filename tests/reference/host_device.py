"""Host stand-ins for the device in the reference tests of GPU cases: a DeviceBuffer in
host memory (views may start past a guard region), and an executable call computed by the
flat-schedule executor on those buffers (FP8 outputs' scales included), so a GPU test's
own bookkeeping (parameters, buffers, poison, shapes, tolerances) runs on the CPU with
the reference where the kernels would be."""

from __future__ import annotations

import numpy as np


class HostBuffer:
    """DeviceBuffer's surface for the tests (and verify.run_random), in host memory."""

    def __init__(self, data: np.ndarray):
        self.data = data

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> HostBuffer:
        return cls(np.ascontiguousarray(array).view(np.uint8).reshape(-1).copy())

    def view(self, shape, dtype, strides=None, offset=0):
        return HostView(self, tuple(shape), dtype, strides, offset)

    def to_numpy(self, shape, dtype):
        n = int(np.prod(shape))
        return self.data.view(dtype)[:n].reshape(shape).copy()


class HostView:
    """A view `offset` bytes into a HostBuffer (past a guard region, say)."""

    def __init__(self, buf, shape, dtype, strides=None, offset=0):
        self.buf, self.shape, self.dtype, self.strides, self.offset = buf, shape, dtype, strides, offset

    def flat(self, dtype) -> np.ndarray:
        """The buffer from the view's first byte on, as `dtype` (a view: writes go through)."""
        data = self.buf.data[self.offset:]
        size = np.dtype(dtype).itemsize
        return data[: data.size // size * size].view(dtype)


def run_on_host(exe, check=None, **args):
    """The call, computed by the schedule executor on the host buffers (`check`, the
    device-side offsets check's switch, has nothing to do here)."""
    from gemmspec.reference.data import (
        NUMPY_TYPES,
        Runtime,
        TensorData,
        element_offsets,
        scale_offsets,
    )
    from gemmspec.reference.schedule_exec import run_schedule

    spec = exe.spec
    dims = {}
    for t in spec.tensors:
        if t.derived is None and t.layout.kind != "segment_major":  # padded rows: not the dim
            for d, n in zip(t.dims, args[t.name].shape):
                if spec.dim(d).size is None:
                    dims[d] = n
    rt = Runtime(dims)
    for g in spec.groups:
        if g.tensor:
            v = args[g.tensor]
            n = int(np.prod(v.shape))
            rt.tensors[g.tensor] = v.flat(np.int32)[:n].reshape(v.shape).astype(np.int64)

    def flat(name, dtype, offsets):
        n = int(offsets.max(initial=-1)) + 1
        with np.errstate(invalid="ignore"):  # bytes of no element: any pattern
            return args[name].flat(NUMPY_TYPES[dtype])[:n].astype(np.float64)

    written = set(spec.written)
    data, init = {}, {}
    for t in spec.tensors:
        if t.derived is not None:
            continue
        off = element_offsets(spec, rt, t)
        values = flat(t.name, t.dtype, off)[off]
        if t.name in written:
            init[t.name] = values
            continue
        grid = None
        if t.scale is not None:
            soff = scale_offsets(spec, rt, t)
            grid = flat(t.scale.name, "f32", soff)[soff]
        data[t.name] = TensorData(values, grid)
    out = run_schedule(spec, rt, exe.schedule, data, init)
    scales = {t.scale.name: t for t in spec.tensors if t.scale is not None}
    for name, values in out.items():
        if name in scales:  # an FP8 output's scales: those it writes (NaN: none)
            stored = ~np.isnan(values)
            grid = args[name].flat(np.float32)
            grid[scale_offsets(spec, rt, scales[name])[stored]] = values[stored].astype(np.float32)
            continue
        t = spec.tensor(name)
        buf = args[name].flat(NUMPY_TYPES[t.dtype])
        buf[element_offsets(spec, rt, t)] = values.astype(NUMPY_TYPES[t.dtype])
