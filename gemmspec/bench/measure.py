"""How each case of the table is measured on gemmspec's side.

A procedure `fn(repeat, *, name, **shape)` builds the case's spec, makes its inputs,
runs gemmspec once and checks the output (against a float64 reference of the
dequantized inputs on sampled rows, or against another path that computes the same
function) before it times it, then times the case's own variants (the same work as
separate launches, another layout of the spec). It returns those rows and the
`Problem` its anchors run on (None where the table names no anchor), in the order the
inputs were made: the anchors' own random inputs come after gemmspec's.
"""

from __future__ import annotations

from . import specs
from .anchors import Problem
from .anchors.torch import lora_epilogue_ops, quantize_1x128
from .compare import checked, dequantized, elementwise, rel_error
from .inputs import (
    load_torch,
    nested_offsets,
    offsets_tensor,
    random_fp8,
    random_fp8_experts,
    random_nested_counts,
    random_scales,
    routed_rows,
    token_leaves,
)
from .timing import Result, result, timed

Measured = tuple[list[Result], Problem | None]


def fp8_grouped(repeat: int, *, name: str, lengths: list[int], n: int, k: int, weights=None) -> Measured:
    """FP8 M-grouped with DeepSeek-V3 scales (1x128 per token, MN-major; 128x128 weights).
    `weights`: (w, w_scale) made once by the caller (a sweep over token counts), else random."""
    torch = load_torch()
    e, t = len(lengths), sum(lengths)
    exe = specs.build_spec(specs.moe_spec("moe_fp8", n=n, k=k, e=e, fp8=True, scales_major_t=True))
    x = random_fp8((t, k))
    w = random_fp8((e, n, k)) if weights is None else weights[0]
    xs = random_scales((k // 128, t)).t()  # 1x128 per token, MN-major as declared
    ws = random_scales((e, n // 128, k // 128)) if weights is None else weights[1]
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offs = offsets_tensor(lengths)
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offs)
    run.enqueue()
    torch.cuda.synchronize()
    # Float64 reference of the dequantized inputs on up to 96 sampled rows per expert.
    g = torch.Generator(device="cpu").manual_seed(0)
    errs_out, errs_ref = [], []
    start = 0
    for ei, m in enumerate(lengths):
        if m:
            rows = start + torch.randperm(m, generator=g)[:96].cuda()
            xa = dequantized(x[rows], xs[rows], 1, 128)
            wb = dequantized(w[ei], ws[ei], 128, 128)
            errs_out.append(y[rows])
            errs_ref.append(xa @ wb.t())
        start += m
    check = checked(rel_error(torch.cat(errs_out), torch.cat(errs_ref)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    out = [result(name, "gemmspec", timed(run.enqueue, repeat), flops, check=check)]
    return out, Problem(work=flops, x=x, xs=xs, w=w, ws=ws, y=y, lengths=lengths, offs=offs)


def fp8_rowwise(repeat: int, *, name: str, lengths: list[int], n: int, k: int) -> Measured:
    """Per-channel scales (one per token, one per expert and column): the recipe torch's
    `_scaled_grouped_mm` takes, computed by both on the same inputs and scales."""
    torch = load_torch()
    e, t = len(lengths), sum(lengths)
    exe = specs.build_spec(specs.ROWWISE.format(n=n, k=k, e=e, directive=""))
    # The same spec with accumulate(fast): the whole of K in the tensor cores' accumulator,
    # timed beside torch's use_fast_accum=True.
    fast = specs.build_spec(specs.ROWWISE.format(n=n, k=k, e=e, directive="  accumulate(fast)\n"))
    x, w = random_fp8((t, k)), random_fp8((e, n, k))
    sa, sb = random_scales((t,)), random_scales((e, n))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offs = offsets_tensor(lengths)
    run = exe.prepare(
        torch.cuda.current_stream(), x=x, x_scale=sa.view(t, 1), w=w, w_scale=sb.view(e, n, 1), y=y, offs=offs
    )
    y_fast = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    run_fast = fast.prepare(
        torch.cuda.current_stream(), x=x, x_scale=sa.view(t, 1), w=w, w_scale=sb.view(e, n, 1), y=y_fast, offs=offs
    )
    run.enqueue()
    run_fast.enqueue()
    torch.cuda.synchronize()
    g = torch.Generator(device="cpu").manual_seed(0)
    outs, fast_outs, refs = [], [], []
    for ei in range(e):
        rows = ei * lengths[0] + torch.randperm(lengths[ei], generator=g)[:96].cuda()
        fast_outs.append(y_fast[rows])
        xa = x[rows].to(torch.float64) * sa[rows, None].to(torch.float64)
        wb = w[ei].to(torch.float64) * sb[ei, :, None].to(torch.float64)
        outs.append(y[rows])
        refs.append(xa @ wb.t())
    check = checked(rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    fast_check = checked(
        rel_error(torch.cat(fast_outs), torch.cat(refs)), 8e-3, "float64 reference (sampled rows), fast accumulation"
    )
    flops = 2.0 * t * n * k
    out = [
        result(name, "gemmspec (per-channel scales, promoted every 128 of K)", timed(run.enqueue, repeat), flops,
               check=check),
        result(name, "gemmspec (per-channel scales, accumulate(fast))", timed(run_fast.enqueue, repeat), flops,
               check=fast_check),
    ]
    return out, Problem(work=flops, x=x, w=w, sa=sa, sb=sb, y=y, lengths=lengths, offs=offs)


def bf16_grouped(repeat: int, *, name: str, lengths: list[int], n: int, k: int) -> Measured:
    """BF16 M-grouped, checked against torch._grouped_mm on the same inputs."""
    torch = load_torch()
    e, t = len(lengths), sum(lengths)
    exe = specs.build_spec(specs.moe_spec("moe_bf16", n=n, k=k, e=e))
    x = torch.randn((t, k), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((e, n, k), device="cuda", dtype=torch.bfloat16)
    y = torch.empty((t, n), dtype=torch.bfloat16, device="cuda")
    offs = offsets_tensor(lengths)
    run = exe.prepare(torch.cuda.current_stream(), x=x, w=w, y=y, offs=offs)
    run.enqueue()
    ends = offs[1:].contiguous()
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    check = checked(rel_error(y, ref), 1e-2, "torch._grouped_mm")
    flops = 2.0 * t * n * k
    out = [result(name, "gemmspec", timed(run.enqueue, repeat), flops, check=check)]
    return out, Problem(work=flops, x=x, w=w, y=y, lengths=lengths, offs=offs)


def wgrad(repeat: int, *, name: str, lengths: list[int], n: int, k: int) -> Measured:
    """FP8 WGRAD K-grouped, 128x1 scales on both sides, FP32 `+=` (counts multiples of 128)."""
    torch = load_torch()
    e, t = len(lengths), sum(lengths)
    exe = specs.build_spec(specs.WGRAD.format(n=n, k=k, e=e))
    # Segment-major bytes: expert g's tokens [s, s+len) are stored as [N, len] (tokens contiguous).
    dy, x = random_fp8((t * n,)), random_fp8((t * k,))
    dys, xs = random_scales((t // 128, n)), random_scales((t // 128, k))
    dw = torch.zeros((e, n, k), dtype=torch.float32, device="cuda")
    offs = offsets_tensor(lengths)
    run = exe.prepare(torch.cuda.current_stream(), dy=dy.view(t, n), dy_scale=dys, x=x.view(t, k), x_scale=xs, dw=dw, offs=offs)
    run.enqueue()
    torch.cuda.synchronize()
    # Reference for experts 0 and 5 on 64 sampled output rows (channels of dy).
    g = torch.Generator(device="cpu").manual_seed(1)
    outs, refs = [], []
    for ei in (0, 5):
        s, m = sum(lengths[:ei]), lengths[ei]
        rows = torch.randperm(n, generator=g)[:64].cuda()
        dseg = dequantized(dy[s * n:(s + m) * n].view(n, m)[rows], dys[s // 128:(s + m) // 128][:, rows].t(), 1, 128)
        xseg = dequantized(x[s * k:(s + m) * k].view(k, m), xs[s // 128:(s + m) // 128].t(), 1, 128)
        refs.append(dseg @ xseg.t())
        outs.append(dw[ei][rows])
    check = checked(rel_error(torch.cat(outs), torch.cat(refs)), 1e-3, "float64 reference (sampled rows)")
    dw_once = dw.clone()  # one += into zeros, for DeepGEMM's check (the timing adds more)
    flops = 2.0 * t * n * k
    out = [result(name, "gemmspec (FP32 +=)", timed(run.enqueue, repeat), flops, check=check)]
    return out, Problem(work=flops, dy=dy, dys=dys, x=x, xs=xs, lengths=lengths, offs=offs, n=n, k=k, dw_ref=dw_once)


def wgrad_ragged(repeat: int, *, name: str, lengths: list[int], n: int, k: int) -> Measured:
    """FP8 WGRAD on the ragged token counts of the forward row, stored `segment_major(expert)
    pad 16` (every segment's rows whole 16-byte units: TMA for every expert), beside the
    same statement unpadded, whose experts with counts not multiples of 16 are copied by hand."""
    torch = load_torch()
    e, t = len(lengths), sum(lengths)
    spec = specs.WGRAD.format(n=n, k=k, e=e)
    padded = specs.build_spec(spec.replace("segment_major(expert)", "segment_major(expert) pad 16"))
    unpadded = specs.build_spec(spec)
    rows = t + 15 * e  # 15 rows of padding per expert
    dy, x = random_fp8((rows * n,)), random_fp8((rows * k,))
    blocks = sum(-(-m // 128) for m in lengths)
    dys, xs = random_scales((blocks, n)), random_scales((blocks, k))
    dw = torch.zeros((e, n, k), dtype=torch.float32, device="cuda")
    offs = offsets_tensor(lengths)
    stream = torch.cuda.current_stream()
    run = padded.prepare(stream, dy=dy.view(rows, n), dy_scale=dys, x=x.view(rows, k), x_scale=xs, dw=dw, offs=offs)
    run.enqueue()
    torch.cuda.synchronize()
    # Segment g of the padded storage: rows from p_g (padded prefix), pitch round_up(len, 16).
    first, block0, outs, refs = [0], [0], [], []
    for m in lengths:
        first.append(first[-1] + -(-m // 16) * 16)
        block0.append(block0[-1] + -(-m // 128))
    g = torch.Generator(device="cpu").manual_seed(1)
    for ei in (3, 5):  # 5155 and 129 tokens: neither a multiple of 16
        m, p, b = lengths[ei], first[ei], block0[ei]
        pitch = -(-m // 16) * 16
        sel = torch.randperm(n, generator=g)[:64].cuda()
        d_sc = dys[b : b + -(-m // 128)][:, sel].t().to(torch.float64).repeat_interleave(128, 1)[:, :m]
        x_sc = xs[b : b + -(-m // 128)].t().to(torch.float64).repeat_interleave(128, 1)[:, :m]
        dseg = dy[p * n : (p + pitch) * n].view(n, pitch)[sel, :m].to(torch.float64) * d_sc
        xseg = x[p * k : (p + pitch) * k].view(k, pitch)[:, :m].to(torch.float64) * x_sc
        refs.append(dseg @ xseg.t())
        outs.append(dw[ei][sel])
    check = checked(rel_error(torch.cat(outs), torch.cat(refs)), 1e-3, "float64 reference (sampled rows)")
    # The unpadded statement reads the same bytes as its own layout (values differ; only timed).
    plain = unpadded.prepare(
        stream, dy=dy[: t * n].view(t, n), dy_scale=dys, x=x[: t * k].view(t, k), x_scale=xs, dw=dw, offs=offs
    )
    flops = 2.0 * t * n * k
    return [
        result(name, "gemmspec pad 16 (FP32 +=)", timed(run.enqueue, repeat), flops, check=check),
        result(name, "gemmspec unpadded (rows copied by hand)", timed(plain.enqueue, repeat), flops),
    ], None


def masked(repeat: int, *, name: str, counts: list[int], m: int, n: int, k: int) -> Measured:
    """FP8 masked decode: each group's first `counts[g]` of its `m` rows."""
    torch = load_torch()
    mmax, e = m, len(counts)
    exe = specs.build_spec(specs.MASKED_SPEC.format(m=mmax, n=n, k=k, e=e))
    x, w = random_fp8((e, mmax, k)), random_fp8((e, n, k))
    xs, ws = random_scales((e, mmax, k // 128)), random_scales((e, n // 128, k // 128))
    y = torch.full((e, mmax, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    counts_t = torch.tensor(counts, dtype=torch.int32, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, counts=counts_t)
    run.enqueue()
    torch.cuda.synchronize()
    outs, refs = [], []
    for ei, c in enumerate(counts):
        rows = torch.arange(0, c, max(c // 64, 1), device="cuda")
        xa = dequantized(x[ei][rows], xs[ei][rows], 1, 128)
        wb = dequantized(w[ei], ws[ei], 128, 128)
        outs.append(y[ei][rows])
        refs.append(xa @ wb.t())
    check = checked(rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * sum(counts) * n * k
    out = [result(name, "gemmspec", timed(run.enqueue, repeat), flops, check=check)]
    return out, Problem(work=flops, x=x, xs=xs, w=w, ws=ws, y=y, counts=counts)


def decode_bytes(counts: list[int], n: int, k: int, *, fp8: bool) -> int:
    """Bytes a decode call must move: the weights of every expert with at least one row
    (N x K, and its 128x128 scales in FP8), the rows read once (T x K, and their 1x128
    scales in FP8) and the BF16 output written (T x N). A decode GEMM reads each active
    expert's weights once, so this, over the HBM copy rate, is the floor of its time."""
    elem = 1 if fp8 else 2
    active, t = sum(1 for c in counts if c), sum(counts)
    weights, rows = active * n * k * elem, t * k * elem
    if fp8:
        weights += active * (n // 128) * (k // 128) * 4
        rows += t * (k // 128) * 4
    return weights + rows + t * n * 2


def _in_bytes(measured: Measured, moved: int) -> Measured:
    """A procedure's rows (and its anchors' `Problem`) rated in TB/s of `moved` bytes."""
    rows, problem = measured
    for r in rows:
        r.work, r.unit = moved, "TB/s"
    if problem is not None:
        problem.work, problem.unit = moved, "TB/s"
    return rows, problem


def decode_fp8(repeat: int, *, name: str, lengths: list[int], n: int, k: int, weights=None) -> Measured:
    """FP8 M-grouped at decode token counts (`fp8_grouped`, checked the same way), rated
    in TB/s of `decode_bytes`."""
    measured = fp8_grouped(repeat, name=name, lengths=lengths, n=n, k=k, weights=weights)
    return _in_bytes(measured, decode_bytes(lengths, n, k, fp8=True))


def decode_bf16(repeat: int, *, name: str, lengths: list[int], n: int, k: int) -> Measured:
    """BF16 M-grouped at decode token counts (`bf16_grouped`), rated in TB/s of `decode_bytes`."""
    measured = bf16_grouped(repeat, name=name, lengths=lengths, n=n, k=k)
    return _in_bytes(measured, decode_bytes(lengths, n, k, fp8=False))


def decode_masked(repeat: int, *, name: str, counts: list[int], m: int, n: int, k: int) -> Measured:
    """FP8 masked decode (`masked`), rated in TB/s of `decode_bytes` of its valid rows."""
    measured = masked(repeat, name=name, counts=counts, m=m, n=n, k=k)
    return _in_bytes(measured, decode_bytes(counts, n, k, fp8=True))


def gather(repeat: int, *, name: str, tokens: int, e: int, n: int, k: int) -> Measured:
    """Tokens in routing order (top-2 of `tokens` over `e` experts): gemmspec reads each
    routed row of x and its scales through idx (by default the gather pre-pass copies them
    once, then the GEMM loads a dense A; the row beside it gathers them in the GEMM's loads);
    torch copies the rows first."""
    torch = load_torch()
    s = tokens
    t = 2 * s
    text = specs.GATHER.format(n=n, k=k, e=e)
    exe = specs.build_spec(text)
    fused = specs.build_spec(specs.with_directive(text, "gather(fused)"))
    g = torch.Generator(device="cpu").manual_seed(3)
    idx = torch.cat([torch.randperm(s, generator=g), torch.randperm(s, generator=g)]).to(torch.int32).cuda()
    x, w = random_fp8((s, k)), random_fp8((e, n, k))
    xs, ws = random_scales((s, k // 128)), random_scales((e, n // 128, k // 128))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    lengths = [t // e] * e
    offs = offsets_tensor(lengths)
    run = exe.prepare(torch.cuda.current_stream(), idx=idx, x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offs)
    run.enqueue()
    torch.cuda.synchronize()
    outs, refs = [], []
    for ei in range(e):
        rows = ei * (t // e) + torch.randperm(t // e, generator=g)[:64].cuda()
        src = idx[rows].long()
        outs.append(y[rows])
        refs.append(dequantized(x[src], xs[src], 1, 128) @ dequantized(w[ei], ws[ei], 128, 128).t())
    check = checked(rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    how = "rows copied by the gather pre-pass" if exe.schedule.prepasses else "rows gathered in the GEMM"
    out = [result(name, f"gemmspec ({how})", timed(run.enqueue, repeat), flops, check=check)]
    y_fused = torch.full_like(y, float("nan"))
    run_fused = fused.prepare(torch.cuda.current_stream(), idx=idx, x=x, x_scale=xs, w=w, w_scale=ws, y=y_fused,
                              offs=offs)
    run_fused.enqueue()
    torch.cuda.synchronize()
    same = checked(rel_error(y_fused.double(), y.double()), 2e-3, "the pre-pass row's output")
    out.append(result(name, "gemmspec, gather(fused): in the GEMM's loads", timed(run_fused.enqueue, repeat), flops,
                      check=same))
    return out, Problem(work=flops, x=x, w=w, idx=idx, y=y, lengths=lengths, offs=offs)


def dense(repeat: int, *, name: str, t: int, n: int, k: int) -> Measured:
    """FP8 dense with 1x128 / 128x128 scales."""
    torch = load_torch()
    exe = specs.build_spec(specs.DENSE.format(t=t, n=n, k=k))
    x, w = random_fp8((t, k)), random_fp8((n, k))
    xs = random_scales((k // 128, t)).t()
    ws = random_scales((n // 128, k // 128))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y)
    run.enqueue()
    torch.cuda.synchronize()
    rows = torch.arange(0, t, 37, device="cuda")
    xa = dequantized(x[rows], xs[rows], 1, 128)
    wb = dequantized(w, ws, 128, 128)
    ref = xa @ wb.t()
    check = checked(rel_error(y[rows], ref), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    out = [result(name, "gemmspec", timed(run.enqueue, repeat), flops, check=check)]
    return out, Problem(work=flops, x=x, xs=xs, w=w, ws=ws, y=y, ref_rows=rows, ref=ref)


def lora_shrink(repeat: int, *, name: str, loras: int, experts: int, r: int, k: int, t: int) -> Measured:
    """The nested LoRA shrink over random expert cuts of equal adapters (memory-bound:
    TB/s of x and the adapters read once, y written)."""
    torch = load_torch()
    exe = specs.build_spec(specs.LORA.format(k=k, r=r, l=loras, e=experts))
    x = torch.randn((t, k), device="cuda", dtype=torch.bfloat16)
    wa = torch.randn((loras, experts, r, k), device="cuda", dtype=torch.bfloat16)
    y = torch.full((t, r), float("nan"), dtype=torch.float32, device="cuda")
    g = torch.Generator(device="cpu").manual_seed(2)
    lo_off, inner = nested_offsets(random_nested_counts([t // loras] * loras, experts, g))
    lora_offsets = torch.tensor(lo_off, dtype=torch.int32, device="cuda")
    expert_offsets = torch.tensor(inner, dtype=torch.int32, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, wa=wa, y=y, lora_offsets=lora_offsets, expert_offsets=expert_offsets)
    run.enqueue()
    torch.cuda.synchronize()
    ends = expert_offsets[:, 1:].reshape(-1).contiguous()
    wflat = wa.reshape(loras * experts, r, k)
    ref64 = torch.empty((t, r), dtype=torch.float64, device="cuda")
    flat = [b for row in inner for b in zip(row[:-1], row[1:])]
    for i, (s, e_) in enumerate(flat):
        if e_ > s:
            ref64[s:e_] = x[s:e_].to(torch.float64) @ wflat[i].to(torch.float64).t()
    check = checked(rel_error(y, ref64), 1e-4, "float64 reference")
    moved = (t * k + loras * experts * r * k) * 2 + t * r * 4  # read x and adapters once, write y
    out = [result(name, "gemmspec", timed(run.enqueue, repeat), moved, unit="TB/s", check=check)]
    return out, Problem(work=moved, unit="TB/s", x=x, w=wflat, ends=ends, y=y)


def ffn(repeat: int, *, name: str, e: int, tokens: int, top_k: int, hidden: int, n: int, f: int) -> Measured:
    """The DeepSeek-V3-style expert FFN of examples/moe_ffn_fp8.gspec (`tokens` routed to
    `top_k` of `e` experts each, gathered by `src`, SwiGLU into FP8 h with its scales
    quantized in the up-projection's epilogue, down-projection weighted and scattered by
    `dst`) against the same work as separate launches: the up-projection into BF16, then h
    quantized (by the quantize pass, or by torch operations), then the same down-projection.
    The shape must be the example's."""
    torch = load_torch()
    t = tokens * top_k
    dims = specs.FFN_DIMS.format(h=hidden, n=n, f=f)
    fused = specs.build_spec(specs.example_text("moe_ffn_fp8"))
    up = specs.build_spec(specs.FFN_UP_BF16.format(dims=dims, e=e))
    down_pass = specs.build_spec(specs.FFN_DOWN.format(suffix="_quantize_pass", dims=dims, e=e, h=specs.FFN_H_QUANTIZE_PASS))
    down = specs.build_spec(specs.FFN_DOWN.format(suffix="", dims=dims, e=e, h=specs.FFN_H_FP8))
    g = torch.Generator(device="cpu").manual_seed(3)
    # Routed rows sorted by expert: row r reads token src[r]; y row s*k + c is token s's c-th
    # expert (distinct: the rows a caller sums per token).
    choice = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    order = torch.argsort(choice.reshape(-1), stable=True)
    src = (order // top_k).to(torch.int32).cuda()
    dst = order.to(torch.int32).cuda()
    lengths = torch.bincount(choice.reshape(-1), minlength=e).tolist()
    offs = offsets_tensor(lengths)
    x, xs = random_fp8((tokens, hidden)), random_scales((tokens, hidden // 128))
    w_up, w_up_s = random_fp8((e, n, hidden)), random_scales((e, n // 128, hidden // 128))
    w_down, w_down_s = random_fp8((e, hidden, f)), random_scales((e, hidden // 128, f // 128))
    route_w = torch.rand((t,), device="cuda")
    h = torch.full((t, f), float("nan"), dtype=torch.float8_e4m3fn, device="cuda")
    h_s = torch.full((t, f // 128), float("nan"), device="cuda")
    hb = torch.full((t, f), float("nan"), dtype=torch.bfloat16, device="cuda")
    y_fused = torch.full((t, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
    y_pass = torch.full_like(y_fused, float("nan"))
    y_torch = torch.full_like(y_fused, float("nan"))
    stream = torch.cuda.current_stream()
    common = dict(expert_offsets=offs, w_down=w_down, w_down_scale=w_down_s, route_w=route_w, dst=dst)
    run_fused = fused.prepare(
        stream, src=src, x=x, x_scale=xs, w_up=w_up, w_up_scale=w_up_s, h=h, h_scale=h_s, y=y_fused, **common
    )
    run_up = up.prepare(stream, src=src, x=x, x_scale=xs, w_up=w_up, h=hb, expert_offsets=offs, w_up_scale=w_up_s)
    run_down_pass = down_pass.prepare(stream, hb=hb, y=y_pass, **common)

    def separate_pass():
        run_up.enqueue()
        run_down_pass.enqueue()

    hq, hq_s = quantize_1x128(torch.zeros((t, f), dtype=torch.bfloat16, device="cuda"))
    run_down = down.prepare(stream, h=hq, h_scale=hq_s, y=y_torch, **common)

    def separate_torch():
        run_up.enqueue()
        q, s = quantize_1x128(hb)
        hq.copy_(q)
        hq_s.copy_(s)
        run_down.enqueue()

    run_fused.enqueue()
    separate_pass()
    separate_torch()
    torch.cuda.synchronize()
    # The fused h is the up-projection's BF16 result quantized: against torch's quantization of
    # the separate BF16 h (the two up kernels may tile differently), and y against both paths.
    h_err = rel_error(h.float() * h_s.repeat_interleave(128, 1), hq.float() * hq_s.repeat_interleave(128, 1))
    y_err = max(rel_error(y_fused, y_pass), rel_error(y_fused, y_torch))
    check = checked(max(h_err, y_err), 3e-2, "separate launches (h and y)")
    flops = 2.0 * t * n * hidden + 2.0 * t * hidden * f
    return [
        result(name, "gemmspec fused (FP8 h from the epilogue)", timed(run_fused.enqueue, repeat), flops, check=check),
        result(name, "gemmspec BF16 h + quantize pass + down", timed(separate_pass, repeat), flops),
        result(name, "torch quantization between gemmspec BF16 up, FP8 down", timed(separate_torch, repeat), flops),
    ], None


def lora_expand_bytes(counts: list[list[int]], n: int, r: int) -> int:
    """Bytes the fused expand must move: h, the non-empty leaves' B, the scales, router
    weights and biases once; the BF16 y read and written."""
    t, loras, experts = sum(map(sum, counts)), len(counts), len(counts[0])
    leaves = sum(1 for row in counts for c in row if c)
    return (t * r + leaves * n * r + experts * n) * 2 + (loras + t) * 4 + 2 * t * n * 2


def lora_expand_reference(rows, lora: int, expert: int, y0, h, wb, scaling, route_w, bias):
    """Float64 y after the scaled expand on `rows` of leaf (lora, expert), from y0."""
    torch = load_torch()
    f64 = torch.float64
    update = h[rows].to(f64) @ wb[lora, expert].to(f64).t()
    coef = scaling[lora].to(f64) * route_w[rows].to(f64)
    return y0[rows].to(f64) + coef[:, None] * update + bias[expert].to(f64)


def lora_expand(repeat: int, *, name: str, counts: list[list[int]], r: int, n: int) -> Measured:
    """The multi-LoRA expand of examples/lora_moe_scaled.gspec (4 adapters x 8 experts,
    rank 16, N = 4096: the shape must be the example's; tokens per leaf in `counts`):
    `y += scaling[lora] * route_w[t] * (h @ wb[lora, expert]^T) + bias[expert]` in one
    launch, against the same work as separate launches: gemmspec's plain grouped GEMM into
    BF16, or torch._grouped_mm over the 32 leaves, each followed by torch element-wise
    operations. Every implementation updates its own y, restored from the same y0 before
    each launch, outside the timed events."""
    torch = load_torch()
    loras, experts = len(counts), len(counts[0])
    t = sum(map(sum, counts))
    fused = specs.build_spec(specs.example_text("lora_moe_scaled"))
    plain = specs.build_spec(specs.LORA_EXPAND.format(n=n, r=r, l=loras, e=experts))
    lo_off, inner = nested_offsets(counts)
    offsets = dict(
        lora_offsets=torch.tensor(lo_off, dtype=torch.int32, device="cuda"),
        expert_offsets=torch.tensor(inner, dtype=torch.int32, device="cuda"),
    )
    h = torch.randn((t, r), device="cuda", dtype=torch.bfloat16)
    wb = (torch.randn((loras, experts, n, r), device="cuda") / 4).to(torch.bfloat16)
    scaling = torch.rand((loras,), device="cuda") * 2 + 0.25  # alpha / rank
    route_w = torch.rand((t,), device="cuda")
    bias = torch.randn((experts, n), device="cuda", dtype=torch.bfloat16)
    y0 = torch.randn((t, n), device="cuda", dtype=torch.bfloat16)
    y_fused, y_separate, y_torch = (torch.empty_like(y0) for _ in range(3))
    y2 = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    lora_idx, expert_idx = token_leaves(counts, "cuda")
    stream = torch.cuda.current_stream()
    run_fused = fused.prepare(stream, h=h, wb=wb, scaling=scaling, route_w=route_w, bias=bias, y=y_fused, **offsets)
    run_plain = plain.prepare(stream, h=h, wb=wb, y2=y2, **offsets)

    def separate():
        run_plain.enqueue()
        lora_epilogue_ops(y_separate, y2, scaling, route_w, bias, lora_idx, expert_idx)

    ends = offsets["expert_offsets"][:, 1:].reshape(-1).contiguous()
    wb_t = wb.reshape(loras * experts, n, r).transpose(-2, -1)

    def torch_only():
        y2_torch = torch._grouped_mm(h, wb_t, offs=ends)
        lora_epilogue_ops(y_torch, y2_torch, scaling, route_w, bias, lora_idx, expert_idx)

    variants = [("gemmspec fused (scale, route_w, bias, +=)", run_fused.enqueue, y_fused),
                ("gemmspec BF16 GEMM + torch element-wise", separate, y_separate)]
    torch_note = ""
    try:
        torch._grouped_mm(h, wb_t, offs=ends)
        variants.append(("torch._grouped_mm (32 groups) + element-wise", torch_only, y_torch))
    except (AttributeError, TypeError, RuntimeError) as exc:  # a torch without a usable _grouped_mm
        torch_note = f"; torch._grouped_mm unavailable: {str(exc).splitlines()[0][:80]}"
    for _, fn, y in variants:
        y.copy_(y0)
        fn()
    torch.cuda.synchronize()
    # Float64 reference on up to 16 sampled rows of every non-empty leaf.
    g = torch.Generator(device="cpu").manual_seed(4)
    outs, refs = [], []
    for li, row in enumerate(counts):
        for ei, c in enumerate(row):
            if c:
                rows = inner[li][ei] + torch.randperm(c, generator=g)[:16].cuda()
                outs.append(y_fused[rows])
                refs.append(lora_expand_reference(rows, li, ei, y0, h, wb, scaling, route_w, bias))
    check = checked(rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    for impl, _, y in variants[1:]:
        check += "; " + checked(rel_error(y_fused, y), 1e-2, impl.split(" (")[0])
    moved = lora_expand_bytes(counts, n, r)
    out = []
    for impl, fn, y in variants:
        samples = timed(fn, repeat, before=lambda y=y: y.copy_(y0))
        out.append(result(name, impl, samples, moved, unit="TB/s", check="" if out else check + torch_note))
    return out, None


# ------------------------------------------------------------------ the decode FFN
def ffn_decode_bytes(lengths: list[int], tokens: int, hidden: int, f: int) -> int:
    """Bytes the decode FFN must move: the gate, up and down weights of every expert with
    a row, with their 128x128 scales; each token's x read once with its 1x128 scales, its
    y written in BF16; the routing (src, route_w). The intermediates (h, y_rows) are the
    implementation's: this, over the HBM copy rate, is the floor of the whole layer."""
    active, t = sum(1 for c in lengths if c), sum(lengths)
    weights = active * 3 * (hidden * f + (hidden // 128) * (f // 128) * 4)
    return weights + tokens * (hidden + hidden // 128 * 4) + tokens * hidden * 2 + t * 8


def graphed(fn, stream):
    """`fn` (which enqueues on `stream`) captured in a CUDA graph after a warm-up on that
    stream; returns the graph's replay (on the caller's current stream). A capture torch
    refuses raises its RuntimeError."""
    torch = load_torch()
    stream.wait_stream(torch.cuda.current_stream())  # the inputs, made on the current stream
    with torch.cuda.stream(stream):
        fn()  # warm-up: plans, workspaces and torch's kernels exist before the capture
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        fn()
    return graph.replay


def ffn_decode_reference(x, xs, wg, wgs, wu, wus, wd, wds, h, hs, route_w, src, expert_of, tokens):
    """The routed rows of `tokens` (each token's rows in ascending order), their h as the
    GPU wrote it and in float64 (SwiGLU of the dequantized inputs), and their weighted
    down-projection in float64 from h as the GPU wrote it (FP8 rounding is discontinuous:
    a result a hair off may round to the next FP8 value, so the down-projection is judged
    on the h it read). y itself is judged against the combine of the rows the GPU wrote
    (`combined`): a sum of k rows carries k rows' accumulation errors, more than one row's
    bound allows, so each step is judged on what the step before it wrote."""
    torch = load_torch()
    rows, h_ref, h_rows, y_rows_ref = [], [], [], []
    for s in tokens:
        for t in torch.nonzero(src == s)[:, 0].tolist():
            e = int(expert_of[t])
            xa = dequantized(x[s:s + 1], xs[s:s + 1], 1, 128)
            gate = xa @ dequantized(wg[e], wgs[e], 128, 128).t()
            up = xa @ dequantized(wu[e], wus[e], 128, 128).t()
            h_ref.append(gate * torch.sigmoid(gate) * up)
            got = dequantized(h[t:t + 1], hs[t:t + 1], 1, 128)
            h_rows.append(got)
            y_rows_ref.append(route_w[t].double() * (got @ dequantized(wd[e], wds[e], 128, 128).t()))
            rows.append(t)
    return rows, torch.cat(h_rows), torch.cat(h_ref), torch.cat(y_rows_ref)


def combined(y_rows, src, tokens: int):
    """y as the spec's `scatter_add(y_rows, rows = src)` defines it: each token's rows in
    ascending row order, added in float32 from zero and rounded once to y_rows' type
    (tokens no row names get zeros). Bit for bit what the GPU's combine must write."""
    torch = load_torch()
    t = src.numel()
    index = torch.arange(t, device=src.device)
    order = torch.argsort(src.long() * t + index)  # by token, then by row
    token = src.long()[order]
    counts = torch.bincount(token, minlength=tokens)
    rank = index - (torch.cumsum(counts, 0) - counts)[token]  # the row's place among its token's
    acc = torch.zeros((tokens, y_rows.shape[1]), dtype=torch.float32, device=y_rows.device)
    for i in range(int(counts.max()) if t else 0):
        at = rank == i  # at most one row of each token
        acc[token[at]] += y_rows[order[at]].float()
    return acc.to(y_rows.dtype)


def ffn_decode(repeat: int, *, name: str, tokens: int, experts: int, top_k: int, hidden: int, f: int,
               seed: int = 0) -> Measured:
    """The decode expert FFN of examples/moe_ffn_fp8_decode.gspec (at `hidden`, `f`,
    `experts`) on `tokens` tokens routed top-`top_k` (seeded), each implementation captured
    in a CUDA graph after a warm-up and timed by replaying it: (a) the one spec (gather, up
    with the SwiGLU into FP8 h, weighted down, the deterministic scatter_add combine into
    token order); (b) the same steps as separate calls: the up spec, the down spec into the
    routed rows, their combine by torch's index_add_ into FP32 zeros; (c) torch alone:
    index_select, `_scaled_grouped_mm` over the concatenated gate/up weights, silu * up,
    a per-row FP8 quantization, `_scaled_grouped_mm` down, the router weight, index_add_.
    torch's grouped FP8 GEMM takes rowwise scales only, so (c) runs on random rowwise
    scales of the same shapes: its time counts, its values are not compared. (a) is
    checked first against a float64 reference on sampled tokens (h, and y from the h the
    GPU wrote), element by element, then against (b), and two replays must give the same
    bits. Rated in TB/s of `ffn_decode_bytes`."""
    torch = load_torch()
    fp8, bf16 = torch.float8_e4m3fn, torch.bfloat16
    src_list, lengths = routed_rows(tokens, experts, top_k, seed)
    t = len(src_list)
    one = specs.build_spec(specs.ffn_decode_text(hidden=hidden, f=f, e=experts, name=f"ffn_decode_{hidden}_{f}"))
    up = specs.build_spec(specs.FFN_DECODE_UP.format(h=hidden, f=f, e=experts))
    down = specs.build_spec(specs.FFN_DECODE_DOWN.format(h=hidden, f=f, e=experts))
    src = torch.tensor(src_list, dtype=torch.int32, device="cuda")
    rows = src.long()
    offs = offsets_tensor(lengths)
    x, xs = random_fp8((tokens, hidden)), random_scales((tokens, hidden // 128))
    wg, wu, wd = (random_fp8_experts(s) for s in ((experts, f, hidden), (experts, f, hidden), (experts, hidden, f)))
    wgs, wus = random_scales((experts, f // 128, hidden // 128)), random_scales((experts, f // 128, hidden // 128))
    wds = random_scales((experts, hidden // 128, f // 128))
    route_w = torch.rand((t,), device="cuda")

    def outputs():
        return (torch.full((t, f), float("nan"), device="cuda").to(fp8), torch.full((t, f // 128), float("nan"), device="cuda"),
                torch.full((t, hidden), float("nan"), dtype=bf16, device="cuda"),
                torch.full((tokens, hidden), float("nan"), dtype=bf16, device="cuda"))

    h, hs, y_rows, y = outputs()
    h2, hs2, y_rows2, y2 = outputs()
    acc = torch.zeros((tokens, hidden), device="cuda")
    stream = torch.cuda.Stream()
    w = dict(wg=wg, wg_scale=wgs, wu=wu, wu_scale=wus)
    wdown = dict(w_down=wd, w_down_scale=wds, route_w=route_w, expert_offsets=offs)
    run_one = one.prepare(stream, src=src, x=x, x_scale=xs, h=h, h_scale=hs, y_rows=y_rows, y=y, **w, **wdown)
    run_up = up.prepare(stream, src=src, x=x, x_scale=xs, h=h2, h_scale=hs2, expert_offsets=offs, **w)
    run_down = down.prepare(stream, h=h2, h_scale=hs2, y_rows=y_rows2, **wdown)

    def separate():
        run_up.enqueue()
        run_down.enqueue()
        acc.zero_()
        acc.index_add_(0, rows, y_rows2.float())
        y2.copy_(acc)

    replay_one, replay_separate = graphed(run_one.enqueue, stream), graphed(separate, stream)
    replay_one()
    replay_separate()
    torch.cuda.synchronize()
    first = y.clone()
    # Float64 reference on up to 16 sampled tokens (all their routed rows), element by element.
    g = torch.Generator(device="cpu").manual_seed(seed)
    sample = torch.randperm(tokens, generator=g)[:16].tolist()
    expert_of = torch.repeat_interleave(torch.arange(experts), torch.tensor(lengths))
    sampled, h_got, h_ref, y_rows_ref = ffn_decode_reference(x, xs, wg, wgs, wu, wus, wd, wds, h, hs, route_w, src,
                                                              expert_of, sample)
    check = "; ".join([
        elementwise("h", h_got, h_ref, "e4m3", "float64 reference (sampled tokens)"),
        elementwise("y_rows", y_rows[sampled], y_rows_ref, "bf16", "float64 reference (sampled tokens)"),
        elementwise("y_rows", y_rows, y_rows2.double(), "bf16", "separate calls"),
    ])
    if not torch.equal(y.view(torch.int16), combined(y_rows, src, tokens).view(torch.int16)):
        raise AssertionError("gemmspec's y is not the combine of the y_rows it wrote (ascending rows, float32)")
    check += "; y the combine of y_rows, bit for bit"
    replay_one()
    torch.cuda.synchronize()
    if not torch.equal(y.view(torch.int16), first.view(torch.int16)):
        raise AssertionError("gemmspec's y differs between two replays: the combine is not deterministic")
    check += "; the same bits on a second replay"
    moved = ffn_decode_bytes(lengths, tokens, hidden, f)
    out = [
        result(name, "gemmspec one spec, combine in it (graph)", timed(replay_one, repeat), moved, unit="TB/s",
               check=check),
        result(name, "gemmspec up, down + index_add_ (graph)", timed(replay_separate, repeat), moved, unit="TB/s"),
    ]
    torch_rows, note = _torch_ffn_decode(name, repeat, moved, stream, x, wg, wu, wd, route_w, rows, offs, tokens, f)
    out[0].check += note
    return out + torch_rows, None


def _torch_ffn_decode(name, repeat, moved, stream, x, wg, wu, wd, route_w, rows, offs, tokens, f):
    """The torch chain of `ffn_decode` (c), captured in a graph where torch allows it,
    else timed as it runs: its rows and a note for gemmspec's row (no row, and the
    reason, where this torch has no usable grouped FP8 GEMM)."""
    torch = load_torch()
    fp8 = torch.float8_e4m3fn
    experts, hidden = wd.shape[0], wd.shape[1]
    w13 = torch.cat([wg, wu], dim=1)  # [E, 2F, H]: one GEMM for gate and up (made once, untimed)
    sa, sb13, sbd = random_scales((tokens,)), random_scales((experts, 2 * f)), random_scales((experts, hidden))
    ends = offs[1:].contiguous()
    y3 = torch.empty((tokens, hidden), dtype=torch.bfloat16, device="cuda")
    acc = torch.zeros((tokens, hidden), device="cuda")

    def chain():
        xg = x.view(torch.uint8).index_select(0, rows).view(fp8)
        gu = torch._scaled_grouped_mm(xg, w13.transpose(-2, -1), sa.index_select(0, rows), sb13, offs=ends,
                                      out_dtype=torch.bfloat16)
        gate, up = gu.split(f, dim=1)
        hb = (torch.nn.functional.silu(gate) * up).float()
        amax = hb.abs().amax(dim=1)
        hs = amax / 448.0
        hs = torch.where(hs > 0, hs, torch.ones_like(hs))
        hq = (hb / hs[:, None]).clamp(-448, 448).to(fp8)
        yr = torch._scaled_grouped_mm(hq, wd.transpose(-2, -1), hs, sbd, offs=ends, out_dtype=torch.bfloat16)
        acc.zero_()
        acc.index_add_(0, rows, yr.float() * route_w[:, None])
        y3.copy_(acc)

    impl = "torch index_select, _scaled_grouped_mm x2, index_add_"
    try:
        chain()
        torch.cuda.synchronize()
    except (AttributeError, TypeError, RuntimeError) as exc:  # a torch without a usable grouped FP8 GEMM
        return [], f"; torch chain unavailable: {str(exc).splitlines()[0][:80]}"
    try:
        fn, how = graphed(chain, stream), "(graph, rowwise)"
    except RuntimeError as exc:
        fn, how = chain, f"(eager, rowwise; capture refused: {str(exc).splitlines()[0][:40]})"
    return [result(name, f"{impl} {how}", timed(fn, repeat), moved, unit="TB/s",
                   check="rowwise scales of the same shapes: values not compared")], ""
