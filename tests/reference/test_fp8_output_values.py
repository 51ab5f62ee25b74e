"""FP8 outputs on the CPU: the reference's FP8 output is, bit for bit, the same statement
with a BF16 output followed by the quantize pass's rule (values and scales); the flat
schedule executor agrees with the direct semantics; its row quantizer agrees with the
quantize pass's reference on awkward values."""

from __future__ import annotations

from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import (
    Runtime,
    TensorData,
    dim_size,
    quantize,
    quantize_rows,
    quantize_values,
    random_inputs,
    random_runtime,
)
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

EDGE = [0, 1, 127, 129]

SPEC = """
gemm g {{
  dim T, S
  dim N = 256, F = 256, K = 300, M = 130, NU = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  group batch[B = 3] = masked(M, counts = counts)
  tensor idx : i32 [T]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor xb : bf16 [T, K]
  tensor xm : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wu : e4m3 [E, NU, K] scale f32 [1, 128, 128]
  tensor wb : bf16 [E, N, K]
  tensor wm : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor rw : f32 [T]
  tensor bias : bf16 [E, N]
  {output}
  {statement}
}}
"""

# name -> (output declaration with {t} for its type and {s} for its scale, statement)
CASES = {
    "plain": ("tensor y : {t} [T, N]{s}", "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]"),
    "epilogue": (
        "tensor y : {t} [T, N]{s}",
        "y[t, n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]",
    ),
    "swiglu": (
        "tensor y : {t} [T, F]{s}",
        "y[t, j] = rw[t] * silu(sum[k] x[t, k] * wu[expert(t), 2*j, k]) * sum[k] x[t, k] * wu[expert(t), 2*j + 1, k]",
    ),
    "gathered": ("tensor y : {t} [T, N]{s}", "y[t, n] = sum[k] xs[idx[t], k] * w[expert(t), n, k]"),
    "bf16-operands": ("tensor y : {t} [T, N]{s}", "y[t, n] = sum[k] xb[t, k] * wb[expert(t), n, k]"),
    # Rows past each batch entry's count are not written: values and scales keep theirs.
    "masked": ("tensor y : {t} [B, M, N]{s3}", "y[b, m, n] = sum[k] xm[b, m, k] * wm[b, n, k]"),
}


def spec_text(case: str, out_type: str, pow2: bool = False) -> str:
    output, statement = CASES[case]
    scale = " scale f32 [1, 128]" + (" pow2" if pow2 else "") if out_type != "bf16" else ""
    scale3 = " scale f32 [1, 1, 128]" + (" pow2" if pow2 else "") if out_type != "bf16" else ""
    return SPEC.format(output=output.format(t=out_type, s=scale, s3=scale3), statement=statement)


def lowered(case: str, out_type: str, pow2: bool = False):
    (x,) = lower_file(spec_text(case, out_type, pow2))
    return x


def problem(x, seed: int):
    rng = np.random.default_rng(seed)
    spec = x.spec
    lengths = {"expert": EDGE} if any(g.name == "expert" for g in spec.groups) else None
    rt = random_runtime(spec, rng, lengths=lengths)
    if "counts" in rt.tensors:
        rt.tensors["counts"] = np.array([0, 129, 130], dtype=np.int32)
    data = random_inputs(spec, rt, rng)
    return rt, data


