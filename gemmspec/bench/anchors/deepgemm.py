"""DeepGEMM as a live anchor of `gemmspec bench`, where `deep_gemm` is importable.

Each adapter takes the inputs a bench case gave gemmspec (same tensors, same scales),
lays them out as DeepGEMM's API wants them (outside the timing: its scale layouts once,
its 128-row padded contiguous layout for ragged groups), checks DeepGEMM's result against
gemmspec's on the rows both compute, and times the call; a failure is reported in its
row instead of ending the case. DeepGEMM's layouts are those of its 2.x API:
`m_grouped_*_contiguous` takes a row -> group index (-1 for padding rows, groups 128-row
aligned), the K-grouped WGRAD takes each group's [M, K_g] bytes back to back
(gemmspec's `segment_major`). Where it is not importable (or with `--no-deepgemm`) it
adds no row, and the report prints the figures recorded in the case table instead.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from ..compare import checked, rel_error
from ..timing import Result, result, timed
from . import Problem

DEEPGEMM = None  # the deep_gemm module where importable (and not --no-deepgemm)


def load():
    """The `deep_gemm` module, or None where it is not installed or does not load."""
    try:
        import deep_gemm
    except Exception:  # noqa: BLE001 - any failure to load means "not available"
        return None
    return deep_gemm


def version(dg) -> str:
    return getattr(dg, "__version__", "?")


def _check(pairs, limit: float) -> str:
    """DeepGEMM's outputs against gemmspec's, (out, ref) pairs judged by the worst, with the
    bench's own error and check (a NaN fails)."""
    return checked(max(rel_error(out, ref) for out, ref in pairs), limit, "gemmspec's output")


