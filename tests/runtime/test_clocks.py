"""The clock and power sampler behind `gemmspec bench`'s clock column, without a GPU: the
CSV nvidia-smi prints is parsed into medians, a fake nvidia-smi on PATH is polled for as
long as the `with` block lasts, and without nvidia-smi nothing is read."""

from __future__ import annotations

import os
import stat
import time

from gemmspec import bench
from gemmspec.bench import timing
from gemmspec.clocks import ClockReading, ClockSampler, gpu_id, parse_samples


def test_parse_samples_takes_medians_and_the_power_cap_share():
    lines = ["1425, 690.1, 0x0000000000000004", "1440, 688.0, 0x0000000000000004", "1980, 80.5, 0x0000000000000000",
             "[N/A], [N/A], [N/A]", ""]
    r = parse_samples(lines)
    assert r == ClockReading(sm_mhz=1440.0, power_w=688.0, power_capped=2 / 3, samples=3)
    assert r.describe() == "1440 MHz, 688 W at the power cap"
    assert round(r.peak_tflops("fp8", 132)) == 1557  # 8192 FLOPs x 132 SMs x 1.44 GHz
    assert round(r.peak_tflops("bf16", 132)) == 779
    # A driver without the reasons column: no power cap seen.
    assert parse_samples(["1980, 75.0"]).power_capped == 0.0
    assert parse_samples(["garbage"]) is None and parse_samples([]) is None


def _fake_nvidia_smi(tmp_path, monkeypatch, body: str):
    exe = tmp_path / "nvidia-smi"
    exe.write_text("#!/bin/sh\n" + body)
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(ClockSampler, "_fields", None)


def test_sampler_polls_a_fake_nvidia_smi(tmp_path, monkeypatch):
    # One line per poll, forever (as with -lms), until the sampler stops it; the arguments
    # it was called with go to a log. A window takes the samples that arrived inside it.
    log = tmp_path / "args"
    _fake_nvidia_smi(tmp_path, monkeypatch, f'echo "$@" >> {log}\nn=1400; while true; do n=$((n+1)); '
                     'echo "$n, 650.0, 0x4"; sleep 0.02; case "$*" in *-lms*) ;; *) exit 0;; esac; done\n')
    with ClockSampler("00000000:19:00.0") as s:
        time.sleep(0.2)
        t0 = time.monotonic()
        time.sleep(0.3)
        t1 = time.monotonic()
        time.sleep(0.1)
        inside, everything = s.reading(t0, t1), s.reading(0.0, time.monotonic())
    assert inside is not None and inside.power_capped == 1.0 and 2 <= inside.samples < everything.samples
    assert everything.sm_mhz < inside.sm_mhz < 1400 + everything.samples  # the middle of a rising count
    assert s.reading(t1 + 10, t1 + 20) is None
    calls = log.read_text().splitlines()
    assert "power.draw.instant,clocks_event_reasons.active" in calls[0]
    assert "-i 00000000:19:00.0" in calls[-1] and "-lms 50" in calls[-1]


def test_sampler_takes_the_first_query_the_driver_answers(tmp_path, monkeypatch):
    _fake_nvidia_smi(tmp_path, monkeypatch, 'case "$*" in *instant*|*clocks_event_reasons*) echo "Field is not valid" >&2; '
                     'exit 2;; esac\necho "1600, 500.0, 0x0"\n')
    with ClockSampler() as s:
        time.sleep(0.2)
        reading = s.reading(0.0, time.monotonic())
    assert ClockSampler._fields == "clocks.sm,power.draw,clocks_throttle_reasons.active"
    assert reading is not None and reading.power_capped == 0.0


def test_no_nvidia_smi_reads_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(ClockSampler, "_fields", None)
    with ClockSampler() as s:
        assert s.reading(0.0, time.monotonic()) is None


def test_report_shows_the_clock_and_the_peak_at_it():
    name = "fp8_fwd_G8x4096_N4096_K7168"
    ours = bench.Result(name, "gemmspec", 1.6, 2.2e12, "TFLOPS", sm_mhz=1425.0, power_w=690.0, power_capped=1.0)
    torch_row = bench.Result(name, "torch._scaled_grouped_mm", 1.9, 2.2e12, "TFLOPS")
    text, summary = bench.report([ours, torch_row], {}, sms=132)
    assert " 1425 MHz  690 W*" in text
    roof = 8192 * 132 * 1425e6 / 1e12
    assert summary[0]["peak_at_clock_tflops"] == roof
    assert f"the FP8 peak at 1425 MHz is {roof:.0f} TFLOPS: {ours.rate / roof:.0%} of it" in text
    # No clock (no nvidia-smi), no SM count, or a memory-bound case: no peak.
    text, summary = bench.report([bench.Result(name, "gemmspec", 1.6, 2.2e12, "TFLOPS")], {}, sms=132)
    assert summary[0]["peak_at_clock_tflops"] is None and "peak at" not in text


def test_gpu_id_is_the_pci_bus_id():
    class Props:
        pci_domain_id, pci_bus_id, pci_device_id = 0, 0x19, 0

    assert gpu_id(Props()) == "00000000:19:00.0"
    assert gpu_id(object()) is None


def test_the_bench_reads_the_clock_of_a_sustained_run(monkeypatch):
    # After timing, the row's launches keep running (each after its restore) and the clock
    # is read from the last CLOCK_READ_S of that run.
    log, windows = [], []

    class Cuda:
        def synchronize(self):
            log.append("sync")

    class Torch:
        cuda = Cuda()

    class Sampler:
        def reading(self, t0, t1):
            windows.append((t0, t1))
            return ClockReading(1500.0, 700.0, 1.0, 10)

    monkeypatch.setattr(timing, "load_torch", lambda: Torch())
    monkeypatch.setattr(timing, "CLOCK_RUN_S", 0.05)
    start = time.monotonic()
    reading = timing.sustained_clock(Sampler(), lambda: log.append("fn"), lambda: log.append("restore"))
    assert reading.sm_mhz == 1500.0
    assert log[:17] == ["restore", "fn"] * 8 + ["sync"] and log[-1] == "sync"
    ((t0, t1),) = windows
    assert t1 - t0 == timing.CLOCK_READ_S and t1 - start >= 0.05
    assert timing.sustained_clock(None, lambda: None) is None
