"""How the bench judges an output: its relative error against a reference, and the
check that passes it (a string for the table) or stops the row. The rows and the
anchors both check with these.
"""

from __future__ import annotations

from .inputs import load_torch


def dequantized(q, scale, block_rows: int, block_cols: int):
    """Float64 values of `q` times its scale grid, each scale repeated over its block."""
    torch = load_torch()
    grid = scale.to(torch.float64).repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return q.to(torch.float64) * grid


def rel_error(out, ref) -> float:
    torch = load_torch()
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref).clamp_min(1e-300))


def checked(err: float, limit: float, against: str) -> str:
    if not err < limit:  # NaN fails too
        raise AssertionError(f"gemmspec differs from {against}: rel error {err:.3e} >= {limit:.0e}")
    return f"{against}: {err:.2e}"


def elementwise(name: str, got, ref, dtype: str, against: str) -> str:
    """`got` against the float64 `ref` element by element, by the rule of `gemmspec run`
    (verify.compare_output: within rtol*|ref| + atol*rms(row) for an output of type
    `dtype`, every element finite); raises with the worst elements, else says how close."""
    from ..runtime.verify import compare_output

    torch = load_torch()
    c = compare_output(name, got.detach().to(torch.float64).cpu().numpy(), ref.detach().to(torch.float64).cpu().numpy(),
                       dtype=dtype)
    if not c.ok:
        raise AssertionError(f"gemmspec differs from {against}: {c.describe()}")
    return f"{name} vs {against}: {c.over_bound} of {c.elements} over bound, rel {c.rel_error:.2e}"