def row(name: str, flops: float, repeat: int, make, unit: str = "TFLOPS") -> list[Result]:
    """DeepGEMM's row of a case, where it is importable: `make(dg)` returns (callable,
    check, how it ran); a failure is reported in the row instead of ending the case.
    `flops` is the row's work in `unit` (bytes for "TB/s")."""
    dg = DEEPGEMM
    if dg is None:
        return []
    impl = f"DeepGEMM {version(dg)}"
    try:
        call, check, how = make(dg)
    except Exception as e:  # noqa: BLE001 - the anchor failing is reported, gemmspec's rows stand
        print(f"      DeepGEMM anchor of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return [Result(name, impl, float("nan"), flops, unit, f"not run: {type(e).__name__}: {str(e)[:80]}")]
    return [result(name, f"{impl} ({how})", timed(call, repeat), flops, unit=unit, check=check)]


# ---------------------------------------------------------------------------- adapters
def m_grouped_fp8(name: str, repeat: int, p: Problem) -> list[Result]:
    """FP8 1x128 / 128x128 M-grouped, on the row's ragged groups."""
    return row(name, p.work, repeat, lambda dg: prepare_m_grouped_fp8(dg, p.x, p.xs, p.w, p.ws, p.lengths, p.y),
               unit=p.unit)


def m_grouped_bf16(name: str, repeat: int, p: Problem) -> list[Result]:
    """BF16 M-grouped, on the row's ragged groups."""
    return row(name, p.work, repeat, lambda dg: prepare_m_grouped_bf16(dg, p.x, p.w, p.lengths, p.y), unit=p.unit)


def k_grouped_fp8_wgrad(name: str, repeat: int, p: Problem) -> list[Result]:
    """FP8 WGRAD K-grouped with FP32 `+=`, checked against gemmspec's one `+=` (`dw_ref`)."""
    return row(
        name, p.work, repeat,
        lambda dg: prepare_k_grouped_fp8_wgrad(dg, p.dy, p.dys, p.x, p.xs, p.lengths, p.n, p.k, p.dw_ref),
    )


def m_grouped_fp8_masked(name: str, repeat: int, p: Problem) -> list[Result]:
    """FP8 masked decode, on the row's per-group counts."""
    return row(name, p.work, repeat, lambda dg: prepare_m_grouped_fp8_masked(dg, p.x, p.xs, p.w, p.ws, p.counts, p.y),
               unit=p.unit)


def dense_fp8(name: str, repeat: int, p: Problem) -> list[Result]:
    """FP8 dense 1x128 / 128x128."""
    return row(name, p.work, repeat, lambda dg: prepare_dense_fp8(dg, p.x, p.xs, p.w, p.ws, p.y))


# ---------------------------------------------------------------------------- layouts


def _padded_rows(lengths: list[int], align: int = 128):
    """Each group's rows placed at a multiple of `align`: (start of every group in the
    padded layout, padded row count)."""
    starts, total = [], 0
    for m in lengths:
        starts.append(total)
        total += -(-m // align) * align
    return starts, total


def prepare_m_grouped_fp8(dg, x, xs, w, ws, lengths: list[int], y) -> tuple[Callable[[], object], str, str]:
    """FP8 1x128 / 128x128 M-grouped (`m_grouped_fp8_gemm_nt_contiguous`). `xs` is [T, K/128]
    with tokens contiguous (MN-major), `ws` [E, N/128, K/128]. Ragged groups are copied once
    into the 128-row aligned layout DeepGEMM needs (not timed: the row says so)."""
    import torch

    t, k = x.shape
    e, n, _ = w.shape
    starts, tp = _padded_rows(lengths)
    padded = tp != t
    if padded:
        xp = torch.zeros((tp, k), dtype=torch.uint8, device=x.device)
        xsp = torch.zeros((k // 128, tp), dtype=torch.float32, device=x.device)
        src = 0
        for s, m in zip(starts, lengths):
            xp[s : s + m] = x[src : src + m].view(torch.uint8)
            xsp[:, s : s + m] = xs[src : src + m].t()
            src += m
        xp, xsp = xp.view(torch.float8_e4m3fn), xsp.t()
    else:
        xp, xsp = x, xs
    idx = torch.full((tp,), -1, dtype=torch.int32, device=x.device)
    for g, (s, m) in enumerate(zip(starts, lengths)):
        idx[s : s + m] = g
    recipe = (1, 128, 128)
    sfa = dg.transform_sf_into_required_layout(xsp, tp, k, recipe, None, True)
    sfb = dg.transform_sf_into_required_layout(ws, n, k, recipe, e, False)
    d = torch.empty((tp, n), dtype=torch.bfloat16, device=x.device)

    def call():
        dg.m_grouped_fp8_gemm_nt_contiguous((xp, sfa), (w, sfb), d, idx, recipe=recipe)

    call()
    torch.cuda.synchronize()
    rows = torch.cat([torch.arange(s, s + m, device=x.device) for s, m in zip(starts, lengths) if m])
    check = _check([(d[rows], y)], 2e-3)
    what = "padded to 128 rows, untimed" if padded else "contiguous"  # the copy into the padded layout
    return call, check, what


def prepare_m_grouped_bf16(dg, x, w, lengths: list[int], y):
    """BF16 M-grouped (`m_grouped_bf16_gemm_nt_contiguous`). Ragged groups are copied once
    into the 128-row aligned layout DeepGEMM needs (not timed: the row says so)."""
    import torch

    t, k = x.shape
    starts, tp = _padded_rows(lengths)
    padded = tp != t
    if padded:
        xp = torch.zeros((tp, k), dtype=x.dtype, device=x.device)
        src = 0
        for s, m in zip(starts, lengths):
            xp[s : s + m] = x[src : src + m]
            src += m
    else:
        xp = x
    idx = torch.full((tp,), -1, dtype=torch.int32, device=x.device)
    for g, (s, m) in enumerate(zip(starts, lengths)):
        idx[s : s + m] = g
    d = torch.empty((tp, w.shape[1]), dtype=torch.bfloat16, device=x.device)

    def call():
        dg.m_grouped_bf16_gemm_nt_contiguous(xp, w, d, idx)

    call()
    torch.cuda.synchronize()
    rows = torch.cat([torch.arange(s, s + m, device=x.device) for s, m in zip(starts, lengths) if m])
    what = "padded to 128 rows, untimed" if padded else "contiguous"
    return call, _check([(d[rows], y)], 1e-2), what


def prepare_k_grouped_fp8_wgrad(dg, dy, dys, x, xs, lengths: list[int], n: int, k: int, dw_ref):
    """FP8 WGRAD K-grouped, 1x128 per channel and 128 tokens on both sides, FP32 `+=`
    (`k_grouped_fp8_gemm_nt_contiguous`): dw[g] += dy_g^T x_g. `dy`, `x` are gemmspec's
    segment-major bytes (per expert [N, len] and [K, len], tokens contiguous); `dys` is
    [T/128, N], `xs` [T/128, K]. DeepGEMM needs every count a multiple of 128. `dw_ref`
    is gemmspec's result of one `+=` into zeros."""
    import torch

    if any(m % 128 for m in lengths):
        raise ValueError("DeepGEMM's K-grouped WGRAD takes 128-aligned counts only")
    e = len(lengths)
    layout = torch.tensor(lengths, dtype=torch.int32, device=dy.device)
    sfa = dys.t()  # [N, T/128], channels contiguous (MN-major)
    sfb = xs.t()
    d = torch.zeros((e, n, k), dtype=torch.float32, device=dy.device)

    def call():
        dg.k_grouped_fp8_gemm_nt_contiguous((dy, sfa), (x, sfb), d, list(lengths), layout, d, recipe=(1, 1, 128))

    call()
    torch.cuda.synchronize()
    check = _check([(d, dw_ref)], 1e-3)
    return call, check, "FP32 +=, 128-aligned counts"


def prepare_m_grouped_fp8_masked(dg, x, xs, w, ws, counts: list[int], y):
    """FP8 masked (`m_grouped_fp8_gemm_nt_masked`): x [G, M, K], xs [G, M, K/128]."""
    import torch

    e, mmax, k = x.shape
    n = w.shape[1]
    recipe = (1, 128, 128)
    sfa = dg.transform_sf_into_required_layout(xs, mmax, k, recipe, e, True)
    sfb = dg.transform_sf_into_required_layout(ws, n, k, recipe, e, False)
    masked = torch.tensor(counts, dtype=torch.int32, device=x.device)
    expected = max(1, sum(counts) // len(counts))
    d = torch.empty((e, mmax, n), dtype=torch.bfloat16, device=x.device)

    def call():
        dg.m_grouped_fp8_gemm_nt_masked((x, sfa), (w, sfb), d, masked, expected, recipe=recipe)

    call()
    torch.cuda.synchronize()
    pairs = [(d[g, :c], y[g, :c]) for g, c in enumerate(counts) if c]
    return call, _check(pairs, 2e-3), f"masked, expected_m {expected}"


def prepare_dense_fp8(dg, x, xs, w, ws, y):
    """FP8 dense 1x128 / 128x128 (`fp8_gemm_nt`): xs [T, K/128] MN-major, ws [N/128, K/128]."""
    import torch

    t, k = x.shape
    n = w.shape[0]
    recipe = (1, 128, 128)
    sfa = dg.transform_sf_into_required_layout(xs, t, k, recipe, None, True)
    sfb = dg.transform_sf_into_required_layout(ws, n, k, recipe, None, False)
    d = torch.empty((t, n), dtype=torch.bfloat16, device=x.device)

    def call():
        dg.fp8_gemm_nt((x, sfa), (w, sfb), d, recipe=recipe)

    call()
    torch.cuda.synchronize()
    return call, _check([(d, y)], 2e-3), "dense"
