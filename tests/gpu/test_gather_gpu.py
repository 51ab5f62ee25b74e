"""On a Hopper GPU: rows gathered through an index tensor (`x[idx[t], k]`, copied by the
producer) and outputs scattered through one (`y[idx[t], n] = ...`, stored from registers)
against the float64 reference of the dequantized inputs. Outputs are poisoned with NaN
first: every row an index names must come back written, every other row untouched.

Ragged segments of 0, 1, 127 and 129 rows; random permutation indices (random rows with
repeats where the index has more entries than the rows it picks from); FP8 with 1x128
activation and 128x128 weight scales (also 128x128 blocks over the gathered rows, and
MN-major activation scales), BF16 and FP32 outputs; gathered rows whose stride TMA could
not describe (K = 200), 64-row and 192-column tiles; scattered outputs beside a router
weight, a bias and a SwiGLU; gathered and scattered together; a capacity group; and indices the checks must refuse.

tests/reference/test_gather_gpu_cases.py runs every case of CASES through the same
run_random on the CPU, with the schedule executor standing in for the GPU, so the cases
themselves are known good where no GPU is."""

from __future__ import annotations

import re

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.runtime.verify import run_random

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129]

SPEC = """
gemm {name} {{
  dim T, S
  dim N = {n}, F = {f}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs{capacity})
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x  : e4m3 [S, K] scale f32 [{bm}, 128]{x_layout}
  tensor xb : bf16 [S, K]
  tensor h  : bf16 [T, K]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wb : bf16 [E, N, K]{wb_layout}
  tensor route_w : f32 [T]
  tensor bias : bf16 [E, N]
  tensor y  : {out} [T, N]
  tensor ys : {out} [S, N]
  tensor yh : bf16 [S, F]
  {statement}
  {directive}
}}
"""

GATHER_FP8 = "y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]"
GATHER_BF16 = "y[t, n] = sum[k] xb[idx[t], k] * wb[expert(t), n, k]"
SCATTER_BF16 = "ys[src[t], n] = route_w[t] * sum[k] h[t, k] * wb[expert(t), n, k]"

# id -> (statement, spec parameters, segment lengths, rows of S beyond T (negative: fewer
# rows than entries, a gather reads some twice))
CASES = {
    "fp8_gather_1x128": (GATHER_FP8, {}, RAGGED, 37),
    "fp8_gather_1x128_mn_major_scales": (GATHER_FP8, {"x_layout": " layout major(S)"}, RAGGED, 5),
    "fp8_gather_deepseek_width": (GATHER_FP8, {"k": 7168, "n": 512}, [*RAGGED, 300, 1000, 0, 513], 100),
    "fp8_gather_128x128_rows": (GATHER_FP8, {"bm": 128}, RAGGED, 200),
    "fp8_gather_repeated_rows": (GATHER_FP8, {}, [300, 1, 127, 129], -400),
    "fp8_gather_rows_not_16_byte_aligned": (GATHER_FP8, {"k": 200, "n": 264}, RAGGED, 3),
    "fp8_gather_64_row_tiles": (GATHER_FP8, {"directive": "tile(64, 64)"}, [0, 1, 63, 65], 0),
    "fp8_gather_wide_tile": (GATHER_FP8, {"n": 520, "directive": "tile(128, 192)"}, RAGGED, 11),
    "bf16_gather": (GATHER_BF16, {}, RAGGED, 64),
    "bf16_gather_deepseek_width": (GATHER_BF16, {"k": 7168, "n": 512}, [*RAGGED, 300, 1000, 0, 513], 0),
    "bf16_gather_f32_out": (GATHER_BF16, {"out": "f32"}, RAGGED, 9),
    # B copied by hand (N contiguous: no TMA box along K) beside an A that TMA could load.
    "bf16_gather_weights_n_major": (GATHER_BF16, {"wb_layout": " layout major(N)"}, RAGGED, 21),
    "bf16_scatter_row_weight": (SCATTER_BF16, {}, RAGGED, 50),
    "bf16_scatter_wide": (SCATTER_BF16, {"n": 512}, RAGGED, 0),
    "f32_scatter_bias": (
        "ys[src[t], n] = sum[k] h[t, k] * wb[expert(t), n, k] + bias[expert(t), n]", {"out": "f32"}, RAGGED, 20,
    ),
    # The whole MoE layer without a permute copy: tokens gathered in, results scattered back.
    "fp8_gather_scatter": ("ys[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]", {}, RAGGED, 31),
    "fp8_gather_swiglu": (
        "yh[idx[t], j] = silu(sum[k] x[idx[t], k] * w[expert(t), 2*j, k]) * sum[k] x[idx[t], k] * w[expert(t), 2*j + 1, k]",
        {"n": 512, "f": 256}, RAGGED, 17,
    ),
    "bf16_scatter_swiglu": (
        "yh[src[t], j] = route_w[t] * silu(sum[k] h[t, k] * wb[expert(t), 2*j, k]) * sum[k] h[t, k] * wb[expert(t), 2*j + 1, k]",
        {"n": 512, "f": 256}, RAGGED, 6,
    ),
}


