"""The LoRA shrink beside plain reads of the same x, under four ways of timing it.

gemmspec as compiled and after a leaf-table builder, torch's grouped GEMM, and two plain
reads of x (a dense `x @ v` with N = 16 and `x.sum(dim=1)`), each timed by triton's
do_bench (L2 flushed by zero-filling 256 MB, as `gemmspec bench` does), by CUDA events
after that zero fill, after a 256 MB read instead (L2 flushed but clean), and back to
back. Needs a Hopper GPU, torch and triton:

    python3 scripts/lora_floor.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402
from gemmspec.bench import LORA, nested_offsets, random_nested_counts  # noqa: E402
from gemmspec.codegen.emit import emit  # noqa: E402

T, K, LORAS, EXPERTS, RANK = 8192, 4096, 4, 8, 16


def events(fn, before, launches: int = 100) -> float:
    """Median us of `fn` between two events, `before` (untimed) ahead of each launch."""
    pairs = []
    for _ in range(launches):
        before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    torch.cuda.synchronize()
    times = sorted(a.elapsed_time(b) for a, b in pairs[10:])
    return times[len(times) // 2] * 1e3


def back_to_back(fn, launches: int = 50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / launches * 1e3


def main() -> int:
    text = LORA.format(k=K, r=RANK, l=LORAS, e=EXPERTS)
    exe = gemmspec.build(text)
    with_builder = gemmspec.build(text)
    with_builder.program = emit(with_builder.spec, with_builder.schedule, inline_tables=False)
    x = torch.randn((T, K), device="cuda", dtype=torch.bfloat16)
    wa = torch.randn((LORAS, EXPERTS, RANK, K), device="cuda", dtype=torch.bfloat16)
    y = torch.empty((T, RANK), dtype=torch.float32, device="cuda")
    g = torch.Generator(device="cpu").manual_seed(2)
    lora_offsets, inner = nested_offsets(random_nested_counts([T // LORAS] * LORAS, EXPERTS, g))
    args = dict(x=x, wa=wa, y=y, lora_offsets=torch.tensor(lora_offsets, dtype=torch.int32, device="cuda"),
                expert_offsets=torch.tensor(inner, dtype=torch.int32, device="cuda"))
    stream = torch.cuda.current_stream()
    ends = args["expert_offsets"][:, 1:].reshape(-1).contiguous()
    flat = wa.reshape(LORAS * EXPERTS, RANK, K)
    v = torch.randn((K, RANK), device="cuda", dtype=torch.bfloat16)
    fns = {
        "gemmspec as compiled": exe.prepare(stream, **args).enqueue,
        "gemmspec builder + GEMM": with_builder.prepare(stream, **args).enqueue,
        "torch._grouped_mm": lambda: torch._grouped_mm(x, flat.transpose(-2, -1), offs=ends),
        "torch x @ v (dense, N=16)": lambda: x @ v,
        "torch x.sum(dim=1)": lambda: x.sum(dim=1),
    }
    zero_flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    read_flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    for name, fn in fns.items():
        fn()
        torch.cuda.synchronize()
        bench = do_bench(fn, warmup=50, rep=300, return_mode="median") * 1e3
        print(
            f"{name:28} do_bench {bench:6.1f} us | events after zero_ {events(fn, zero_flush.zero_):6.1f} | "
            f"after a read flush {events(fn, read_flush.sum):6.1f} | back to back {back_to_back(fn):6.1f}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
