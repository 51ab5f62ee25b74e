"""`gemmspec bench` without a GPU: it lists its cases, judges rows by their targets,
and says clearly when torch or a GPU is missing."""

from __future__ import annotations

import pytest

from gemmspec import bench
from gemmspec.bench import timing
from gemmspec.bench.anchors import deepgemm
from gemmspec.bench.compare import checked
from gemmspec.bench.report import verdict
from gemmspec.cli import main


def test_list_needs_no_gpu(capsys):
    assert main(["bench", "--list"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in bench.CASES)
    assert ">= 1230 TFLOPS" in out


def test_bad_tile_option_is_a_usage_error():
    with pytest.raises(SystemExit) as e:
        bench.main(["--tile", "big"])
    assert e.value.code == 2


def test_negative_idle_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--idle", "-1"])
    assert e.value.code == 2
    assert "--idle takes milliseconds >= 0" in capsys.readouterr().err


def _row(case, impl, ms, work=2e12):
    return bench.Result(case, impl, ms, work, "TFLOPS")


def test_verdict_applies_rate_and_ratio_targets():
    case = bench.Case("c", "", bench.Target(tflops=1000, vs_torch=1.2), lambda r: [])
    fast = _row("c", "gemmspec", 1.5)  # 1333 TFLOPS
    torch_row = _row("c", "torch", 1.9)
    assert verdict(case, fast, torch_row) == "pass"
    assert verdict(case, fast, _row("c", "torch", 1.7)) == "MISS"  # only 1.13x torch
    assert verdict(case, _row("c", "gemmspec", 2.5), torch_row) == "MISS"  # 800 TFLOPS
    timed = bench.Case("l", "", bench.Target(max_us=24), lambda r: [])
    assert verdict(timed, _row("l", "gemmspec", 0.020), None) == "pass"
    assert verdict(timed, _row("l", "gemmspec", 0.030), None) == "MISS"


def test_report_marks_failed_cases():
    text, summary = bench.report([], {bench.CASES[0].name: "AssertionError: differs"})
    assert "FAILED: AssertionError: differs" in text
    assert summary == [{"case": bench.CASES[0].name, "error": "AssertionError: differs"}]


def test_checked_rejects_nan_and_large_errors():
    assert "1.00e-03" in checked(1e-3, 4e-3, "ref")
    for bad in (float("nan"), 5e-3):
        with pytest.raises(AssertionError):
            checked(bad, 4e-3, "ref")


def test_verdict_judges_the_deepgemm_ratio_only_where_deepgemm_ran():
    case = bench.Case("d", "", bench.Target(vs_torch=1.3, vs_deepgemm=1.05), lambda r: [])
    assert case.target.describe() == ">= 1.30x torch, >= 1.05x DeepGEMM"
    ours, torch_row = _row("d", "gemmspec", 1.0), _row("d", "torch", 1.5)
    ahead, level = _row("d", "DeepGEMM 2.5.0 (masked)", 1.06), _row("d", "DeepGEMM 2.5.0 (masked)", 1.0)
    assert verdict(case, ours, torch_row, [torch_row, ahead]) == "pass"
    assert verdict(case, ours, torch_row, [torch_row, level]) == "MISS"  # 1.00x, not 1.05x
    # DeepGEMM not importable, or its anchor failed (a row with no time): the rest is
    # judged and the verdict says the DeepGEMM ratio was not.
    failed = bench.Result("d", "DeepGEMM 2.5.0", float("nan"), 2e12, "TFLOPS", "not run: ValueError")
    for others in ([torch_row], [torch_row, failed]):
        assert verdict(case, ours, torch_row, others) == "pass, DeepGEMM's ratio not judged (it did not run)"
    assert verdict(case, ours, _row("d", "torch", 1.2), [failed]) == "MISS"  # torch's ratio still judged


def test_verdict_against_every_separate_launch_row():
    case = bench.Case("s", "", bench.Target(vs_separate=1.0), lambda r: [])
    assert case.target.describe() == "faster than separate launches"
    assert bench.Target(vs_separate=1.5).describe() == ">= 1.50x separate launches"
    ours = _row("s", "gemmspec fused", 1.0)
    slower = [_row("s", "gemmspec + torch", 1.4), _row("s", "torch", 1.2)]
    assert verdict(case, ours, None, slower) == "pass"
    assert verdict(case, ours, None, [*slower, _row("s", "torch other", 0.9)]) == "MISS"
    assert verdict(case, ours, None, []) == "MISS"  # nothing it was compared with


class _FakeCuda:
    """Just enough of torch.cuda for the event loop: every call is logged in order."""

    def __init__(self, log):
        self.log = log
        outer = self

        class Event:
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                outer.log.append("record")

            def elapsed_time(self, end):
                return 0.5

        self.Event = Event

    def _sleep(self, cycles):
        self.log.append("sleep")

    def synchronize(self):
        self.log.append("sync")


class _FakeTorch:
    int8 = "int8"

    def __init__(self, log):
        self.log = log
        self.cuda = _FakeCuda(log)

    def empty(self, size, dtype, device):
        log = self.log

        class Flush:
            def zero_(self):
                log.append("flush")

        return Flush()


def test_restored_launches_restore_before_each_flush_and_launch(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "load_torch", lambda: _FakeTorch(log))
    monkeypatch.setattr(timing, "IDLE_MS", 0.0)
    monkeypatch.setattr(timing, "RESTORED_LAUNCHES", 3)
    measured = timing.timed(lambda: log.append("fn"), 2, before=lambda: log.append("restore"))
    assert measured.samples_ms == [0.5, 0.5]
    one = ["restore", "fn"] + ["restore", "flush", "record", "fn", "record"] * 3 + ["sync"]
    assert log == one * 2


def test_idle_launches_sleep_after_the_restore(monkeypatch):
    log = []
    monkeypatch.setattr(timing, "load_torch", lambda: _FakeTorch(log))
    bench.timed_launches(lambda: log.append("fn"), 1, 2.0, before=lambda: log.append("restore"))
    assert log == ["restore", "fn", "restore", "sleep", "flush", "record", "fn", "record", "sync"]
    log.clear()
    bench.timed_launches(lambda: log.append("fn"), 1, 0.0)  # rows that update nothing in place
    assert log == ["fn", "flush", "record", "fn", "record", "sync"]


def test_live_deepgemm_row_replaces_the_recorded_figure():
    name = "fp8_fwd_G8x4096_N4096_K7168"
    ours, torch_row = _row(name, "gemmspec", 1.7), _row(name, "torch._scaled_grouped_mm", 1.9)
    text, summary = bench.report([ours, torch_row], {})
    assert "DeepGEMM 2.6.1 (recorded 2026-11-30)" in text
    assert summary[0]["deepgemm_recorded_tflops"] == bench.CASES[0].deepgemm_recorded_tflops == 1232.4
    live = _row(name, "DeepGEMM 2.6.1 (contiguous)", 1.6)
    text, summary = bench.report([ours, torch_row, live], {})
    assert "(recorded" not in text and "DeepGEMM 2.6.1 (contiguous)" in text
    assert summary[0]["deepgemm_recorded_tflops"] is None
    assert [r["impl"] for r in summary[0]["rows"]][2].startswith("DeepGEMM")
    # A DeepGEMM row that failed to run was never timed: the recorded figure stays.
    failed = bench.Result(name, "DeepGEMM 2.6.1 (contiguous)", float("nan"), 2e12, "TFLOPS", "not run: ValueError")
    text, summary = bench.report([ours, torch_row, failed], {})
    assert "DeepGEMM 2.6.1 (recorded 2026-11-30)" in text and "not run: ValueError" in text
    assert summary[0]["deepgemm_recorded_tflops"] == 1232.4


def test_a_failing_deepgemm_anchor_is_reported_in_its_row(monkeypatch, capsys):
    monkeypatch.setattr(deepgemm, "DEEPGEMM", object())  # a "module" without the API

    def make(dg):
        raise AttributeError("module has no attribute 'm_grouped_fp8_gemm_nt_contiguous'")

    (row,) = deepgemm.row("c", 2e12, 1, make)
    assert row.impl.startswith("DeepGEMM") and row.check.startswith("not run: AttributeError")
    assert row.ms != row.ms  # nan: never timed, never a rate
    assert "DeepGEMM anchor of c failed" in capsys.readouterr().err
    monkeypatch.setattr(deepgemm, "DEEPGEMM", None)
    assert deepgemm.row("c", 2e12, 1, make) == []  # not installed: no row at all


def test_deepgemm_padded_layout_puts_each_group_at_a_multiple_of_128():
    assert deepgemm._padded_rows([1, 127, 0, 5155, 128]) == ([0, 128, 256, 256, 5504], 5632)
    assert deepgemm._padded_rows([4096] * 2) == ([0, 4096], 8192)
