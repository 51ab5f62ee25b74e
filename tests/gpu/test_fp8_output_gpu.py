"""On a Hopper GPU: FP8 outputs quantized in the GEMM's epilogue.

- Against the float64 rule (the reference's result rounded to bf16 and quantized per row
  and 128 columns), on ragged segments of 0, 1, 127 and 129 rows, outputs and scales
  poisoned first: every written scale close to the reference's, the values within FP8's
  rounding of the exact result, and what no leaf writes left as it was.
- Bit for bit against the same GEMM with a BF16 output followed by the quantize pass: the
  pass's float32 rule on the CPU (itself bit exact with the pass, see
  test_quantize_gpu.py), and the quantize pass on the device.
- The expert FFN example end to end against the reference.

Skipped without a Hopper GPU (conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.codegen.emit import with_kernel_config
from gemmspec.reference.data import (
    NUMPY_TYPES,
    Runtime,
    dim_size,
    expand_scales,
    quantize,
    quantize_values,
    random_inputs,
    random_runtime,
    scale_grid_shape,
)
from gemmspec.reference.direct import run_direct, statement_result
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.verify import GuardedBuffer, run_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import assert_close_elementwise  # noqa: E402

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SPEC = """
gemm {name} {{
  dim T, S
  dim N = 384, F = 384, NU = 768, K = 300, M = 130
  group expert[E = 4] = ragged(T, offsets = offs)
  group batch[B = 4] = masked(M, counts = counts)
  tensor idx : i32 [T]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor xb : bf16 [T, K]
  tensor xm : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wu : e4m3 [E, NU, K] scale f32 [1, 128, 128]
  tensor wb : bf16 [E, N, K]
  tensor wbu : bf16 [E, NU, K]
  tensor wm : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor alpha : f32 [E]
  tensor rw : f32 [T]
  tensor bias : bf16 [E, N]
  {output}
  {statement}
}}
"""


def _swiglu(a: str, w: str, pre: str = "") -> str:
    return (
        f"y[t, j] = {pre}silu(sum[k] {a} * {w}[expert(t), 2*j, k]) * sum[k] {a} * {w}[expert(t), 2*j + 1, k]"
    )


# id -> (output shape, statement, output type, pow2)
CASES = {
    "e4m3": ("[T, N]", "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", "e4m3", False),
    "e5m2_pow2": ("[T, N]", "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", "e5m2", True),
    "epilogue": (
        "[T, N]",
        "y[t, n] = alpha[expert(t)] * rw[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]",
        "e4m3", False,
    ),
    "swiglu_halves": ("[T, F]", _swiglu("x[t, k]", "wu"), "e4m3", False),
    "swiglu_gather_row_pow2": ("[T, F]", _swiglu("xs[idx[t], k]", "wu", "rw[t] * "), "e4m3", True),
    "bf16_operands": ("[T, N]", "y[t, n] = sum[k] xb[t, k] * wb[expert(t), n, k]", "e4m3", False),
    "bf16_swiglu": ("[T, F]", _swiglu("xb[t, k]", "wbu"), "e4m3", False),
    "masked_3d": ("[B, M, N]", "y[b, m, n] = sum[k] xm[b, m, k] * wm[b, n, k]", "e4m3", False),
}


def spec_text(case: str, out: str | None = None) -> str:
    """The case with an FP8 output, or (out='bf16') the same statement into BF16."""
    shape, statement, dtype, pow2 = CASES[case]
    block = "[1, 1, 128]" if shape.count(",") == 2 else "[1, 128]"
    if out == "bf16":
        output = f"tensor y : bf16 {shape}"
    else:
        output = f"tensor y : {dtype} {shape} scale f32 {block}{' pow2' if pow2 else ''}"
    return SPEC.format(name=f"fp8out_{case}_{out or dtype}", output=output, statement=statement)


def problem(spec, seed: int):
    rng = np.random.default_rng(seed)
    lengths = {"expert": RAGGED, "batch": [0, 1, 127, 129]}
    rt = random_runtime(spec, rng, lengths=lengths)
    return rt, random_inputs(spec, rt, rng)


def _upload(values: np.ndarray, dtype: str, keep: list):
    host = np.ascontiguousarray(values.astype(np.int32 if dtype == "i32" else NUMPY_TYPES[dtype]))
    buf = DeviceBuffer.from_numpy(host.view(np.uint8) if host.size else np.zeros(16, np.uint8))
    keep.append(buf)
    return buf.view(values.shape, dtype)


def _inputs(spec, rt: Runtime, data) -> dict[str, tuple[np.ndarray, str]]:
    out = {}
    for name, d in data.items():
        t = spec.tensor(name)
        out[name] = (d.values, t.dtype)
        if d.scale_grid is not None:
            out[t.scale.name] = (d.scale_grid, "f32")
    for name, v in rt.tensors.items():
        out[name] = (v, "i32")
    return out


def run(exe, rt: Runtime, data) -> tuple[np.ndarray, np.ndarray | None]:
    """One call with y (and its scales) poisoned with NaN first, each between guard bytes
    that must come back unchanged: y's raw bits (uint8 for FP8, uint16 for bf16) and the
    scales (float32), as the device left them."""
    spec = exe.spec
    y = spec.tensor("y")
    shape = tuple(dim_size(spec, rt, d) for d in y.dims)
    keep: list = []
    args = {name: _upload(v, dtype, keep) for name, (v, dtype) in _inputs(spec, rt, data).items()}
    args = {n: a for n, a in args.items() if n in exe.argument_names()}
    y_buf = GuardedBuffer(np.full(shape, np.nan).astype(NUMPY_TYPES[y.dtype]))
    args["y"] = y_buf.view(shape, y.dtype)
    s_buf = None
    if y.scale is not None:
        grid = scale_grid_shape(spec, rt, y)
        s_buf = GuardedBuffer(np.full(grid, np.nan, np.float32))
        args[y.scale.name] = s_buf.view(grid, "f32")
    exe(**args)
    for name, buf in (("y", y_buf), ("y_scale", s_buf)):
        assert buf is None or buf.changed_outside().size == 0, f"{name}: a guard byte changed"
    bits = np.uint8 if y.dtype in ("e4m3", "e5m2") else np.uint16
    values = y_buf.to_numpy(shape, NUMPY_TYPES[y.dtype]).view(bits)
    scales = s_buf.to_numpy(scale_grid_shape(spec, rt, y), np.float32) if s_buf is not None else None
    return values, scales


def as_values(bits: np.ndarray, dtype: str) -> np.ndarray:
    return bits.view(NUMPY_TYPES[dtype]).astype(np.float64)


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_output_matches_the_float64_rule(case):
    exe = gemmspec.build(spec_text(case))
    spec = exe.spec
    y = spec.tensor("y")
    for seed in (1, 2):
        rt, data = problem(spec, seed)
        bits, scales = run(exe, rt, data)
        got = as_values(bits, y.dtype)
        shape = got.shape
        ref = run_direct(spec, rt, data, {"y": np.full(shape, np.nan)})
        exact, written = statement_result(spec, rt, spec.gemms[0], data, shape)
        rows = ~np.isnan(ref["y_scale"])
        # Poisoned: scales and values written exactly where the reference writes them.
        assert np.array_equal(~np.isnan(scales), rows), "scales written where no leaf is, or missing"
        assert np.array_equal(~np.isnan(got), written), "values written where no leaf is, or missing"
        # Scales: from the bf16-rounded amax, one bf16 step at most from the reference's.
        ratio = scales[rows] / ref["y_scale"][rows]
        if y.scale.pow2:
            assert set(np.unique(ratio)) <= {0.5, 1.0, 2.0} and (ratio != 1.0).mean() <= 0.01
        else:
            assert np.abs(ratio - 1.0).max() <= 2.0**-7, np.abs(ratio - 1.0).max()
        # Values: within FP8's rounding of the exact result, as close as the reference's own.
        deq = got * expand_scales(spec, rt, y, np.where(rows, scales, 0.0))
        deq_ref = ref["y"] * expand_scales(spec, rt, y, np.where(rows, ref["y_scale"], 0.0))
        norm = np.linalg.norm(exact[written])
        err = np.linalg.norm(deq[written] - exact[written]) / norm
        err_ref = np.linalg.norm(deq_ref[written] - exact[written]) / norm
        print(f"{case} seed {seed}: error {err:.3e} (reference's own {err_ref:.3e})")
        assert err <= 1.25 * err_ref + 1e-3
        assert np.linalg.norm(deq[written] - deq_ref[written]) / norm < 3e-2
        assert (deq[written] != deq_ref[written]).mean() < 0.05
        # Element by element: within one FP8 step of the reference's value and of the exact
        # result; what no leaf writes keeps the poison's very bytes.
        poison = np.full(shape, np.nan).astype(NUMPY_TYPES[y.dtype])
        assert_close_elementwise(deq, np.where(written, deq_ref, np.nan), dtype=y.dtype, name=f"{case} seed {seed}",
                                 got_raw=bits, before=poison)
        assert_close_elementwise(deq, np.where(written, exact, np.nan), dtype=y.dtype,
                                 name=f"{case} seed {seed} against the exact result")


@pytest.mark.parametrize("case", sorted(CASES))
def test_fused_equals_bf16_output_then_quantize(case):
    fused = gemmspec.build(spec_text(case))
    wide = gemmspec.build(spec_text(case, out="bf16"))
    cfg = fused.program.launches[0].gemm
    # The same tile, so that both kernels accumulate the same way (a BF16-output SwiGLU of
    # 256 FP8 columns runs the two wgmma halves too).
    wide.program = with_kernel_config(wide.spec, wide.program, tile_m=cfg.tile_m, tile_n=cfg.tile_n)
    assert wide.program.launches[0].gemm.mma_parts == cfg.mma_parts
    spec = fused.spec
    y = spec.tensor("y")
    rt, data = problem(spec, 7)
    q_bits, scales = run(fused, rt, data)
    b_bits, _ = run(wide, rt, data)
    rows = ~np.isnan(scales)
    written = ~np.isnan(as_values(b_bits, "bf16"))
    assert written.any()
    # The quantize pass's float32 rule on the BF16 result.
    q, grid = quantize_values(spec, rt, np.where(written, as_values(b_bits, "bf16"), 0.0), y)
    want = np.asarray(q).astype(NUMPY_TYPES[y.dtype]).view(np.uint8)
    differ = int((q_bits[written] != want[written]).sum())
    assert differ == 0, f"{differ} of {int(written.sum())} FP8 values differ from bf16 + quantize"
    assert np.array_equal(scales[rows].view(np.uint32), grid[rows].astype(np.float32).view(np.uint32))
    # The quantize pass itself on the device (2-D outputs): its output times its scales,
    # read through an identity GEMM, equals the fused values times the fused scales.
    if len(y.dims) == 2:
        z = quantize_pass_on_device(as_values(b_bits, "bf16"), y.dtype, y.scale.pow2, written)
        mine = (as_values(q_bits, y.dtype).astype(np.float32) * np.repeat(scales, 128, axis=1)).astype(np.float32)
        assert np.array_equal(z[written], mine[written])  # as values: the GEMM's 0 + (-0) is +0


QUANTIZE_PASS = """
gemm fp8out_quantize_pass_{dtype}_{n}{suffix} {{
  dim T
  dim C = {n}, D = {n}
  tensor yb  : bf16 [T, C]
  tensor yq  : {dtype} [T, C] scale f32 [1, 128] = quantize(yb{pow2})
  tensor eye : e4m3 [D, C] scale f32 [128, 128]
  tensor z   : f32 [T, D]
  z[t, d] = sum[c] yq[t, c] * eye[d, c]
}}
"""


def quantize_pass_on_device(values: np.ndarray, dtype: str, pow2: bool, written: np.ndarray) -> np.ndarray:
    """quantize(yb) (with pow2) by the pre-pass, then z = yq times an identity with unit
    scales: each z is exactly the float32 product of one FP8 value and its block's scale."""
    t, n = values.shape
    exe = gemmspec.build(
        QUANTIZE_PASS.format(dtype=dtype, n=n, suffix="_pow2" if pow2 else "", pow2=", pow2" if pow2 else "")
    )
    keep: list = []
    z_buf = GuardedBuffer(np.full((t, n), np.nan, np.float32))
    args = {
        "yb": _upload(np.where(written, values, 0.0), "bf16", keep),
        "eye": _upload(np.eye(n), "e4m3", keep),
        "eye_scale": _upload(np.ones((n // 128, n // 128)), "f32", keep),
        "z": z_buf.view((t, n), "f32"),
    }
    exe(**args)
    assert z_buf.changed_outside().size == 0, "z: a guard byte changed"
    return z_buf.to_numpy((t, n), np.float32)


def test_the_expert_ffn_example_end_to_end():
    exe = gemmspec.build(EXAMPLES / "moe_ffn_fp8.gspec")
    lengths = {"expert": [*RAGGED, 4097, 300, 1000, 512]}
    # h (FP8, its scales written by the up-projection) against the float64 rule; y against
    # the reference run on h as the GPU wrote it.
    report = run_random(exe, dims={"S": 6200}, lengths=lengths, seed=3, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
    assert {c.tensor for c in report.checks} == {"h", "y"}


def test_scales_of_rows_past_a_capacity_stay_untouched():
    text = spec_text("e4m3").replace("ragged(T, offsets = offs)", "ragged(T, offsets = offs, capacity)")
    exe = gemmspec.build(text)
    spec = exe.spec
    rng = np.random.default_rng(11)
    rt = random_runtime(spec, rng, lengths={"expert": RAGGED, "batch": [0, 1, 127, 129]})
    used = int(rt.tensors["offs"][-1])
    rt.dims["T"] = used + 40  # 40 rows past the offsets' end: neither read nor written
    data = random_inputs(spec, rt, rng)
    bits, scales = run(exe, rt, data)
    assert np.isnan(scales[used:]).all() and (bits[used:] == 0x7F).all()
    assert not np.isnan(scales[:used]).any()


def test_quantized_values_round_trip_to_the_bf16_result_scale():
    # A block whose largest value is the FP8 maximum times its scale: the largest element
    # maps onto +-FP8 max exactly, as the quantize pass maps it.
    exe = gemmspec.build(spec_text("bf16_operands"))
    spec = exe.spec
    rt, data = problem(spec, 5)
    bits, scales = run(exe, rt, data)
    got = as_values(bits, "e4m3")
    rows = ~np.isnan(scales)
    blocks = np.abs(got).reshape(*scales.shape, 128).max(axis=-1)
    assert rows.any() and (blocks[rows] == 448.0).all()
    assert quantize(np.array([448.0]), "e4m3")[0] == 448.0
