"""The derived backward of examples/moe_ffn_fp8_train.gspec takes its arguments: the
output gradient, the index and row weight of the scattered rows, the transposed weight's
source, the forward's copy h_t (padded segments, anchored scales), the up-projection's
inputs and the gradients
validate from metadata alone (fake `__cuda_array_interface__` objects, offsets read on
the host), and every run-time dim has a size."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.build import build_backward
from gemmspec.errors import ArgumentError
from gemmspec.runtime import executor

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"
T, S, H, N, F, E = 512, 512, 7168, 4096, 2048, 8  # S = T: the index fixture permutes T rows
GIB = 1 << 30


class FakeCuda:
    def __init__(self, shape, typestr, ptr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape), "typestr": typestr, "data": (ptr, False), "strides": None, "version": 3,
        }


def good_args(**changes):
    shapes = {
        "dy": ((T, H), "|u1"),
        "dy_scale": ((T, H // 128), "<f4"),
        "route_w": ((T,), "<f4"),
        "dst": ((T,), "<i4"),
        "w_down": ((E, H, F), "|u1"),
        "w_down_scale": ((E, H // 128, F // 128), "<f4"),
        "h_t": ((T + 15 * E, F), "|u1"),  # segments padded to 16 rows
        "h_t_scale": ((E, F), "<f4"),  # 64 tokens per expert: one 128-row block each
        "h": ((T, F), "|u1"),
        "h_scale": ((T, F // 128), "<f4"),
        "dh_pre": ((T, F), "<u2"),
        "dh": ((T, F), "<u2"),
        "dw_down": ((E, H, F), "<f4"),
        "droute_w": ((T,), "<f4"),
        "expert_offsets": ((E + 1,), "<i4"),
        # The SwiGLU up-projection's backward: x (S tokens) read through src, the gate/up
        # columns recomputed, the DGRAD's rows added back into dx.
        "x": ((S, H), "|u1"),
        "x_scale": ((S, H // 128), "<f4"),
        "w_up": ((E, N, H), "|u1"),
        "w_up_scale": ((E, N // 128, H // 128), "<f4"),
        "src": ((T,), "<i4"),
        "h_gate_up": ((T, N), "<u2"),
        "dx_rows": ((T, H), "<u2"),
        "dw_up": ((E, N, H), "<f4"),
        "dx": ((S, H), "<u2"),
    }
    shapes.update(changes)
    return {n: FakeCuda(shape, ty, (i + 1) * 64 * GIB) for i, (n, (shape, ty)) in enumerate(shapes.items())}


@pytest.fixture
def offsets_on_host(monkeypatch):
    """The offsets (T tokens spread over the experts) and the index (a permutation) as
    the host reads them back."""
    values = {(E + 1,): np.linspace(0, T, E + 1).astype(np.int32), (T,): np.random.default_rng(0).permutation(T).astype(np.int32)}
    monkeypatch.setattr(executor, "copy_to_host", lambda a, shape: values[tuple(shape)])


@pytest.fixture(scope="module")
def exe():
    return build_backward(gemmspec.build(EXAMPLE).spec)[0]


def test_the_arguments_are_the_backward_inputs_and_gradients(exe):
    assert set(exe.argument_names()) == set(good_args())


def test_good_args_pass_validation(exe, offsets_on_host):
    bound = exe._bind(good_args())
    assert bound.dims == {"T": T, "S": S}


def test_a_row_weight_of_another_length_is_refused(exe, offsets_on_host):
    with pytest.raises(ArgumentError, match="dim T is 512 in an earlier tensor but 511 in 'route_w'"):
        exe._bind(good_args(route_w=((T - 1,), "<f4")))


ROWS = """\
gemm wgrad_rows {
  dim T, S
  dim N = 256, K = 256
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor dy  : e4m3 [S, N] scale f32 [1, 128]
  tensor x_t : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy, rows = dst, weight = rw)
  tensor dw  : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_t[t, k]
}
"""


def test_the_host_reads_the_index_of_a_requantize_and_refuses_a_row_outside(monkeypatch):
    """The index only the requantize pass reads is checked like a gathered row's: the host
    (check=True) names the entry, the source and its rows."""
    t, s = 40, 30
    exe = gemmspec.build(ROWS)
    shapes = {
        "dst": ((t,), "<i4"), "rw": ((t,), "<f4"), "dy": ((s, 256), "|u1"), "dy_scale": ((s, 2), "<f4"),
        "x_t": ((t + 15 * 2, 256), "|u1"), "x_t_scale": ((2, 256), "<f4"), "dw": ((2, 256, 256), "<f4"),
        "offs": ((3,), "<i4"),
    }
    args = {n: FakeCuda(shape, ty, (i + 1) * 64 * GIB) for i, (n, (shape, ty)) in enumerate(shapes.items())}
    index = np.arange(t, dtype=np.int32) % s
    values = {(3,): np.array([0, 25, t], np.int32), (t,): index}
    monkeypatch.setattr(executor, "copy_to_host", lambda a, shape: values[tuple(shape)])
    assert exe._bind(args).dims == {"T": t, "S": s}
    index[7] = s + 3
    with pytest.raises(ArgumentError, match=r"'dst' holds a row number outside the S rows of 'dy': dst\[7\] = 33, S = 30"):
        exe._bind(args)
