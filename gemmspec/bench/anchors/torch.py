"""PyTorch as the anchor of `gemmspec bench`: its grouped and scaled GEMMs timed on the
inputs gemmspec ran on, and the torch operations of the cases' separate-launch paths.

torch's grouped FP8 GEMM takes rowwise scales only: where a row's gemmspec launch has
blockwise scales, the anchor runs on random rowwise scales of the same shapes (its time
counts, its values are not compared).
"""

from __future__ import annotations

from ..compare import rel_error
from ..inputs import load_torch, random_scales
from ..timing import Result, result, timed
from . import Problem


def scaled_grouped_mm(name: str, repeat: int, p: Problem) -> list[Result]:
    """FP8 M-grouped `torch._scaled_grouped_mm` over the row's offsets, with the row's
    rowwise scales (`sa`, `sb`) where it has them: with its default accumulation
    (`use_fast_accum=False`, promoted as gemmspec's default is) and, for a row with
    rowwise scales, `use_fast_accum=True` beside gemmspec's accumulate(fast)."""
    torch = load_torch()
    x, w = p.x, p.w
    if getattr(p, "sa", None) is None:
        sa, sb = random_scales((x.shape[0],)), random_scales((w.shape[0], w.shape[1]))
    else:
        sa, sb = p.sa, p.sb
    ends = p.offs[1:].contiguous()

    def call(fast: bool):
        return lambda: torch._scaled_grouped_mm(
            x, w.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16, use_fast_accum=fast
        )

    out = [result(name, "torch._scaled_grouped_mm (rowwise scales)", timed(call(False), repeat), p.work, unit=p.unit)]
    if getattr(p, "sa", None) is not None:
        out.append(
            result(name, "torch._scaled_grouped_mm (rowwise scales, use_fast_accum)", timed(call(True), repeat), p.work,
                   unit=p.unit)
        )
    return out


def scaled_grouped_mm_3d(name: str, repeat: int, p: Problem) -> list[Result]:
    """FP8 `torch._scaled_grouped_mm` on the [E, M, K] batch: every row of every group,
    whatever the counts say."""
    torch = load_torch()
    x, w = p.x, p.w
    e, mmax, _ = x.shape
    sa, sb = random_scales((e, mmax)), random_scales((e, w.shape[1]))
    return [
        result(
            name,
            f"torch._scaled_grouped_mm 3D (all {mmax} rows, rowwise)",
            timed(lambda: torch._scaled_grouped_mm(x, w.transpose(-2, -1), sa, sb, out_dtype=torch.bfloat16), repeat),
            p.work,
            unit=p.unit,
        )
    ]


def grouped_mm(name: str, repeat: int, p: Problem) -> list[Result]:
    """BF16 M-grouped `torch._grouped_mm` over the row's offsets."""
    torch = load_torch()
    x, w, ends = p.x, p.w, p.offs[1:].contiguous()
    return [
        result(name, "torch._grouped_mm", timed(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), repeat), p.work, unit=p.unit)
    ]


def grouped_mm_leaves(name: str, repeat: int, p: Problem) -> list[Result]:
    """`torch._grouped_mm` over a nest's leaves flattened (torch has no nesting): one group
    per leaf, `w` [leaves, N, K], `ends` each leaf's last row."""
    torch = load_torch()
    x, w, ends = p.x, p.w, p.ends
    impl = f"torch._grouped_mm ({w.shape[0]} groups)"
    return [result(name, impl, timed(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), repeat), p.work, unit=p.unit)]


def grouped_mm_k(name: str, repeat: int, p: Problem) -> list[Result]:
    """The WGRAD's shape as a K-grouped `torch._grouped_mm` in BF16 on random operands
    (torch has no FP8 K-grouped GEMM, nor an accumulating one)."""
    torch = load_torch()
    t = sum(p.lengths)
    a = torch.randn((p.n, t), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((p.k, t), device="cuda", dtype=torch.bfloat16).t()
    ends = p.offs[1:].contiguous()
    return [
        result(name, "torch._grouped_mm K-grouped (BF16, no +=)", timed(lambda: torch._grouped_mm(a, b, offs=ends), repeat), p.work,
               unit=p.unit)
    ]


def gather_scaled_grouped_mm(name: str, repeat: int, p: Problem) -> list[Result]:
    """The routed rows copied by `index_select` (scales too), then `_scaled_grouped_mm`."""
    torch = load_torch()
    x, w, offs = p.x, p.w, p.offs
    sa, sb = random_scales((x.shape[0],)), random_scales((w.shape[0], w.shape[1]))
    ends = offs[1:].contiguous()
    rows = p.idx.long()

    def anchor():
        xg = x.view(torch.uint8).index_select(0, rows).view(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(xg, w.transpose(-2, -1), sa.index_select(0, rows), sb, offs=ends,
                                        out_dtype=torch.bfloat16)

    return [result(name, "torch index_select + _scaled_grouped_mm", timed(anchor, repeat), p.work, unit=p.unit)]


def _blockwise_scaled_mm(x, xs, w, ws):
    """torch._scaled_mm with 1x128 / 128x128 scales (cuBLASLt); the scale layouts it
    accepts have moved between releases, so try the known ones."""
    torch = load_torch()
    tries = [
        lambda: torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws.t(), out_dtype=torch.bfloat16),
        lambda: torch._scaled_mm(x, w.t(), scale_a=xs, scale_b=ws, out_dtype=torch.bfloat16),
        lambda: torch._scaled_mm(x, w.t(), scale_a=xs.contiguous(), scale_b=ws.t().contiguous(), out_dtype=torch.bfloat16),
    ]
    errors = []
    for fn in tries:
        try:
            fn()
            return fn
        except Exception as exc:  # noqa: BLE001 - report every layout that was refused
            errors.append(str(exc).splitlines()[0])
    raise RuntimeError("torch._scaled_mm refused every blockwise layout: " + " | ".join(errors))


def scaled_mm_blockwise(name: str, repeat: int, p: Problem) -> list[Result]:
    """Dense FP8 `torch._scaled_mm` with the row's own 1x128 / 128x128 scales, its error
    against the row's float64 reference (`ref` on `ref_rows`) reported beside it."""
    anchor = _blockwise_scaled_mm(p.x, p.xs, p.w, p.ws)
    a_err = rel_error(anchor()[p.ref_rows], p.ref)
    return [result(name, "torch._scaled_mm 1x128/128x128", timed(anchor, repeat), p.work, unit=p.unit,
                   check=f"its own error vs float64: {a_err:.2e}")]


# ------------------------------------------------------- torch in separate-launch paths
def lora_epilogue_ops(y, y2, scaling, route_w, bias, lora_idx, expert_idx) -> None:
    """`y += scaling[lora(t)] * route_w[t] * y2 + bias[expert(t)]` by torch operations: the
    update in FP32, added into y and rounded once."""
    torch = load_torch()
    coef = (scaling[lora_idx] * route_w).unsqueeze(1)
    y.add_(torch.addcmul(bias[expert_idx], y2, coef))


def quantize_1x128(value):
    """`value` (2-D) in e4m3 with one f32 scale per row and 128 columns, by torch operations:
    amax / 448 (1 where that is 0), as the quantize pass computes it."""
    torch = load_torch()
    rows, cols = value.shape
    blocks = value.float().view(rows, cols // 128, 128)
    amax = blocks.abs().amax(dim=-1)
    quotient = amax / 448.0
    scale = torch.where(quotient > 0, quotient, torch.ones_like(amax))
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rows, cols), scale
