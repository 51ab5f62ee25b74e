"""`gemmspec bench` without a GPU: it lists its cases, judges rows by their targets,
and says clearly when torch or a GPU is missing."""

from __future__ import annotations

import pytest

from gemmspec import bench
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
    assert bench._verdict(case, fast, torch_row) == "pass"
    assert bench._verdict(case, fast, _row("c", "torch", 1.7)) == "MISS"  # only 1.13x torch
    assert bench._verdict(case, _row("c", "gemmspec", 2.5), torch_row) == "MISS"  # 800 TFLOPS
    timed = bench.Case("l", "", bench.Target(max_us=24), lambda r: [])
    assert bench._verdict(timed, _row("l", "gemmspec", 0.020), None) == "pass"
    assert bench._verdict(timed, _row("l", "gemmspec", 0.030), None) == "MISS"


def test_report_marks_failed_cases():
    text, summary = bench.report([], {bench.CASES[0].name: "AssertionError: differs"})
    assert "FAILED: AssertionError: differs" in text
    assert summary == [{"case": bench.CASES[0].name, "error": "AssertionError: differs"}]


def test_checked_rejects_nan_and_large_errors():
    assert "1.00e-03" in bench._checked(1e-3, 4e-3, "ref")
    for bad in (float("nan"), 5e-3):
        with pytest.raises(AssertionError):
            bench._checked(bad, 4e-3, "ref")
