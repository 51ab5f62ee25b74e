"""Arguments stored `segment_major(G) pad P` at call time (no GPU): the buffer's shape has
(P - 1) rows per segment more than the dim along the segmented dim; the dim is read from
the other tensors first; wrong shapes and padded rows past 32-bit indices are clear
errors; a requantize pass into a padded layout gets a workspace with the padding."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.runtime import executor
from gemmspec.runtime.arrays import DeviceArray, DeviceBuffer

GIB = 1 << 30

WGRAD = """
gemm wgrad {
  dim T
  dim N = 256, K = 384
  group expert[E = 8] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""

LENGTHS = [0, 1, 15, 16, 17, 127, 129, 695]  # T = 1000


def wgrad_args(host, rows_dy=1120, rows_x=1120, dy_strides=None):
    offs = np.concatenate([[0], np.cumsum(LENGTHS)]).astype(np.int32)
    blocks = sum(-(-n // 128) for n in LENGTHS)
    host[30 * GIB] = offs
    return {
        "dy": DeviceArray(GIB, (rows_dy, 256), dy_strides or (256, 1), "e4m3", 0),
        "dy_scale": DeviceArray(2 * GIB, (blocks, 256), (256, 1), "f32", 0),
        "x": DeviceArray(4 * GIB, (rows_x, 384), (384, 1), "e4m3", 0),
        "x_scale": DeviceArray(6 * GIB, (blocks, 384), (384, 1), "f32", 0),
        "dw": DeviceArray(8 * GIB, (8, 256, 384), (256 * 384, 384, 1), "f32", 0),
        "offs": DeviceArray(30 * GIB, (9,), (1,), "i32", 0),
    }


def test_padded_buffers_give_the_dim(offline):
    exe = gemmspec.build(WGRAD)
    run = exe.prepare(None, **wgrad_args(offline))
    assert run.dims == {"T": 1000}


@pytest.mark.parametrize(
    "rows_dy, rows_x, flagged",
    # dy comes first: its rows give T, and the tensor that disagrees is named.
    [(1120, 1000, "x: [1120, 384] for T = 1000, got [1000, 384]"),
     (1000, 1120, "x: [1000, 384] for T = 880, got [1120, 384]"),
     (1121, 1120, "x: [1121, 384] for T = 1001, got [1120, 384]")],
)
def test_a_buffer_without_its_padding_is_refused(offline, rows_dy, rows_x, flagged):
    exe = gemmspec.build(WGRAD)
    with pytest.raises(ArgumentError) as info:
        exe.prepare(None, **wgrad_args(offline, rows_dy, rows_x))
    msg = str(info.value)
    name, rest = flagged.split(": ", 1)
    assert f"tensor '{name}' must have shape [T + 120, 384]" in msg
    assert "(segment_major(expert) pad 16: 15 rows of padding for each of its 8 segments, 120 rows beyond T)" in msg
    assert f"which is {rest}" in msg


def test_fewer_rows_than_the_padding_is_refused(offline):
    exe = gemmspec.build(WGRAD)
    with pytest.raises(ArgumentError, match=r"tensor 'dy' must have shape \[T \+ 120, 256\] .*got \[100, 256\]"):
        exe.prepare(None, **wgrad_args(offline, 100, 100))


def test_padded_buffers_are_contiguous(offline):
    exe = gemmspec.build(WGRAD)
    with pytest.raises(ArgumentError, match=r"tensor 'dy' must have element strides \[256, 1\]"):
        exe.prepare(None, **wgrad_args(offline, dy_strides=(512, 1)))


def test_padded_rows_past_32_bits_are_refused(offline):
    exe = gemmspec.build(WGRAD)
    t = 2**31 - 100  # a legal T, but T + 120 rows are not
    args = wgrad_args(offline, t + 120, t + 120)
    offline[30 * GIB] = np.array([0, 0, 0, 0, 0, 0, 0, 0, t], np.int32)
    args["dy_scale"] = DeviceArray(2 * GIB, (-(-t // 128), 256), (256, 1), "f32", 0)
    args["x_scale"] = DeviceArray(6 * GIB, (-(-t // 128), 384), (384, 1), "f32", 0)
    with pytest.raises(ArgumentError, match=r"'dy' \(segment_major\(expert\) pad 16\) has 2147483668 rows along T"):
        exe.prepare(None, check=False, **args)


REQUANT = """
gemm req {
  dim T
  dim N = 256, K = 384
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


def test_requantized_padded_target_gets_room_for_its_padding(offline):
    exe = gemmspec.build(REQUANT)
    offline[30 * GIB] = np.array([0, 1, 17, 17, 300], np.int32)
    args = {
        "x": DeviceArray(GIB, (300, 384), (384, 1), "e4m3", 0),
        "x_scale": DeviceArray(2 * GIB, (300, 3), (3, 1), "f32", 0),
        "dy": DeviceArray(3 * GIB, (300, 256), (256, 1), "e4m3", 0),
        "dy_scale": DeviceArray(4 * GIB, (300, 2), (2, 1), "f32", 0),
        "dw": DeviceArray(5 * GIB, (4, 256, 384), (256 * 384, 384, 1), "f32", 0),
        "offs": DeviceArray(30 * GIB, (5,), (1,), "i32", 0),
    }
    run = exe.prepare(None, **args)
    requant = [k for k in exe.manifest.kernels if k.role == "requantize"]
    assert len(requant) == 2 and all(k.symbol.endswith("_p16") for k in requant)
    sizes = sorted(b.nbytes for b in run.workspace if isinstance(b, executor.DeviceBuffer))
    assert (300 + 60) * 384 in sizes and (300 + 60) * 256 in sizes


def test_verify_builds_padded_buffers_the_executor_accepts(offline, monkeypatch):
    """`gemmspec run`'s buffers (runtime/verify.py): a padded input holds T + 120 rows
    whose padding is NaN (it must never be read), and its view passes the call's checks."""
    from gemmspec.reference.data import element_offsets, random_inputs, random_runtime
    from gemmspec.runtime import verify

    class HostBuffer:
        _next = 1 << 40

        def __init__(self, host):
            self.host, self.nbytes, self.device = host, host.nbytes, 0
            self.ptr = HostBuffer._next
            HostBuffer._next += 1 << 36

        view = DeviceBuffer.view

    monkeypatch.setattr(verify, "DeviceBuffer", type("B", (), {"from_numpy": staticmethod(HostBuffer)}))
    exe = gemmspec.build(WGRAD)
    spec = exe.spec
    rt = random_runtime(spec, np.random.default_rng(0), lengths={"expert": LENGTHS})
    data = random_inputs(spec, rt, np.random.default_rng(1))
    args = {}
    for name in ("dy", "x"):
        t = spec.tensor(name)
        host, buf = verify._flat_buffer(spec, rt, t, data[name].values, 0.0)
        assert host.size == (1000 + 120) * spec.dim(t.dims[1]).size
        stored = np.zeros(host.size, bool)
        stored[element_offsets(spec, rt, t).ravel()] = True
        values = host.astype(np.float64)
        assert np.isnan(values[~stored]).all() and not np.isnan(values[stored]).any()
        args[name] = verify._shaped(buf, t, spec, rt)
        assert args[name].shape == (1120, spec.dim(t.dims[1]).size)
    base = wgrad_args(offline)
    base.update(args)
    assert exe.prepare(None, **base).dims == {"T": 1000}
