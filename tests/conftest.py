"""Suite-wide: torch's absence is an absence, and after a run the tests not marked `slow`
that took long enough to be are named.

pytest puts tests/ on sys.path (this file and tests/test_import_layers.py live there), and
there tests/torch/ is a namespace package called `torch`: where torch is not installed,
`pytest.importorskip("torch")` would import that folder and the torch tests would fail
instead of skipping. So where no installed torch is found, `import torch` is made to fail.

The default run (`python -m pytest -q`) leaves out the tests marked `slow` and must stay
fast on a small machine (README, "Contributing"); a test that compiles many kernels
belongs in the slow set. The report of slow unmarked tests only reports (timings depend
on the machine and its load); it never fails a run.
"""

from __future__ import annotations

import importlib.util
import sys
from collections import defaultdict


def _torch_installed() -> bool:
    spec = importlib.util.find_spec("torch")
    return spec is not None and spec.origin is not None  # a namespace package has no origin


if "torch" not in sys.modules and not _torch_installed():
    sys.modules["torch"] = None  # `import torch` raises ImportError: importorskip skips

# Seconds (setup, call and teardown together) past which an unmarked test is named.
REPORT_SECONDS = 10.0


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    seconds: dict[str, float] = defaultdict(float)
    marked: set[str] = set()
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid = getattr(report, "nodeid", None)
            if not nodeid or not hasattr(report, "duration"):
                continue
            seconds[nodeid] += report.duration
            if "slow" in getattr(report, "keywords", {}):
                marked.add(nodeid)
    long = sorted(((s, n) for n, s in seconds.items() if s > REPORT_SECONDS and n not in marked), reverse=True)
    if not long:
        return
    terminalreporter.write_sep("-", f"unmarked tests over {REPORT_SECONDS:.0f} s: mark them @pytest.mark.slow?")
    for s, nodeid in long:
        terminalreporter.write_line(f"{s:7.1f} s  {nodeid}")
