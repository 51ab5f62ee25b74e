"""Wrong specs as a new user writes them from the docs, for DeepSeek-V3's routed experts,
Qwen3-30B-A3B's MoE, Mixtral 8x7B's expert FFN and multi-LoRA over QKV: each with where
the checker must point, what it must say, and how many of its proposed fixes it takes
until the spec checks (`test_fixit_corpus.py` applies them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Case:
    name: str
    text: str
    at: str  # "LINE:COLUMN" of the first error
    message: str  # a part of its message
    steps: int = 1  # fixes applied until the spec checks


# DeepSeek-V3 routed experts: hidden 7168, expert FFN 2048, 256 experts.
DSV3_FP8 = """\
gemm dsv3_up {{
  dim T
  dim N = 2048, K = 7168
  group expert[E = 256] = ragged(T, offsets = expert_offsets)
  tensor x : e4m3 [T, K]{x}
  tensor w : e4m3 [E, N, K]{w}
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""

CASES: list[Case] = [
    Case(
        "dsv3_x_no_scale",
        DSV3_FP8.format(x="", w=" scale f32 [1, 128, 128]"),
        "8:20", "FP8 operand 'x' has no scale",
    ),
    Case(
        "dsv3_w_no_scale",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=""),
        "8:30", "FP8 operand 'w' has no scale",
    ),
    Case(
        "dsv3_no_scales",
        DSV3_FP8.format(x="", w=""),
        "8:20", "FP8 operand 'x' has no scale", steps=2,
    ),
    Case(
        "dsv3_x_per_element_scale",
        DSV3_FP8.format(x=" scale f32 [1, 1]", w=" scale f32 [1, 128, 128]"),
        "5:40", "changes every 1 element along the contracted dim K",
    ),
    Case(
        "dsv3_x_64_wide_scale",
        DSV3_FP8.format(x=" scale f32 [1, 64]", w=" scale f32 [1, 128, 128]"),
        "5:40", "changes every 64 elements along the contracted dim K",
    ),
]

# DeepSeek-V3 WGRAD of the up-projection: contracted over each expert's tokens.
DSV3_WGRAD = """\
gemm dsv3_up_wgrad {{
  dim T
  dim N = 2048, K = 7168
  group expert[E = 256] = ragged(T, offsets = expert_offsets)
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x  : e4m3 [T, K]{x}
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy[t, n] * x[t, k]
}}
"""

# Qwen3-30B-A3B MoE: hidden 2048, expert FFN 768, 128 experts, top-8, in BF16.
QWEN3_DOWN = """\
gemm qwen3_down {{
  dim T, S
  dim H = 2048, F = 768
  group expert[E = 128] = ragged(T, offsets = expert_offsets)
{decls}
}}
"""

# Mixtral 8x7B expert FFN: hidden 4096, FFN 14336, 8 experts, top-2.
MIXTRAL = """\
gemm mixtral_w1 {{
  dim T
  dim H = 4096, F = 14336
{decls}
}}
"""

# Multi-LoRA over the packed QKV projection of a 4096-wide model (8 KV heads of 128).
LORA_QKV = """\
gemm lora_qkv {{
  dim T
  dim K = 4096, R = 16
  dim N = 6144
{decls}
}}
"""

CASES += [
    Case(
        "dsv3_w_64_wide_scale_along_k",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 64]"),
        "6:48", "changes every 64 elements along the contracted dim K",
    ),
    Case(
        "dsv3_w_256_wide_scale_along_k",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 256]"),
        "6:48", "scale block 256 along the contracted dim K is not supported",
    ),
    Case(
        "dsv3_w_scale_across_experts",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [8, 128, 128]"),
        "6:40", "spans several groups",
    ),
    Case(
        "dsv3_x_per_channel_w_blockwise",
        DSV3_FP8.format(x=" scale f32 [1, K]", w=" scale f32 [1, 128, 128]"),
        "5:40", "has one scale along the whole contracted dim K",
    ),
    Case(
        "dsv3_w_stored_n_major",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" layout major(N) scale f32 [1, 128, 128]"),
        "8:30", "FP8 operand 'w' is not K-major",
    ),
    Case(
        "dsv3_w_declared_k_by_n",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "tensor w : e4m3 [E, N, K]", "tensor w : e4m3 [E, K, N]"
        ).replace("w[expert(t), n, k]", "w[expert(t), k, n]"),
        "8:30", "FP8 operand 'w' is not K-major",
    ),
    Case(
        "dsv3_wgrad_x_no_scale",
        DSV3_WGRAD.format(x=""),
        "5:38", "scale of 'dy' changes every 1 element along the contracted dim T", steps=3,
    ),
    Case(
        "dsv3_wgrad_x_row_scales",
        DSV3_WGRAD.format(x=" scale f32 [1, 128]"),
        "5:38", "scale of 'dy' changes every 1 element along the contracted dim T", steps=2,
    ),
    Case(
        "dsv3_fp8_output_no_scale",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "tensor y : bf16 [T, N]", "tensor y : e4m3 [T, N]"
        ),
        "8:3", "FP8 output 'y' has no scale",
    ),
    Case(
        "dsv3_fp8_output_per_tensor_scale",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "tensor y : bf16 [T, N]", "tensor y : e4m3 [T, N] scale f32 [1, N]"
        ),
        "7:40", "FP8 output 'y' has scale block",
    ),
    Case(
        "dsv3_fp8_output_padded",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "tensor y : bf16 [T, N]", "tensor y : e4m3 [T, N] layout row_major pad 64 scale f32 [1, 128]"
        ),
        "7:26", "pad",
    ),
    Case(
        "dsv3_bf16_activations_fp8_weights",
        DSV3_FP8.format(x="", w=" scale f32 [1, 128, 128]").replace(
            "tensor x : e4m3 [T, K]", "tensor x : bf16 [T, K]"
        ),
        "8:30", "must both be FP8",
    ),
    Case(
        "dsv3_offsets_forgotten",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "ragged(T, offsets = expert_offsets)", "ragged(T)"
        ),
        "4:35", "unexpected ')'",
    ),
    Case(
        "dsv3_typo_in_tensor_name",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "* w[expert(t)", "* wt[expert(t)"
        ),
        "8:30", "unknown tensor 'wt'",
    ),
    Case(
        "dsv3_typo_in_group_name",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "w[expert(t)", "w[experts(t)"
        ),
        "8:32", "unknown group 'experts'",
    ),
    Case(
        "dsv3_typo_in_dim_name",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "tensor y : bf16 [T, N]", "tensor y : bf16 [T, n]"
        ),
        "7:23", "unknown dim 'n'",
    ),
    Case(
        "qwen3_topk_combine_scattered_add",
        QWEN3_DOWN.format(decls="""\
  tensor h       : bf16 [T, F]
  tensor w_down  : bf16 [E, H, F]
  tensor src     : i32 [T]
  tensor route_w : f32 [T]
  tensor y       : bf16 [S, H]
  y[src[t], n] += route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]"""),
        "10:5", "written through src[t] with +=",
    ),
    Case(
        "qwen3_index_tensor_undeclared",
        QWEN3_DOWN.format(decls="""\
  tensor x      : bf16 [S, H]
  tensor w_gate : bf16 [E, F, H]
  tensor g      : bf16 [T, F]
  g[t, f] = sum[k] x[idx[t], k] * w_gate[expert(t), f, k]"""),
        "8:22", "unknown index tensor 'idx'",
    ),
    Case(
        "qwen3_index_tensor_wrong_type",
        QWEN3_DOWN.format(decls="""\
  tensor x      : bf16 [S, H]
  tensor idx    : f32 [T]
  tensor w_gate : bf16 [E, F, H]
  tensor g      : bf16 [T, F]
  g[t, f] = sum[k] x[idx[t], k] * w_gate[expert(t), f, k]"""),
        "9:22", "'idx' is f32",
    ),
    Case(
        "qwen3_gate_typo",
        QWEN3_DOWN.format(decls="""\
  tensor x      : bf16 [T, H]
  tensor w_gate : bf16 [E, F, H]
  tensor g      : bf16 [T, F]
  g[t, f] = sum[k] x[t, k] * w_gat[expert(t), f, k]"""),
        "8:30", "unknown tensor 'w_gat'",
    ),
    Case(
        "mixtral_offsets_forgotten",
        MIXTRAL.format(decls="""\
  group expert[E = 8] = ragged(T)
  tensor x  : bf16 [T, H]
  tensor w1 : bf16 [E, F, H]
  tensor g  : bf16 [T, F]
  g[t, f] = sum[k] x[t, k] * w1[expert(t), f, k]"""),
        "4:33", "unexpected ')'",
    ),
    Case(
        "mixtral_fp8_no_scales",
        MIXTRAL.format(decls="""\
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor x  : e4m3 [T, H]
  tensor w1 : e4m3 [E, F, H]
  tensor g  : bf16 [T, F]
  g[t, f] = sum[k] x[t, k] * w1[expert(t), f, k]"""),
        "8:20", "FP8 operand 'x' has no scale", steps=2,
    ),
    Case(
        "mixtral_fp8_out_no_scale",
        MIXTRAL.format(decls="""\
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor x  : e4m3 [T, H] scale f32 [1, 128]
  tensor w1 : e4m3 [E, F, H] scale f32 [1, 128, 128]
  tensor g  : e4m3 [T, F]
  g[t, f] = sum[k] x[t, k] * w1[expert(t), f, k]"""),
        "8:3", "FP8 output 'g' has no scale",
    ),
    Case(
        "lora_over_moe_not_nested",
        LORA_QKV.format(decls="""\
  group lora[L = 4]   = ragged(T, offsets = lora_offsets)
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [L, E, R, K]
  tensor h  : f32 [T, R]
  h[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]"""),
        "10:3", "both split T, but neither is declared within the other",
    ),
    Case(
        "lora_over_moe_inner_declared_first",
        LORA_QKV.format(decls="""\
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  group lora[L = 4]   = ragged(T, offsets = lora_offsets)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [E, L, R, K]
  tensor h  : f32 [T, R]
  h[t, r] = sum[k] x[t, k] * wa[expert(t), lora(t), r, k]"""),
        "10:3", "groups 'expert' and 'lora' both split T",
    ),
    Case(
        "lora_qkv_expand_uniform_heads_not_nested",
        LORA_QKV.format(decls="""\
  group head[H = 4]  = uniform(T)
  group lora[L = 4]  = ragged(T, offsets = lora_offsets)
  tensor h  : bf16 [T, R]
  tensor wb : bf16 [H, L, N, R]
  tensor y  : bf16 [T, N]
  y[t, n] += sum[r] h[t, r] * wb[head(t), lora(t), n, r]""").replace("dim T\n", "dim T = 512\n"),
        "10:3", "groups 'head' and 'lora' both split T",
    ),
    Case(
        "dsv3_wgrad_scale_blocks_not_anchored",
        DSV3_WGRAD.format(x=" layout segment_major(expert) scale f32 [128, 1]").replace(
            "tensor dy : e4m3 [T, N] scale f32 [1, 128]",
            "tensor dy : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert",
        ),
        "6:67", "would straddle the segments of 'expert'",
    ),
    Case(
        "lora_fp8_expand_no_scale_on_b",
        LORA_QKV.format(decls="""\
  group lora[L = 4] = ragged(T, offsets = lora_offsets)
  tensor h  : e4m3 [T, R] scale f32 [1, R]
  tensor wb : e4m3 [L, N, R]
  tensor y  : bf16 [T, N]
  y[t, n] += sum[r] h[t, r] * wb[lora(t), n, r]"""),
        "9:31", "FP8 operand 'wb' has no scale",
    ),
    Case(
        "spec_named_after_a_keyword",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "gemm dsv3_up", "gemm sum"
        ),
        "1:6", "is a word of the language",
    ),
    Case(
        "c_style_comment",
        DSV3_FP8.format(x=" scale f32 [1, 128]", w=" scale f32 [1, 128, 128]").replace(
            "  dim T\n", "  dim T  // tokens\n"
        ),
        "2:10", "unexpected character '/'",
    ),
]

