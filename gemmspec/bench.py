"""`gemmspec bench`: gemmspec beside the anchors, in one process, on one GPU.

Every row of the target table runs gemmspec and the anchors available here on the
same inputs: PyTorch's grouped and scaled GEMMs always (torch is needed for this
command only). Each gemmspec result is checked before it is timed (against the
anchor's output where the anchor computes the same function, otherwise against a
float64 reference of the dequantized inputs on sampled rows). Times are medians of
`triton.testing.do_bench` (CUDA events, L2 flushed between runs); TFLOPS count
useful FLOPs only (no padding), the memory-bound rows report TB/s of bytes that must
move. A row whose launches must each start from the same output (the scaled LoRA
expand's BF16 `+=`) restores it before every launch, untimed, and is timed by the
`--idle` event loop instead. Where `deep_gemm` is importable, DeepGEMM runs beside them on
the same inputs (its output checked against gemmspec's first; ragged groups copied once,
untimed, into the 128-row aligned layout it needs); elsewhere, or with `--no-deepgemm`,
DeepGEMM 2.6.1's figures measured on an H200 on 2026-11-30 are printed as recorded
references. Where nvidia-smi is on the PATH, each row also shows the SM clock and board
power of its kernel kept running for a second after it is timed (a sustained FP8 GEMM
runs at the card's power cap, at a clock well below the maximum), and each compute-bound
case the share of the tensor cores' peak at the clock gemmspec's row ran at.

    gemmspec bench [--only NAME ...] [--repeat N] [--idle MS] [--json FILE] [--plot FILE.png] [--no-deepgemm]
    python -m gemmspec.bench ...
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from . import bench_deepgemm
from .clocks import ClockReading, ClockSampler, at_power_cap, gpu_id, peak_tflops

# DeepGEMM 2.6.1 on one H200, 2026-11-30 (same shapes; M-grouped rows count its
# 128-row padding as useful work).
RECORDED_DEEPGEMM = {
    "fp8_fwd_G8x4096_N4096_K7168": 1232.4,
    "fp8_fwd_G8x4096_N7168_K2048": 1163.8,
    "fp8_fwd_G4x8192_N6144_K7168": 1257.6,
    "fp8_fwd_ragged_T32768_N4096_K7168": 1202.2,
    "bf16_fwd_G8x4096_N4096_K7168": 697.6,
    "fp8_wgrad_G8x4096_N4096_K7168": 833.8,
    "fp8_masked_G6_M1024_N4096_K7168": 1130.3,
    "fp8_dense_T4096_N7168_K7168": 1264.4,
}

RAGGED = [1, 127, 0, 5155, 10949, 129, 10269, 6138]
MASKED = [983, 769, 816, 1024, 734, 666]


@dataclass(frozen=True)
class Target:
    """What a row must reach: an absolute rate and/or a ratio to the torch anchor, or to
    every other row of its case (`vs_separate`: the same work done as separate launches)."""

    tflops: float | None = None
    vs_torch: float | None = None
    max_us: float | None = None
    vs_separate: float | None = None

    def describe(self) -> str:
        parts = []
        if self.tflops:
            parts.append(f">= {self.tflops:.0f} TFLOPS")
        if self.vs_torch:
            parts.append(f">= {self.vs_torch:.2f}x torch")
        if self.max_us:
            parts.append(f"<= {self.max_us:.0f} us")
        if self.vs_separate == 1.0:
            parts.append("faster than separate launches")
        elif self.vs_separate:
            parts.append(f">= {self.vs_separate:.2f}x separate launches")
        return ", ".join(parts)


@dataclass
class Result:
    case: str
    impl: str
    ms: float
    work: float  # useful FLOPs, or bytes for memory-bound rows
    unit: str  # "TFLOPS" or "TB/s"
    check: str = ""  # how the result was verified, with the error
    samples_ms: list[float] = field(default_factory=list)
    # The SM clock and board power of its launches kept running right after they were
    # timed (medians; None without nvidia-smi; see sustained_clock), and the share of those
    # samples at the software power cap.
    sm_mhz: float | None = None
    power_w: float | None = None
    power_capped: float | None = None

    @property
    def rate(self) -> float:
        return self.work / self.ms / 1e9  # FLOP/ms -> TFLOPS; bytes/ms -> TB/s (1e12/1e3)


@dataclass
class Case:
    name: str
    what: str
    target: Target
    run: Callable[..., list[Result]]
    memory_bound: bool = False
    # The tensor-core peak a compute-bound row is measured against at its clock: "fp8" or
    # "bf16" (None: memory-bound, or not one kind of GEMM).
    peak: str | None = None


# ---------------------------------------------------------------------------- inputs
def _torch():
    import torch

    return torch


def _fp8(shape):
    torch = _torch()
    return (torch.randn(shape, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def _scales(shape):
    torch = _torch()
    return torch.rand(shape, device="cuda") * 0.01 + 0.001


def _offsets(lengths):
    torch = _torch()
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def random_nested_counts(lora_lengths: list[int], experts: int, generator) -> list[list[int]]:
    """Each adapter's tokens cut at `experts - 1` random points: per adapter, the token
    count of each expert (0 where two cuts meet, odd sizes as they fall)."""
    torch = _torch()
    counts = []
    for length in lora_lengths:
        cuts = sorted(torch.randint(0, length + 1, (experts - 1,), generator=generator).tolist())
        bounds = [0, *cuts, length]
        counts.append([b - a for a, b in zip(bounds[:-1], bounds[1:])])
    return counts


def nested_offsets(counts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The offsets of a nest `lora` > `expert ragged(T within lora)` from its L x E token
    counts: `lora_offsets` (L + 1 entries) and `expert_offsets` (L rows of E + 1 absolute
    row numbers, each row from its adapter's first token to its end)."""
    lora_offsets, expert_offsets = [0], []
    for row in counts:
        bounds = [lora_offsets[-1]]
        for c in row:
            bounds.append(bounds[-1] + c)
        expert_offsets.append(bounds)
        lora_offsets.append(bounds[-1])
    return lora_offsets, expert_offsets


