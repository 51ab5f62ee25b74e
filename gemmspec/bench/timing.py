"""How a row is timed: medians of `triton.testing.do_bench` (CUDA events, L2 flushed
between runs), or an event loop of its own when the GPU idles before each launch
(`--idle`) or when each launch must start from the same output; then, where nvidia-smi
runs, the SM clock and board power of the row's launches kept running. `Result` is one
timed row of the table.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..clocks import ClockReading, ClockSampler
from .inputs import load_torch


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
    torch = load_torch()
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


SAMPLER: ClockSampler | None = None  # the runner's clock and power sampler, running while cases run


def timed(fn, repeat: int, before: Callable[[], object] | None = None) -> Timing:
    """Median ms per `repeat`: do_bench, or the event loop when idling or when `before`
    must restore the inputs ahead of every launch; then, where the runner's sampler runs,
    the clock and power of `fn` kept running (untimed) for CLOCK_RUN_S."""
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
    torch = load_torch()
    start = time.monotonic()
    while time.monotonic() - start < CLOCK_RUN_S:
        for _ in range(8):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    end = time.monotonic()
    return sampler.reading(end - CLOCK_READ_S, end)


def result(case, impl, timing: Timing, work, unit="TFLOPS", check="") -> Result:
    """The table's row of `impl` in `case` from its timing."""
    c = timing.clock
    return Result(case, impl, statistics.median(timing.samples_ms), work, unit, check, timing.samples_ms,
                  c and c.sm_mhz, c and c.power_w, c and c.power_capped)