# Multi-LoRA over QKV as one spec: the shrink writes a [T, 3R], the expand reads it
# through a view [T, 3, R] (examples/lora_qkv_one_spec.gspec).
LORA_QKV_VIEW = """\
gemm lora_qkv_one_spec {{
  dim T
  dim K = 4096, R = 16, R3 = 48, N = 6144
  group lora[L = 4]  = ragged(T, offsets = lora_offsets)
  group slice[S = 3] = split(N, sizes = [4096, 1024, 1024])
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [L, R3, K]
  tensor a  : bf16 [T, R3]{a}
  tensor a3 : {a3} [T, S, R]{a3_layout} = view({source})
  tensor wb : bf16 [L, N, R]
  tensor y  : bf16 [T, N]{more}
  a[t, r3] = sum[k] x[t, k] * wa[lora(t), r3, k]
  y[t, n]  = sum[r] a3[t, slice(n), r] * wb[lora(t), n, r]
}}
"""


def _qkv_view(a="", a3="bf16", a3_layout="", source="a", more=""):
    return LORA_QKV_VIEW.format(a=a, a3=a3, a3_layout=a3_layout, source=source, more=more)


CASES += [
    Case(
        "lora_view_of_another_type",
        _qkv_view(a3="f16"), "9:15", "'a3' is f16 but views 'a', which is bf16",
    ),
    Case(
        "lora_view_of_a_view",
        _qkv_view(source="a2", more="\n  tensor a2 : bf16 [T, R3] = view(a)"),
        "9:37", "'a2' is itself a view of 'a'",
    ),
    Case(
        "lora_view_of_a_column_major_source",
        _qkv_view(a=" layout major(T)"),
        "9:37", "does not address the elements of 'a' (stored major(T)",
    ),
    Case(
        "lora_view_of_a_segment_major_source",
        _qkv_view(a=" layout segment_major(lora)"),
        "9:37", "'a' is stored segment_major(lora), in segments",
    ),
    Case(
        "lora_view_with_strides_of_its_own",
        _qkv_view(a3_layout=" layout major(T)"),
        "9:30", "'a3' (strides 1, 16*T, T) does not address the elements of 'a'",
    ),
    Case(
        "lora_view_of_another_type_of_a_view",
        _qkv_view(a3="f16", source="a2", more="\n  tensor a2 : bf16 [T, R3] = view(a)"),
        "9:36", "'a2' is itself a view of 'a'", steps=2,
    ),
]