def _dequantized(q, scale, block_rows: int, block_cols: int):
    """Float64 values of `q` times its scale grid, each scale repeated over its block."""
    torch = _torch()
    grid = scale.to(torch.float64).repeat_interleave(block_rows, 0).repeat_interleave(block_cols, 1)
    return q.to(torch.float64) * grid


def _rel_error(out, ref) -> float:
    torch = _torch()
    out, ref = out.to(torch.float64), ref.to(torch.float64)
    return float(torch.linalg.norm(out - ref) / torch.linalg.norm(ref).clamp_min(1e-300))


def _checked(err: float, limit: float, against: str) -> str:
    if not err < limit:  # NaN fails too
        raise AssertionError(f"gemmspec differs from {against}: rel error {err:.3e} >= {limit:.0e}")
    return f"{against}: {err:.2e}"


# ---------------------------------------------------------------------------- specs
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
    activation scales token-contiguous with `scales_major_t`; `capacity` lets the
    offsets end below T."""
    t = "e4m3" if fp8 else "bf16"
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
  tensor y : {out} [T, N]
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
}}
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
# The expand row's tokens per adapter (rows) and expert (columns), 8192 in all: empty
# experts, single tokens, the 127 / 129 tile edges and other odd sizes.
LORA_EXPAND_COUNTS = [
    [1, 127, 129, 0, 1000, 511, 257, 23],
    [0, 0, 3001, 17, 255, 1, 0, 0],
    [129, 129, 129, 129, 127, 127, 127, 127],
    [903, 0, 1, 255, 333, 131, 0, 223],
]


def token_leaves(counts: list[list[int]], device):
    """Each token's adapter and expert (int64 [T] each) from the nest's L x E counts: the
    indices a caller has from routing, which torch's element-wise path needs."""
    torch = _torch()
    experts = len(counts[0])
    flat = torch.tensor([c for row in counts for c in row], device=device)
    leaf = torch.repeat_interleave(torch.arange(flat.numel(), device=device), flat)
    return leaf // experts, leaf % experts


def lora_epilogue_ops(y, y2, scaling, route_w, bias, lora_idx, expert_idx) -> None:
    """`y += scaling[lora(t)] * route_w[t] * y2 + bias[expert(t)]` by torch operations: the
    update in FP32, added into y and rounded once."""
    torch = _torch()
    coef = (scaling[lora_idx] * route_w).unsqueeze(1)
    y.add_(torch.addcmul(bias[expert_idx], y2, coef))


def lora_expand_bytes(counts: list[list[int]], n: int, r: int) -> int:
    """Bytes the fused expand must move: h, the non-empty leaves' B, the scales, router
    weights and biases once; the BF16 y read and written."""
    t, loras, experts = sum(map(sum, counts)), len(counts), len(counts[0])
    leaves = sum(1 for row in counts for c in row if c)
    return (t * r + leaves * n * r + experts * n) * 2 + (loras + t) * 4 + 2 * t * n * 2


def lora_expand_reference(rows, lora: int, expert: int, y0, h, wb, scaling, route_w, bias):
    """Float64 y after the scaled expand on `rows` of leaf (lora, expert), from y0."""
    torch = _torch()
    f64 = torch.float64
    update = h[rows].to(f64) @ wb[lora, expert].to(f64).t()
    coef = scaling[lora].to(f64) * route_w[rows].to(f64)
    return y0[rows].to(f64) + coef[:, None] * update + bias[expert].to(f64)


# The expert FFN (examples/moe_ffn_fp8.gspec) and the same work as separate launches: the
# up-projection into BF16, its quantization, the down-projection.
FFN_DIMS = "dim H = 7168, N = 4096, F = 2048"
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


