"""The spec the scatter_add tests share: a 16-bit statement whose output dxr feeds a
scatter_add (the gradient of rows read through src), and a second scatter_add of an f16
input with padded rows into an f32 target. Line 9 is dx's declaration, line 10 dx2's."""

K = 136  # a multiple of 8 bf16 columns (16-byte loads), not of 128

SCATTER_ADD_SPEC = f"""\
gemm sa {{
  dim T, S
  dim H = 64, K = {K}
  tensor dy  : bf16 [T, H]
  tensor w   : bf16 [K, H]
  tensor src : i32 [T]
  tensor gi  : f16 [T, K] layout strides(139, 1)
  tensor dxr : bf16 [T, K]
  tensor dx  : bf16 [S, K] = scatter_add(dxr, rows = src)
  tensor dx2 : f32 [S, K] = scatter_add(gi, rows = src)
  dxr[t, k] = sum[n] dy[t, n] * w[k, n]
}}
"""
