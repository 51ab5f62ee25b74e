"""On a Hopper GPU: `T = copy(D)`, the segment-major 128x1 copy of an FP8 output written in
the same epilogue.

- Bit for bit against the same GEMM with a BF16 output followed by the quantize rule into
  the copy's layout and [128, 1] blocks per segment (the float32 rule of the quantize
  pass, itself bit exact with the pass on the device, see test_quantize_gpu.py): values
  and scales, on ragged segments of 0, 1, 127, 129 and 300 rows, every output poisoned
  first (NaN, FP8 bytes 0xFF), the padding rows of the copy left as they were, scale rows
  past the counted ones (a fresh output is sized for the most) left as they were.
- The FFN up-projection (SwiGLU over interleaved rows, gathered tokens, a router weight,
  two 128-column halves), a plain M-grouped FP8 GEMM, power-of-two scales, e5m2.
- The training example end to end against the float64 reference.

Skipped without a Hopper GPU (conftest.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.codegen.emit import with_kernel_config
from gemmspec.reference.data import (
    NUMPY_TYPES,
    Runtime,
    dim_size,
    element_offsets,
    quantize_values,
    random_inputs,
    random_runtime,
    scale_grid_shape,
    scale_offsets,
    storage_elements,
)
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.verify import GuardedBuffer, run_random

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129, 300]
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

SPEC = """
gemm {name} {{
  dim T, S
  dim N = 384, F = 384, NU = 768, K = 300
  group expert[E = 5] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wu : e4m3 [E, NU, K] scale f32 [1, 128, 128]
  tensor rw : f32 [T]
  {output}
  {statement}
}}
"""
SWIGLU = "y[t, j] = rw[t] * silu(sum[k] xs[idx[t], k] * wu[expert(t), 2*j, k]) * sum[k] xs[idx[t], k] * wu[expert(t), 2*j + 1, k]"
PLAIN = "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]"
# id -> (columns, statement, FP8 type, pad, pow2)
CASES = {
    "ffn_up_pad16": ("F", SWIGLU, "e4m3", 16, False),
    "ffn_up_pow2": ("F", SWIGLU, "e4m3", 16, True),
    "plain_unpadded": ("N", PLAIN, "e4m3", 1, False),
    "plain_pad8_e5m2_pow2": ("N", PLAIN, "e5m2", 8, True),
}


def spec_text(case: str, out: str | None = None) -> str:
    cols, statement, dtype, pad, pow2 = CASES[case]
    if out == "bf16":
        output = f"tensor y : bf16 [T, {cols}]"
    else:
        output = (
            f"tensor y : {dtype} [T, {cols}] scale f32 [1, 128]\n"
            f"  tensor y_t : {dtype} [T, {cols}] layout segment_major(expert)"
            f"{f' pad {pad}' if pad > 1 else ''} scale f32 [128, 1] per expert{' pow2' if pow2 else ''} = copy(y)"
        )
    return SPEC.format(name=f"fp8copy_{case}_{out or dtype}", output=output, statement=statement)


def problem(spec, seed: int):
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths={"expert": RAGGED})
    return rt, random_inputs(spec, rt, rng)


def _upload_bytes(host: np.ndarray, keep: list) -> DeviceBuffer:
    buf = DeviceBuffer.from_numpy(np.ascontiguousarray(host).view(np.uint8) if host.size else np.zeros(16, np.uint8))
    keep.append(buf)
    return buf


def _upload(values: np.ndarray, dtype: str, keep: list):
    host = values.astype(np.int32 if dtype == "i32" else NUMPY_TYPES[dtype])
    return _upload_bytes(host, keep).view(values.shape, dtype)


def _outputs(keep: list, **storage: np.ndarray) -> dict[str, GuardedBuffer]:
    """Each output's storage between guard bytes (kept alive in `keep`)."""
    bufs = {name: GuardedBuffer(values) for name, values in storage.items()}
    keep.extend(bufs.values())
    return bufs


def _guards_kept(bufs: dict[str, GuardedBuffer]) -> None:
    for name, buf in bufs.items():
        assert buf.changed_outside().size == 0, f"{name}: a guard byte changed"


