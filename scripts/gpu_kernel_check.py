#!/usr/bin/env python3
"""Standalone GPU check of gemmspec's Hopper kernels (needs an sm_90 GPU).

Renders the grouped GEMM, requant and transpose kernels, compiles them with NVRTC
through cuda.core, builds GsLeaf tables on the host with numpy, launches with
cuda.core on buffers owned by torch, and compares against a float64 numpy reference
of the dequantized inputs. Prints one line per case and exits non-zero on any
failure. ``--small`` runs a tiny suite (for compute-sanitizer); the default also times
one large FP8 M-grouped case. With OUT set, the log also goes to $OUT/kernel_check.log.

Imports only gemmspec.codegen.kernels from the project (no lark on the device image).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gemmspec.codegen.kernels import (  # noqa: E402
    GemmKernelConfig,
    RequantKernelConfig,
    TransposeKernelConfig,
    include_dir,
    render_gemm,
    render_requant,
    render_transpose,
)

# Host mirror of struct GsLeaf: 4 int32, then 15 int64 (offset 16, so no padding).
LEAF_FIELDS = ["m", "n", "k", "tile_begin"]
LONG_FIELDS = [
    "a_off",
    "a_sm",
    "a_sk",
    "b_off",
    "b_sn",
    "b_sk",
    "d_off",
    "d_sm",
    "d_sn",
    "sa_off",
    "sa_sm",
    "sa_sk",
    "sb_off",
    "sb_sn",
    "sb_sk",
]
LEAF_DTYPE = np.dtype(
    [(f, "<i4") for f in LEAF_FIELDS] + [(f, "<i8") for f in LONG_FIELDS], align=True
)
assert LEAF_DTYPE.itemsize == 136 and LEAF_DTYPE.fields["a_off"][1] == 16

NP_DTYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f32": np.float32,
}
TOL_BF16_OUT = 4e-3  # bf16 rounding of the output alone is ~1.6e-3
TOL_F32_FROM_FP8 = 1e-3
TOL_F32_FROM_16 = 1e-4

LOG_LINES: list[str] = []


def log(msg: str) -> None:
    print(msg, flush=True)
    LOG_LINES.append(msg)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ----------------------------------------------------------------------------- GPU plumbing
class Gpu:
    def __init__(self) -> None:
        import torch
        from cuda.core import Device

        self.torch = torch
        torch.cuda.init()
        self.dev = Device(0)
        self.dev.set_current()
        self.stream = self.dev.create_stream()
        self.num_sms = self.dev.properties.multiprocessor_count
        self._kernels: dict[str, object] = {}

    def kernel(self, name: str, source: str, smem: int = 0):
        if name in self._kernels:
            return self._kernels[name]
        from cuda.core import ObjectCode

        from gemmspec.runtime.nvrtc import compile_cubin

        t0 = time.time()
        compiled = compile_cubin(source, name=name, include_dirs=[include_dir()])
        k = ObjectCode.from_cubin(compiled.cubin).get_kernel(name)
        if smem > 48 * 1024:
            from cuda.bindings import driver

            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            (err,) = driver.cuKernelSetAttribute(attr, smem, k.handle, driver.CUdevice(0))
            if err != driver.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuKernelSetAttribute failed: {err}")
        a = k.attributes
        log(
            f"  compiled {name} in {time.time() - t0:.1f}s: {a.num_regs} regs, "
            f"local {a.local_size_bytes} B, dyn smem {smem} B"
        )
        self._kernels[name] = k
        return k

    def up(self, arr: np.ndarray):
        """Copy a numpy array to the GPU as raw bytes (torch uint8 tensor)."""
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        return self.torch.from_numpy(flat.copy()).cuda()

    def down(self, t, dtype) -> np.ndarray:
        self.torch.cuda.synchronize()
        return t.cpu().numpy().view(dtype)

    def launch(self, kernel, grid, block, smem, *args) -> None:
        from cuda.core import LaunchConfig, launch

        self.torch.cuda.synchronize()
        launch(self.stream, LaunchConfig(grid=grid, block=block, shmem_size=smem), kernel, *args)
        self.stream.sync()


def ptr(t) -> int:
    return 0 if t is None else t.data_ptr()


# ----------------------------------------------------------------------------- leaf tables
def leaf_table(cfg: GemmKernelConfig, leaves: list[dict]) -> np.ndarray:
    tab = np.zeros(len(leaves) + 1, dtype=LEAF_DTYPE)
    begin = 0
    for i, lf in enumerate(leaves):
        for f in LEAF_FIELDS[:3] + LONG_FIELDS:
            tab[i][f] = lf.get(f, 0)
        tab[i]["tile_begin"] = begin
        begin += cfg.tiles(lf["m"], lf["n"])
    tab[-1]["tile_begin"] = begin
    return tab


def run_gemm(
    gpu: Gpu,
    cfg: GemmKernelConfig,
    tab: np.ndarray,
    A,
    B,
    D,
    SA=None,
    SB=None,
    grid: int | None = None,
) -> None:
    k = gpu.kernel(cfg.name, render_gemm(cfg), cfg.smem_bytes)
    total = int(tab[-1]["tile_begin"])
    g = grid if grid is not None else gpu.num_sms
    g = max(1, min(g, total))
    dtab = gpu.up(tab)
    gpu.launch(
        k,
        g,
        cfg.threads,
        cfg.smem_bytes,
        ptr(dtab),
        np.int32(len(tab) - 1),
        ptr(A),
        ptr(B),
        ptr(D),
        ptr(SA),
        ptr(SB),
    )


# ----------------------------------------------------------------------------- data
RNG = np.random.default_rng(1234)


def rand_op(shape, dtype: str) -> np.ndarray:
    x = RNG.standard_normal(shape, dtype=np.float32)
    if dtype in ("e4m3", "e5m2"):
        x = x * 8.0  # use the FP8 range; values that round to 0 are rare
    return x.astype(NP_DTYPES[dtype])


def rand_scales(shape) -> np.ndarray:
    return RNG.uniform(0.25, 2.0, size=shape).astype(np.float32)


def f64(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float64)


def nan_fill(shape, dtype: str) -> np.ndarray:
    return np.full(shape, np.nan, dtype=np.float32).astype(NP_DTYPES[dtype])


@dataclass
class Result:
    name: str
    ok: bool
    detail: str


RESULTS: list[Result] = []


def report(name: str, ok: bool, detail: str) -> None:
    RESULTS.append(Result(name, ok, detail))
    log(f"{'PASS' if ok else 'FAIL'} {name}: {detail}")


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    den = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (den if den > 0 else 1.0))


def check(
    name: str, out: np.ndarray, ref: np.ndarray, tol: float, extra_ok: bool = True, extra: str = ""
) -> None:
    nan = int(np.isnan(out).sum())
    err = rel_err(np.nan_to_num(out), ref) if nan == 0 else float("nan")
    ok = nan == 0 and err < tol and extra_ok
    report(name, ok, f"rel err {err:.3e} (tol {tol:.0e}), unwritten/NaN {nan}{extra}")


# ----------------------------------------------------------------------------- cases
def case_m_grouped(
    gpu: Gpu,
    name: str,
    cfg: GemmKernelConfig,
    lens: list[int],
    N: int,
    K: int,
    b_mn_major: bool = False,
    grid: int | None = 13,
) -> None:
    """MoE forward / DGRAD shape: X [T, K] ragged by expert, W [G, N, K], D [T, N]."""
    G, T = len(lens), sum(lens)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    X = rand_op((T, K), cfg.a_type)
    W = rand_op((G, N, K), cfg.b_type)
    Wdev = np.ascontiguousarray(W.transpose(0, 2, 1)) if b_mn_major else W  # [G, K, N]
    kb, nb = cdiv(K, 128), cdiv(N, 128)
    SX = rand_scales((kb, T)) if cfg.scaled else None  # MN-major activation scales
    SW = rand_scales((G, nb, kb)) if cfg.scaled else None
    leaves = []
    for g in range(G):
        s = int(offs[g])
        lf = dict(m=lens[g], n=N, k=K, a_off=s * K, a_sm=K, a_sk=1, d_off=s * N, d_sm=N, d_sn=1)
        if b_mn_major:
            lf.update(b_off=g * N * K, b_sn=1, b_sk=N)
        else:
            lf.update(b_off=g * N * K, b_sn=K, b_sk=1)
        if cfg.scaled:
            assert cfg.sa_bm == 1 and cfg.sb_bn == 128
            lf.update(sa_off=s, sa_sm=1, sa_sk=T, sb_off=g * nb * kb, sb_sn=kb, sb_sk=1)
        leaves.append(lf)
    tab = leaf_table(cfg, leaves)
    if cfg.accumulate:
        D0 = RNG.standard_normal((T, N), dtype=np.float32).astype(NP_DTYPES[cfg.d_type])
    else:
        D0 = nan_fill((T, N), cfg.d_type)
    dA, dB, dD = gpu.up(X), gpu.up(Wdev), gpu.up(D0)
    dSA = gpu.up(SX) if cfg.scaled else None
    dSB = gpu.up(SW) if cfg.scaled else None
    run_gemm(gpu, cfg, tab, dA, dB, dD, dSA, dSB, grid=grid)
    out = f64(gpu.down(dD, NP_DTYPES[cfg.d_type]).reshape(T, N))
    # float64 reference of the dequantized inputs.
    Xd, Wd = f64(X), f64(W)
    if cfg.scaled:
        Xd = Xd * np.repeat(SX.T.astype(np.float64), 128, axis=1)[:, :K]
        Wd = Wd * np.repeat(np.repeat(SW.astype(np.float64), 128, axis=1), 128, axis=2)[:, :N, :K]
    ref = np.zeros((T, N))
    for g in range(G):
        s, e = int(offs[g]), int(offs[g + 1])
        ref[s:e] = Xd[s:e] @ Wd[g].T
    if cfg.accumulate:
        out = out - f64(D0)
    tol = (
        TOL_BF16_OUT
        if cfg.d_type != "f32"
        else (TOL_F32_FROM_FP8 if cfg.a_type in ("e4m3", "e5m2") else TOL_F32_FROM_16)
    )
    check(name, out, ref, tol)


def pack_segments_transposed(mats: list[np.ndarray], C: int) -> np.ndarray:
    """Per-segment transposed storage: segment g ([len_g, C] logically) at s*C as [C, len_g]."""
    return np.concatenate([m.T.reshape(-1) for m in mats]) if mats else np.zeros(0)


def wgrad_leaves(lens: list[int], N: int, Kc: int) -> list[dict]:
    """dW[e] (N x Kc) += dY_e^T X_e over the expert's tokens, both operands per-segment
    transposed (token-contiguous) with 128x1 scales SY[(rowbase + t/128)*C + c]."""
    leaves, s, rb = [], 0, 0
    for e, ln in enumerate(lens):
        leaves.append(
            dict(
                m=N,
                n=Kc,
                k=ln,
                a_off=s * N,
                a_sm=ln,
                a_sk=1,
                b_off=s * Kc,
                b_sn=ln,
                b_sk=1,
                d_off=e * N * Kc,
                d_sm=Kc,
                d_sn=1,
                sa_off=rb * N,
                sa_sm=1,
                sa_sk=N,
                sb_off=rb * Kc,
                sb_sn=1,
                sb_sk=Kc,
            )
        )
        s += ln
        rb += cdiv(ln, 128)
    return leaves


def dequant_segments(buf: np.ndarray, sy: np.ndarray, lens: list[int], C: int) -> list[np.ndarray]:
    """Inverse of the requantized layout: list of [len_g, C] float64 matrices."""
    mats, s, rb = [], 0, 0
    for ln in lens:
        q = f64(buf[s * C : (s + ln) * C].reshape(C, ln)).T  # [len, C]
        rows = (np.arange(ln) // 128) + rb
        mats.append(q * f64(sy[rows, :]) if ln else q)
        s += ln
        rb += cdiv(ln, 128)
    return mats


def run_wgrad(
    gpu: Gpu,
    name: str,
    lens: list[int],
    N: int,
    Kc: int,
    qA,
    sA,
    qB,
    sB,
    ref_mats_a=None,
    ref_mats_b=None,
) -> None:
    cfg = GemmKernelConfig("e4m3", "e4m3", "f32", accumulate=True, scaled=True, sa_bm=1, sb_bn=1)
    E = len(lens)
    tab = leaf_table(cfg, wgrad_leaves(lens, N, Kc))
    D0 = RNG.standard_normal((E, N, Kc), dtype=np.float32)
    dD = gpu.up(D0)
    run_gemm(gpu, cfg, tab, gpu.up(qA), gpu.up(qB), dD, gpu.up(sA), gpu.up(sB), grid=13)
    out = f64(gpu.down(dD, np.float32).reshape(E, N, Kc)) - f64(D0)
    ma = dequant_segments(qA, sA, lens, N)
    mb = dequant_segments(qB, sB, lens, Kc)
    ref = np.stack([a.T @ b for a, b in zip(ma, mb, strict=True)])
    zero_k = [e for e, ln in enumerate(lens) if ln == 0]
    untouched = all(np.array_equal(out[e], np.zeros((N, Kc))) for e in zero_k)
    check(name, out, ref, TOL_F32_FROM_FP8, untouched, f", k=0 leaves untouched {untouched}")
    if ref_mats_a is not None:
        ref0 = np.stack([a.T @ b for a, b in zip(ref_mats_a, ref_mats_b, strict=True)])
        log(
            f"  info {name}: vs the pre-requant inputs rel err {rel_err(out, ref0):.3e} "
            "(FP8 requantization noise, expected a few 1e-2)"
        )


def case_wgrad_direct(gpu: Gpu, lens: list[int], N: int, Kc: int) -> None:
    T = sum(lens)
    nbr = sum(cdiv(ln, 128) for ln in lens)
    mats_a = [rand_op((ln, N), "e4m3") for ln in lens]
    mats_b = [rand_op((ln, Kc), "e4m3") for ln in lens]
    qA = pack_segments_transposed(mats_a, N).astype(ml_dtypes.float8_e4m3fn)
    qB = pack_segments_transposed(mats_b, Kc).astype(ml_dtypes.float8_e4m3fn)
    assert qA.size == T * N
    run_wgrad(
        gpu,
        f"e4m3 1d1d K-grouped WGRAD lens={lens} N={N} K={Kc} -> f32 +=",
        lens,
        N,
        Kc,
        qA,
        rand_scales((nbr, N)),
        qB,
        rand_scales((nbr, Kc)),
    )


def requant_numpy(X: np.ndarray, SX: np.ndarray, lens: list[int], out_max: float = 448.0):
    """Same math as the requant kernel, in float32: returns (Y bytes, SY)."""
    T, C = X.shape
    deq = X.astype(np.float32) * np.repeat(SX, 128, axis=1)[:, :C]
    Y = np.zeros(T * C, dtype=ml_dtypes.float8_e4m3fn)
    rows = []
    s = 0
    for ln in lens:
        for b0 in range(0, ln, 128):
            blk = deq[s + b0 : s + min(ln, b0 + 128)]
            amax = np.abs(blk).max(axis=0)
            sy = np.where(amax > 0, amax / np.float32(out_max), np.float32(1.0)).astype(np.float32)
            rows.append(sy)
            q = np.clip(blk / sy, -out_max, out_max).astype(ml_dtypes.float8_e4m3fn)
            seg = Y[s * C : (s + ln) * C].reshape(C, ln)
            seg[:, b0 : b0 + blk.shape[0]] = q.T
        s += ln
    SY = np.stack(rows) if rows else np.zeros((0, C), np.float32)
    return Y, SY


def run_requant(gpu: Gpu, X: np.ndarray, SX: np.ndarray, lens: list[int]):
    cfg = RequantKernelConfig()
    T, C = X.shape
    G = len(lens)
    offs = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
    k = gpu.kernel(cfg.name, render_requant(cfg))
    rows_bound = cfg.scale_rows_bound(T, G)
    dY = gpu.up(np.full(T * C, 0x7F, np.uint8))  # 0x7F is e4m3 NaN: poison
    dSY = gpu.up(np.full((rows_bound, C), np.nan, np.float32))
    # Hold every device buffer in a name until the launch is done: a temporary's memory
    # goes back to torch's allocator at once and the next upload would reuse it.
    dX, dSX, dOffs = gpu.up(X), gpu.up(SX), gpu.up(offs)
    gpu.launch(
        k,
        cfg.grid(T, C, G),
        cfg.threads,
        0,
        ptr(dX),
        np.int64(C),
        ptr(dSX),
        np.int64(SX.shape[1]),
        np.int64(1),
        ptr(dOffs),
        np.int32(G),
        np.int32(T),
        np.int32(C),
        ptr(dY),
        ptr(dSY),
    )
    nbr = sum(cdiv(ln, 128) for ln in lens)
    Y = gpu.down(dY, ml_dtypes.float8_e4m3fn)
    SY = gpu.down(dSY, np.float32).reshape(rows_bound, C)[:nbr]
    return Y, SY


def case_requant_wgrad(gpu: Gpu, lens: list[int], N: int, Kc: int) -> None:
    """Row-major 1x128 dY and X -> requant -> WGRAD GEMM."""
    T = sum(lens)
    ok_all = True
    outs = {}
    for label, C in (("dY", N), ("X", Kc)):
        X = rand_op((T, C), "e4m3")
        SX = rand_scales((T, cdiv(C, 128)))
        Y, SY = run_requant(gpu, X, SX, lens)
        Yr, SYr = requant_numpy(X, SX, lens)
        y_bytes, yr_bytes = Y.view(np.uint8), Yr.view(np.uint8)
        mism = int((y_bytes != yr_bytes).sum())
        sy_bad = int((~np.isclose(SY, SYr, rtol=0, atol=0)).sum())
        ok = mism == 0 and sy_bad == 0
        ok_all &= ok
        report(
            f"requant {label} [T={T}, C={C}] lens={lens}",
            ok,
            f"Y byte mismatches {mism}/{Y.size}, SY mismatches {sy_bad}/{SY.size}",
        )
        deq = f64(X) * np.repeat(f64(SX), 128, axis=1)[:, :C]
        segs, s = [], 0
        for ln in lens:
            segs.append(deq[s : s + ln])
            s += ln
        outs[label] = (Y, SY, segs)
    qA, sA, ra = outs["dY"]
    qB, sB, rb = outs["X"]
    run_wgrad(
        gpu,
        f"requant -> WGRAD lens={lens} N={N} K={Kc} -> f32 +=",
        lens,
        N,
        Kc,
        qA,
        sA,
        qB,
        sB,
        ra,
        rb,
    )


def case_transpose(gpu: Gpu, Bt: int, K: int, N: int) -> None:
    cfg = TransposeKernelConfig()
    x = RNG.integers(0, 256, size=(Bt, K, N), dtype=np.uint8)
    k = gpu.kernel(cfg.name, render_transpose(cfg))
    dout = gpu.up(np.full(Bt * N * K, 0x7F, np.uint8))
    dx = gpu.up(x)  # named so that it outlives the launch
    gpu.launch(
        k,
        cfg.grid(Bt, K, N),
        cfg.threads,
        0,
        ptr(dx),
        ptr(dout),
        np.int32(Bt),
        np.int32(K),
        np.int32(N),
        np.int64(K * N),
        np.int64(N),
        np.int64(N * K),
        np.int64(K),
    )
    out = gpu.down(dout, np.uint8).reshape(Bt, N, K)
    mism = int((out != x.transpose(0, 2, 1)).sum())
    report(
        f"transpose [{Bt}, {K}, {N}] -> [{Bt}, {N}, {K}]",
        mism == 0,
        f"byte mismatches {mism}/{out.size}",
    )


def case_edges(gpu: Gpu, cfg: GemmKernelConfig, shapes: list[tuple[int, int, int]]) -> None:
    """Independent leaves packed at odd offsets, mixed majors: every edge of the loader."""
    a_parts, b_parts, leaves, refs = [], [], [], []
    sa_parts, sb_parts = [], []
    a_pos = b_pos = d_pos = sa_pos = sb_pos = 0
    for i, (m, n, k) in enumerate(shapes):
        A = rand_op((m, k), cfg.a_type)
        B = rand_op((n, k), cfg.b_type)
        pad_a, pad_b = 1 + 3 * i, 5 + i  # misalign on purpose
        a_mn, b_mn = i % 3 == 1, i % 2 == 1  # MN-major some of the time
        a_store = A.T if a_mn else A
        b_store = B.T if b_mn else B
        a_parts += [rand_op((pad_a,), cfg.a_type), np.ascontiguousarray(a_store).reshape(-1)]
        b_parts += [rand_op((pad_b,), cfg.b_type), np.ascontiguousarray(b_store).reshape(-1)]
        a_off, b_off = a_pos + pad_a, b_pos + pad_b
        a_pos, b_pos = a_off + m * k, b_off + n * k
        lf = dict(
            m=m,
            n=n,
            k=k,
            a_off=a_off,
            b_off=b_off,
            a_sm=1 if a_mn else k,
            a_sk=m if a_mn else 1,
            b_sn=1 if b_mn else k,
            b_sk=n if b_mn else 1,
            d_off=d_pos + 3,
            d_sm=n + 2,
            d_sn=1,
        )
        d_pos += 3 + m * (n + 2)
        Ad, Bd = f64(A), f64(B)
        if cfg.scaled:
            sa = rand_scales((cdiv(m, cfg.sa_bm) + 1, cdiv(k, 128) + 1))
            sb = rand_scales((cdiv(n, cfg.sb_bn) + 1, cdiv(k, 128) + 1))
            sa_parts.append(sa.reshape(-1))
            sb_parts.append(sb.reshape(-1))
            lf.update(
                sa_off=sa_pos,
                sa_sm=sa.shape[1],
                sa_sk=1,
                sb_off=sb_pos,
                sb_sn=1 * sb.shape[1],
                sb_sk=1,
            )
            sa_pos += sa.size
            sb_pos += sb.size
            ri, ki = np.arange(m) // cfg.sa_bm, np.arange(k) // 128
            Ad = Ad * f64(sa)[ri][:, ki]
            ci = np.arange(n) // cfg.sb_bn
            Bd = Bd * f64(sb)[ci][:, ki]
        leaves.append(lf)
        refs.append(Ad @ Bd.T)
    tab = leaf_table(cfg, leaves)
    Dh = nan_fill((d_pos + 7,), cfg.d_type)
    dD = gpu.up(Dh)
    dSA = gpu.up(np.concatenate(sa_parts)) if cfg.scaled else None
    dSB = gpu.up(np.concatenate(sb_parts)) if cfg.scaled else None
    run_gemm(
        gpu,
        cfg,
        tab,
        gpu.up(np.concatenate(a_parts)),
        gpu.up(np.concatenate(b_parts)),
        dD,
        dSA,
        dSB,
        grid=5,
    )
    D = f64(gpu.down(dD, NP_DTYPES[cfg.d_type]))
    outs, refs_flat = [], []
    stray = 0
    for lf, ref in zip(leaves, refs, strict=True):
        m, n = lf["m"], lf["n"]
        blk = D[lf["d_off"] : lf["d_off"] + m * (n + 2)].reshape(m, n + 2)
        outs.append(blk[:, :n].reshape(-1))
        refs_flat.append(ref.reshape(-1))
        stray += int((~np.isnan(blk[:, n:])).sum())  # the row padding must stay untouched
    tol = TOL_BF16_OUT if cfg.d_type != "f32" else TOL_F32_FROM_FP8
    check(
        f"edges {cfg.a_type}->{cfg.d_type} shapes={shapes}",
        np.concatenate(outs),
        np.concatenate(refs_flat),
        tol,
        stray == 0,
        f", writes outside leaves {stray}",
    )


def bench(gpu: Gpu) -> None:
    """8 experts x 4096 tokens, N=4096, K=7168, e4m3 1x128 / 128x128 -> bf16."""
    torch = gpu.torch
    G, Tg, N, K = 8, 4096, 4096, 7168
    T = G * Tg
    cfg = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    kb, nb = cdiv(K, 128), cdiv(N, 128)
    X = (torch.randn(T, K, device="cuda") * 8).to(torch.float8_e4m3fn)
    W = (torch.randn(G, N, K, device="cuda") * 8).to(torch.float8_e4m3fn)
    SX = torch.rand(kb, T, device="cuda") * 1.75 + 0.25
    SW = torch.rand(G, nb, kb, device="cuda") * 1.75 + 0.25
    D = torch.empty(T, N, dtype=torch.bfloat16, device="cuda")
    leaves = [
        dict(
            m=Tg,
            n=N,
            k=K,
            a_off=g * Tg * K,
            a_sm=K,
            a_sk=1,
            b_off=g * N * K,
            b_sn=K,
            b_sk=1,
            d_off=g * Tg * N,
            d_sm=N,
            d_sn=1,
            sa_off=g * Tg,
            sa_sm=1,
            sa_sk=T,
            sb_off=g * nb * kb,
            sb_sn=kb,
            sb_sk=1,
        )
        for g in range(G)
    ]
    tab = leaf_table(cfg, leaves)
    dtab = gpu.up(tab)
    k = gpu.kernel(cfg.name, render_gemm(cfg), cfg.smem_bytes)
    from cuda.core import EventOptions, LaunchConfig, launch

    lc = LaunchConfig(grid=gpu.num_sms, block=cfg.threads, shmem_size=cfg.smem_bytes)
    args = (ptr(dtab), np.int32(G), ptr(X), ptr(W), ptr(D), ptr(SX), ptr(SW))
    torch.cuda.synchronize()
    for _ in range(3):
        launch(gpu.stream, lc, k, *args)
    gpu.stream.sync()
    times = []
    eo = EventOptions(timing_enabled=True)
    for _ in range(20):
        e0 = gpu.stream.record(options=eo)
        launch(gpu.stream, lc, k, *args)
        e1 = gpu.stream.record(options=eo)
        e1.sync()
        times.append(e1 - e0)
    ms = float(np.median(times))
    tflops = 2.0 * T * N * K / (ms * 1e-3) / 1e12
    # Spot-check 64 rows of expert 5 against float64.
    rows = slice(5 * Tg + 1000, 5 * Tg + 1064)
    xs = (
        f64(X[rows].float().cpu().numpy())
        * np.repeat(f64(SX[:, rows].T.cpu().numpy()), 128, axis=1)[:, :K]
    )
    ws = (
        f64(W[5].float().cpu().numpy())
        * np.repeat(np.repeat(f64(SW[5].cpu().numpy()), 128, axis=0), 128, axis=1)[:N, :K]
    )
    ref = xs @ ws.T
    out = f64(D[rows].float().cpu().numpy())
    check("bench spot check (64 rows of expert 5)", out, ref, TOL_BF16_OUT)
    log(
        f"TIMING e4m3 1x128/128x128 -> bf16, {G} experts x {Tg} tokens, N={N}, K={K}: "
        f"median {ms:.3f} ms over 20, {tflops:.1f} TFLOPS (grid {gpu.num_sms}, "
        f"min {min(times):.3f} ms)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="tiny suite (for compute-sanitizer)")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    gpu = Gpu()
    log(f"device: {gpu.dev.name}, {gpu.num_sms} SMs")
    bf = GemmKernelConfig("bf16", "bf16", "bf16")
    bf_acc = GemmKernelConfig("bf16", "bf16", "f32", accumulate=True)
    fp8 = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    fp8_edges = GemmKernelConfig("e4m3", "e4m3", "f32", scaled=True, sa_bm=3, sb_bn=1)
    cases = []
    if args.small:
        cases += [
            lambda: case_m_grouped(
                gpu, "bf16->bf16 M-grouped small", bf, [0, 1, 70, 129], 200, 100
            ),
            lambda: case_m_grouped(
                gpu, "e4m3 1x128/128x128->bf16 small", fp8, [3, 0, 130], 136, 300
            ),
            lambda: case_edges(
                gpu, bf, [(1, 1, 1), (5, 1, 33), (0, 5, 7), (70, 0, 9), (130, 17, 70)]
            ),
            lambda: case_edges(gpu, fp8_edges, [(1, 1, 1), (3, 1, 129), (0, 4, 4), (131, 20, 300)]),
            lambda: case_wgrad_direct(gpu, [0, 1, 129, 40], 72, 136),
            lambda: case_requant_wgrad(gpu, [0, 1, 129, 7], 72, 136),
            lambda: case_transpose(gpu, 2, 70, 45),
        ]
    else:
        lens = [0, 1, 127, 129, 4097]
        cases += [
            lambda: case_m_grouped(
                gpu, f"bf16->bf16 M-grouped {lens} N=200 K=576", bf, lens, 200, 576
            ),
            lambda: case_m_grouped(
                gpu,
                "bf16->bf16 M-grouped B MN-major N=200 K=1000",
                bf,
                [3, 0, 130, 257],
                200,
                1000,
                b_mn_major=True,
            ),
            lambda: case_m_grouped(
                gpu, f"bf16->f32 += M-grouped {lens} N=200 K=1000", bf_acc, lens, 200, 1000
            ),
            lambda: case_m_grouped(
                gpu, f"e4m3 1x128/128x128->bf16 {lens} N=200 K=7168", fp8, lens, 200, 7168
            ),
            lambda: case_m_grouped(
                gpu, f"e4m3 1x128/128x128->bf16 {lens} N=200 K=576", fp8, lens, 200, 576
            ),
            lambda: case_m_grouped(
                gpu,
                f"e4m3 1x128/128x128->bf16 {lens} N=384 K=1000 grid=132",
                fp8,
                lens,
                384,
                1000,
                grid=None,
            ),
            lambda: case_edges(
                gpu,
                bf,
                [(1, 1, 1), (5, 1, 33), (0, 5, 7), (70, 0, 9), (130, 17, 70), (64, 300, 200)],
            ),
            lambda: case_edges(
                gpu,
                fp8_edges,
                [(1, 1, 1), (3, 1, 129), (0, 4, 4), (131, 20, 300), (200, 129, 1000)],
            ),
            lambda: case_wgrad_direct(gpu, [0, 1, 127, 129, 300], 200, 264),
            lambda: case_requant_wgrad(gpu, [0, 1, 127, 129, 300], 200, 264),
            lambda: case_transpose(gpu, 3, 200, 300),
        ]
    for c in cases:
        try:
            c()
        except Exception as exc:  # noqa: BLE001 - report and keep going
            import traceback

            report("case raised", False, f"{type(exc).__name__}: {exc}")
            log(traceback.format_exc())
    if not args.small and not args.no_bench:
        try:
            bench(gpu)
        except Exception as exc:  # noqa: BLE001
            import traceback

            report("bench raised", False, f"{type(exc).__name__}: {exc}")
            log(traceback.format_exc())
    failed = [r for r in RESULTS if not r.ok]
    log(f"SUMMARY: {len(RESULTS) - len(failed)}/{len(RESULTS)} passed")
    out_dir = os.environ.get("OUT")
    if out_dir:
        Path(out_dir, "kernel_check.log").write_text("\n".join(LOG_LINES) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
