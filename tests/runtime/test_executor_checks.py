"""Run-time checks that mirror the checker's limits (gemmspec/runtime/checks.py):
sizes the kernels index in 32 bits, written layouts that depend on run-time dims,
and outputs against every other argument by byte range. No GPU: the arrays are
`DeviceArray`s at made-up addresses, and nothing gets as far as a launch."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.runtime import checks
from gemmspec.runtime.arrays import DeviceArray

GIB = 1 << 30
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def arr(shape, dtype="bf16", ptr=GIB, strides=None):
    if strides is None:
        strides, step = [], 1
        for n in reversed(shape):
            strides.insert(0, step)
            step *= max(n, 1)
    return DeviceArray(ptr, tuple(shape), tuple(strides), dtype, 0)


DENSE = """
gemm dense {
  dim T
  dim N = 256, K = 128
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


@pytest.fixture(scope="module")
def dense():
    return gemmspec.build(DENSE)


def dense_args(t, **ptrs):
    base = {"x": GIB, "w": 2 * GIB, "y": 3 * GIB, **ptrs}
    return {
        "x": arr((t, 128), ptr=base["x"]),
        "w": arr((256, 128), ptr=base["w"]),
        "y": arr((t, 256), ptr=base["y"]),
    }


# ---- sizes ---------------------------------------------------------------------------


def test_runtime_dim_of_2_pow_31_is_rejected(dense):
    # Far apart, so the size is what is wrong (the ranges would overlap otherwise).
    args = dense_args(2**31, y=1 << 45, w=1 << 44)
    with pytest.raises(
        ArgumentError,
        match=r"run-time dim T = 2147483648 \(from the shape of 'x'\) "
        r"is more than 2\^31 - 1: the kernels index rows, columns and K",
    ):
        dense._bind(args)


def test_runtime_dim_just_below_the_limit_passes(dense):
    t = 2**31 - 1
    bound = dense._bind(dense_args(t, y=1 << 45, w=1 << 44))
    assert bound.dims == {"T": t}


def test_the_limit_is_checked_before_any_plan(dense, offline):
    with pytest.raises(ArgumentError, match="run-time dim T = 4294967296"):
        dense(**dense_args(2**32, y=1 << 46, w=1 << 45))
    assert not dense._plans


WIDE = """
gemm wide {
  dim T
  dim N = 268435456, K = 128
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


def test_output_tiles_beyond_int32_are_rejected():
    exe = gemmspec.build(WIDE)
    n = 268435456
    ok = {"x": arr((1024, 128)), "w": arr((n, 128), ptr=1 << 40), "y": arr((1024, n), ptr=1 << 42)}
    exe._bind(ok)
    t = 1 << 20
    big = {"x": arr((t, 128)), "w": arr((n, 128), ptr=1 << 40), "y": arr((t, n), ptr=1 << 42)}
    with pytest.raises(
        ArgumentError,
        match=r"with T = 1048576, launch 0 \(statement #0\) can have "
        r"up to \d+ output tiles of .*, more than 2\^31 - 1",
    ):
        exe._bind(big)


def test_a_pair_along_m_counts_units_of_two_row_blocks(monkeypatch):
    # The blockwise FP8 launch runs as CTA pairs sharing B: its work units are 256 x 192,
    # and the 32-bit count is checked in those units (a pair sharing A would be 128 x 384).
    from gemmspec.bench import moe_spec
    from gemmspec.lower.schedule import unit_shape

    exe = gemmspec.build(moe_spec(n=768, k=576, e=4, fp8=True))
    (launch,) = exe.schedule.launches
    assert launch.signature.unit_shape == (256, 192) == unit_shape(128, 192, 2, True)
    assert unit_shape(128, 192, 2, False) == (128, 384) and unit_shape(128, 192, 1, False) == (128, 192)
    dims = {"T": 4096}
    checks.check_sizes(exe.spec, exe.schedule, exe.manifest, dims)
    # With the bound lowered to one unit, the refusal names the unit it counted.
    monkeypatch.setattr(checks, "MAX_TILES_PER_LAUNCH", 1)
    with pytest.raises(ArgumentError, match=r"output tiles of 256x192, more than 2\^31 - 1"):
        checks.check_sizes(exe.spec, exe.schedule, exe.manifest, dims)


def test_values_a_kernel_takes_as_int_are_bounded():
    # Past the dim check, every int the launches pass is checked against its C++ type.
    exe = gemmspec.build(EXAMPLES / "linear_fp8_training.gspec")
    checks._check_manifest_values(exe.spec, exe.manifest, {"T": 4096})
    with pytest.raises(ArgumentError, match=r"with T = 2147483648, .*(does not fit|would hold)"):
        checks._check_manifest_values(exe.spec, exe.manifest, {"T": 2**31})


# ---- written layouts that depend on run-time dims -------------------------------------

LEADING = """
gemm leading {
  dim T
  dim N = 256, K = 128
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N] layout strides(T, 1)
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


@pytest.fixture(scope="module")
def leading():
    return gemmspec.build(LEADING)


def leading_args(t):
    return {
        "x": arr((t, 128)),
        "w": arr((256, 128), ptr=2 * GIB),
        "y": arr((t, 256), ptr=3 * GIB, strides=(t, 1)),
    }


def test_runtime_strides_that_alias_an_output_are_rejected(leading):
    # Rows T = 100 elements apart, 256 wide: row 1 starts inside row 0.
    with pytest.raises(
        ArgumentError,
        match=r"output 'y' has shape \[100, 256\] with strides "
        r"\[100, 1\] \(strides\(T, 1\)\) for T = 100: elements \(T=0, N=100\) and "
        r"\(T=1, N=0\) are both at offset 100, a write race",
    ):
        leading._bind(leading_args(100))


@pytest.mark.parametrize("t", [0, 1, 256, 1000])
def test_runtime_strides_that_keep_elements_apart_pass(leading, t):
    leading._bind(leading_args(t))


def test_written_layout_is_checked_once_per_plan(leading, offline):
    with pytest.raises(ArgumentError, match="a write race"):
        leading(**leading_args(64))
    assert not leading._plans


# ---- outputs against the other arguments, by byte range ----------------------------------


def test_partial_overlap_of_an_output_and_an_input(dense):
    # y's last row shares 16 bytes with the start of x.
    args = dense_args(64, y=GIB - 64 * 256 * 2 + 16)
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'"):
        dense._bind(args)


def test_adjacent_views_of_one_buffer_pass(dense):
    # x, then y right after it, then w right after y: one buffer, three views.
    t = 64
    y = GIB + t * 128 * 2
    dense._bind(dense_args(t, y=y, w=y + t * 256 * 2))


def test_same_buffer_different_offsets(dense):
    t = 64
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'w'"):
        dense._bind(dense_args(t, w=3 * GIB + 2 * 256 * 2))  # w starts at y's third row
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'"):
        dense._bind(dense_args(t, x=3 * GIB + (t - 1) * 256 * 2))  # x starts on y's last row
    dense._bind(dense_args(t, w=3 * GIB + t * 256 * 2))  # past y's last byte


HALVES = """
gemm halves {
  dim T
  dim N = 256, K = 256
  tensor x : bf16 [T, K] layout strides(512, 1)
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N] layout strides(512, 1)
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


def test_interleaved_views_count_as_overlapping():
    # x is columns 256..511 of a [T, 512] buffer, y columns 0..255: no element is
    # shared, but the byte ranges interleave, and the rule is conservative.
    exe = gemmspec.build(HALVES)
    t = 64
    args = {
        "x": arr((t, 256), ptr=GIB + 512, strides=(512, 1)),
        "w": arr((256, 256), ptr=2 * GIB),
        "y": arr((t, 256), ptr=GIB, strides=(512, 1)),
    }
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'"):
        exe._bind(args)
    args["x"] = arr((t, 256), ptr=GIB + t * 512 * 2, strides=(512, 1))  # the next buffer
    exe._bind(args)


COLUMN_MAJOR = """
gemm column_major {
  dim T
  dim N = 256, K = 128
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : f32 [T, N] layout major(T)
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


@pytest.mark.parametrize("t", [64, 1000])
def test_extents_with_runtime_strides(t):
    # y's strides (1, T) depend on T: its range is T * 256 floats.
    exe = gemmspec.build(COLUMN_MAJOR)
    end = 3 * GIB + t * 256 * 4

    def args(x_at):
        return {
            "x": arr((t, 128), ptr=x_at),
            "w": arr((256, 128), ptr=2 * GIB),
            "y": arr((t, 256), "f32", ptr=3 * GIB, strides=(1, t)),
        }

    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'"):
        exe._bind(args(end - 16))
    exe._bind(args(end))


def brute_force(arrays, roles):
    names = list(roles)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            if "output" not in (roles[a], roles[b]):
                continue
            ea, eb = arrays[a].byte_extent(), arrays[b].byte_extent()
            if ea and eb and ea[0] < eb[1] and eb[0] < ea[1]:
                return True
    return False


def test_sweep_agrees_with_every_pair():
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 7)
        roles = {f"t{i}": rng.choice(["input", "output", "scale", "offsets"]) for i in range(n)}
        arrays = {
            name: arr((rng.randint(0, 4), rng.randint(1, 4)), ptr=16 * rng.randint(1, 12))
            for name in roles
        }
        try:
            checks.check_outputs(arrays, roles)
            found = False
        except ArgumentError as e:
            found = True
            assert "output '" in str(e)
        assert found == brute_force(arrays, roles), (arrays, roles)