def spec_text(key: str) -> str:
    """The case's spec, declaring only the tensors its statement uses (each is an argument)."""
    statement, opts, lengths, _ = CASES[key]
    params = {
        "name": key, "n": 256, "f": 128, "k": 576, "e": len(lengths), "bm": 1, "x_layout": "", "out": "bf16",
        "capacity": "", "directive": "", "wb_layout": "", "statement": statement,
    }
    params.update(opts)
    used = set(re.findall(r"\w+", statement))
    lines = [
        ln for ln in SPEC.format(**params).splitlines()
        if not ln.strip().startswith("tensor ") or ln.split()[1] in used
    ]
    return "\n".join(lines) + "\n"


def with_directive(text: str, directive: str) -> str:
    body = text.rstrip()
    return body[:-1] + f"  {directive}\n}}\n"


def dims_and_lengths(key: str) -> tuple[dict, dict]:
    _, _, lengths, extra = CASES[key]
    t = sum(lengths)
    return {"T": t, "S": t + extra}, {"expert": lengths}


def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


@pytest.mark.parametrize("key", sorted(CASES))
def test_matches_reference(key):
    exe = gemmspec.build(spec_text(key))
    dims, lengths = dims_and_lengths(key)
    report_ok(run_random(exe, dims=dims, lengths=lengths, seed=len(key), repeats=0))


@pytest.mark.parametrize("key", sorted(k for k in CASES if "gather" in k))
def test_rows_copied_by_the_producer_match_reference(key):
    """The gathered A copied by the producer's cp.async for every leaf (the default loads
    rows by TMA, a one-row box each, where the leaf's A allows it)."""
    from gemmspec.codegen.emit import with_kernel_config

    exe = gemmspec.build(with_directive(spec_text(key), "gather(fused)"))
    assert exe.program.launches[0].gemm.gather_tma
    exe.program = with_kernel_config(exe.spec, exe.program, gather_tma=False)
    assert not exe.program.launches[0].gemm.gather_tma
    dims, lengths = dims_and_lengths(key)
    report_ok(run_random(exe, dims=dims, lengths=lengths, seed=len(key) + 1, repeats=0))


@pytest.mark.parametrize("key", sorted(k for k in CASES if "gather" in k))
@pytest.mark.parametrize("mode", ["fused", "prepass"])
def test_either_way_of_reading_gathered_rows_matches_reference(key, mode):
    """Rows gathered in the GEMM's loads, or copied first by the gather pre-pass (where it
    can copy them: not [128, 128] row blocks), whatever the automatic choice would be."""
    from gemmspec.gather_plan import copyable

    exe = gemmspec.build(with_directive(spec_text(key), f"gather({mode})"))
    kinds = [p.kind for p in exe.schedule.prepasses]
    can = copyable(exe.spec, exe.spec.gemms[0]) is None
    assert kinds == (["gather"] if mode == "prepass" and can else [])
    assert exe.program.launches[0].gemm.gather == (not kinds)
    dims, lengths = dims_and_lengths(key)
    report_ok(run_random(exe, dims=dims, lengths=lengths, seed=len(key) + 2, repeats=0))


