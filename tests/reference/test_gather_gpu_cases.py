"""The GPU tests of gathered rows and scattered outputs (tests/gpu/test_gather_gpu.py), run
on the CPU: verify.run_random end to end, with the flat-schedule executor computing on
host buffers where the GPU would. Each case's sizes admit its indices, the buffers carry
int32 indices, and the checks count every row an index names as written and every other
row as untouched, so the GPU tests check the kernels and nothing else."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.runtime.verify import run_random

_PATH = Path(__file__).resolve().parents[1] / "gpu" / "test_gather_gpu.py"
_SPEC = importlib.util.spec_from_file_location("gather_gpu_cases", _PATH)
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)


@pytest.mark.parametrize("key", sorted(cases.CASES))
def test_cases_run_on_the_reference(key, monkeypatch):
    """run_random end to end with the flat-schedule executor as the device: the case's
    sizes admit its indices, the buffers carry int32 indices, and the checks count every
    row the index names as written and every other row as untouched."""
    from gemmspec.runtime import verify

    exe = gemmspec.build(cases.spec_text(key))
    monkeypatch.setattr(verify, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(type(exe), "__call__", _run_on_host)
    dims, lengths = cases.dims_and_lengths(key)
    report = run_random(exe, dims=dims, lengths=lengths, seed=len(key), repeats=0)
    assert report.ok, report.describe()  # within the output type's rounding, nothing missed


@pytest.mark.parametrize("key", sorted(k for k in cases.CASES if "gather" in k))
def test_cases_with_the_rows_copied_first_run_on_the_reference(key, monkeypatch):
    """The same with every gathered A copied by the gather pre-pass where it can be."""
    from gemmspec.runtime import verify

    exe = gemmspec.build(cases.with_directive(cases.spec_text(key), "gather(prepass)"))
    monkeypatch.setattr(verify, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(type(exe), "__call__", _run_on_host)
    dims, lengths = cases.dims_and_lengths(key)
    report = run_random(exe, dims=dims, lengths=lengths, seed=len(key) + 2, repeats=0)
    assert report.ok, report.describe()


class _HostBuffer:
    """DeviceBuffer's surface for verify.run_random, in host memory."""

    def __init__(self, data: np.ndarray):
        self.data = data

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> _HostBuffer:
        return cls(np.ascontiguousarray(array).view(np.uint8).reshape(-1).copy())

    def view(self, shape, dtype, strides=None):
        return _HostView(self, tuple(shape), dtype, strides)

    def to_numpy(self, shape, dtype):
        n = int(np.prod(shape))
        return self.data.view(dtype)[:n].reshape(shape).copy()


class _HostView:
    def __init__(self, buf, shape, dtype, strides):
        self.buf, self.shape, self.dtype, self.strides = buf, shape, dtype, strides


def _run_on_host(exe, **args):
    """The call, computed by the schedule executor on the flat buffers."""
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
        if t.derived is None:
            for d, n in zip(t.dims, args[t.name].shape):
                if spec.dim(d).size is None:
                    dims[d] = n
    rt = Runtime(dims)
    for g in spec.groups:
        if g.tensor:
            v = args[g.tensor]
            rt.tensors[g.tensor] = v.buf.to_numpy(v.shape, np.int32).astype(np.int64)

    def flat(name, dtype, offsets):
        v = args[name]
        n = int(offsets.max(initial=-1)) + 1
        return v.buf.data.view(NUMPY_TYPES[dtype])[:n].astype(np.float64)

    written = {g.out.tensor for g in spec.gemms}
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
    for name, values in out.items():
        t = spec.tensor(name)
        off = element_offsets(spec, rt, t)
        view = args[name].buf.data.view(NUMPY_TYPES[t.dtype])
        view[off] = values.astype(NUMPY_TYPES[t.dtype])
