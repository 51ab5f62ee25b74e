"""Benchmark gemmspec against PyTorch's grouped GEMMs on the same GPU, in one run.

Times each case with triton.testing.do_bench (median, CUDA events, warm-up),
counts only useful FLOPs (no padding), prints a table with the ratio to each
anchor and writes JSON. Measured anchors run here; DeepGEMM's figures come from
the recorded baselines (pass --anchors FILE to include them).

    python3 scripts/bench.py [--out bench.json] [--anchors h200-deepgemm.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
E, M_PER, N, K = 8, 4096, 4096, 7168


def bench(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")  # milliseconds


def fp8(shape, dev="cuda"):
    return (torch.randn(shape, device=dev) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)


def scales(shape):
    return torch.rand(shape, device="cuda") * 0.01 + 0.001


def offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def case_moe_fp8(rows):
    T = E * M_PER
    flops = 2.0 * T * N * K
    exe = gemmspec.build(EXAMPLES / "moe_fp8_forward.gspec")
    x, w = fp8((T, K)), fp8((E, N, K))
    xs = scales((K // 128, T)).t()  # MN-major, as declared
    ws = scales((E, N // 128, K // 128))
    y = torch.empty((T, N), dtype=torch.bfloat16, device="cuda")
    offs = offsets([M_PER] * E)
    run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, expert_offsets=offs)
    ms = bench(run.enqueue)
    rows.append(("moe_fp8_forward G8 m4096 N4096 K7168", "gemmspec 1x128/128x128", ms, flops))
    try:
        sa = scales((T,))
        sb = scales((E, N))
        b = w.transpose(-2, -1)
        ends = offs[1:].contiguous()
        ms = bench(lambda: torch._scaled_grouped_mm(x, b, sa, sb, offs=ends, out_dtype=torch.bfloat16))
        rows.append(("moe_fp8_forward G8 m4096 N4096 K7168", "torch._scaled_grouped_mm rowwise", ms, flops))
    except Exception as e:  # an anchor that cannot run is reported, not hidden
        print(f"anchor torch._scaled_grouped_mm failed: {e}", file=sys.stderr)


def case_moe_bf16(rows):
    T = E * M_PER
    flops = 2.0 * T * N * K
    exe = gemmspec.build(EXAMPLES / "moe_bf16_forward.gspec")
    x = torch.randn((T, K), device="cuda", dtype=torch.bfloat16)
    w = torch.randn((E, N, K), device="cuda", dtype=torch.bfloat16)
    y = torch.empty((T, N), dtype=torch.bfloat16, device="cuda")
    offs = offsets([M_PER] * E)
    run = exe.prepare(torch.cuda.current_stream(), x=x, w=w, y=y, expert_offsets=offs)
    ms = bench(run.enqueue)
    rows.append(("moe_bf16_forward G8 m4096 N4096 K7168", "gemmspec bf16", ms, flops))
    try:
        b = w.transpose(-2, -1)
        ends = offs[1:].contiguous()
        ms = bench(lambda: torch._grouped_mm(x, b, offs=ends))
        rows.append(("moe_bf16_forward G8 m4096 N4096 K7168", "torch._grouped_mm", ms, flops))
    except Exception as e:
        print(f"anchor torch._grouped_mm failed: {e}", file=sys.stderr)


def case_wgrad(rows):
    T = E * M_PER
    NW, KW = 4096, 7168
    flops = 2.0 * T * NW * KW
    exe = gemmspec.build(EXAMPLES / "moe_fp8_wgrad.gspec")
    dy, x = fp8((T * NW,)).view(T, NW), fp8((T * KW,)).view(T, KW)  # per-segment transposed bytes
    dys = scales((T // 128, NW))
    xs = scales((T // 128, KW))
    dw = torch.zeros((E, NW, KW), dtype=torch.float32, device="cuda")
    offs = offsets([M_PER] * E)
    run = exe.prepare(torch.cuda.current_stream(), dy=dy, dy_scale=dys, x=x, x_scale=xs, dw=dw, expert_offsets=offs)
    ms = bench(run.enqueue)
    rows.append(("moe_fp8_wgrad G8 k4096 M4096 N7168", "gemmspec 128x1/128x1 +=", ms, flops))
    try:
        a = torch.randn((NW, T), device="cuda", dtype=torch.bfloat16)
        b = torch.randn((KW, T), device="cuda", dtype=torch.bfloat16).t()
        ends = offs[1:].contiguous()
        ms = bench(lambda: torch._grouped_mm(a, b, offs=ends))
        rows.append(("moe_fp8_wgrad G8 k4096 M4096 N7168", "torch._grouped_mm bf16 K-grouped", ms, flops))
    except Exception as e:
        print(f"anchor torch._grouped_mm (K-grouped) failed: {e}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    ap.add_argument("--anchors", type=Path, nargs="*", default=[], help="recorded baseline JSON files")
    args = ap.parse_args()
    torch.manual_seed(0)
    rows: list[tuple[str, str, float, float]] = []
    for case in (case_moe_fp8, case_moe_bf16, case_wgrad):
        case(rows)
    recorded = {}
    for path in args.anchors:
        recorded.update(json.loads(path.read_text()))
    print(f"{'case':40} {'implementation':36} {'ms':>8} {'TFLOPS':>8} {'gemmspec/this':>14}")
    results = []
    for case, impl, ms, flops in rows:
        tflops = flops / ms / 1e9
        ours = next(t for c, i, m, f in rows if c == case and i.startswith("gemmspec") for t in [f / m / 1e9])
        ratio = ours / tflops
        print(f"{case:40} {impl:36} {ms:8.3f} {tflops:8.1f} {ratio:14.2f}")
        results.append({"case": case, "impl": impl, "ms": ms, "tflops": tflops, "gemmspec_over_this": ratio})
    for key, value in recorded.items():
        if key.endswith("TFLOPS") or "TFLOPS(" in key:
            print(f"recorded anchor {key}: {value}")
    doc = {"gpu": torch.cuda.get_device_name(), "results": results, "recorded_anchors": recorded}
    if args.out:
        args.out.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