CAPACITY = """
gemm capacity_gather {
  dim T, S
  dim N = 256, K = 576
  group expert[E = 4] = ragged(T, offsets = offs, capacity)
  tensor idx : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor ys : bf16 [S, N]
  ys[idx[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""
BF16_NAN = 0x7FC0


@pytest.mark.parametrize("mode", ["fused", "prepass"])
def test_capacity_rows_past_the_end_are_neither_read_nor_written(mode):
    from gemmspec.runtime.arrays import DeviceBuffer

    exe = gemmspec.build(with_directive(CAPACITY, f"gather({mode})"))
    t, s, used = 500, 520, 257
    rng = np.random.default_rng(7)
    idx = rng.permutation(s)[:t].astype(np.int32)
    idx[used:] = -3  # past the offsets' end: never read, never checked
    y = DeviceBuffer.from_numpy(np.full((s, 256), BF16_NAN, np.uint16))
    fp8 = lambda shape: DeviceBuffer.from_numpy(rng.integers(0, 0x70, shape, dtype=np.uint8))  # noqa: E731
    exe(
        check=True,
        idx=DeviceBuffer.from_numpy(idx).view((t,), "i32"),
        x=fp8((s, 576)).view((s, 576), "e4m3"),
        x_scale=DeviceBuffer.from_numpy(np.ones((s, 5), np.float32)).view((s, 5), "f32"),
        w=fp8((4, 256, 576)).view((4, 256, 576), "e4m3"),
        w_scale=DeviceBuffer.from_numpy(np.ones((4, 2, 5), np.float32)).view((4, 2, 5), "f32"),
        ys=y.view((s, 256), "bf16"),
        offs=DeviceBuffer.from_numpy(np.array([0, 0, 1, 128, used], np.int32)).view((5,), "i32"),
    )
    out = y.to_numpy((s, 256), np.uint16)
    written = np.zeros(s, bool)
    written[idx[:used]] = True
    assert (out[~written] == BF16_NAN).all(), "a row no used index names was written"
    assert not (out[written] == BF16_NAN).any(), "a row an index names was left unwritten"


BAD = """
gemm bad_index {
  dim T, S
  dim N = 128, K = 128
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [S, N]
  y[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
"""


@pytest.mark.parametrize("mode", ["fused", "prepass"])
def test_bad_indices_are_caught_and_never_followed(mode):
    from gemmspec.runtime.arrays import DeviceBuffer

    exe = gemmspec.build(with_directive(BAD, f"gather({mode})"))
    t, s = 10, 12

    def args(idx, src):
        return {
            "idx": DeviceBuffer.from_numpy(np.array(idx, np.int32)).view((t,), "i32"),
            "src": DeviceBuffer.from_numpy(np.array(src, np.int32)).view((t,), "i32"),
            "x": DeviceBuffer.from_numpy(np.zeros((s, 128), np.uint16)).view((s, 128), "bf16"),
            "w": DeviceBuffer.from_numpy(np.zeros((2, 128, 128), np.uint16)).view((2, 128, 128), "bf16"),
            "y": DeviceBuffer(s * 128 * 2).view((s, 128), "bf16"),
            "offs": DeviceBuffer.from_numpy(np.array([0, 4, t], np.int32)).view((3,), "i32"),
        }

    good = list(range(t))
    exe(check=True, **args(good, good))
    far = [0, 1, 2, 1 << 30, 4, 5, 6, 7, 8, 9]  # a wild read if a kernel followed it
    with pytest.raises(ArgumentError, match=r"'idx' holds a row number outside the S rows of 'x'"):
        exe(check=True, **args(far, good))  # the device found it
    run = exe.prepare(check=False, **args(far, good))
    run.enqueue()
    run.synchronize()  # unchecked: the kernels skip the row, nothing faults
    with pytest.raises(ArgumentError, match=r"'src' holds a row number outside the S rows of 'y'"):
        exe(check=True, **args(good, [-1, *good[1:]]))
    with pytest.raises(ArgumentError, match=r"'src' sends rows 2 and 3 to row 2 of output 'y'"):
        exe(check=True, **args(good, [0, 1, 2, 2, 4, 5, 6, 7, 8, 9]))
    with pytest.raises(ArgumentError, match=r"idx\[3\] = 1073741824"):
        exe.prepare(**args(far, good))  # the host reads the indices
