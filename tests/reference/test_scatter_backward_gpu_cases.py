"""The GPU tests of requantize(SOURCE, rows = IDX, weight = W) and of the example's derived
backward (tests/gpu/test_scatter_backward_gpu.py), run on the CPU with host stand-ins: the
requant kernel emulated from its documented storage (padded segments, per-segment scale
rows) and the executable computed by the flat-schedule executor. What they check here is
the tests' own bookkeeping (parameters, buffers, poison, shapes, tolerances), so that on
the GPU they check the kernels and nothing else."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "gpu" / "test_scatter_backward_gpu.py"
_SPEC = importlib.util.spec_from_file_location("scatter_backward_gpu_cases", _PATH)
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)


class _HostBuffer:
    """DeviceBuffer's surface for these tests, in host memory."""

    def __init__(self, data: np.ndarray):
        self.data = data

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> _HostBuffer:
        return cls(np.ascontiguousarray(array).view(np.uint8).reshape(-1).copy())

    def view(self, shape, dtype, strides=None):
        return _HostView(self, tuple(shape), dtype)

    def to_numpy(self, shape, dtype):
        n = int(np.prod(shape))
        return self.data.view(dtype)[:n].reshape(shape).copy()


class _HostView:
    def __init__(self, buf, shape, dtype):
        self.buf, self.shape, self.dtype = buf, shape, dtype


def _emulated_requant(p, arrays, grid, params):
    """The kernel's documented arithmetic and storage, written out on the host: per
    segment and 128-token block, each column's amax of fp8 * SX(row) * W[t] (float32),
    SY = amax / 448 (1 when zero) at scale row rowbase_g + block, Y at
    p_g * C + c * len'_g + (t - s_g) with len'_g the length rounded up to the pad."""
    a = {n: arrays[n] for n in params}
    c = int(a["C"])
    x = a["X"].data.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, c)
    sx = a["SX"].data.view(np.float32).reshape(x.shape[0], -1)
    offs = a["offsets"].data.view(np.int32)
    y, sy = a["Y"].data, a["SY"].data.view(np.float32)
    pad = p.config.pad
    idx = a["idx"].data.view(np.int32) if "idx" in a else None
    w = a["W"].data.view(np.float32) if "W" in a else None
    rowbase = padbase = 0
    for g in range(int(a["G"])):
        s0, s1 = int(offs[g]), int(offs[g + 1])
        length = s1 - s0
        pitch = -(-length // pad) * pad
        for b0 in range(s0, s1, 128):
            b1 = min(b0 + 128, s1)
            vals = np.zeros((b1 - b0, c), np.float32)
            for r, t in enumerate(range(b0, b1)):
                src = t if idx is None else int(idx[t])
                if 0 <= src < x.shape[0]:
                    scale = np.repeat(sx[src], 128)[:c]
                    if w is not None:
                        scale = scale * w[t]
                    vals[r] = x[src] * scale
            amax = np.abs(vals).max(axis=0)
            block_sy = np.where(amax > 0, amax / np.float32(448), np.float32(1)).astype(np.float32)
            sy[(rowbase + (b0 - s0) // 128) * c : (rowbase + (b0 - s0) // 128 + 1) * c] = block_sy
            q = np.clip(vals / block_sy, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            base = (padbase if pad > 1 else s0) * c
            for r in range(b1 - b0):
                for col in range(c):
                    y[base + col * (pitch if pad > 1 else length) + (b0 - s0) + r] = q[r, col]
        rowbase += -(-length // 128)
        padbase += pitch


@pytest.mark.parametrize("counts", [cases.COUNTS, [129, 0, 127, 1]], ids=["up", "mixed"])
@pytest.mark.parametrize("form", sorted(cases.FORMS))
def test_the_bit_for_bit_case_on_an_emulated_kernel(form, counts, monkeypatch):
    from gemmspec.runtime import arrays

    monkeypatch.setattr(arrays, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(cases, "run_prepass", _emulated_requant)
    cases.test_requant_rows_kernel_is_the_reference_bit_for_bit(form, counts)


def _run_on_host(exe, check=None, **args):
    """The call, computed by the schedule executor on the host buffers."""
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
            rt.tensors[g.tensor] = v.buf.to_numpy(v.shape, np.int32).astype(np.int64)

    def flat(name, dtype, offsets):
        n = int(offsets.max(initial=-1)) + 1
        return args[name].buf.data.view(NUMPY_TYPES[dtype])[:n].astype(np.float64)

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
        buf = args[name].buf.data.view(NUMPY_TYPES[t.dtype])
        buf[element_offsets(spec, rt, t)] = values.astype(NUMPY_TYPES[t.dtype])


SMALL = {"H = 7168": "H = 384", "N = 4096": "N = 512", "F = 2048": "F = 256"}


@pytest.mark.parametrize("gather", ["auto", "fused"])
@pytest.mark.parametrize("counts", [cases.COUNTS * 2], ids=["up"])
def test_the_example_backward_case_on_the_flat_executor(counts, gather, monkeypatch, tmp_path):
    """The example's own statements at smaller compile-time dims."""
    from gemmspec.runtime import arrays
    from gemmspec.runtime.executor import Executable

    text = cases.EXAMPLE.read_text()
    for old, new in SMALL.items():
        text = text.replace(old, new)
    small = tmp_path / "moe_ffn_fp8_train.gspec"
    small.write_text(text)
    monkeypatch.setattr(cases, "EXAMPLE", small)
    monkeypatch.setattr(arrays, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(Executable, "__call__", _run_on_host)
    cases.test_the_example_backward_matches_float64(counts, gather)


def test_the_executable_case_on_the_flat_executor(monkeypatch):
    """run_random with the rows-and-weight pass, the flat executor standing in for the GPU."""
    from gemmspec.runtime import verify
    from gemmspec.runtime.executor import Executable

    monkeypatch.setattr(verify, "DeviceBuffer", _HostBuffer)
    monkeypatch.setattr(Executable, "__call__", _run_on_host)
    cases.test_requant_rows_prepass_through_the_executable_feeds_the_wgrad()