def run(exe, rt: Runtime, data, scale_rows_extra: int = 0):
    """One call with every output poisoned: y and the scales NaN, the copy's bytes 0xFF
    (padding included), each between guard bytes that must come back unchanged. Returns
    the raw bits and scales as the device left them: y's values (uint8), y's scales, the
    copy's whole storage (uint8) and its scale buffer, `scale_rows_extra` rows longer
    than the segments need."""
    spec = exe.spec
    keep: list = []
    args = {}
    for name, d in data.items():
        t = spec.tensor(name)
        args[name] = _upload(d.values, t.dtype, keep)
        if d.scale_grid is not None:
            args[t.scale.name] = _upload(d.scale_grid, "f32", keep)
    for name, v in rt.tensors.items():
        args[name] = _upload(v, "i32", keep)
    y, y_t = spec.tensor("y"), spec.tensor("y_t")
    shape = tuple(dim_size(spec, rt, d) for d in y.dims)
    store = storage_elements(spec, rt, y_t)
    grid = scale_grid_shape(spec, rt, y_t)
    grid = (grid[0] + scale_rows_extra, grid[1])
    bufs = _outputs(
        keep,
        y=np.full(shape, np.nan).astype(NUMPY_TYPES[y.dtype]),
        y_scale=np.full(scale_grid_shape(spec, rt, y), np.nan, np.float32),
        y_t=np.full(store, 0xFF, np.uint8),
        y_t_scale=np.full(grid, np.nan, np.float32),
    )
    y_buf, ys_buf, c_buf, cs_buf = bufs.values()
    args["y"] = y_buf.view(shape, y.dtype)
    args["y_scale"] = ys_buf.view(scale_grid_shape(spec, rt, y), "f32")
    args["y_t"] = c_buf.view(y_t.layout.storage_shape(shape), y_t.dtype)
    args["y_t_scale"] = cs_buf.view(grid, "f32")
    args = {n: a for n, a in args.items() if n in exe.argument_names()}
    exe(**args)
    _guards_kept(bufs)
    return (
        y_buf.to_numpy(shape, np.uint8),
        ys_buf.to_numpy(scale_grid_shape(spec, rt, y), np.float32),
        c_buf.to_numpy((store,), np.uint8) if store else np.zeros(0, np.uint8),
        cs_buf.to_numpy(grid, np.float32),
    )


def run_bf16(exe, rt: Runtime, data) -> np.ndarray:
    spec = exe.spec
    keep: list = []
    args = {}
    for name, d in data.items():
        t = spec.tensor(name)
        args[name] = _upload(d.values, t.dtype, keep)
        if d.scale_grid is not None:
            args[t.scale.name] = _upload(d.scale_grid, "f32", keep)
    for name, v in rt.tensors.items():
        args[name] = _upload(v, "i32", keep)
    y = spec.tensor("y")
    shape = tuple(dim_size(spec, rt, d) for d in y.dims)
    bufs = _outputs(keep, y=np.full(shape, np.nan).astype(NUMPY_TYPES["bf16"]))
    args["y"] = bufs["y"].view(shape, "bf16")
    args = {n: a for n, a in args.items() if n in exe.argument_names()}
    exe(**args)
    _guards_kept(bufs)
    return bufs["y"].to_numpy(shape, NUMPY_TYPES["bf16"]).astype(np.float64)


