"""Edges that docs/language.md and docs/usage.md describe, held to the code: empty and
one-row segments, K and N not multiples of the scale block, capacity and masked rows,
nested segments that are empty or end at the outer end, `=` and `+=` over empty ranges,
rows read and written through index tensors, the FP8 quantization rules, padded
segment-major addresses, and the command line's exit codes. Every expected value is
computed here with plain float64 / float32 loops from the docs' rules, element by
element (`|got - ref| <= rtol*|ref| + atol*rms(row)`, all finite)."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

from gemmspec.cli import main
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, TensorData
from gemmspec.reference.schedule_exec import run_schedule

BF, E4, E5 = ml_dtypes.bfloat16, ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
F32 = np.float32


def rnd(x, dtype):
    return np.asarray(x).astype(dtype).astype(np.float64)


def close(got, ref, rtol, atol):
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape and np.isfinite(got).all()
    rms = np.sqrt(np.mean(ref**2, axis=-1, keepdims=True)) if ref.shape[-1] else 0.0
    bad = np.abs(got - ref) > rtol * np.abs(ref) + atol * rms
    assert not bad.any(), (np.argwhere(bad)[:4], got[bad][:4], ref[bad][:4])


def sched(text, dims, offs, inputs, init):
    """The lowered schedule of `text`, executed on the CPU; every output's values."""
    (lo,) = lower_file(text)
    rt = Runtime(dict(dims), {k: np.asarray(v, dtype=np.int64) for k, v in offs.items()})
    data = {k: TensorData(*v) if isinstance(v, tuple) else TensorData(v) for k, v in inputs.items()}
    return run_schedule(lo.spec, rt, lo.schedule, data, init)


def fp8(rng, shape):
    return rnd(rng.uniform(-224, 224, shape), E4)


def scales(rng, shape):
    return rnd(2.0 ** rng.uniform(-3, 3, shape), F32)


def offsets(lens):
    return np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)


def quantize_block(block, fmax=448.0, dtype=E4, pow2=False):
    """language.md section 7, steps 1-3, in float32 (pow2: the power-of-two step 2)."""
    block = np.asarray(block, F32)
    amax = F32(np.nanmax(np.abs(block), initial=0))
    if pow2:
        m, e = np.frexp(amax)
        e = max(int(e) - (9 if fmax == 448.0 else 16) + int(m > 0.875), -127)
        s = F32(np.ldexp(F32(1), e)) if 0 < amax < np.inf else (amax if amax > 0 else F32(1))
    else:
        s = amax / F32(fmax)
        s = s if s > 0 else F32(1)
    return np.clip(block / s, -fmax, fmax).astype(dtype).astype(np.float64), F32(s)


RAGGED = """gemm edges_ragged {{
  dim T, N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor x : {xt}
  tensor w : {wt}
  tensor y : {yt} [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}"""
LENS = [0, 1, 2, 7, 63, 64, 65, 0, 129]


CASES = [("bf16", 1, 7), ("bf16", 255, 1), ("bf16", 300, 2)] + [
    (r, k, n) for r in ("blockwise", "channel", "tensor", "mixed") for k, n in ((129, 200), (300, 7))]


