"""Calls of specs that read or write rows through index tensors, with no GPU (the fakes of
conftest): the index tensor's arguments and checks, the device check that reads it, and
the host checks of `prepare` (rows in range, a scattered output's rows distinct)."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec
from gemmspec.codegen.kernels import include_dir
from gemmspec.codegen.validate import index_rows, validation_kernel
from gemmspec.errors import ArgumentError
from gemmspec.runtime import executor
from gemmspec.runtime.arrays import DeviceArray

GIB = 1 << 30
T, S, N, K, E = 300, 400, 256, 512, 4

SPEC = """
gemm moe_gather {
  dim T, S
  dim N = 256, K = 512
  group expert[E = 4] = ragged(T, offsets = offs%(CAP)s)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [S, N]
  y[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""

MASKED = """
gemm masked_gather {
  dim M = 64, N = 128, K = 128
  group expert[E = 2] = masked(M, counts = cnt)
  tensor rows : i32 [M]
  tensor x : bf16 [E, M, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [E, M, N]
  y[e, m, n] = sum[k] x[e, rows[m], k] * w[e, n, k]
}
"""


def args(t=T, idx_at=6 * GIB, src_at=7 * GIB):
    return {
        "idx": DeviceArray(idx_at, (t,), (1,), "i32", 0),
        "src": DeviceArray(src_at, (t,), (1,), "i32", 0),
        "x": DeviceArray(GIB, (S, K), (K, 1), "e4m3", 0),
        "x_scale": DeviceArray(2 * GIB, (S, K // 128), (K // 128, 1), "f32", 0),
        "w": DeviceArray(3 * GIB, (E, N, K), (N * K, K, 1), "e4m3", 0),
        "w_scale": DeviceArray(4 * GIB, (E, N // 128, K // 128), (N * K // 128**2, K // 128, 1), "f32", 0),
        "y": DeviceArray(5 * GIB, (S, N), (N, 1), "bf16", 0),
        "offs": DeviceArray(8 * GIB, (E + 1,), (1,), "i32", 0),
    }


@pytest.fixture
def exe():
    return gemmspec.build(SPEC % {"CAP": ""})


def fill(offline, lengths=(100, 0, 150, 50), idx=None, src=None, t=T):
    offline[8 * GIB] = np.array([0, *np.cumsum(lengths)], np.int32)
    rng = np.random.default_rng(0)
    offline[6 * GIB] = np.asarray(idx if idx is not None else rng.permutation(S)[:t], np.int32)
    offline[7 * GIB] = np.asarray(src if src is not None else rng.permutation(S)[:t], np.int32)


def test_arguments_and_roles(exe):
    assert exe.argument_names()[:2] == ["idx", "src"]
    roles = {a.name: a.role for a in exe.manifest.arguments}
    assert roles["idx"] == roles["src"] == "index" and exe._argument_roles()["idx"] == "index"


def test_plan_passes_the_index_tensors_themselves(exe, offline):
    fill(offline)
    exe(**args())
    names = [name for name, _, _ in executor.LoadedKernel.launched]
    assert names == ["gs_moe_gather_l0_leaves", exe.program.launches[0].gemm.name]
    (_, _, table), _ = executor.LoadedKernel.launched
    # The builder's device check reads both index tensors (no copy), and its table takes
    # them as they are: each passed once.
    assert table.count(6 * GIB) == 1 and table.count(7 * GIB) == 1
    v = validation_kernel(exe.spec)
    assert v.indices == ("idx", "src") and v.sizes == ("T", "S")
    assert [c.message for c in v.checks if c.tensor in v.indices] == [
        "'idx' holds a row number outside the S rows of 'x'",
        "'src' holds a row number outside the S rows of 'y'",
    ]


def test_index_tensors_need_only_int32_alignment(exe, offline):
    fill(offline)
    exe(**args(idx_at=6 * GIB + 4))
    with pytest.raises(ArgumentError, match="index tensor 'src' must be 4-byte aligned"):
        exe(**args(src_at=7 * GIB + 2))


def test_index_tensor_dtype_and_shape_are_checked(exe, offline):
    fill(offline)
    bad = args()
    bad["idx"] = DeviceArray(6 * GIB, (T,), (1,), "f32", 0)
    with pytest.raises(ArgumentError, match="tensor 'idx' must be i32, got f32"):
        exe(**bad)
    bad = args()
    bad["idx"] = DeviceArray(6 * GIB, (T + 1,), (1,), "i32", 0)
    with pytest.raises(ArgumentError, match="dim T is 301 in an earlier tensor but 300 in 'src'"):
        exe(**bad)


def test_an_output_may_not_overlap_an_index_tensor(exe, offline):
    fill(offline)
    with pytest.raises(ArgumentError, match="output 'y' overlaps index 'idx'"):
        exe(**args(idx_at=5 * GIB + 64))


@pytest.mark.parametrize("which, value, message", [
    ("idx", -1, r"'idx' holds a row number outside the S rows of 'x': idx\[17\] = -1, S = 400"),
    ("src", 400, r"'src' holds a row number outside the S rows of 'y': src\[17\] = 400"),
])
def test_prepare_reads_the_indices_back(exe, offline, which, value, message):
    rng = np.random.default_rng(1)
    values = rng.permutation(S)[:T]
    values[17] = value
    fill(offline, **{which: values})
    with pytest.raises(ArgumentError, match=message):
        exe.prepare(None, **args())


def test_prepare_refuses_rows_scattered_twice(exe, offline):
    src = np.random.default_rng(2).permutation(S)[:T]
    src[250] = src[3]
    fill(offline, src=src)
    with pytest.raises(ArgumentError, match=rf"'src' sends rows 3 and 250 to row {src[3]} of output 'y'"):
        exe.prepare(None, **args())
    # A gather may read one row many times.
    idx = np.zeros(T, np.int32)
    fill(offline, idx=idx)
    exe.prepare(None, **args())


def test_rows_past_a_capacity_are_not_checked(offline):
    exe = gemmspec.build(SPEC % {"CAP": ", capacity"})
    (x,) = [r for r in index_rows(exe.spec) if r.tensor == "idx"]
    assert x.limit == "expert"
    idx = np.random.default_rng(3).permutation(S)[:T]
    idx[200:] = -5  # past offs[E] = 200: never read
    src = np.random.default_rng(4).permutation(S)[:T]
    src[200:] = src[0]
    fill(offline, lengths=(100, 0, 50, 50), idx=idx, src=src)
    exe.prepare(None, **args())
    idx[199] = -5
    fill(offline, lengths=(100, 0, 50, 50), idx=idx, src=src)
    with pytest.raises(ArgumentError, match=r"idx\[199\] = -5"):
        exe.prepare(None, **args())


def test_masked_rows_check_up_to_the_largest_count():
    spec = gemmspec.build(MASKED).spec
    (x,) = index_rows(spec)
    assert (x.tensor, x.rows, x.bound, x.of, x.limit) == ("rows", "M", "M", ("x",), "expert")


@pytest.mark.parametrize("text", [SPEC % {"CAP": ""}, SPEC % {"CAP": ", capacity"}, MASKED])
def test_the_device_check_compiles(text):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    from gemmspec.runtime.nvrtc import compile_cubin

    v = validation_kernel(gemmspec.build(text).spec)
    assert v.indices and "Index tensors are read, not copied" in v.source
    assert compile_cubin(v.source, name=v.name, include_dirs=[include_dir()]).cubin
