"""What `gemmspec run` and the GPU tests print for a run's checks (no GPU needed)."""

from __future__ import annotations

from gemmspec.runtime.verify import OutputCheck, RunReport


def test_describe_names_every_check_and_its_verdict():
    good = OutputCheck("y", 1.5e-3, 0, 0, 4e-3)
    bad = OutputCheck("dw", 2e-2, 3, 1, 1e-3)
    assert good.describe() == "y: rel error 1.500e-03 (limit 4e-03), unwritten 0, clobbered 0: ok"
    assert bad.describe() == "dw: rel error 2.000e-02 (limit 1e-03), unwritten 3, clobbered 1: FAIL"
    report = RunReport("moe", {"T": 257}, (good, bad), 0.0, 1.0)
    assert not report.ok
    assert report.describe() == f"moe {{'T': 257}}: {good.describe()}; {bad.describe()}"
