"""The specs the bench builds, as .gspec texts with the sizes left to format, and the
build of one (with `--tile`'s directive where it forces a tile).
"""

from __future__ import annotations

from pathlib import Path

from ..build import build

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

FORCED_TILE: tuple[int, int] | None = None  # --tile: the same spec with a tile directive


def moe_spec(
    name: str = "moe",
    *,
    n: int,
    k: int,
    e: int,
    fp8: bool = False,
    out: str = "bf16",
    scales_major_t: bool = False,
    capacity: bool = False,
) -> str:
    """An M-grouped MoE GEMM: tokens in ragged expert segments, y = x * w[expert]^T.
    FP8 operands carry DeepSeek-V3 scales (1x128 activations, 128x128 weights), the
    activation scales token-contiguous with `scales_major_t`; an FP8 `out` carries 1x128
    scales (its epilogue quantizes it); `capacity` lets the offsets end below T."""
    t = "e4m3" if fp8 else "bf16"
    ys = " scale f32 [1, 128]" if out in ("e4m3", "e5m2") else ""
    xs = " scale f32 [1, 128]" + (" layout major(T)" if scales_major_t else "") if fp8 else ""
    ws = " scale f32 [1, 128, 128]" if fp8 else ""
    ragged = "ragged(T, offsets = offs, capacity)" if capacity else "ragged(T, offsets = offs)"
    return f"""
gemm {name} {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = {e}] = {ragged}
  tensor x : {t} [T, K]{xs}
  tensor w : {t} [E, N, K]{ws}
  tensor y : {out} [T, N]{ys}
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""


WGRAD = """
gemm wgrad {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}}
"""

MASKED_SPEC = """
gemm masked {{
  dim M = {m}, N = {n}, K = {k}
  group expert[E = {e}] = masked(M, counts = counts)
  tensor x : e4m3 [E, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [E, M, N]
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}}
"""

ROWWISE = """
gemm moe_rowwise {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, 1, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
{directive}}}
"""

GATHER = """
gemm moe_gather {{
  dim T, S
  dim N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}}