def quantize_1x128(value):
    """`value` (2-D) in e4m3 with one f32 scale per row and 128 columns, by torch operations:
    amax / 448 (1 for an all-zero block), as the quantize pass computes it."""
    torch = _torch()
    rows, cols = value.shape
    blocks = value.float().view(rows, cols // 128, 128)
    amax = blocks.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    q = (blocks / scale[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    return q.view(rows, cols), scale


# ---------------------------------------------------------------------------- timing
DEEPGEMM = None  # the deep_gemm module where importable (and not --no-deepgemm)
IDLE_MS = 0.0  # --idle: GPU idle time before each timed launch
IDLE_LAUNCHES = 60
# Rows whose launches must each start from the same output (a `+=` the bench restores before
# every launch, outside the timed events) run this event loop, not do_bench, this many times.
RESTORED_LAUNCHES = 200
_SLEEP_CYCLES_PER_MS = 1_900_000  # torch.cuda._sleep counts SM cycles: about the idle clock


def timed_launches(fn, launches: int, idle_ms: float, before: Callable[[], object] | None = None) -> float:
    """Median ms of `fn` over `launches` launches, each between its own CUDA events,
    after an L2 flush and `idle_ms` of the GPU sleeping (a cool, unthrottled card).
    `before` (untimed) runs ahead of each launch and of the warm-up, before the flush:
    it restores what `fn` updates in place, so every launch starts from the same data."""
    torch = _torch()
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(launches)]
    if before is not None:
        before()
    fn()
    for start, end in events:
        if before is not None:
            before()
        if idle_ms:
            torch.cuda._sleep(int(idle_ms * _SLEEP_CYCLES_PER_MS))
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in events)


@dataclass(frozen=True)
class Timing:
    samples_ms: list[float]  # the median ms of each repeat
    clock: ClockReading | None  # the SM clock and power under sustained load, right after


SAMPLER: ClockSampler | None = None  # main's clock and power sampler, running while cases run


def _time(fn, repeat: int, before: Callable[[], object] | None = None) -> Timing:
    """Median ms per `repeat`: do_bench, or the event loop when idling or when `before`
    must restore the inputs ahead of every launch; then, where main's sampler runs, the
    clock and power of `fn` kept running (untimed) for CLOCK_RUN_S."""
    if IDLE_MS or before is not None:
        launches = IDLE_LAUNCHES if IDLE_MS else RESTORED_LAUNCHES
        samples = [timed_launches(fn, launches, IDLE_MS, before) for _ in range(repeat)]
    else:
        from triton.testing import do_bench

        samples = [do_bench(fn, warmup=50, rep=300, return_mode="median") for _ in range(repeat)]
    return Timing(samples, sustained_clock(SAMPLER, fn, before))


# nvidia-smi's readings trail the card by a few hundred milliseconds, more than a row's
# timing lasts: the clock is read while the row's launches keep running for CLOCK_RUN_S,
# from the samples of its last CLOCK_READ_S.
CLOCK_RUN_S = 1.0
CLOCK_READ_S = 0.5


def sustained_clock(sampler: ClockSampler | None, fn, before: Callable[[], object] | None = None) -> ClockReading | None:
    """`fn`'s clock and power under sustained load: its launches (each after `before`) run
    for CLOCK_RUN_S, read from `sampler`'s samples of the last CLOCK_READ_S (None without a
    sampler)."""
    if sampler is None:
        return None
    torch = _torch()
    start = time.monotonic()
    while time.monotonic() - start < CLOCK_RUN_S:
        for _ in range(8):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    end = time.monotonic()
    return sampler.reading(end - CLOCK_READ_S, end)


def _result(case, impl, timing: Timing, work, unit="TFLOPS", check="") -> Result:
    c = timing.clock
    return Result(case, impl, statistics.median(timing.samples_ms), work, unit, check, timing.samples_ms,
                  c and c.sm_mhz, c and c.power_w, c and c.power_capped)


def _deepgemm(name: str, flops: float, repeat: int, make) -> list[Result]:
    """DeepGEMM's row of a case, where it is importable: `make(dg)` returns (callable,
    check, how it ran); a failure is reported in the row instead of ending the case."""
    dg = DEEPGEMM
    if dg is None:
        return []
    impl = f"DeepGEMM {bench_deepgemm.version(dg)}"
    try:
        call, check, how = make(dg)
    except Exception as e:  # noqa: BLE001 - the anchor failing is reported, gemmspec's rows stand
        print(f"      DeepGEMM anchor of {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        return [Result(name, impl, float("nan"), flops, "TFLOPS", f"not run: {type(e).__name__}: {str(e)[:80]}")]
    return [_result(name, f"{impl} ({how})", _time(call, repeat), flops, check=check)]


FORCED_TILE: tuple[int, int] | None = None  # --tile: the same spec with a tile directive


def with_directive(text: str, directive: str) -> str:
    """A one-spec text with `directive` added as its last item."""
    body = text.rstrip().rstrip("}")
    return f"{body}  {directive}\n}}\n"


def _build(text: str):
    import gemmspec

    if FORCED_TILE is not None:
        text = with_directive(text, f"tile({FORCED_TILE[0]}, {FORCED_TILE[1]})")
    return gemmspec.build(text)


# ---------------------------------------------------------------------------- cases
def _fp8_grouped(name: str, lengths: list[int], n: int, k: int, repeat: int) -> list[Result]:
    torch = _torch()
    e, t = len(lengths), sum(lengths)
    exe = _build(moe_spec("moe_fp8", n=n, k=k, e=e, fp8=True, scales_major_t=True))
    x, w = _fp8((t, k)), _fp8((e, n, k))
    xs = _scales((k // 128, t)).t()  # 1x128 per token, MN-major as declared
    ws = _scales((e, n // 128, k // 128))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offs = _offsets(lengths)
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
            xa = _dequantized(x[rows], xs[rows], 1, 128)
            wb = _dequantized(w[ei], ws[ei], 128, 128)
            errs_out.append(y[rows])
            errs_ref.append(xa @ wb.t())
        start += m
    check = _checked(_rel_error(torch.cat(errs_out), torch.cat(errs_ref)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    out = [_result(name, "gemmspec", _time(run.enqueue, repeat), flops, check=check)]
    sa, sb = _scales((t,)), _scales((e, n))
    ends = offs[1:].contiguous()
    out.append(
        _result(
            name,
            "torch._scaled_grouped_mm (rowwise scales)",
            _time(lambda: torch._scaled_grouped_mm(x, w.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16), repeat),
            flops,
        )
    )
    out += _deepgemm(name, flops, repeat, lambda dg: bench_deepgemm.m_grouped_fp8(dg, x, xs, w, ws, lengths, y))
    return out


def case_fp8_rowwise(repeat):
    """Per-channel scales (one per token, one per expert and column): the recipe torch's
    `_scaled_grouped_mm` takes, computed by both on the same inputs and scales."""
    torch = _torch()
    lengths, n, k = [4096] * 8, 4096, 7168
    e, t = len(lengths), sum(lengths)
    exe = _build(ROWWISE.format(n=n, k=k, e=e))
    x, w = _fp8((t, k)), _fp8((e, n, k))
    sa, sb = _scales((t,)), _scales((e, n))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    offs = _offsets(lengths)
    run = exe.prepare(
        torch.cuda.current_stream(), x=x, x_scale=sa.view(t, 1), w=w, w_scale=sb.view(e, n, 1), y=y, offs=offs
    )
    run.enqueue()
    torch.cuda.synchronize()
    g = torch.Generator(device="cpu").manual_seed(0)
    outs, refs = [], []
    for ei in range(e):
        rows = ei * lengths[0] + torch.randperm(lengths[ei], generator=g)[:96].cuda()
        xa = x[rows].to(torch.float64) * sa[rows, None].to(torch.float64)
        wb = w[ei].to(torch.float64) * sb[ei, :, None].to(torch.float64)
        outs.append(y[rows])
        refs.append(xa @ wb.t())
    check = _checked(_rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    ends = offs[1:].contiguous()
    return [
        _result("fp8_rowwise_G8x4096_N4096_K7168", "gemmspec (per-channel scales)", _time(run.enqueue, repeat), flops,
                check=check),
        _result(
            "fp8_rowwise_G8x4096_N4096_K7168",
            "torch._scaled_grouped_mm (rowwise scales)",
            _time(lambda: torch._scaled_grouped_mm(x, w.transpose(-2, -1), sa, sb, offs=ends, out_dtype=torch.bfloat16), repeat),
            flops,
        ),
    ]


def case_fp8_g8(repeat):
    return _fp8_grouped("fp8_fwd_G8x4096_N4096_K7168", [4096] * 8, 4096, 7168, repeat)


def case_fp8_g8_k2048(repeat):
    return _fp8_grouped("fp8_fwd_G8x4096_N7168_K2048", [4096] * 8, 7168, 2048, repeat)


def case_fp8_g4(repeat):
    return _fp8_grouped("fp8_fwd_G4x8192_N6144_K7168", [8192] * 4, 6144, 7168, repeat)


def case_fp8_ragged(repeat):
    return _fp8_grouped("fp8_fwd_ragged_T32768_N4096_K7168", RAGGED, 4096, 7168, repeat)


def case_bf16(repeat):
    torch = _torch()
    name, e, m, n, k = "bf16_fwd_G8x4096_N4096_K7168", 8, 4096, 4096, 7168
    t = e * m
    exe = _build(moe_spec("moe_bf16", n=n, k=k, e=e))
    x = torch.randn((t, k), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((e, n, k), device="cuda", dtype=torch.bfloat16)
    y = torch.empty((t, n), dtype=torch.bfloat16, device="cuda")
    offs = _offsets([m] * e)
    run = exe.prepare(torch.cuda.current_stream(), x=x, w=w, y=y, offs=offs)
    run.enqueue()
    ends = offs[1:].contiguous()
    ref = torch._grouped_mm(x, w.transpose(-2, -1), offs=ends)
    check = _checked(_rel_error(y, ref), 1e-2, "torch._grouped_mm")
    flops = 2.0 * t * n * k
    return [
        _result(name, "gemmspec", _time(run.enqueue, repeat), flops, check=check),
        _result(name, "torch._grouped_mm", _time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=ends), repeat), flops),
    ] + _deepgemm(name, flops, repeat, lambda dg: bench_deepgemm.m_grouped_bf16(dg, x, w, [m] * e, y))


def case_wgrad(repeat):
    torch = _torch()
    name, e, m, n, k = "fp8_wgrad_G8x4096_N4096_K7168", 8, 4096, 4096, 7168
    t = e * m
    exe = _build(WGRAD.format(n=n, k=k, e=e))
    # Segment-major bytes: expert g's tokens [s, s+len) are stored as [N, len] (tokens contiguous).
    dy, x = _fp8((t * n,)), _fp8((t * k,))
    dys, xs = _scales((t // 128, n)), _scales((t // 128, k))
    dw = torch.zeros((e, n, k), dtype=torch.float32, device="cuda")
    offs = _offsets([m] * e)
    run = exe.prepare(torch.cuda.current_stream(), dy=dy.view(t, n), dy_scale=dys, x=x.view(t, k), x_scale=xs, dw=dw, offs=offs)
    run.enqueue()
    torch.cuda.synchronize()
    # Reference for experts 0 and 5 on 64 sampled output rows (channels of dy).
    g = torch.Generator(device="cpu").manual_seed(1)
    outs, refs = [], []
    for ei in (0, 5):
        s = ei * m
        rows = torch.randperm(n, generator=g)[:64].cuda()
        dseg = _dequantized(dy[s * n:(s + m) * n].view(n, m)[rows], dys[s // 128:(s + m) // 128][:, rows].t(), 1, 128)
        xseg = _dequantized(x[s * k:(s + m) * k].view(k, m), xs[s // 128:(s + m) // 128].t(), 1, 128)
        refs.append(dseg @ xseg.t())
        outs.append(dw[ei][rows])
    check = _checked(_rel_error(torch.cat(outs), torch.cat(refs)), 1e-3, "float64 reference (sampled rows)")
    dw_once = dw.clone()  # one += into zeros, for DeepGEMM's check (the timing adds more)
    flops = 2.0 * t * n * k
    a = torch.randn((n, t), device="cuda", dtype=torch.bfloat16)
    b = torch.randn((k, t), device="cuda", dtype=torch.bfloat16).t()
    ends = offs[1:].contiguous()
    return [
        _result(name, "gemmspec (FP32 +=)", _time(run.enqueue, repeat), flops, check=check),
        _result(name, "torch._grouped_mm K-grouped (BF16, no +=)", _time(lambda: torch._grouped_mm(a, b, offs=ends), repeat), flops),
    ] + _deepgemm(name, flops, repeat,
                  lambda dg: bench_deepgemm.k_grouped_fp8_wgrad(dg, dy, dys, x, xs, [m] * e, n, k, dw_once))


def case_wgrad_ragged(repeat):
    """FP8 WGRAD on the ragged token counts of the forward row, stored `segment_major(expert)
    pad 16` (every segment's rows whole 16-byte units: TMA for every expert), beside the
    same statement unpadded, whose experts with counts not multiples of 16 are copied by hand."""
    torch = _torch()
    name, n, k = "fp8_wgrad_ragged_T32768_N4096_K7168", 4096, 7168
    lengths, e, t = RAGGED, len(RAGGED), sum(RAGGED)
    spec = WGRAD.format(n=n, k=k, e=e)
    padded = _build(spec.replace("segment_major(expert)", "segment_major(expert) pad 16"))
    unpadded = _build(spec)
    rows = t + 15 * e  # 15 rows of padding per expert
    dy, x = _fp8((rows * n,)), _fp8((rows * k,))
    blocks = sum(-(-m // 128) for m in lengths)
    dys, xs = _scales((blocks, n)), _scales((blocks, k))
    dw = torch.zeros((e, n, k), dtype=torch.float32, device="cuda")
    offs = _offsets(lengths)
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
    check = _checked(_rel_error(torch.cat(outs), torch.cat(refs)), 1e-3, "float64 reference (sampled rows)")
    # The unpadded statement reads the same bytes as its own layout (values differ; only timed).
    plain = unpadded.prepare(
        stream, dy=dy[: t * n].view(t, n), dy_scale=dys, x=x[: t * k].view(t, k), x_scale=xs, dw=dw, offs=offs
    )
    flops = 2.0 * t * n * k
    return [
        _result(name, "gemmspec pad 16 (FP32 +=)", _time(run.enqueue, repeat), flops, check=check),
        _result(name, "gemmspec unpadded (rows copied by hand)", _time(plain.enqueue, repeat), flops),
    ]


def case_masked(repeat):
    torch = _torch()
    name, mmax, n, k = "fp8_masked_G6_M1024_N4096_K7168", 1024, 4096, 7168
    e = len(MASKED)
    exe = _build(MASKED_SPEC.format(m=mmax, n=n, k=k, e=e))
    x, w = _fp8((e, mmax, k)), _fp8((e, n, k))
    xs, ws = _scales((e, mmax, k // 128)), _scales((e, n // 128, k // 128))
    y = torch.full((e, mmax, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    counts = torch.tensor(MASKED, dtype=torch.int32, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, counts=counts)
    run.enqueue()
    torch.cuda.synchronize()
    outs, refs = [], []
    for ei, c in enumerate(MASKED):
        rows = torch.arange(0, c, max(c // 64, 1), device="cuda")
        xa = _dequantized(x[ei][rows], xs[ei][rows], 1, 128)
        wb = _dequantized(w[ei], ws[ei], 128, 128)
        outs.append(y[ei][rows])
        refs.append(xa @ wb.t())
    check = _checked(_rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * sum(MASKED) * n * k
    out = [_result(name, "gemmspec", _time(run.enqueue, repeat), flops, check=check)]
    sa, sb = _scales((e, mmax)), _scales((e, n))
    out.append(
        _result(
            name,
            "torch._scaled_grouped_mm 3D (all 1024 rows, rowwise)",
            _time(lambda: torch._scaled_grouped_mm(x, w.transpose(-2, -1), sa, sb, out_dtype=torch.bfloat16), repeat),
            flops,
        )
    )
    out += _deepgemm(name, flops, repeat, lambda dg: bench_deepgemm.m_grouped_fp8_masked(dg, x, xs, w, ws, MASKED, y))
    return out


def case_gather(repeat):
    """Tokens in routing order (top-2 of 16384 tokens over 8 experts): gemmspec reads each
    routed row of x and its scales through idx (by default the gather pre-pass copies them
    once, then the GEMM loads a dense A; the row beside it gathers them in the GEMM's loads);
    torch copies the rows first."""
    torch = _torch()
    name, n, k, e, s = "fp8_gather_G8x4096_N4096_K7168", 4096, 7168, 8, 16384
    t = 2 * s
    text = GATHER.format(n=n, k=k, e=e)
    exe = _build(text)
    fused = _build(with_directive(text, "gather(fused)"))
    g = torch.Generator(device="cpu").manual_seed(3)
    idx = torch.cat([torch.randperm(s, generator=g), torch.randperm(s, generator=g)]).to(torch.int32).cuda()
    x, w = _fp8((s, k)), _fp8((e, n, k))
    xs, ws = _scales((s, k // 128)), _scales((e, n // 128, k // 128))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    lengths = [t // e] * e
    offs = _offsets(lengths)
    run = exe.prepare(torch.cuda.current_stream(), idx=idx, x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offs)
    run.enqueue()
    torch.cuda.synchronize()
    outs, refs = [], []
    for ei in range(e):
        rows = ei * (t // e) + torch.randperm(t // e, generator=g)[:64].cuda()
        src = idx[rows].long()
        outs.append(y[rows])
        refs.append(_dequantized(x[src], xs[src], 1, 128) @ _dequantized(w[ei], ws[ei], 128, 128).t())
    check = _checked(_rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    how = "rows copied by the gather pre-pass" if exe.schedule.prepasses else "rows gathered in the GEMM"
    out = [_result(name, f"gemmspec ({how})", _time(run.enqueue, repeat), flops, check=check)]
    y_fused = torch.full_like(y, float("nan"))
    run_fused = fused.prepare(torch.cuda.current_stream(), idx=idx, x=x, x_scale=xs, w=w, w_scale=ws, y=y_fused,
                              offs=offs)
    run_fused.enqueue()
    torch.cuda.synchronize()
    same = _checked(_rel_error(y_fused.double(), y.double()), 2e-3, "the pre-pass row's output")
    out.append(_result(name, "gemmspec, gather(fused): in the GEMM's loads", _time(run_fused.enqueue, repeat), flops,
                       check=same))
    sa, sb = _scales((s,)), _scales((e, n))
    ends = offs[1:].contiguous()
    rows = idx.long()

    def anchor():
        xg = x.view(torch.uint8).index_select(0, rows).view(torch.float8_e4m3fn)
        return torch._scaled_grouped_mm(xg, w.transpose(-2, -1), sa.index_select(0, rows), sb, offs=ends,
                                        out_dtype=torch.bfloat16)

    out.append(_result(name, "torch index_select + _scaled_grouped_mm", _time(anchor, repeat), flops))
    return out


def _blockwise_anchor(x, xs, w, ws):
    """torch._scaled_mm with 1x128 / 128x128 scales (cuBLASLt); the scale layouts it
    accepts have moved between releases, so try the known ones."""
    torch = _torch()
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


def case_dense(repeat):
    torch = _torch()
    name, t, n, k = "fp8_dense_T4096_N7168_K7168", 4096, 7168, 7168
    exe = _build(DENSE.format(t=t, n=n, k=k))
    x, w = _fp8((t, k)), _fp8((n, k))
    xs = _scales((k // 128, t)).t()
    ws = _scales((n // 128, k // 128))
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y)
    run.enqueue()
    torch.cuda.synchronize()
    rows = torch.arange(0, t, 37, device="cuda")
    xa = _dequantized(x[rows], xs[rows], 1, 128)
    wb = _dequantized(w, ws, 128, 128)
    check = _checked(_rel_error(y[rows], xa @ wb.t()), 4e-3, "float64 reference (sampled rows)")
    flops = 2.0 * t * n * k
    out = [_result(name, "gemmspec", _time(run.enqueue, repeat), flops, check=check)]
    anchor = _blockwise_anchor(x, xs, w, ws)
    a_err = _rel_error(anchor()[rows], xa @ wb.t())
    out.append(_result(name, "torch._scaled_mm 1x128/128x128", _time(anchor, repeat), flops, check=f"its own error vs float64: {a_err:.2e}"))
    out += _deepgemm(name, flops, repeat, lambda dg: bench_deepgemm.dense_fp8(dg, x, xs, w, ws, y))
    return out


def case_lora(repeat):
    torch = _torch()
    name, loras, experts, r, k, t = "lora_shrink_L4xE8_R16_K4096_T8192", 4, 8, 16, 4096, 8192
    exe = _build(LORA.format(k=k, r=r, l=loras, e=experts))
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
    check = _checked(_rel_error(y, ref64), 1e-4, "float64 reference")
    moved = (t * k + loras * experts * r * k) * 2 + t * r * 4  # read x and adapters once, write y
    out = [_result(name, "gemmspec", _time(run.enqueue, repeat), moved, unit="TB/s", check=check)]
    out.append(
        _result(name, "torch._grouped_mm (32 groups)", _time(lambda: torch._grouped_mm(x, wflat.transpose(-2, -1), offs=ends), repeat), moved, unit="TB/s")
    )
    return out


def case_ffn(repeat):
    """The DeepSeek-V3-style expert FFN of examples/moe_ffn_fp8.gspec (8 experts, 16384 tokens
    routed to 2 each, gathered by `src`, SwiGLU into FP8 h with its scales quantized in the
    up-projection's epilogue, down-projection weighted and scattered by `dst`) against the
    same work as separate launches: the up-projection into BF16, then h quantized (by the
    quantize pass, or by torch operations), then the same down-projection."""
    from pathlib import Path

    torch = _torch()
    name = "ffn_fp8_E8_T32768_H7168_F2048"
    e, tokens, top_k, hid, n, f = 8, 16384, 2, 7168, 4096, 2048
    t = tokens * top_k
    text = (Path(__file__).resolve().parents[1] / "examples" / "moe_ffn_fp8.gspec").read_text()
    fused = _build(text)
    up = _build(FFN_UP_BF16.format(dims=FFN_DIMS, e=e))
    down_pass = _build(FFN_DOWN.format(suffix="_quantize_pass", dims=FFN_DIMS, e=e, h=FFN_H_QUANTIZE_PASS))
    down = _build(FFN_DOWN.format(suffix="", dims=FFN_DIMS, e=e, h=FFN_H_FP8))
    g = torch.Generator(device="cpu").manual_seed(3)
    # Routed rows sorted by expert: row r reads token src[r]; y row s*k + c is token s's c-th
    # expert (distinct: the rows a caller sums per token).
    choice = torch.stack([torch.randperm(e, generator=g)[:top_k] for _ in range(tokens)])
    order = torch.argsort(choice.reshape(-1), stable=True)
    src = (order // top_k).to(torch.int32).cuda()
    dst = order.to(torch.int32).cuda()
    lengths = torch.bincount(choice.reshape(-1), minlength=e).tolist()
    offs = _offsets(lengths)
    x, xs = _fp8((tokens, hid)), _scales((tokens, hid // 128))
    w_up, w_up_s = _fp8((e, n, hid)), _scales((e, n // 128, hid // 128))
    w_down, w_down_s = _fp8((e, hid, f)), _scales((e, hid // 128, f // 128))
    route_w = torch.rand((t,), device="cuda")
    h = torch.full((t, f), float("nan"), dtype=torch.float8_e4m3fn, device="cuda")
    h_s = torch.full((t, f // 128), float("nan"), device="cuda")
    hb = torch.full((t, f), float("nan"), dtype=torch.bfloat16, device="cuda")
    y_fused = torch.full((t, hid), float("nan"), dtype=torch.bfloat16, device="cuda")
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
    h_err = _rel_error(h.float() * h_s.repeat_interleave(128, 1), hq.float() * hq_s.repeat_interleave(128, 1))
    y_err = max(_rel_error(y_fused, y_pass), _rel_error(y_fused, y_torch))
    check = _checked(max(h_err, y_err), 3e-2, "separate launches (h and y)")
    flops = 2.0 * t * n * hid + 2.0 * t * hid * f
    return [
        _result(name, "gemmspec fused (FP8 h from the epilogue)", _time(run_fused.enqueue, repeat), flops, check=check),
        _result(name, "gemmspec BF16 h + quantize pass + down", _time(separate_pass, repeat), flops),
        _result(name, "torch quantization between gemmspec BF16 up, FP8 down", _time(separate_torch, repeat), flops),
    ]


def case_lora_expand(repeat):
    """The multi-LoRA expand of examples/lora_moe_scaled.gspec (4 adapters x 8 experts,
    rank 16, N = 4096, 8192 tokens in LORA_EXPAND_COUNTS): `y += scaling[lora] * route_w[t]
    * (h @ wb[lora, expert]^T) + bias[expert]` in one launch, against the same work as
    separate launches: gemmspec's plain grouped GEMM into BF16, or torch._grouped_mm over the
    32 leaves, each followed by torch element-wise operations. Every implementation updates
    its own y, restored from the same y0 before each launch, outside the timed events."""
    from pathlib import Path

    torch = _torch()
    name = "lora_expand_L4xE8_R16_N4096_T8192"
    counts = LORA_EXPAND_COUNTS
    loras, experts, r, n = len(counts), len(counts[0]), 16, 4096
    t = sum(map(sum, counts))
    text = (Path(__file__).resolve().parents[1] / "examples" / "lora_moe_scaled.gspec").read_text()
    fused = _build(text)
    plain = _build(LORA_EXPAND.format(n=n, r=r, l=loras, e=experts))
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
    check = _checked(_rel_error(torch.cat(outs), torch.cat(refs)), 4e-3, "float64 reference (sampled rows)")
    for impl, _, y in variants[1:]:
        check += "; " + _checked(_rel_error(y_fused, y), 1e-2, impl.split(" (")[0])
    moved = lora_expand_bytes(counts, n, r)
    out = []
    for impl, fn, y in variants:
        samples = _time(fn, repeat, before=lambda y=y: y.copy_(y0))
        out.append(_result(name, impl, samples, moved, unit="TB/s", check="" if out else check + torch_note))
    return out


CASES = [
    Case("fp8_fwd_G8x4096_N4096_K7168", "FP8 1x128/128x128 M-grouped, 8 x 4096 tokens", Target(1230, 1.2), case_fp8_g8, peak="fp8"),
    Case("fp8_fwd_G8x4096_N7168_K2048", "same, N=7168, K=2048", Target(1160, 1.2), case_fp8_g8_k2048, peak="fp8"),
    Case("fp8_fwd_G4x8192_N6144_K7168", "same, 4 x 8192 tokens, N=6144", Target(1250, 1.2), case_fp8_g4, peak="fp8"),
    Case("fp8_fwd_ragged_T32768_N4096_K7168", f"FP8 ragged unpadded, lengths {RAGGED}", Target(1200), case_fp8_ragged, peak="fp8"),
    Case("bf16_fwd_G8x4096_N4096_K7168", "BF16 M-grouped, 8 x 4096 tokens", Target(vs_torch=1.05), case_bf16, peak="bf16"),
    Case("fp8_wgrad_G8x4096_N4096_K7168", "FP8 WGRAD K-grouped 128x1, FP32 +=", Target(1040), case_wgrad, peak="fp8"),
    Case("fp8_wgrad_ragged_T32768_N4096_K7168", f"FP8 WGRAD, ragged counts {RAGGED}, segment_major pad 16",
         Target(1040), case_wgrad_ragged, peak="fp8"),
    Case("fp8_masked_G6_M1024_N4096_K7168", f"FP8 masked decode, counts {MASKED}", Target(1130), case_masked, peak="fp8"),
    Case("fp8_rowwise_G8x4096_N4096_K7168", "FP8 per-channel scales M-grouped, 8 x 4096 tokens", Target(vs_torch=1.2),
         case_fp8_rowwise, peak="fp8"),
    Case("fp8_gather_G8x4096_N4096_K7168", "FP8 M-grouped, rows gathered through idx (top-2)", Target(vs_torch=1.2),
         case_gather, peak="fp8"),
    Case("fp8_dense_T4096_N7168_K7168", "FP8 dense 1x128/128x128", Target(vs_torch=1.1), case_dense, peak="fp8"),
    Case("lora_shrink_L4xE8_R16_K4096_T8192", "nested LoRA shrink (memory-bound)", Target(vs_torch=2.0, max_us=24), case_lora, memory_bound=True),
    Case("ffn_fp8_E8_T32768_H7168_F2048", "expert FFN, FP8 h quantized in the epilogue vs separate launches",
         Target(vs_torch=1.0), case_ffn),
    Case("lora_expand_L4xE8_R16_N4096_T8192",
         "scaled LoRA expand += over experts vs separate launches (memory-bound; y restored before each launch, untimed)",
         Target(vs_separate=1.0), case_lora_expand, memory_bound=True),
]


# ---------------------------------------------------------------------------- report
def _verdict(case: Case, ours: Result, torch_row: Result | None, others: list[Result] | None = None) -> str:
    """`others`: the case's rows beside gemmspec's first, which `vs_separate` compares with."""
    t = case.target
    ok = True
    if t.vs_separate is not None:
        ok &= bool(others) and all(r.ms / ours.ms >= t.vs_separate for r in others)
    if t.tflops is not None:
        ok &= ours.rate >= t.tflops
    if t.max_us is not None:
        ok &= ours.ms * 1e3 <= t.max_us
    if t.vs_torch is not None:
        ok &= torch_row is not None and torch_row.ms / ours.ms >= t.vs_torch
    return "pass" if ok else "MISS"


def _clock(r: Result) -> str:
    if r.sm_mhz is None:
        return f"{'':17}"
    cap = "*" if r.power_capped is not None and at_power_cap(r.power_capped) else " "
    return f"{r.sm_mhz:5.0f} MHz {r.power_w:4.0f} W{cap}"


def report(results: list[Result], failures: dict[str, str], sms: int | None = None) -> tuple[str, list[dict]]:
    """The table and its JSON summary; `sms`: the GPU's SM count, for each compute-bound
    row's peak at the clock it ran at."""
    lines = [
        f"{'case':36} {'impl':44} {'ms':>9} {'rate':>12} {'gemmspec/it':>11}  {'clock, power':17}  check",
    ]
    summary = []
    for case in CASES:
        rows = [r for r in results if r.case == case.name]
        if case.name in failures:
            lines.append(f"{case.name:36} FAILED: {failures[case.name]}")
            summary.append({"case": case.name, "error": failures[case.name]})
            continue
        if not rows:
            continue
        ours = rows[0]
        torch_row = next((r for r in rows[1:] if r.impl.startswith("torch")), None)
        for r in rows:
            ratio = r.ms / ours.ms if r is not ours else 1.0
            lines.append(
                f"{case.name:36} {r.impl[:44]:44} {r.ms:9.4f} {r.rate:7.1f} {r.unit:>4} "
                f"{ratio:10.2f}x  {_clock(r)}  {r.check}"
            )
        live = any(r.impl.startswith("DeepGEMM") for r in rows)
        dg = None if live else RECORDED_DEEPGEMM.get(case.name)
        if dg:
            lines.append(f"{'':36} {'DeepGEMM 2.6.1 (recorded 2026-11-30)':44} {'':9} {dg:7.1f} TFLOPS {dg and ours.rate / dg:10.2f}x (gemmspec / it)")
        verdict = _verdict(case, ours, torch_row, rows[1:])
        roof = None
        if case.peak and sms and ours.sm_mhz:
            roof = peak_tflops(case.peak, sms, ours.sm_mhz)
        at_clock = (
            f"; the {case.peak.upper()} peak at {ours.sm_mhz:.0f} MHz is {roof:.0f} TFLOPS: "
            f"{ours.rate / roof:.0%} of it" if roof else ""
        )
        lines.append(f"{'':36} target {case.target.describe()}: {verdict}{at_clock}")
        summary.append(
            {
                "case": case.name,
                "what": case.what,
                "target": case.target.describe(),
                "verdict": verdict,
                "deepgemm_recorded_tflops": dg,
                "peak_at_clock_tflops": roof,
                "rows": [asdict(r) | {"rate": r.rate} for r in rows],
            }
        )
    return "\n".join(lines), summary


def plot(summary: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("gemmspec bench: --plot needs matplotlib (pip install matplotlib)", file=sys.stderr)
        return
    cases = [s for s in summary if "rows" in s]
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(cases)), 5))
    width = 0.28
    for i, s in enumerate(cases):
        ours = s["rows"][0]
        others = [r for r in s["rows"][1:]]
        base = ours["rate"]
        vals = [("gemmspec", 1.0)] + [(r["impl"].split(" ")[0], r["rate"] / base if ours["unit"] == "TFLOPS" else r["rate"] / base) for r in others]
        if s.get("deepgemm_recorded_tflops"):
            vals.append(("DeepGEMM (rec.)", s["deepgemm_recorded_tflops"] / base))
        for j, (label, v) in enumerate(vals):
            ax.bar(i + (j - 1) * width, v, width, color=["tab:blue", "tab:orange", "tab:gray"][j % 3],
                   label=label if i == 0 else None)
    ax.set_xticks(range(len(cases)), [s["case"].replace("_", "\n", 2) for s in cases], fontsize=7)
    ax.set_ylabel("rate relative to gemmspec")
    ax.axhline(1.0, color="k", lw=0.5)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def selected_cases(only: list[str] | None) -> list[Case]:
    """The cases `--only` names by prefix (every case without it)."""
    return [c for c in CASES if only is None or any(c.name.startswith(p) for p in only)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="gemmspec bench", description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", default=None, metavar="CASE", help="run only these cases (prefixes)")
    ap.add_argument("--repeat", type=int, default=1, help="do_bench runs per implementation (median of medians)")
    ap.add_argument("--json", metavar="FILE", help="write every measurement as JSON")
    ap.add_argument("--plot", metavar="FILE.png", help="draw gemmspec vs anchors per case (needs matplotlib)")
    ap.add_argument("--list", action="store_true", help="list the cases and their targets, then exit")
    ap.add_argument("--no-deepgemm", action="store_true",
                    help="do not run DeepGEMM even where deep_gemm is importable (print its recorded figures)")
    ap.add_argument("--tile", metavar="MxN", help="force this tile on every gemmspec launch (a tile directive)")
    ap.add_argument(
        "--idle", type=float, default=0.0, metavar="MS",
        help="let the GPU idle MS milliseconds before each timed launch (median of 60 launches "
        "instead of do_bench): sustained FP8 GEMMs throttle the card, so back-to-back rates "
        "depend on what ran before; with a pause every kernel starts from the same state",
    )
    args = ap.parse_args(argv)
    global FORCED_TILE, IDLE_MS, DEEPGEMM, SAMPLER
    if args.idle < 0:
        ap.error(f"--idle takes milliseconds >= 0, got {args.idle}")
    IDLE_MS = args.idle
    if args.tile:
        try:
            m, n = (int(v) for v in args.tile.lower().split("x"))
        except ValueError:
            ap.error(f"--tile expects MxN, e.g. 128x128, got {args.tile!r}")
        FORCED_TILE = (m, n)
    if args.list:
        for c in CASES:
            print(f"{c.name:36} {c.target.describe():32} {c.what}")
        return 0
    try:
        torch = _torch()
        import triton  # noqa: F401
    except ImportError as e:
        print(f"gemmspec bench: needs torch and triton ({e})", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("gemmspec bench: no CUDA device", file=sys.stderr)
        return 2
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    DEEPGEMM = None if args.no_deepgemm else bench_deepgemm.load()
    if DEEPGEMM is not None:
        print(f"DeepGEMM {bench_deepgemm.version(DEEPGEMM)} found: timed beside gemmspec", file=sys.stderr)
    chosen = selected_cases(args.only)
    results: list[Result] = []
    failures: dict[str, str] = {}
    with ClockSampler(gpu_id(props)) as SAMPLER:
        for i, case in enumerate(chosen, 1):
            t0 = time.time()
            print(f"[{i}/{len(chosen)}] {case.name} ...", file=sys.stderr, flush=True)
            torch.manual_seed(i)
            try:
                results += case.run(args.repeat)
            except Exception as e:  # noqa: BLE001 - a failing case is reported, the rest still run
                failures[case.name] = f"{type(e).__name__}: {e}"
            torch.cuda.empty_cache()
            print(f"      {time.time() - t0:.1f} s", file=sys.stderr, flush=True)
    SAMPLER = None
    sms = props.multi_processor_count
    text, summary = report(results, failures, sms)
    print(f"GPU: {torch.cuda.get_device_name()} ({sms} SMs), torch {torch.__version__}")
    print(text)
    if any(r.sm_mhz is not None for r in results):
        print("clock, power: medians of nvidia-smi samples while each row was timed; * at the power cap")
    if args.json:
        with open(args.json, "w") as f:
            deepgemm = bench_deepgemm.version(DEEPGEMM) if DEEPGEMM is not None else None
            json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "deepgemm": deepgemm,
                       "cases": summary}, f, indent=1)
    if args.plot:
        plot(summary, args.plot)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
