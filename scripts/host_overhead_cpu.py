"""Host time of a planned call with no GPU: what gemmspec's own Python costs per call.

Runs the default call path (`exe(**args)`, `gemmspec.torch.op` called eagerly and
through torch's dispatcher, and `enqueue()` of a prepared run) on torch CPU tensors that pass for CUDA tensors, with every driver call
stubbed: buffers get fake addresses, kernels are never compiled or loaded, the
launch itself does nothing, and the driver's context query answers at once that the
device's primary context is current (as under torch). The real `LoadedKernel`
argument handling and context switch run up to the driver calls. So the numbers are
gemmspec's Python overhead per call, *without* the driver's launch cost (a few us per
kernel on a real GPU; scripts/host_path_probe.py measures the whole thing there).

It measures the gemmspec of the checkout it is in, whatever is installed.

    python scripts/host_overhead_cpu.py            # per-call medians
    python scripts/host_overhead_cpu.py --profile  # and a cProfile breakdown per call
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import itertools
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gemmspec  # noqa: E402
from gemmspec.runtime import executor, launch, plan, streams  # noqa: E402

CUDA0 = torch.device("cuda", 0)


class FakeBuffer:
    """A workspace with a fake, well-aligned address."""

    _next = 1 << 40

    def __init__(self, nbytes, **_):
        self.nbytes = nbytes
        self.device = 0
        self.ptr = FakeBuffer._next
        FakeBuffer._next += ((nbytes + 255) // 256 + 1) * 256

    @classmethod
    def from_numpy(cls, array, **_):
        return cls(array.nbytes)


class FakeStream:
    """Stands in for a cuda.core Stream (the launch stub never reads it)."""

    handle = 0

    def sync(self):
        raise AssertionError("a call waited for the device")


class FakeLoadedKernel(launch.LoadedKernel):
    """The real launch-argument handling; only loading and the driver are skipped.
    Parameter sizes come from the first launch's arguments (as the driver would say)."""

    def __init__(self, compiled, name, *, device=0):
        self.name, self.device = name, device
        self._kernel = None
        self._cu_kernel = None
        self._cu_function = launch.driver.CUfunction(0)
        self._smem_limit = 1 << 30
        self._param_sizes = None

    def _sizes(self, args):
        return [a.dtype.itemsize if isinstance(a, np.generic) else 8 for a in args]

    def launch(self, grid, block, smem, stream, *args):
        if self._param_sizes is None:
            self._param_sizes = self._sizes(args)
        super().launch(grid, block, smem, stream, *args)

    def bind(self, grid, block, smem, stream, args, slots, cells, programmatic=False):
        if self._param_sizes is None:
            self._param_sizes = self._sizes(args)
        return super().bind(grid, block, smem, stream, args, slots, cells, programmatic=programmatic)


class FakeContextDriver:
    """The driver calls of `streams.on_device`: device 0's primary context is current
    (a new handle object per query, as the driver's bindings return)."""

    CUresult = launch.driver.CUresult
    PRIMARY = 0x5000

    @classmethod
    def cuCtxGetCurrent(cls):
        return cls.CUresult.CUDA_SUCCESS, launch.driver.CUcontext(cls.PRIMARY)

    @classmethod
    def cuCtxSetCurrent(cls, ctx):
        # Making the current context current again (what a planning call does on its way
        # out) is harmless; a switch to any other would mean the primary was not current.
        if int(ctx) != cls.PRIMARY:
            raise AssertionError("the primary context is current: nothing to switch")
        return (cls.CUresult.CUDA_SUCCESS,)


def _constant(value):
    """A C callable of one argument that returns `value` (next() of an endless repeat,
    the argument being next's unused default)."""
    return functools.partial(next, itertools.repeat(value))