@pytest.mark.parametrize("spare", [False, True], ids=["exact-scale-rows", "most-scale-rows"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_copy_equals_bf16_output_then_quantize(case, spare):
    fused = gemmspec.build(spec_text(case))
    wide = gemmspec.build(spec_text(case, out="bf16"))
    cfg = fused.program.launches[0].gemm
    assert cfg.copy and cfg.tile_m == 128
    # The same tile, so that both kernels accumulate the same way.
    wide.program = with_kernel_config(wide.spec, wide.program, tile_m=cfg.tile_m, tile_n=cfg.tile_n)
    spec = fused.spec
    y, y_t = spec.tensor("y"), spec.tensor("y_t")
    for seed in (3, 4):
        rt, data = problem(spec, seed)
        wide_data = {n: d for n, d in data.items() if n in {t.name for t in wide.spec.tensors}}
        b = run_bf16(wide, rt, wide_data)
        assert not np.isnan(b).any(), "the BF16 GEMM writes every row"
        # Exactly the counted scale rows, or the most any counts need (a fresh output's).
        t_rows = dim_size(spec, rt, "T")
        extra = (t_rows + len(RAGGED) * 127) // 128 - scale_grid_shape(spec, rt, y_t)[0] if spare else 0
        y_bits, y_scales, c_bits, c_scales = run(fused, rt, data, extra)
        # D itself, as before: the quantize rule per row and 128 columns.
        q, grid = quantize_values(spec, rt, b, y)
        assert np.array_equal(y_bits, np.asarray(q).astype(NUMPY_TYPES[y.dtype]).view(np.uint8))
        assert np.array_equal(y_scales.view(np.uint32), grid.astype(np.float32).view(np.uint32))
        # The copy: the quantize rule with [128, 1] blocks per segment, at its own layout.
        qc, gridc = quantize_values(spec, rt, b, y_t)
        want = np.asarray(qc).astype(NUMPY_TYPES[y_t.dtype]).view(np.uint8)
        offsets = element_offsets(spec, rt, y_t)
        got = c_bits[offsets]
        differ = int((got != want).sum())
        assert differ == 0, f"{differ} of {got.size} copy values differ from bf16 + quantize"
        rows = gridc.shape[0]
        assert np.array_equal(c_scales[:rows].view(np.uint32), gridc.astype(np.float32).view(np.uint32))
        assert np.isnan(c_scales[rows:]).all(), "scale rows past the segments' were written"
        # The padding rows of every segment: never written.
        used = np.zeros(c_bits.size, dtype=bool)
        used[offsets.ravel()] = True
        assert (c_bits[~used] == 0xFF).all(), "the copy's padding was written"
        assert int(scale_offsets(spec, rt, y_t).max(initial=-1)) + 1 == rows * dim_size(spec, rt, y_t.dims[1])
        if y_t.scale.pow2:
            finite = gridc[gridc > 0]
            assert np.array_equal(np.frexp(finite)[0], np.full(finite.shape, 0.5))


def test_the_training_example_end_to_end():
    exe = gemmspec.build(EXAMPLES / "moe_ffn_fp8_train.gspec")
    lengths = {"expert": [*RAGGED, 4097, 1000, 512]}
    # h and h_t against the float64 rule; y against the reference run on h as the GPU wrote it.
    report = run_random(exe, dims={"S": 6200}, lengths=lengths, seed=5, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
    assert {c.tensor for c in report.checks} == {"h", "h_t", "y"}


def test_a_fresh_output_from_torch_has_room_for_the_scale_rows():
    torch = pytest.importorskip("torch")
    import gemmspec.torch as gtorch

    op = gtorch.op(gemmspec.build(spec_text("plain_unpadded")))
    spec = op.exe.spec
    rt, data = problem(spec, 9)
    t = int(dim_size(spec, rt, "T"))
    inputs = {}
    for name, d in data.items():
        tt = spec.tensor(name)
        inputs[name] = torch.tensor(d.values.astype(np.float32)).to("cuda").to(
            {"e4m3": torch.float8_e4m3fn, "f32": torch.float32, "bf16": torch.bfloat16, "i32": torch.int32}[tt.dtype]
        )
        if d.scale_grid is not None:
            inputs[tt.scale.name] = torch.tensor(d.scale_grid.astype(np.float32), device="cuda")
    for name, v in rt.tensors.items():
        inputs[name] = torch.tensor(v.astype(np.int32), device="cuda")
    outs = dict(zip(op.outputs, op(**{n: inputs[n] for n in op.inputs})))
    assert tuple(outs["y_t"].shape) == (t, 384)
    assert tuple(outs["y_t_scale"].shape) == ((t + 5 * 127) // 128, 384)
