"""Device time of a prepared run, by CUDA events (cuda-python only, no torch).

Each timing is one call between two events on the run's stream, the calls issued back to
back after a warm-up call; before each, the L2 cache is flushed by writing a buffer
larger than it (on the same stream, outside the events), so every call reads its operands
from memory as a call between other work would. The result is the median of the timings,
in milliseconds, with every timing kept.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from cuda.bindings import driver

from gemmspec.errors import GemmspecError
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.streams import on_device

__all__ = ["EventTiming", "L2_FLUSH_BYTES", "time_events"]

# Larger than the L2 of any Hopper part (50 MiB on the H100 and H200).
L2_FLUSH_BYTES = 256 << 20


@dataclass(frozen=True)
class EventTiming:
    samples_ms: tuple[float, ...]

    @property
    def median_ms(self) -> float:
        return statistics.median(self.samples_ms)


def _ok(result: tuple, what: str):
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GemmspecError(f"{what} failed: {err.name}")
    return result[1] if len(result) > 1 else None


def time_events(run, repeat: int, *, flush_l2: bool = True) -> EventTiming:
    """Time `run` (a PreparedRun: `enqueue()` on its `stream`) `repeat` times after one
    warm-up call, each call between its own CUDA events, the L2 flushed before each."""
    if repeat < 1:
        raise ValueError(f"repeat must be at least 1, got {repeat}")
    with on_device(run.device):
        stream = driver.CUstream(int(run.stream.handle))
        flush = DeviceBuffer(L2_FLUSH_BYTES, device=run.device, stream=run.stream) if flush_l2 else None
        events = [
            (_ok(driver.cuEventCreate(0), "cuEventCreate"), _ok(driver.cuEventCreate(0), "cuEventCreate"))
            for _ in range(repeat)
        ]
        try:
            run.enqueue()  # warm-up: kernels loaded, clocks up, plan packed
            for start, end in events:
                if flush is not None:
                    _ok(driver.cuMemsetD8Async(flush.ptr, 0, flush.nbytes, stream), "cuMemsetD8Async")
                _ok(driver.cuEventRecord(start, stream), "cuEventRecord")
                run.enqueue()
                _ok(driver.cuEventRecord(end, stream), "cuEventRecord")
            _ok(driver.cuEventSynchronize(events[-1][1]), "cuEventSynchronize")
            samples = tuple(
                float(_ok(driver.cuEventElapsedTime(start, end), "cuEventElapsedTime")) for start, end in events
            )
        finally:
            for pair in events:
                for event in pair:
                    driver.cuEventDestroy(event)
            run.synchronize()  # the flush buffer is freed only after the last call
    return EventTiming(samples)