def install_fakes() -> None:
    """Stub every driver call; torch CPU tensors pass for CUDA tensors on device 0."""
    executor.DeviceBuffer = FakeBuffer
    executor.LoadedKernel = FakeLoadedKernel
    executor.compile_cubin = lambda source, **kw: None
    executor.num_sms = lambda device=0: 132
    executor.caller_stream = lambda s, objects, device: FakeStream()
    executor.is_capturing = lambda s: False
    streams.driver = FakeContextDriver
    primary = launch.driver.CUcontext(FakeContextDriver.PRIMARY)
    streams._CONTEXTS[0] = (primary, int(primary))
    plan.encode_tile_map = lambda dtype, rows, inner, address: bytes(128)
    launch.DeviceBuffer = FakeBuffer
    launch._cuda_launch = lambda *a: None  # the cuda.core launch
    launch.current_stream = lambda stream, device=0: stream
    if hasattr(launch, "_launch_kernel"):  # the driver's cuLaunchKernel, where used
        launch._launch_kernel = lambda *a: (launch.driver.CUresult.CUDA_SUCCESS,)
    if hasattr(launch, "_launch_kernel_ex"):  # cuLaunchKernelEx: programmatic dependent launches
        launch._launch_kernel_ex = lambda *a: (launch.driver.CUresult.CUDA_SUCCESS,)
    # torch: CPU tensors claim to be on cuda:0, and the current stream is the default.
    # The stand-ins are C callables, as torch's own getters are: a Python lambda costs
    # several times more and would be counted as gemmspec's.
    torch.Tensor.is_cuda = property(_constant(True))
    torch.Tensor.device = property(_constant(CUDA0))
    torch.Tensor.get_device = staticmethod(int)  # int() is 0

    class _TorchStream:
        cuda_stream = 0

    torch.cuda.current_stream = lambda device=None: _TorchStream()
    torch._C._cuda_getCurrentRawStream = _constant(0)
    streams._STREAMS.clear()


def forward_args(t: int = 8192, e: int = 8) -> dict[str, torch.Tensor]:
    """The arguments of scripts/host_path_probe.py (host memory, never touched)."""
    f8 = torch.float8_e4m3fn
    return {
        "x": torch.empty(t, 7168, dtype=f8),
        "x_scale": torch.empty(7168 // 128, t).t(),  # MN-major scales
        "w": torch.empty(e, 4096, 7168, dtype=f8),
        "w_scale": torch.empty(e, 32, 56),
        "y": torch.empty(t, 4096, dtype=torch.bfloat16),
        "expert_offsets": torch.zeros(e + 1, dtype=torch.int32),
    }


def per_call(fn, n: int) -> tuple[float, float]:
    """Median and minimum host time of `fn()`, in microseconds, over `n` calls."""
    times = []
    for _ in range(n):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6, min(times) * 1e6


def profile(fn, n: int, title: str, top: int) -> None:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(n):
        fn()
    prof.disable()
    print(f"\n--- {title}: cProfile over {n} calls (times are totals; divide by {n}) ---")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(top)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=5000, help="calls per measurement")
    parser.add_argument("--profile", action="store_true", help="print a cProfile breakdown")
    parser.add_argument("--top", type=int, default=25, help="rows of the breakdown")
    ns = parser.parse_args()

    install_fakes()
    import gemmspec.torch as gt

    exe = gemmspec.build(ROOT / "examples" / "moe_fp8_forward.gspec")
    args = forward_args()
    exe(**args)  # plans
    op = gt.op(exe)
    # The op is registered for CUDA tensors; these are CPU tensors underneath.
    gt._LIB.impl(op.name, op._run, "CPU")
    gt._LIB.impl(f"{op.name}_out", op._run_out, "CPU")
    op(**args)
    prepared = exe.prepare(None, check=False, **args)  # reads no offsets
    launches = len(prepared.launches)
    in_place = [args[n] for n in op.inputs + op.outputs]
    cases = [
        ("exe(**args)", lambda: exe(**args)),
        ("gemmspec.torch op(**args)", lambda: op(**args)),
        # What torch.compile's graphs call, and the op when anything watches it.
        ("op via the dispatcher", lambda: op.in_place(*in_place)),
        ("prepared.enqueue()", prepared.enqueue),
    ]
    print(
        f"{exe.spec.name}: {launches} launches per call; fake driver (no launch cost, "
        "context already current): gemmspec's host overhead only"
    )
    for title, fn in cases:
        per_call(fn, ns.n // 10)  # warm
        median, low = per_call(fn, ns.n)
        print(f"  {title:28s} median {median:7.2f} us   min {low:7.2f} us")
    if ns.profile:
        for title, fn in cases[:3]:
            profile(fn, ns.n, title, ns.top)


if __name__ == "__main__":
    main()