@pytest.mark.parametrize("recipe, k, n", CASES)
def test_ragged_awkward_sizes_and_partial_scale_blocks(recipe, k, n):
    """Segments of 0, 1, 2, 7, 63, 64, 65 and 129 rows. Blockwise FP8: the last K block and
    the last 128-row N block are short; per-channel and per-tensor: one scale along K."""
    xs, ws = {"blockwise": ("[1, 128] layout major(T)", "[1, 128, 128]"), "channel": ("[1, K]", "[1, 1, K]"),
              "tensor": ("[T, K]", "[1, N, K]"), "mixed": ("[T, K]", "[1, 1, K]"), "bf16": ("", "")}[recipe]
    rng = np.random.default_rng(n + k)
    off, t = offsets(LENS), sum(LENS)
    # Elements per scale along (T, K) of x and (N, K) of w; a whole dim is one block.
    bx = {"blockwise": (1, 128), "channel": (1, k)}.get(recipe, (t, k))
    bw = {"blockwise": (128, 128), "tensor": (n, k)}.get(recipe, (1, k))
    sx, sw = scales(rng, (-(-t // bx[0]), -(-k // bx[1]))), scales(rng, (9, -(-n // bw[0]), -(-k // bw[1])))
    if recipe == "bf16":
        x, w, sx, sw = rnd(rng.standard_normal((t, k)), BF), rnd(rng.standard_normal((9, n, k)), BF), sx * 0 + 1, sw * 0 + 1
        inputs, types = {"x": x, "w": w}, ("bf16 [T, K]", "bf16 [E, N, K]")
    else:
        x, w = fp8(rng, (t, k)), fp8(rng, (9, n, k))
        inputs, types = {"x": (x, sx), "w": (w, sw)}, (f"e4m3 [T, K] scale f32 {xs}", f"e4m3 [E, N, K] scale f32 {ws}")
    text = RAGGED.format(n=n, k=k, e=9, xt=types[0], wt=types[1], yt="f32")
    got = sched(text, {"T": t}, {"offs": off}, inputs, {"y": np.full((t, n), np.nan)})["y"]
    ref, ks = np.zeros((t, n)), np.arange(k)
    for e in range(9):
        for r in range(off[e], off[e + 1]):
            for c in range(n):
                ref[r, c] = np.dot(x[r] * sx[r // bx[0], ks // bx[1]], w[e, c] * sw[e, c // bw[0], ks // bw[1]])
    close(got, rnd(ref, F32), 2**-8 if recipe != "bf16" else 1e-6, 4e-3 if recipe != "bf16" else 1e-6)


@pytest.mark.parametrize("lens, t", [([0, 1, 0, 2], 10), ([3, 0, 0, 2], 5), ([0, 0, 0, 0], 5), ([0, 0, 0, 0], 0)])
def test_capacity_accumulate_leaves_rows_past_the_end(lens, t):
    rng = np.random.default_rng(t)
    off = offsets(lens)
    text = RAGGED.replace("offsets = offs)", "offsets = offs, capacity)").replace("y[t, n] =", "y[t, n] +=")
    text = text.format(n=7, k=129, e=4, xt="bf16 [T, K]", wt="bf16 [E, N, K]", yt="f32")
    x, w = rnd(rng.standard_normal((t, 129)), BF), rnd(rng.standard_normal((4, 7, 129)), BF)
    y0 = rnd(rng.standard_normal((t, 7)), F32)
    got = sched(text, {"T": t}, {"offs": off}, {"x": x, "w": w, "y": y0.copy()}, {"y": y0.copy()})["y"]
    ref = y0.copy()
    for e in range(4):
        for r in range(off[e], off[e + 1]):
            ref[r] += w[e] @ x[r]
    assert np.array_equal(got[off[-1]:], y0[off[-1]:])
    close(got, rnd(ref, F32), 1e-6, 1e-6)


def test_masked_counts_zero_and_past_the_padded_size():
    text = """gemm edges_masked {
  dim M = 5, N = 7, K = 129
  group expert[E = 4] = masked(M, counts = cnt)
  tensor x : bf16 [E, M, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [E, M, N]
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}"""
    rng = np.random.default_rng(5)
    cnt = [0, 1, 5, 9]  # 9 > M uses all 5 rows
    x, w = rnd(rng.standard_normal((4, 5, 129)), BF), rnd(rng.standard_normal((4, 7, 129)), BF)
    y0 = np.full((4, 5, 7), -7.0)
    got = sched(text, {}, {"cnt": cnt}, {"x": x, "w": w}, {"y": y0.copy()})["y"]
    ref = y0.copy()
    for e in range(4):
        for m in range(min(cnt[e], 5)):
            ref[e, m] = w[e] @ x[e, m]
    close(got.reshape(-1, 7), rnd(ref, BF).reshape(-1, 7), 2**-7, 1e-2)
    with pytest.raises(Exception, match="non-negative"):
        sched(text, {}, {"cnt": [0, -1, 2, 3]}, {"x": x, "w": w}, {"y": y0.copy()})


def test_nested_segments_empty_or_ending_at_the_outer_end():
    text = """gemm edges_nested {
  dim T, K = 255, R = 3
  group lora[L = 3] = ragged(T, offsets = lo)
  group expert[E = 3] = ragged(T within lora, offsets = eo)
  tensor x : bf16 [T, K]
  tensor wa : bf16 [L, E, R, K]
  tensor y : f32 [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}"""
    rng = np.random.default_rng(6)
    lo, eo = [0, 6, 6, 10], [[0, 0, 2, 6], [6, 6, 6, 6], [6, 9, 10, 10]]
    x, wa = rnd(rng.standard_normal((10, 255)), BF), rnd(rng.standard_normal((3, 3, 3, 255)), BF)
    got = sched(text, {"T": 10}, {"lo": lo, "eo": eo}, {"x": x, "wa": wa}, {"y": np.full((10, 3), np.nan)})["y"]
    ref = np.full((10, 3), np.nan)
    for a in range(3):
        for e in range(3):
            for r in range(eo[a][e], eo[a][e + 1]):
                ref[r] = wa[a, e] @ x[r]
    close(got, rnd(ref, F32), 1e-6, 1e-6)


@pytest.mark.parametrize("op", ["=", "+="])
def test_fp8_wgrad_padded_segments_blocks_per_segment(op):
    """[128, 1] scales per expert: segment g owns ceil(len_g / 128) block rows, one segment
    after the other. A leaf's bias is written even where its K range is empty."""
    text = f"""gemm edges_wgrad {{
  dim T, N = 3, K = 5
  group expert[E = 5] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor alpha : f32 [E]
  tensor bias : f32 [E, K]
  tensor dw : f32 [E, N, K]
  dw[e, n, k] {op} alpha[e] * sum[t in expert(e)] dy[t, n] * x[t, k] + bias[e, k]
}}"""
    rng = np.random.default_rng(8)
    lens = [0, 1, 129, 0, 257]
    off, t, nbl = offsets(lens), sum(lens), [-(-n // 128) for n in lens]
    dy, x = fp8(rng, (t, 3)), fp8(rng, (t, 5))
    sdy, sx = scales(rng, (sum(nbl), 3)), scales(rng, (sum(nbl), 5))
    dw0, alpha, bias = (rnd(rng.standard_normal(s), F32) for s in ((5, 3, 5), 5, (5, 5)))
    inputs = {"dy": (dy, sdy), "x": (x, sx), "alpha": alpha, "bias": bias, **({"dw": dw0.copy()} if op == "+=" else {})}
    got = sched(text, {"T": t}, {"offs": off}, inputs, {"dw": dw0.copy()})["dw"]
    ref = dw0.copy() if op == "+=" else np.zeros_like(dw0)
    for e in range(5):
        for r in range(off[e], off[e + 1]):
            b = sum(nbl[:e]) + (r - off[e]) // 128
            ref[e] += alpha[e] * np.outer(dy[r] * sdy[b], x[r] * sx[b])
        ref[e] += bias[e]
    close(got.reshape(-1, 5), rnd(ref, F32).reshape(-1, 5), 1e-6, 1e-6)


def test_gathered_and_scattered_rows_over_a_capacity_group():
    """Gathered rows may repeat; rows no used entry of src names keep their values; the
    entries of rows past the capacity end are never read (here invalid, or repeated)."""
    text = """gemm edges_gs {
  dim T, S, N = 7, K = 129
  group expert[E = 3] = ragged(T, offsets = offs, capacity)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [S, N]
  y[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}"""
    rng = np.random.default_rng(11)
    off, idx, src = [0, 2, 2, 6], [3, 3, 0, 8, 1, 3, -5, 100], [4, 0, 8, 2, 1, 7, 4, 4]
    x, w = rnd(rng.standard_normal((9, 129)), BF), rnd(rng.standard_normal((3, 7, 129)), BF)
    y0 = np.full((9, 7), 3.25)
    inputs = {"x": x, "w": w, "idx": np.array(idx, float), "src": np.array(src, float)}
    got = sched(text, {"T": 8, "S": 9}, {"offs": off}, inputs, {"y": y0.copy()})["y"]
    ref = y0.copy()
    for e in range(3):
        for r in range(off[e], off[e + 1]):
            ref[src[r]] = w[e] @ x[idx[r]]
    close(got, rnd(ref, BF), 2**-7, 1e-2)


@pytest.mark.parametrize("dtype, pow2", [("e4m3", ""), ("e5m2", " pow2")])
def test_fp8_output_and_its_copy_follow_the_quantize_rule(dtype, pow2):
    """The f32 result rounded to bf16, then quantized per [1, 128] block (and, for the
    copy, per 128 rows of a segment's column), bit for bit."""
    fmax, np_t = (448.0, E4) if dtype == "e4m3" else (57344.0, E5)
    text = f"""gemm edges_fp8out {{
  dim T, F = 256, K = 129
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, F, K]
  tensor rw : f32 [T]
  tensor h : {dtype} [T, F] scale f32 [1, 128]{pow2}
  tensor h_t : {dtype} [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert{pow2} = copy(h)
  h[t, j] = rw[t] * sum[k] x[t, k] * w[expert(t), j, k]
}}"""
    rng = np.random.default_rng(12)
    lens = [0, 1, 130, 2]
    off, t, nbl = offsets(lens), sum(lens), sum(-(-n // 128) for n in lens)
    x, w = rnd(rng.standard_normal((t, 129)), BF), rnd(rng.standard_normal((4, 256, 129)), BF)
    rw = rnd(rng.standard_normal(t) * 2.0 ** rng.integers(-30, 30, t), F32)
    rw[5] = 0  # an all-zero row: scale 1
    init = {"h": np.full((t, 256), np.nan), "h_scale": np.full((t, 2), np.nan),
            "h_t": np.full((t, 256), np.nan), "h_t_scale": np.full((nbl, 256), np.nan)}
    got = sched(text, {"T": t}, {"offs": off}, {"x": x, "w": w, "rw": rw}, init)
    res = np.zeros((t, 256))
    for e in range(4):
        for r in range(off[e], off[e + 1]):
            res[r] = rw[r] * (w[e] @ x[r])
    b = res.astype(F32).astype(BF).astype(F32)
    for r in range(t):
        for j in range(2):
            q, s = quantize_block(b[r, 128 * j:128 * (j + 1)], fmax, np_t, bool(pow2))
            assert np.array_equal(got["h"][r, 128 * j:128 * (j + 1)], q) and got["h_scale"][r, j] == s
    row = 0
    for e in range(4):
        for r0 in range(off[e], off[e + 1], 128):
            for c in range(256):
                q, s = quantize_block(b[r0:min(r0 + 128, off[e + 1]), c], fmax, np_t, bool(pow2))
                assert np.array_equal(got["h_t"][r0:r0 + len(q), c], q) and got["h_t_scale"][row, c] == s
            row += 1


def test_requantize_rows_and_weight_with_entries_outside_the_source():
    text = """gemm edges_requant {
  dim T, S, H = 256, K = 3
  group expert[E = 5] = ragged(T, offsets = offs)
  tensor dy : e4m3 [S, H] scale f32 [1, 128]
  tensor dst : i32 [T]
  tensor rw : f32 [T]
  tensor dyw : e4m3 [T, H] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy, rows = dst, weight = rw)
  tensor x : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dw : f32 [E, H, K]
  dw[e, n, k] = sum[t in expert(e)] dyw[t, n] * x[t, k]
}"""
    rng = np.random.default_rng(14)
    lens = [0, 1, 130, 0, 5]
    off, t, nbl = offsets(lens), sum(lens), [-(-n // 128) for n in lens]
    dy, sdy = fp8(rng, (9, 256)), scales(rng, (9, 2))
    dst = rng.integers(0, 9, t)
    dst[3], dst[10] = -1, 13  # outside [0, S): zero rows
    rw = rnd(rng.standard_normal(t), F32)
    x, sx = fp8(rng, (t, 3)), scales(rng, (sum(nbl), 3))
    inputs = {"dy": (dy, sdy), "dst": dst.astype(float), "rw": rw, "x": (x, sx)}
    got = sched(text, {"T": t, "S": 9}, {"offs": off}, inputs, {"dw": np.full((5, 256, 3), np.nan)})["dw"]
    v = np.zeros((t, 256), F32)
    for r in range(t):
        if 0 <= dst[r] < 9:
            for c in range(256):
                v[r, c] = F32(dy[dst[r], c]) * (F32(sdy[dst[r], c // 128]) * F32(rw[r]))
    ref, row = np.zeros((5, 256, 3)), 0
    for e in range(5):
        for r0 in range(off[e], off[e + 1], 128):
            r1 = min(r0 + 128, off[e + 1])
            for c in range(256):
                q, s = quantize_block(v[r0:r1, c])
                ref[e, c] += (q * np.float64(s)) @ (x[r0:r1] * sx[row])
            row += 1
    close(got.reshape(-1, 3), rnd(ref, F32).reshape(-1, 3), 2e-7, 1e-9)


def test_scatter_add_skips_entries_outside_and_zeroes_unnamed_rows():
    text = """gemm edges_rowpass {
  dim T, S, H = 8, K = 256
  tensor dy  : bf16 [T, H]
  tensor w   : bf16 [K, H]
  tensor src : i32 [T]
  tensor dxr : bf16 [T, K]
  tensor dx  : bf16 [S, K] = scatter_add(dxr, rows = src)
  dxr[t, k] = sum[n] dy[t, n] * w[k, n]
}"""
    rng = np.random.default_rng(15)
    src = [4, -1, 4, 0, 5, 4, 2]
    dy, w = rnd(rng.standard_normal((7, 8)), BF), rnd(rng.standard_normal((256, 8)), BF)
    init = {"dxr": np.full((7, 256), np.nan), "dx": np.full((5, 256), np.nan)}
    got = sched(text, {"T": 7, "S": 5}, {}, {"dy": dy, "w": w, "src": np.array(src, float)}, init)
    dxr = rnd(dy @ w.T, BF)
    assert np.array_equal(got["dxr"], dxr)
    dx = np.zeros((5, 256), F32)
    for r in range(7):  # ascending t, in float32; an entry outside [0, S) adds nothing
        if 0 <= src[r] < 5:
            dx[src[r]] = dx[src[r]] + dxr[r].astype(F32)
    assert np.array_equal(got["dx"], rnd(dx, BF))


# ---- gemmspec.torch on CPU tensors (its ops run the float64 reference there) --------------
SEGPAD = """gemm edges_segpad {
  dim T, K = 5, R = 3
  group lora[L = 2]   = ragged(T, offsets = lo)
  group expert[E = 3] = ragged(T within lora, offsets = eo)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R] layout segment_major(expert) pad 4
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}"""


def padded_addresses(eo, cols, pad):
    """language.md, layouts: element (t, c) of segment (s, n) lives at p_g*C + c*n' + (t - s),
    n' = round_up(n, P), p_g the sum of n' over the segments before it (flat order)."""
    at, p = {}, 0
    for s, e in ((s, e) for row in eo for s, e in zip(row[:-1], row[1:])):
        npad = -(-(e - s) // pad) * pad
        at.update({(t, c): p * cols + c * npad + (t - s) for t in range(s, e) for c in range(cols)})
        p += npad
    return at


def test_torch_op_reads_and_writes_padded_segments_at_the_documented_addresses():
    torch = pytest.importorskip("torch")
    import gemmspec.torch as gt
    from gemmspec.torch_reference import register_reference

    op = gt.op(SEGPAD)
    register_reference(op)
    lo, eo, t = [0, 9, 20], [[0, 0, 1, 9], [9, 18, 18, 20]], 20
    rng = np.random.default_rng(20)
    xl, wa = rnd(rng.standard_normal((t, 5)), BF), rnd(rng.standard_normal((2, 3, 3, 5)), BF)
    xb = np.full((t + 7 * 6) * 5, np.nan)
    for (r, c), a in padded_addresses(eo, 5, 8).items():
        xb[a] = xl[r, c]
    y = torch.full((t + 3 * 6, 3), float("nan"))
    op(x=torch.from_numpy(xb.reshape(-1, 5)).bfloat16(), wa=torch.from_numpy(wa).bfloat16(),
       lo=torch.tensor(lo, dtype=torch.int32), eo=torch.tensor(eo, dtype=torch.int32), y=y)
    flat, yat = y.view(-1).double().numpy(), padded_addresses(eo, 3, 4)
    got, ref = np.zeros((t, 3)), np.zeros((t, 3))
    for a in range(2):
        for e in range(3):
            for r in range(eo[a][e], eo[a][e + 1]):
                ref[r] = wa[a, e] @ xl[r]
                got[r] = [flat[yat[r, c]] for c in range(3)]
    close(got, rnd(ref, F32), 1e-6, 1e-6)
    assert np.isnan(np.delete(flat, list(yat.values()))).all()  # the padding is never written


# ---- the command line: errors and exit statuses (docs/usage.md, Commands) ----------------
GOOD = RAGGED.format(n=8, k=16, e=2, xt="bf16 [T, K]", wt="bf16 [E, N, K]", yt="bf16")


@pytest.mark.parametrize("argv, status, message", [
    (["check", "{bad}"], 1, r"bad\.gspec:4:23: error: unknown dim 'Q'\n.*\n *\^"),
    (["check", "{empty}"], 1, r"empty\.gspec:1:1: error: no `gemm NAME"),
    (["check", "{crlf}"], 1, r"crlf\.gspec:3:3: error: unexpected character '/'"),
    (["check", "{dir}/missing.gspec"], 2, r"gemmspec: error: .*missing\.gspec"),
    (["compile", "{good}", "-o", "{good}"], 2, r"gemmspec: error: .*not a directory"),
    (["compile", "{good}", "-o", ""], 2, r"expected a path"),
    (["explain", "{good}", "--json", "--backward"], 2, r"not allowed with"),
    (["explain", "{good}", "--width", "39"], 2, r"--width"),
    (["run", "{good}", "--dims", "N=5"], 2, r"gemmspec: error: --dims: .*'N'"),
    (["run", "{good}", "--dims", "T=2147483648"], 2, r"gemmspec: error: --dims: .*2147483648"),
    (["run", "{good}", "--seed", "-1"], 2, r"gemmspec: error: --seed"),
    (["run", "{good}", "--repeats", "0"], 2, r"--repeats"),
    (["tune", "{good}", "--json", "{good}"], 2, r"gemmspec: error: .*spec"),
    (["bench", "--repeat", "0"], 2, r"gemmspec bench: error:"),
    (["bench", "--tile", "64x12"], 2, r"gemmspec bench: error:"),
])
def test_cli_errors_and_exit_statuses(argv, status, message, tmp_path, capsys):
    files = {"good": GOOD, "bad": "gemm a {\n  dim T\n\n  tensor x : bf16 [T, Q]\n}\n", "empty": "",
             "crlf": "gemm a {\r\n  dim T\r\n  /* no */\r\n}\r\n"}
    paths = {name: tmp_path / f"{name}.gspec" for name in files}
    for name, text in files.items():
        paths[name].write_bytes(text.encode())
    argv = [a.format(dir=tmp_path, **paths) for a in argv]
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == status and re.search(message, err), (rc, out, err)
    assert "Traceback" not in err