# DeepSeek-V3's up-projection writing h twice, for the down-projection and its WGRAD
# (language.md, copies of an FP8 output), with the copy's scales asked as powers of two.
DSV3_UP_COPY = """\
gemm dsv3_up_train {{
  dim T
  dim F = 2048, K = 7168
  group expert[E = 256] = ragged(T, offsets = expert_offsets)
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : e4m3 [E, F, K] scale f32 [1, 128, 128]
  tensor h   : e4m3 [T, F] scale f32 [1, 128]
  tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert{pow2} = copy(h, pow2)
  h[t, f] = sum[k] x[t, k] * w[expert(t), f, k]
}}
"""

# DeepSeek-V3 WGRAD of the up-projection from dy as the forward's DGRAD left it (1x128
# scales), requantized to 128x1 blocks per expert.
DSV3_WGRAD_REQUANTIZED = """\
gemm dsv3_up_wgrad {{
  dim T
  dim N = 2048, K = 7168
  group expert[E = 256] = ragged(T, offsets = expert_offsets)
  tensor dy   : e4m3 [T, N] scale f32 [1, 128]
  tensor dy_t : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy, {options})
  tensor x_t  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dw   : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_t[t, n] * x_t[t, k]
}}
"""

# Qwen3-30B-A3B's down-projection DGRAD: the router-weighted rows and the router weight's
# gradient as row passes (language.md, row passes).
QWEN3_DOWN_DGRAD = """\
gemm qwen3_down_dgrad {{
  dim T
  dim H = 2048, F = 768
  group expert[E = 128] = ragged(T, offsets = expert_offsets)
  tensor dy      : bf16 [T, H]
  tensor w_down  : bf16 [E, H, F]
  tensor h       : bf16 [T, F]
  tensor route_w : f32 [T]
  tensor g       : bf16 [T, F]
  tensor dh      : bf16 [T, F] = rowscale(g, {weight})
  tensor drw     : {drw} = rowdot(g, h)
  g[t, f] = sum[n] dy[t, n] * w_down[expert(t), n, f]
}}
"""

