"""On a Hopper GPU: requantize(SOURCE, rows = IDX, weight = W), the requant kernel with its
rows read through an index and weighted, bit for bit against the reference (float32, as
the kernel computes it) on expert counts 0, 1, 127, 129 with indices outside the source;
its output and scales are NaN-poisoned first, and the padding of the padded segments and
the spare scale rows must stay NaN. Then the derived backward of
examples/moe_ffn_fp8_train.gspec's down projection (dh before and after the row weight,
dw_down, droute_w) against float64 gradients of the forward formula. Skipped elsewhere,
with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gemmspec
from gemmspec.build import build_backward
from gemmspec.reference.data import (
    Runtime,
    TensorData,
    element_offsets,
    quantize_real_values,
    requantize_rows_values,
    scale_grid_shape,
    scale_offsets,
)
from gemmspec.runtime.verify import GuardedBuffer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import assert_close_elementwise  # noqa: E402

pytestmark = pytest.mark.gpu

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec"
COUNTS = [0, 1, 127, 129]
E4M3_NAN = 0x7F  # every bit of the FP8 poison

SPEC = """\
gemm rows_weight {{
  dim T, S
  dim N = 264, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dst : i32 [T]
  tensor rw  : f32 [T]
  tensor dy  : e4m3 [{src_rows}, N] scale f32 [1, 128]
  tensor x_t : e4m3 [T, K] layout segment_major(expert){pad} scale f32 [128, 1] per expert
  tensor dy_q : e4m3 [T, N] layout segment_major(expert){pad} scale f32 [128, 1] per expert = requantize(dy{opts})
  tensor dw  : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_t[t, k]
}}
"""
FORMS = {
    "rows-weight-pad16": (", rows = dst, weight = rw", " pad 16"),
    "rows-weight": (", rows = dst, weight = rw", ""),
    "rows-pad16": (", rows = dst", " pad 16"),
    "weight-pad16": (", weight = rw", " pad 16"),
}


def _fp8_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


def run_prepass(p, arrays: dict, grid: tuple[int, int], params: list[str]) -> None:
    """Launch the emitted requant kernel of pre-pass `p` alone, on our own buffers."""
    from gemmspec.codegen.kernels import include_dir
    from gemmspec.runtime.launch import LoadedKernel
    from gemmspec.runtime.nvrtc import compile_cubin

    cubin = compile_cubin(p.source, name=p.kernel, include_dirs=[include_dir()])
    kernel = LoadedKernel(cubin, p.kernel)
    kernel.launch(grid, p.config.threads, 0, None, *[arrays[n] for n in params])


@pytest.mark.parametrize("counts", [COUNTS, COUNTS[::-1], [129, 0, 127, 1]], ids=["up", "down", "mixed"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_requant_rows_kernel_is_the_reference_bit_for_bit(form, counts):
    from gemmspec.runtime.arrays import DeviceBuffer

    opts, pad = FORMS[form]
    rows, weighted = "rows" in opts, "weight" in opts
    t = sum(counts)
    s_rows = 300 if rows else t
    exe = gemmspec.build(SPEC.format(opts=opts, pad=pad, src_rows="S" if rows else "T"))
    spec = exe.spec
    (p,) = [x for x in exe.program.prepasses if x.prepass.kind == "requantize"]
    assert (p.config.gather_rows, p.config.row_weight) == (rows, weighted)
    rng = np.random.default_rng(len(form) + counts[0])
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rt = Runtime({"T": t, "S": s_rows}, {"offs": offs.astype(np.int64)})
    q = rng.uniform(-448, 448, size=(s_rows, 264)).astype(ml_dtypes.float8_e4m3fn)
    sx = (2.0 ** rng.uniform(-6, 2, size=(s_rows, 3))).astype(np.float32)
    index = rng.integers(0, s_rows, size=t).astype(np.int32)
    if rows:
        index[::5] = np.where(np.arange(len(index[::5])) % 2, -2, s_rows + 3)  # zero rows
    weight = rng.standard_normal(t).astype(np.float32)
    src, dst = spec.tensor("dy"), spec.tensor("dy_q")
    want, want_grid = requantize_rows_values(
        spec, rt, src, TensorData(q.astype(np.float64), sx), dst,
        index if rows else None, weight if weighted else None,
    )
    y_off, s_off = element_offsets(spec, rt, dst), scale_offsets(spec, rt, dst)
    y_rows = t + dst.layout.pad_rows
    sy_rows = -(-t // 128) + len(counts)  # what the executor allocates: an upper bound
    keep = {
        "X": DeviceBuffer.from_numpy(q.view(np.uint8)),
        "SX": DeviceBuffer.from_numpy(sx),
        "offsets": DeviceBuffer.from_numpy(offs),
        "Y": DeviceBuffer.from_numpy(np.full((y_rows, 264), E4M3_NAN, np.uint8)),
        "SY": DeviceBuffer.from_numpy(np.full((sy_rows, 264), np.nan, np.float32)),
        "idx": DeviceBuffer.from_numpy(index),
        "W": DeviceBuffer.from_numpy(weight),
    }
    scalars = {
        "ldx": np.int64(264), "sx_st": np.int64(3), "sx_sc": np.int64(1), "G": np.int32(len(counts)),
        "T": np.int32(t), "C": np.int32(264), "S": np.int32(s_rows),
    }
    params = ["X", "ldx", "SX", "sx_st", "sx_sc", "offsets", "G", "T", "C", "Y", "SY"]
    params += (["idx", "S"] if rows else []) + (["W"] if weighted else [])
    run_prepass(p, keep | scalars, (sy_rows, 3), params)
    got = keep["Y"].to_numpy((y_rows, 264), np.uint8).reshape(-1)
    got_sy = keep["SY"].to_numpy((sy_rows, 264), np.float32).reshape(-1)
    want_bytes = _fp8_bytes(want)
    differ = got[y_off] != want_bytes
    assert not differ.any(), f"{int(differ.sum())} of {differ.size} values differ"
    assert np.array_equal(got_sy[s_off], want_grid), "scales differ"
    # Nothing else written: the padding rows and the spare scale rows keep their NaN.
    untouched = np.ones(got.size, bool)
    untouched[y_off.reshape(-1)] = False
    assert (got[untouched] == E4M3_NAN).all()
    spare = np.ones(got_sy.size, bool)
    spare[s_off.reshape(-1)] = False
    assert np.isnan(got_sy[spare]).all()
    if rows:
        outside = (index < 0) | (index >= s_rows)
        assert (want[outside] == 0).all() and outside.any()


def test_requant_rows_prepass_through_the_executable_feeds_the_wgrad():
    """The same pass planned and launched by the executor: the WGRAD over it matches the
    flat reference (run_random poisons the outputs)."""
    from gemmspec.runtime.verify import run_random

    exe = gemmspec.build(SPEC.format(opts=", rows = dst, weight = rw", pad=" pad 16", src_rows="S"))
    report = run_random(exe, lengths={"expert": COUNTS}, dims={"S": 300}, seed=7, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()


def test_an_index_outside_the_source_is_caught_and_never_followed():
    """The offsets check reads the requantize's index like a gathered row's: check=True
    raises; unchecked, the pass reads a zero row and nothing faults."""
    from gemmspec.errors import ArgumentError
    from gemmspec.runtime.arrays import DeviceBuffer

    exe = gemmspec.build(SPEC.format(opts=", rows = dst, weight = rw", pad=" pad 16", src_rows="S"))
    t, s = 40, 30
    counts = [0, 1, 39, 0]
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)

    def args(index):
        return {
            "dst": DeviceBuffer.from_numpy(np.array(index, np.int32)).view((t,), "i32"),
            "rw": DeviceBuffer.from_numpy(np.ones(t, np.float32)).view((t,), "f32"),
            "dy": DeviceBuffer.from_numpy(np.zeros((s, 264), np.uint8)).view((s, 264), "e4m3"),
            "dy_scale": DeviceBuffer.from_numpy(np.ones((s, 3), np.float32)).view((s, 3), "f32"),
            "x_t": DeviceBuffer.from_numpy(np.zeros((t + 60, 256), np.uint8)).view((t + 60, 256), "e4m3"),
            "x_t_scale": DeviceBuffer.from_numpy(np.ones((2, 256), np.float32)).view((2, 256), "f32"),
            "dw": DeviceBuffer(4 * 264 * 256 * 4).view((4, 264, 256), "f32"),
            "offs": DeviceBuffer.from_numpy(offs).view((5,), "i32"),
        }

    good = [i % s for i in range(t)]
    exe(check=True, **args(good))
    far = [*good[:7], 1 << 30, *good[8:]]  # a wild read if the pass followed it
    with pytest.raises(ArgumentError, match=r"'dst' holds a row number outside the S rows of 'dy'"):
        exe(check=True, **args(far))
    run = exe.prepare(check=False, **args(far))
    run.enqueue()
    run.synchronize()


# ---- the derived backward of the training FFN example --------------------------------------

# Against float64 of the real (unquantized) h, the FP8 rounding of what the kernels read
# is part of the difference: a few percent of every term, whose largest among many
# elements reaches a good part of the row's rms (an expert's weight gradient: of the
# expert's whole matrix, its terms being products of two rounded values). As in
# test_ffn_backward_gpu.py, beside each output's norm.
FP8_VS_UNQUANTIZED = {"rtol": 2.0**-3, "atol": 0.4}
WGRAD_FP8_VS_UNQUANTIZED = {"rtol": 2.0**-3, "atol": 1.0}


@pytest.mark.parametrize("gather", ["auto", "fused"])
@pytest.mark.parametrize("counts", [COUNTS * 2, [129, 127, 1, 0, 0, 129, 1, 127]], ids=["up", "down"])
def test_the_example_backward_matches_float64(counts, gather):
    """`auto`: as planned (at the example's sizes the DGRAD's dy rows are copied by the
    gather pre-pass); `fused`: gathered in the DGRAD's own loads."""
    from gemmspec.bench import with_directive
    from gemmspec.runtime.arrays import DeviceBuffer

    exe, bw = build_backward(gemmspec.build(EXAMPLE).spec)
    if gather != "auto":
        exe = gemmspec.build(with_directive(bw.source, f"gather({gather})"))
    if gather == "fused":
        assert exe.program.launches[0].gemm.gather
    spec = exe.spec
    rng = np.random.default_rng(sum(counts[:3]))
    t, e = sum(counts), len(counts)
    h_dim, f_dim = spec.dim("H").size, spec.dim("F").size
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    rt = Runtime({"T": t, "S": t}, {"expert_offsets": offs.astype(np.int64)})
    h = rng.standard_normal((t, f_dim))
    w_real = rng.standard_normal((e, h_dim, f_dim)) / 16
    dy_real = rng.standard_normal((t, h_dim))
    route_w = rng.uniform(0.1, 1.0, t).astype(np.float32)
    dst = rng.permutation(t).astype(np.int32)
    data = {}
    for name, real in (("dy", dy_real), ("w_down", w_real), ("h_t", h), ("h", h)):
        qv, grid = quantize_real_values(spec, rt, real, spec.tensor(name))
        data[name] = TensorData(qv, grid)

    keep = {}

    def upload(array: np.ndarray, shape, dtype, name: str):
        keep[name] = DeviceBuffer.from_numpy(np.ascontiguousarray(array))
        return keep[name].view(shape, dtype)

    def output(array: np.ndarray, shape, dtype, name: str):
        """An output, poisoned (`array`), between guard bytes."""
        keep[name] = GuardedBuffer(array)
        return keep[name].view(shape, dtype)

    args = {
        "dst": upload(dst, (t,), "i32", "dst"),
        "route_w": upload(route_w, (t,), "f32", "route_w"),
        "expert_offsets": upload(offs, (e + 1,), "i32", "expert_offsets"),
    }
    for name in ("dy", "w_down", "h"):
        sc = spec.tensor(name).scale.name
        args[name] = upload(_fp8_bytes(data[name].values), data[name].values.shape, "e4m3", name)
        args[sc] = upload(data[name].scale_grid.astype(np.float32), data[name].scale_grid.shape, "f32", sc)
    # h_t as the forward's copy stores it: padded segments (padding NaN), anchored scales.
    ht = spec.tensor("h_t")
    rows = t + ht.layout.pad_rows
    stored = np.full(rows * f_dim, E4M3_NAN, np.uint8)
    stored[element_offsets(spec, rt, ht).reshape(-1)] = _fp8_bytes(data["h_t"].values).reshape(-1)
    args["h_t"] = upload(stored, (rows, f_dim), "e4m3", "h_t")
    grid = data["h_t"].scale_grid.astype(np.float32)
    assert grid.shape == scale_grid_shape(spec, rt, ht)
    args["h_t_scale"] = upload(grid, grid.shape, "f32", "h_t_scale")
    for name in ("dh", "dh_pre"):  # bf16 NaN
        args[name] = output(np.full((t, f_dim), 0x7FC0, np.uint16), (t, f_dim), "bf16", name)
    args["dw_down"] = output(np.full((e, h_dim, f_dim), np.nan, np.float32), (e, h_dim, f_dim), "f32", "dw_down")
    args["droute_w"] = output(np.full(t, np.nan, np.float32), (t,), "f32", "droute_w")
    # The up-projection's backward (the SwiGLU's: checked against float64 in
    # tests/gpu/test_ffn_backward_gpu.py) runs in the same call: its inputs, poisoned outputs.
    n_dim = spec.dim("N").size
    for name, real in (("x", rng.standard_normal((t, h_dim))), ("w_up", rng.standard_normal((e, n_dim, h_dim)) / 16)):
        qv, sgrid = quantize_real_values(spec, rt, real, spec.tensor(name))
        sc = spec.tensor(name).scale.name
        args[name] = upload(_fp8_bytes(qv), qv.shape, "e4m3", name)
        args[sc] = upload(sgrid.astype(np.float32), sgrid.shape, "f32", sc)
    args["src"] = upload(rng.integers(0, t, t).astype(np.int32) if t else np.zeros(0, np.int32), (t,), "i32", "src")
    for name, shape in (("h_gate_up", (t, n_dim)), ("dx_rows", (t, h_dim)), ("dx", (t, h_dim))):
        args[name] = output(np.full(shape, 0x7FC0, np.uint16), shape, "bf16", name)
    args["dw_up"] = output(np.full((e, n_dim, h_dim), np.nan, np.float32), (e, n_dim, h_dim), "f32", "dw_up")
    exe(check=True, **args)
    for name, buf in keep.items():
        if isinstance(buf, GuardedBuffer):
            assert buf.changed_outside().size == 0, f"{name}: a guard byte changed"
    assert not np.isnan(keep["dw_up"].to_numpy((e, n_dim, h_dim), np.float32)).any()
    dx = (keep["dx"].to_numpy((t, h_dim), np.uint16).astype(np.uint32) << 16).view(np.float32)
    assert not np.isnan(dx).any()

    def bf16(name):
        return (keep[name].to_numpy((t, f_dim), np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)

    dh, dh_pre = bf16("dh"), bf16("dh_pre")
    dw = keep["dw_down"].to_numpy((e, h_dim, f_dim), np.float32).astype(np.float64)
    drw = keep["droute_w"].to_numpy((t,), np.float32).astype(np.float64)
    assert not np.isnan(dh).any() and not np.isnan(dw).any()
    assert not np.isnan(dh_pre).any() and not np.isnan(drw).any()

    # float64 gradients of y[dst[t], n] = route_w[t] * sum[f] h[t, f] * w_down[e(t), n, f],
    # from the dy and w_down the backward reads and the real h.
    dq = data["dy"].values * np.repeat(data["dy"].scale_grid.astype(np.float64), 128, axis=1)
    wq = data["w_down"].values * np.kron(data["w_down"].scale_grid.astype(np.float64), np.ones((1, 128, 128)))
    dy_rows = dq[dst] * route_w[:, None].astype(np.float64)
    want_pre = np.zeros((t, f_dim))
    want_dw = np.zeros((e, h_dim, f_dim))
    for g, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        want_pre[a:b] = dq[dst][a:b] @ wq[g]
        want_dw[g] = dy_rows[a:b].T @ h[a:b]
    want_dh = want_pre * route_w[:, None].astype(np.float64)
    # d route_w[t] = sum[n] dy[dst[t], n] * (h @ w_down[e]^T)[t, n] = sum[f] G[t, f] * h[t, f]:
    # against the FP8 h the row pass reads (tight), and against the real h (FP8 rounding).
    hq = data["h"].values * np.repeat(data["h"].scale_grid.astype(np.float64), 128, axis=1)
    want_drw = (want_pre * hq).sum(axis=1)
    want_drw_real = (want_pre * h).sum(axis=1)
    # dh_pre from the FP8 values it reads, rounded once; dh from it, twice (both within
    # bf16's rule); d route_w as the pass computes it, float32 sums over G as stored.
    assert_close_elementwise(dh_pre, want_pre, dtype="bf16", name=f"{counts} dh_pre", rel_norm_limit=1e-2)
    assert_close_elementwise(dh, want_dh, dtype="bf16", name=f"{counts} dh", rel_norm_limit=1e-2)
    assert_close_elementwise(drw, (dh_pre * hq).sum(axis=1), dtype="f32", name=f"{counts} droute_w over stored G")
    # Against G in float64: G's bf16 rounding in every term (bf16's rule), and the real h:
    # its FP8 rounding (a few percent of every term).
    assert_close_elementwise(drw, want_drw, dtype="bf16", name=f"{counts} droute_w", rel_norm_limit=1e-2)
    assert_close_elementwise(drw, want_drw_real, dtype="f32", name=f"{counts} droute_w vs real h",
                             **FP8_VS_UNQUANTIZED, rel_norm_limit=0.09)
    # The WGRAD reads h_t, the FP8 copy: against the real h, one row per expert (an
    # expert's whole gradient carries its tokens' rounding).
    assert_close_elementwise(dw.reshape(e, -1), want_dw.reshape(e, -1), dtype="f32", name=f"{counts} dw_down",
                             **WGRAD_FP8_VS_UNQUANTIZED, rel_norm_limit=0.09)
    for g, c in enumerate(counts):
        if c == 0:
            assert (dw[g] == 0).all()
