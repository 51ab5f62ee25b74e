"""What `gemmspec run` and the GPU tests print for a run's checks (no GPU needed)."""

from __future__ import annotations

from gemmspec.runtime.verify import ElementError, OutputCheck, RunReport


def test_describe_names_every_check_and_its_verdict():
    good = OutputCheck("y", 2.0**-7, 1e-2, elements=1000, max_abs_error=1.5e-3, rel_error=1.2e-3)
    bad = OutputCheck(
        "dw", 1e-3, 1e-3, elements=64, max_abs_error=0.5, over_bound=1,
        worst=(ElementError((3, 17), 1.0, 1.5, 2e-3),), unwritten=3, non_finite=3, clobbered=1,
        guard_bytes_changed=2, guard_offsets=(("dw", -1), ("dw", 256)), rel_error=2e-2,
    )
    assert good.ok and not bad.ok
    assert good.describe() == (
        "y: max abs error 1.500e-03, 0 of 1000 over 0.0078*|ref| + 0.01*rms(row), non-finite 0, "
        "unwritten 0, clobbered 0, guard bytes changed 0 (rel error 1.200e-03): ok"
    )
    assert bad.describe() == (
        "dw: max abs error 5.000e-01, 1 of 64 over 0.001*|ref| + 0.001*rms(row), non-finite 3, "
        "unwritten 3, clobbered 1, guard bytes changed 2 (rel error 2.000e-02): FAIL; "
        "worst [3, 17] ref 1 got 1.5 (bound 0.002); changed bytes dw-1, dw+256"
    )
    assert "\n" not in bad.describe()
    report = RunReport("moe", {"T": 257}, (good, bad), 0.0, 1.0)
    assert not report.ok
    assert report.describe() == f"moe {{'T': 257}}: {good.describe()}; {bad.describe()}"


def test_each_count_alone_fails_the_check():
    for field in ("over_bound", "non_finite", "unwritten", "clobbered", "guard_bytes_changed"):
        assert not OutputCheck("y", 1e-4, 1e-3, **{field: 1}).ok, field
