"""Host time of a gemmspec call on the default path (torch tensors, torch's current
stream): the median host time per call once planned (the executable, its custom op
called eagerly and through torch's dispatcher) and per enqueue() of a prepared run,
and whether calls queue behind busy GPU work without waiting for it (100 calls issued
while a long matmul runs)."""

from __future__ import annotations

import statistics
import time

import torch

import gemmspec
import gemmspec.torch as gt


def _host_times(call, repeats: int = 200) -> list[float]:
    """Host seconds of each of `repeats` calls (the GPU work they queue is waited for after)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return times


def main() -> None:
    exe = gemmspec.build("examples/moe_fp8_forward.gspec")
    t, e = 8192, 8
    dev = torch.device("cuda")
    x = torch.randn(t, 7168, device=dev).to(torch.float8_e4m3fn)
    xs = torch.ones(7168 // 128, t, device=dev).t()  # MN-major scales
    w = torch.randn(e, 4096, 7168, device=dev).to(torch.float8_e4m3fn)
    ws = torch.ones(e, 32, 56, device=dev)
    y = torch.empty(t, 4096, device=dev, dtype=torch.bfloat16)
    offs = torch.linspace(0, t, e + 1, device=dev).to(torch.int32)
    args = dict(x=x, x_scale=xs, w=w, w_scale=ws, y=y, expert_offsets=offs)
    exe(check=True, **args)  # compile, plan
    torch.cuda.synchronize()
    times = _host_times(lambda: exe(**args))
    print(f"host time per call: median {statistics.median(times) * 1e6:.1f} us, min {min(times) * 1e6:.1f} us")
    op = gt.op(exe)
    times = _host_times(lambda: op(**args))
    print(f"host time per custom-op call: median {statistics.median(times) * 1e6:.1f} us")
    in_place = [args[n] for n in op.inputs + op.outputs]
    times = _host_times(lambda: op.in_place(*in_place))  # as torch.compile's graphs call it
    print(f"host time per custom-op call through the dispatcher: median {statistics.median(times) * 1e6:.1f} us")
    run = exe.prepare(torch.cuda.current_stream(), **args)
    times = _host_times(run.enqueue)
    print(f"host time per enqueue() of a prepared run: median {statistics.median(times) * 1e6:.1f} us")
    print("targets: <= 30 us per call, <= 10 us per enqueue()")
    big = torch.randn(16384, 16384, device=dev, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        big @ big
    issued = time.perf_counter()
    for _ in range(100):
        exe(**args)
    queued = time.perf_counter()
    torch.cuda.synchronize()
    done = time.perf_counter()
    print(
        f"100 calls queued behind {issued - start:.4f} s of matmul issue: {1e3 * (queued - issued):.2f} ms "
        f"to issue, {1e3 * (done - queued):.1f} ms until the GPU finished (no call waited if "
        "the first is far below the second)"
    )


if __name__ == "__main__":
    main()