CASES += [
    # The note declares the index tensor over the dim its index ranges over (T, the rows
    # the expert group splits), not over the dim it was declared with.
    Case(
        "qwen3_index_tensor_wrong_type_and_dim",
        QWEN3_DOWN.format(decls="""\
  tensor x      : bf16 [S, H]
  tensor idx    : bf16 [F]
  tensor w_gate : bf16 [E, F, H]
  tensor g      : bf16 [T, F]
  g[t, f] = sum[k] x[idx[t], k] * w_gate[expert(t), f, k]"""),
        "9:22", "'idx' is bf16, but idx[t] reads it as an index tensor",
    ),
    Case(
        "qwen3_index_tensor_of_token_rows",
        QWEN3_DOWN.format(decls="""\
  tensor x      : bf16 [S, H]
  tensor idx    : i32 [S, H]
  tensor w_gate : bf16 [E, F, H]
  tensor g      : bf16 [T, F]
  g[t, f] = sum[k] x[idx[t], k] * w_gate[expert(t), f, k]"""),
        "6:27", "'idx' is i32, an index tensor, but has 2 dims [S, H]",
    ),
    Case(
        "qwen3_router_weight_read_as_an_index",
        QWEN3_DOWN.format(decls="""\
  tensor x       : bf16 [S, H]
  tensor route_w : f32 [T]
  tensor w_gate  : bf16 [E, F, H]
  tensor g       : bf16 [T, F]
  g[t, f] = route_w[t] * sum[k] x[route_w[t], k] * w_gate[expert(t), f, k]"""),
        "9:35", "'route_w' is f32, but route_w[t] reads it as an index tensor",
    ),
    Case(
        "qwen3_gather_and_scatter_indices_undeclared",
        QWEN3_DOWN.format(decls="""\
  tensor x      : bf16 [S, H]
  tensor w_gate : bf16 [E, F, H]
  tensor g      : bf16 [S, F]
  g[src[t], f] = sum[k] x[idx[t], k] * w_gate[expert(t), f, k]"""),
        "8:5", "unknown index tensor 'src'", steps=2,
    ),
    Case(
        "dsv3_gathered_per_channel_scales",
        DSV3_FP8.format(x=" scale f32 [1, K]", w=" scale f32 [1, 1, K]").replace(
            "dim T\n", "dim T, S\n"
        ).replace("tensor x : e4m3 [T, K]", "tensor idx : i32 [T]\n  tensor x : e4m3 [S, K]").replace(
            "x[t, k]", "x[idx[t], k]"
        ),
        "9:22", "'x' has per-channel scales (one along the whole of K), which a gathered operand",
    ),
    Case(
        "dsv3_wgrad_requantize_pow2",
        DSV3_WGRAD_REQUANTIZED.format(options="pow2"),
        "6:112", "'pow2' is not an option of requantize: its options are the keywords `rows = IDX`",
    ),
    Case(
        "dsv3_wgrad_requantize_pow2_after_rows",
        DSV3_WGRAD_REQUANTIZED.format(options="rows = dst, pow2").replace(
            "  tensor dy   :", "  tensor dst  : i32 [T]\n  tensor dy   :"
        ),
        "7:124", "power-of-two scales are written by `quantize(SOURCE, pow2)`",
    ),
    Case(
        "dsv3_copy_pow2_as_an_option",
        DSV3_UP_COPY.format(pow2=""), "8:104", "copy(...) takes no options, but 'pow2' is given",
    ),
    Case(
        "dsv3_copy_pow2_twice",
        DSV3_UP_COPY.format(pow2=" pow2"), "8:109", "write `pow2` after the scale block of the copy",
    ),
    Case(
        "qwen3_topk_combine_fp8_target",
        QWEN3_DOWN.format(decls="""\
  tensor h       : bf16 [T, F]
  tensor w_down  : bf16 [E, H, F]
  tensor src     : i32 [T]
  tensor route_w : f32 [T]
  tensor y_rows  : bf16 [T, H]
  tensor y       : e4m3 [S, H] scale f32 [1, 128] = scatter_add(y_rows, rows = src)
  y_rows[t, n] = route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]"""),
        "10:10", "scatter_add writes rows of 'y_rows': 'y' must be an unscaled bf16, f16 or f32",
    ),
    Case(
        "qwen3_topk_combine_other_columns",
        QWEN3_DOWN.format(decls="""\
  tensor h       : bf16 [T, F]
  tensor w_down  : bf16 [E, H, F]
  tensor src     : i32 [T]
  tensor route_w : f32 [T]
  tensor y_rows  : bf16 [T, H]
  tensor y       : bf16 [S, F] = scatter_add(y_rows, rows = src)
  y_rows[t, n] = route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]"""),
        "10:10", "scatter_add adds whole rows: the columns of 'y' [S, F]",
    ),
    Case(
        "qwen3_rowscale_weight_without_keyword",
        QWEN3_DOWN_DGRAD.format(weight="route_w", drw="f32 [T]"),
        "10:46", "'route_w' is not an option of rowscale",
    ),
    Case(
        "qwen3_rowdot_target_bf16",
        QWEN3_DOWN_DGRAD.format(weight="weight = route_w", drw="bf16 [T]"),
        "11:10", "rowdot writes one f32 per row: 'drw' must be an unscaled, contiguous f32 [T]",
    ),
]

CASES += [
    # x arrives in FP8 with 1x128 scales: the WGRAD operand in 128x1 blocks is a requantize.
    Case(
        "dsv3_wgrad_quantize_of_fp8",
        DSV3_WGRAD_REQUANTIZED.format(options="").replace("requantize(dy, )", "quantize(dy)"),
        "6:97", "quantize reads an unscaled bf16, f16 or f32 tensor, but 'dy' is e4m3 with a scale",
    ),
]
