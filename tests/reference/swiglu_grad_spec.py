"""The spec the swiglu_grad tests share: a SwiGLU's gate/up columns recomputed by one
statement (gu), the gradient of its output made by a weighted DGRAD and a row pass (dh),
the gradient of the gate/up columns quantized by swiglu_grad (dgu), and the DGRAD that
reads it. The statement reading dgu is written first: the analysis and the step order
put it after everything it waits for. Line 13 declares dgu."""

H, N, F = 256, 512, 256

SWIGLU_GRAD_SPEC = f"""\
gemm swg {{
  dim T
  dim H = {H}, N = {N}, F = {F}
  tensor x      : e4m3 [T, H] scale f32 [1, 128]
  tensor w      : e4m3 [N, H] scale f32 [128, 128]
  tensor w_t    : e4m3 [H, N] scale f32 [128, 128]
  tensor gu     : bf16 [T, N]
  tensor dy     : bf16 [T, H]
  tensor wd     : bf16 [F, H]
  tensor rw     : f32 [T]
  tensor dh_pre : bf16 [T, F]
  tensor dh     : bf16 [T, F] = rowscale(dh_pre, weight = rw)
  tensor dgu    : e4m3 [T, N] scale f32 [1, 128] = swiglu_grad(gu, dh)
  tensor dx     : bf16 [T, H]
  dx[t, h] = sum[n] dgu[t, n] * w_t[h, n]
  gu[t, n] = sum[h] x[t, h] * w[n, h]
  dh_pre[t, f] = sum[h] dy[t, h] * wd[f, h]
}}
"""

# The WGRAD's form: the gate/up gradient quantized straight into 128x1 blocks per expert
# segment (tokens contiguous, segments padded to 16 rows), read by a K-grouped WGRAD.
SWIGLU_GRAD_WGRAD_SPEC = f"""\
gemm swgw {{
  dim T
  dim H = {H}, N = {N}, F = {F}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor gu    : bf16 [T, N]
  tensor dh    : bf16 [T, F]
  tensor x     : e4m3 [T, H] scale f32 [1, 128]
  tensor xq    : e4m3 [T, H] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dgu_t : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = swiglu_grad(gu, dh)
  tensor dw    : f32 [E, N, H]
  dw[e, n, h] = sum[t in expert(e)] dgu_t[t, n] * xq[t, h]
}}
"""