"""

DENSE = """
gemm dense {{
  dim T = {t}, N = {n}, K = {k}
  tensor x : e4m3 [T, K] scale f32 [1, 128] layout major(T)
  tensor w : e4m3 [N, K] scale f32 [128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}}
"""

LORA = """
gemm lora_shrink {{
  dim T
  dim K = {k}, R = {r}
  group lora[L = {l}]   = ragged(T, offsets = lora_offsets)
  group expert[E = {e}] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}}
"""

# The scaled LoRA expand (examples/lora_moe_scaled.gspec) as separate launches: the same
# nested grouped GEMM with no epilogue, into BF16 (what torch._grouped_mm returns too),
# then torch element-wise operations for the scaling, router weight, bias and `+=`.
LORA_EXPAND = """
gemm lora_expand {{
  dim T
  dim N = {n}, R = {r}
  group lora[L = {l}]   = ragged(T, offsets = lora_offsets)
  group expert[E = {e}] = ragged(T within lora, offsets = expert_offsets)
  tensor h  : bf16 [T, R]
  tensor wb : bf16 [L, E, N, R]
  tensor y2 : bf16 [T, N]
  y2[t, n] = sum[r] h[t, r] * wb[lora(t), expert(t), n, r]
}}
"""


# The expert FFN (examples/moe_ffn_fp8.gspec) and the same work as separate launches: the
# up-projection into BF16, its quantization, the down-projection.
FFN_DIMS = "dim H = {h}, N = {n}, F = {f}"
FFN_UP_BF16 = """
gemm ffn_up_bf16 {{
  dim T, S
  {dims}
  group expert[E = {e}] = ragged(T, offsets = expert_offsets)
  tensor src  : i32 [T]
  tensor x    : e4m3 [S, H] scale f32 [1, 128]
  tensor w_up : e4m3 [E, N, H] scale f32 [1, 128, 128]
  tensor h    : bf16 [T, F]
  h[t, j] = silu(sum[k] x[src[t], k] * w_up[expert(t), 2*j, k]) * sum[k] x[src[t], k] * w_up[expert(t), 2*j + 1, k]
}}
"""
FFN_DOWN = """
gemm ffn_down{suffix} {{
  dim T
  {dims}
  group expert[E = {e}] = ragged(T, offsets = expert_offsets)
  tensor dst     : i32 [T]
  {h}
  tensor w_down  : e4m3 [E, H, F] scale f32 [1, 128, 128]
  tensor route_w : f32  [T]
  tensor y       : bf16 [T, H]
  y[dst[t], n] = route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]
}}
"""
FFN_H_QUANTIZE_PASS = "tensor hb : bf16 [T, F]\n  tensor h : e4m3 [T, F] scale f32 [1, 128] = quantize(hb)"
FFN_H_FP8 = "tensor h : e4m3 [T, F] scale f32 [1, 128]"


# The decode FFN (examples/moe_ffn_fp8_decode.gspec: gathered rows, SwiGLU over separate
# gate and up weights into FP8 h, the weighted down-projection, the top-k combine by
# scatter_add) at another model's sizes, and its steps as separate specs: the
# up-projection, then the down-projection into the routed rows (their combine is torch's).
FFN_DECODE_EXAMPLE = "moe_ffn_fp8_decode"
FFN_DECODE_UP = """
gemm ffn_decode_up {{
  dim T, S
  dim H = {h}, F = {f}
  group expert[E = {e}] = ragged(T, offsets = expert_offsets)
  tensor src : i32 [T]
  tensor x   : e4m3 [S, H] scale f32 [1, 128]
  tensor wg  : e4m3 [E, F, H] scale f32 [1, 128, 128]
  tensor wu  : e4m3 [E, F, H] scale f32 [1, 128, 128]
  tensor h   : e4m3 [T, F] scale f32 [1, 128]
  h[t, j] = silu(sum[k] x[src[t], k] * wg[expert(t), j, k]) * sum[k] x[src[t], k] * wu[expert(t), j, k]
}}
"""
FFN_DECODE_DOWN = """
gemm ffn_decode_down {{
  dim T
  dim H = {h}, F = {f}
  group expert[E = {e}] = ragged(T, offsets = expert_offsets)
  tensor h       : e4m3 [T, F] scale f32 [1, 128]
  tensor w_down  : e4m3 [E, H, F] scale f32 [1, 128, 128]
  tensor route_w : f32  [T]
  tensor y_rows  : bf16 [T, H]
  y_rows[t, n] = route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]
}}
"""


def ffn_decode_text(*, hidden: int, f: int, e: int, name: str = FFN_DECODE_EXAMPLE) -> str:
    """examples/moe_ffn_fp8_decode.gspec (DeepSeek-V3: hidden 7168, intermediate 2048, 256
    experts) at `hidden`, `f` and `e`, named `name`."""
    text = example_text(FFN_DECODE_EXAMPLE)
    for old, new in (("H = 7168", f"H = {hidden}"), ("F = 2048", f"F = {f}"), ("E = 256", f"E = {e}"),
                     (f"gemm {FFN_DECODE_EXAMPLE} {{", f"gemm {name} {{")):
        if old not in text:
            raise ValueError(f"examples/{FFN_DECODE_EXAMPLE}.gspec no longer says '{old}'")
        text = text.replace(old, new, 1)
    return text


def with_directive(text: str, directive: str) -> str:
    """A one-spec text with `directive` added as its last item."""
    body = text.rstrip().rstrip("}")
    return f"{body}  {directive}\n}}\n"


def build_spec(text: str):
    """`text` built by gemmspec, with `tile(M, N)` added where `--tile` forces one."""
    if FORCED_TILE is not None:
        text = with_directive(text, f"tile({FORCED_TILE[0]}, {FORCED_TILE[1]})")
    return build(text)


def example_text(name: str) -> str:
    """The text of examples/<name>.gspec."""
    return (EXAMPLES / f"{name}.gspec").read_text()
