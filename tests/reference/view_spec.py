"""A QKV LoRA as one spec: the shrink writes a [T, 3R], the expand reads it through the
view a3 [T, 3, R] (small sizes, the example's form), for the CPU and GPU tests."""

from __future__ import annotations

import numpy as np

from gemmspec.reference.data import quantize

SHRINK = "a[t, r3] = sum[k] x[t, k] * wa[lora(t), r3, k]"
EXPAND = "y[t, n] = sum[r] a3[t, slice(n), r] * wb[lora(t), n, r]"

QKV_VIEW = """
gemm qkv_view {{
  dim T
  dim K = {k}, R = 16, R3 = 48, N = 96
  group lora[L = 3]  = ragged(T, offsets = lora_offsets)
  group slice[S = 3] = split(N, sizes = [64, 16, 16])
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [L, R3, K]
  tensor a  : bf16 [T, R3]
  tensor a3 : bf16 [T, S, R] = view(a)
  tensor wb : bf16 [L, N, R]
  tensor y  : {y} [T, N]
  {first}
  {second}
}}
"""


def qkv_view(k: int = 200, y: str = "bf16", expand_first: bool = False) -> str:
    """The spec; `expand_first` writes the expand before the shrink in the source."""
    first, second = (EXPAND, SHRINK) if expand_first else (SHRINK, EXPAND)
    return QKV_VIEW.format(k=k, y=y, first=first, second=second)


def expected(x: np.ndarray, wa: np.ndarray, wb: np.ndarray, lengths: list[int], y_type: str) -> dict[str, np.ndarray]:
    """a and y by hand, in float64: a rounded to bf16 as the shrink stores it, and y's
    column slice s (q: 64, k and v: 16 wide) from a's columns 16s .. 16s + 15."""
    t = x.shape[0]
    a = np.zeros((t, 48))
    y = np.zeros((t, 96))
    starts = np.concatenate([[0], np.cumsum(lengths)])
    for lo in range(len(lengths)):
        rows = slice(starts[lo], starts[lo + 1])
        a[rows] = x[rows] @ wa[lo].T
    a = quantize(a, "bf16")
    cols = [(0, 64), (64, 80), (80, 96)]
    for lo in range(len(lengths)):
        rows = slice(starts[lo], starts[lo + 1])
        for s, (c0, c1) in enumerate(cols):
            y[rows, c0:c1] = a[rows, 16 * s : 16 * s + 16] @ wb[lo, c0:c1].T
    return {"a": a, "y": quantize(y, y_type)}
