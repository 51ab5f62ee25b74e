"""The spec the row-pass tests share: a 16-bit statement whose output G feeds both row
passes, a row weight's gradient (rowdot with an FP8 h, 1x128 scales) and the weighted
rows (rowscale), as a derived backward writes them. Line 9 is the rowdot's declaration,
line 10 the rowscale's."""

H, F = 256, 384

ROW_PASS_SPEC = f"""\
gemm rp {{
  dim T
  dim H = {H}, F = {F}
  tensor dy  : bf16 [T, H]
  tensor w   : bf16 [F, H]
  tensor h   : e4m3 [T, F] scale f32 [1, 128]
  tensor rw  : f32 [T]
  tensor g   : bf16 [T, F]
  tensor drw : f32 [T] = rowdot(g, h)
  tensor dh  : bf16 [T, F] = rowscale(g, weight = rw)
  g[t, f] = sum[n] dy[t, n] * w[f, n]
}}
"""
