"""A run-time dim of size 0 (no tokens at all) is a valid call.

When no statement has anything to write, the call validates and launches nothing;
when one still must write (an `=` whose sum over tokens is empty writes zeros), its
launches are planned with zero-size extents. No GPU: workspaces, kernels and the
read-back of offsets are faked.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.reference.data import dim_size, random_index, random_runtime, scale_grid_shape
from gemmspec.runtime import executor
from gemmspec.runtime.arrays import DeviceArray

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))
GIB = 1 << 30


def empty_arrays(exe, host, **dims):
    """Arguments for run-time dims `dims` (0 by default), empty ones at address 0
    with contiguous strides, as frameworks hand them out."""
    spec = exe.spec
    dims = {d: dims.get(d, 0) for d in spec.runtime_dims}
    rt = random_runtime(spec, np.random.default_rng(0), dims=dims)
    args, ptr = {}, GIB

    def add(name, shape, dtype, strides):
        nonlocal ptr
        empty = 0 in shape
        args[name] = DeviceArray(0 if empty else ptr, shape, strides, dtype, 0)
        ptr += GIB

    for t in spec.tensors:
        if t.derived is not None:
            continue
        # A padded segment_major buffer holds its padding rows even with no tokens.
        shape = t.layout.storage_shape(tuple(dim_size(spec, rt, d) for d in t.dims))
        if t.layout.kind == "strided" and 0 not in shape:
            strides = tuple(s.evaluate(rt.dims) for s in t.layout.strides)
        else:
            strides = executor._row_major(shape)
        add(t.name, shape, t.dtype, strides)
        if t.dtype == "i32" and 0 not in shape:  # an index tensor: the host reads it back
            host[args[t.name].ptr] = random_index(spec, rt, np.random.default_rng(0), t.name).astype(np.int32)
        if t.scale:
            grid = scale_grid_shape(spec, rt, t)
            add(t.scale.name, grid, "f32", tuple(s.evaluate(rt.dims) for s in t.scale.layout.strides))
    for name, values in rt.tensors.items():
        args[name] = DeviceArray(ptr, values.shape, executor._row_major(values.shape), "i32", 0)
        host[ptr] = np.asarray(values)
        ptr += GIB
    return args


RUNTIME_EXAMPLES = [p for p in EXAMPLES if gemmspec.build(p).spec.runtime_dims]


@pytest.mark.parametrize("path", RUNTIME_EXAMPLES, ids=lambda p: p.stem)
def test_no_tokens_launches_nothing(path, offline):
    exe = gemmspec.build(path)
    args = empty_arrays(exe, offline)
    padded = any(t.layout.pad_rows for t in exe.spec.tensors)
    assert any(0 in a.shape for a in args.values()) or padded
    run = exe.prepare(None, **args)
    assert run.launches == [] and run.workspace == []
    assert exe(**args) is None  # neither enqueues nor synchronises


def test_no_tokens_passed_as_cuda_array_interface(offline):
    """The message that used to reject T = 0 ('[None, 7168]') is gone: the call is accepted."""
    exe = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_forward.gspec")

    class Empty:
        def __init__(self, shape, typestr, strides=None, ptr=0):
            self.__cuda_array_interface__ = {
                "shape": shape, "typestr": typestr, "data": (ptr, False),
                "strides": strides, "version": 3,
            }

    offline[7 * GIB] = np.zeros(9, np.int32)
    args = {
        "x": Empty((0, 7168), "|u1"),
        "x_scale": Empty((0, 56), "<f4"),  # row-major strides: any strides fit an empty tensor
        "w": Empty((8, 4096, 7168), "|u1", ptr=GIB),
        "w_scale": Empty((8, 32, 56), "<f4", ptr=2 * GIB),
        "y": Empty((0, 4096), "<u2"),
        "expert_offsets": Empty((9,), "<i4", ptr=7 * GIB),
    }
    assert exe.prepare(None, **args).launches == []


def test_no_tokens_still_checks_fixed_dims(offline):
    exe = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_forward.gspec")
    args = empty_arrays(exe, offline)
    args["x"] = DeviceArray(0, (0, 7040), (7040, 1), "e4m3", 0)
    with pytest.raises(ArgumentError, match=r"tensor 'x' must have shape \[T, 7168\], got \[0, 7040\]"):
        exe.prepare(None, **args)


def test_no_tokens_offsets_must_end_at_zero(offline):
    exe = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_forward.gspec")
    args = empty_arrays(exe, offline)
    offline[args["expert_offsets"].ptr] = np.arange(9, dtype=np.int32)
    with pytest.raises(ArgumentError, match="must start at 0 and end at T = 0, got 0..8"):
        exe.prepare(None, **args)


TOKEN_SUM = """
gemm token_sum {
  dim T
  dim N = 256, K = 256
  tensor dy : bf16 [T, N] layout major(T)
  tensor x  : bf16 [T, K] layout major(T)
  tensor dw : f32  [N, K]
  dw[n, k] %s sum[t] dy[t, n] * x[t, k]
}
"""


def test_accumulating_an_empty_sum_launches_nothing(offline):
    exe = gemmspec.build(TOKEN_SUM % "+=")
    assert exe.prepare(None, **empty_arrays(exe, offline)).launches == []


def test_assigning_an_empty_sum_still_writes(offline):
    """`dw = sum over no tokens` is all zeros: the GEMM runs with K = 0."""
    exe = gemmspec.build(TOKEN_SUM % "=")
    run = exe.prepare(None, **empty_arrays(exe, offline))
    names = [k.name for k, *_ in run.launches]
    assert names == [exe.program.launches[0].gemm.name]  # it builds its table itself
    table_args = run.launches[0][4]
    assert np.int64(0) in [a for a in table_args if isinstance(a, np.int64)]


TWO_DIMS = """
gemm two_dims {
  dim T, S
  dim K = 256
  tensor x : bf16 [T, K]
  tensor w : bf16 [S, K]
  tensor y : f32  [T, S]
  y[t, s] = sum[k] x[t, k] * w[s, k]
}
"""


@pytest.mark.parametrize(("t", "s"), [(0, 64), (64, 0), (0, 0)])
def test_any_empty_output_dim_launches_nothing(offline, t, s):
    exe = gemmspec.build(TWO_DIMS)
    assert exe.prepare(None, **empty_arrays(exe, offline, T=t, S=s)).launches == []


def test_nonempty_dims_still_launch(offline):
    exe = gemmspec.build(TWO_DIMS)
    (launch,) = exe.program.launches
    assert len(exe.prepare(None, **empty_arrays(exe, offline, T=64, S=64)).launches) == len(launch.kernels) == 1


REQUANTIZED_TOKEN_SUM = """
gemm requantized_token_sum {
  dim T
  dim N = 256, K = 256
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor dw : f32  [N, K]
  tensor x_q  : e4m3 [T, K] layout major(T) scale f32 [128, 1] = requantize(x)
  tensor dy_q : e4m3 [T, N] layout major(T) scale f32 [128, 1] = requantize(dy)
  dw[n, k] = sum[t] dy_q[t, n] * x_q[t, k]
}
"""


def test_assigning_an_empty_sum_of_requantized_operands(offline):
    """Pre-passes run before a GEMM that must still write zeros: T = 0 reaches them."""
    exe = gemmspec.build(REQUANTIZED_TOKEN_SUM)
    run = exe.prepare(None, **empty_arrays(exe, offline))
    assert len(run.launches) == len(exe.program.prepasses) + 2
