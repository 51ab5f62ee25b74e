"""The GPU's SM clock and board power while a benchmark row runs, polled from nvidia-smi.

A sustained FP8 GEMM on an H200 draws the card's whole power limit (700 W): the card then
lowers its SM clock to what that power allows (about 1.4 GHz against a 1.98 GHz maximum),
so a rate says little about a kernel without the clock it ran at. The tensor cores' peak
scales with that clock (per SM and cycle: 8192 dense FP8 FLOPs, 4096 BF16), which gives the
compute roof a power-capped row is measured against.

``ClockSampler`` runs ``nvidia-smi --query-gpu ... -lms 50`` in a thread for as long as its
``with`` block lasts, and gives the medians of the samples taken between two instants;
without nvidia-smi it reads nothing (None).
"""

from __future__ import annotations

import shutil
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass

# Dense tensor-core FLOPs per SM and cycle on Hopper (H100/H200: 1979 FP8 TFLOPS = 132 SMs x
# 1.83 GHz x 8192).
PEAK_FLOPS_PER_SM_CYCLE = {"fp8": 8192, "bf16": 4096}
# nvidia-smi's clock-event reasons (a bit mask): the software power cap.
SW_POWER_CAP = 0x4
POLL_MS = 50
FIRST_SAMPLE_TIMEOUT_S = 10.0
# The first query this driver answers: the instant power where it reports it (power.draw
# is a one-second average on newer drivers), the reasons mask under its newer name or its
# older one, or neither.
_QUERIES = (
    "clocks.sm,power.draw.instant,clocks_event_reasons.active",
    "clocks.sm,power.draw,clocks_event_reasons.active",
    "clocks.sm,power.draw,clocks_throttle_reasons.active",
    "clocks.sm,power.draw",
)


@dataclass(frozen=True)
class ClockReading:
    """Medians over the samples taken while a row ran."""

    sm_mhz: float
    power_w: float
    power_capped: float  # the fraction of samples with the software power cap active
    samples: int

    def describe(self) -> str:
        cap = " at the power cap" if at_power_cap(self.power_capped) else ""
        return f"{self.sm_mhz:.0f} MHz, {self.power_w:.0f} W{cap}"

    def peak_tflops(self, kind: str, sms: int) -> float:
        """The dense tensor-core peak of `sms` SMs at this clock (kind "fp8" or "bf16")."""
        return peak_tflops(kind, sms, self.sm_mhz)


def at_power_cap(share: float) -> bool:
    """A row counts as power-capped where at least half of its samples had the cap active."""
    return share >= 0.5


def gpu_id(props) -> str | None:
    """A device's PCI bus id as nvidia-smi -i takes it, from torch's device properties
    (device numbers differ where CUDA_VISIBLE_DEVICES reorders them); None if unknown."""
    bus = getattr(props, "pci_bus_id", None)
    if bus is None:
        return None
    return f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"


def peak_tflops(kind: str, sms: int, sm_mhz: float) -> float:
    """The dense tensor-core peak of `sms` SMs at `sm_mhz` (kind "fp8" or "bf16")."""
    return PEAK_FLOPS_PER_SM_CYCLE[kind] * sms * sm_mhz * 1e6 / 1e12


def parse_samples(lines: list[str]) -> ClockReading | None:
    """nvidia-smi's CSV lines (no header, no units): SM MHz, watts and, where the driver
    reports it, the reasons mask. Lines that do not parse (a "[N/A]") are skipped."""
    clocks, watts, capped = [], [], []
    for line in lines:
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 2:
            continue
        try:
            mhz, w = float(cells[0]), float(cells[1])
        except ValueError:
            continue
        clocks.append(mhz)
        watts.append(w)
        try:
            capped.append(bool(int(cells[2], 16) & SW_POWER_CAP) if len(cells) > 2 else False)
        except ValueError:
            capped.append(False)
    if not clocks:
        return None
    return ClockReading(statistics.median(clocks), statistics.median(watts), sum(capped) / len(capped), len(clocks))


class ClockSampler:
    """``with ClockSampler(gpu) as s:`` polls nvidia-smi every POLL_MS in a thread for as
    long as the block lasts, stamping each sample as it arrives; ``s.reading(t0, t1)``
    gives the medians of the samples between two ``time.monotonic()`` readings (None
    without nvidia-smi or without a sample there). One sampler serves a whole benchmark:
    nvidia-smi takes longer to start than a timed row lasts. `gpu` is what ``nvidia-smi -i``
    takes (an index or a PCI bus id); None: the first GPU."""

    _fields: str | None = None  # the query that works with this driver, found once

    def __init__(self, gpu: str | None = None) -> None:
        self.gpu = gpu
        self._samples: list[tuple[float, str]] = []
        self._proc: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None
        self._first = threading.Event()

    def _command(self, fields: str, loop: bool) -> list[str]:
        cmd = ["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"]
        if self.gpu is not None:
            cmd += ["-i", str(self.gpu)]
        return cmd + (["-lms", str(POLL_MS)] if loop else [])

    def _query(self) -> str | None:
        if ClockSampler._fields is None:
            for fields in _QUERIES:
                try:
                    done = subprocess.run(self._command(fields, False), capture_output=True, text=True, timeout=10)
                except (OSError, subprocess.SubprocessError):
                    return None
                if done.returncode == 0 and parse_samples(done.stdout.splitlines()) is not None:
                    ClockSampler._fields = fields
                    break
            else:
                return None
        return ClockSampler._fields

    def __enter__(self) -> ClockSampler:
        fields = self._query() if shutil.which("nvidia-smi") else None
        if fields is None:
            return self
        self._proc = subprocess.Popen(self._command(fields, True), stdout=subprocess.PIPE,
                                      stderr=subprocess.DEVNULL, text=True)
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        # nvidia-smi takes a while to start: wait for its first sample, so that the first
        # window already has its own.
        self._first.wait(timeout=FIRST_SAMPLE_TIMEOUT_S)
        return self

    def _read(self) -> None:
        assert self._proc is not None and self._proc.stdout is not None
        for line in self._proc.stdout:
            self._samples.append((time.monotonic(), line))
            self._first.set()
        self._first.set()  # nvidia-smi ended: nobody waits for it

    def reading(self, t0: float, t1: float) -> ClockReading | None:
        return parse_samples([line for t, line in list(self._samples) if t0 <= t <= t1])

    def __exit__(self, *exc) -> None:
        if self._proc is None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