def poisoned(spec, rt: Runtime, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The output's starting values: FP8 values (rows a statement leaves alone keep them)."""
    y = spec.tensor("y")
    shape = tuple(dim_size(spec, rt, d) for d in y.dims)
    return {"y": quantize(rng.uniform(-400, 400, size=shape), "e4m3")}


@pytest.mark.parametrize("pow2", [False, True], ids=["amax-scales", "pow2-scales"])
@pytest.mark.parametrize("out_type", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_output_is_the_bf16_output_then_quantize(case, out_type, pow2):
    fp8, bf16 = lowered(case, out_type, pow2), lowered(case, "bf16")
    for seed in range(2):
        rt, data = problem(fp8, seed)
        nan = {"y": np.full(poisoned(fp8.spec, rt, np.random.default_rng(0))["y"].shape, np.nan)}
        got = run_direct(fp8.spec, rt, data, nan)
        # The same statement into BF16, then quantize(SOURCE) with the FP8 output's blocks.
        wide = run_direct(bf16.spec, rt, data, nan)["y"]
        y = fp8.spec.tensor("y")
        written = ~np.isnan(wide)
        q, grid = quantize_values(fp8.spec, rt, quantize(np.where(written, wide, 0.0), "bf16"), y)
        rows = written.reshape(-1, written.shape[-1]).all(axis=-1).reshape(written.shape[:-1])
        assert written.any() and np.array_equal(written, np.broadcast_to(rows[..., None], written.shape))
        assert np.array_equal(got["y"][written], q[written]), case
        assert np.array_equal(got["y_scale"][rows], grid[rows]), case
        # What a statement does not write stays as it was (poison here).
        assert np.isnan(got["y"][~written]).all() and np.isnan(got["y_scale"][~rows]).all()
        if pow2:
            finite = grid[rows][grid[rows] > 0]
            assert np.array_equal(np.frexp(finite)[0], np.full(finite.shape, 0.5))


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_schedule_writes_what_the_spec_says(case):
    x = lowered(case, "e4m3")
    for seed in range(3):
        rt, data = problem(x, seed)
        init = poisoned(x.spec, rt, np.random.default_rng(seed))
        init["y_scale"] = np.full(
            (*init["y"].shape[:-1], init["y"].shape[-1] // 128), 7.0
        )  # unwritten scales keep this
        direct = run_direct(x.spec, rt, data, init)
        flat = run_schedule(x.spec, rt, x.schedule, data, init)
        assert sorted(direct) == sorted(flat) == ["y", "y_scale"]
        assert np.array_equal(direct["y"], flat["y"], equal_nan=True), case
        assert np.array_equal(direct["y_scale"], flat["y_scale"], equal_nan=True), case
        if case == "masked":  # rows past the counts keep their values and scales
            assert (direct["y_scale"][0] == 7.0).all() and np.array_equal(direct["y"][0], init["y"][0])
            assert (direct["y_scale"][1, 129] == 7.0).all() and (direct["y_scale"][2] != 7.0).all()


# The expert FFN of examples/moe_ffn_fp8.gspec at a small size.
FFN = (Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8.gspec").read_text().replace(
    "dim H = 7168, N = 4096, F = 2048", "dim H = 256, N = 512, F = 256"
)


def test_a_later_statement_reads_the_fp8_output_with_its_scales():
    (x,) = lower_file(FFN)
    spec = x.spec
    rng = np.random.default_rng(5)
    rt = random_runtime(spec, rng, lengths={"expert": [0, 1, 127, 129, 3, 0, 64, 2]})
    data = random_inputs(spec, rt, rng)
    t = dim_size(spec, rt, "T")
    init = {"y": np.full((t, 256), np.nan), "h": np.full((t, 256), np.nan)}
    got = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, x.schedule, data, init)
    assert np.array_equal(got["h"], flat["h"]) and np.array_equal(got["h_scale"], flat["h_scale"])
    assert close(flat["y"], got["y"])
    # The down-projection reads h dequantized with h_scale, not the unrounded result.
    h_real = got["h"] * np.repeat(got["h_scale"], 128, axis=1)
    dst = data["dst"].values.astype(int)
    offs = rt.tensors["expert_offsets"]
    w_down = data["w_down"].values * np.repeat(np.repeat(data["w_down"].scale_grid, 128, 1), 128, 2)
    want = np.full_like(init["y"], np.nan)
    for e in range(8):
        rows = np.arange(offs[e], offs[e + 1])
        want[dst[rows]] = data["route_w"].values[rows, None] * (h_real[rows] @ w_down[e].T)
    # y is bf16: the reference stores it rounded, as the kernel does.
    assert close(got["y"], quantize(want, "bf16"))


def close(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal up to float64 summation order (relative to the whole result), NaN where NaN."""
    return np.array_equal(np.isnan(a), np.isnan(b)) and np.linalg.norm(np.nan_to_num(a - b)) <= 1e-12 * np.linalg.norm(np.nan_to_num(b))


def _quantize_pass(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """The quantize pass's documented numpy rule, one [1, 128] block at a time."""
    fp8 = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2}[dtype]
    top = np.float32({"e4m3": 448, "e5m2": 57344}[dtype])
    q = np.zeros(x.shape)
    scales = np.zeros((x.shape[0], x.shape[1] // 128), dtype=np.float32)
    for r in range(x.shape[0]):
        for b in range(x.shape[1] // 128):
            block = x[r, 128 * b : 128 * (b + 1)].astype(np.float32)
            amax = np.float32(np.nanmax(np.abs(block), initial=0))
            scale = amax / top
            scale = scale if scale > 0 else np.float32(1)
            with np.errstate(invalid="ignore", divide="ignore"):
                q[r, 128 * b : 128 * (b + 1)] = np.clip(block / scale, -top, top).astype(fp8).astype(np.float64)
            scales[r, b] = scale
    return q, scales


@pytest.mark.parametrize("dtype", ["e4m3", "e5m2"])
def test_the_row_quantizer_is_the_quantize_pass_on_bf16_values(dtype):
    rng = np.random.default_rng(1)
    values = rng.standard_normal((6, 384)) * 10.0 ** rng.uniform(-30, 30, size=(6, 1))
    values[0, :128] = 0.0  # an all-zero block: scale 1
    values[1, 5] = np.nan  # NaN ignored by amax, stays NaN
    values[2, 130] = 1e38  # saturates bf16? no: bf16 holds it; the block's scale follows it
    values[3, 300] = np.inf  # amax inf: scale inf, finite values 0, the inf NaN
    values[4, :] = 2.0 ** -140  # subnormal-sized values
    q, scales = quantize_rows(values, dtype)
    want_q, want_s = _quantize_pass(quantize(values, "bf16"), dtype)
    assert np.array_equal(scales, want_s)
    assert np.array_equal(q, want_q, equal_nan=True)
    assert scales[0, 0] == 1.0 and np.isnan(q[1, 5]) and np.isinf(scales[3, 2])


def test_the_row_quantizer_agrees_with_quantize_values_on_pow2():
    (x,) = lower_file(spec_text("plain", "e4m3", pow2=True))
    rng = np.random.default_rng(2)
    values = rng.standard_normal((5, 256)) * 10.0 ** rng.uniform(-30, 30, size=(5, 1))
    rt = Runtime({"T": 5, "S": 1})
    q, grid = quantize_values(x.spec, rt, quantize(values, "bf16"), x.spec.tensor("y"))
    q2, scales = quantize_rows(values, "e4m3", pow2=True)
    assert np.array_equal(grid, scales) and np.array_equal(q, q2, equal_nan=True)


def test_tensor_data_keeps_the_written_scales():
    x = lowered("plain", "e4m3")
    rt, data = problem(x, 0)
    got = run_direct(x.spec, rt, data, {"y": np.full((dim_size(x.spec, rt, "T"), 256), np.nan)})
    d = TensorData(got["y"], got["y_scale"])
    assert d.scale_grid.shape == (dim_size(x.spec, rt, "T"), 2)


def test_statements_reading_an_fp8_output_may_take_it_as_given():
    # run_direct(given=...) checks a reader against the FP8 values a device wrote: the
    # statement writing h is skipped, h and its scales are the given ones.
    (x,) = lower_file(FFN)
    spec = x.spec
    rng = np.random.default_rng(6)
    rt = random_runtime(spec, rng, lengths={"expert": [3, 0, 129, 1, 127, 2, 0, 5]})
    data = random_inputs(spec, rt, rng)
    t = dim_size(spec, rt, "T")
    init = {"y": np.full((t, 256), np.nan), "h": np.full((t, 256), np.nan)}
    plain = run_direct(spec, rt, data, init)
    h = quantize(rng.uniform(-448, 448, size=(t, 256)), "e4m3")
    h_scale = np.full((t, 2), 0.5)
    got = run_direct(spec, rt, data, init, given={"h": TensorData(h, h_scale)})
    assert np.array_equal(got["h"], h) and np.array_equal(got["h_scale"], h_scale)
    again = run_direct(spec, rt, data, init, given={"h": TensorData(plain["h"], plain["h_scale"])})
    assert np.array_equal(again["y"], plain["y"], equal_nan=True)
    assert not np.allclose(got["y"], plain["y"], equal_nan=True)
