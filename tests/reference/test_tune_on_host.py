"""`gemmspec tune`'s own runner on the CPU: each candidate built from its spec text and
checked by verify.check_random, with the flat-schedule executor computing on host buffers
where the GPU would (as for the gathered rows' GPU cases); only the timer is fake."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from gemmspec import tune as tuning
from gemmspec.runtime import verify

_HERE = Path(__file__).resolve().parent
_CASES = importlib.util.spec_from_file_location("tune_gpu_cases", _HERE.parent / "gpu" / "test_tune_gpu.py")
cases = importlib.util.module_from_spec(_CASES)
_CASES.loader.exec_module(cases)
sys.path.insert(0, str(_HERE))
from host_device import HostBuffer, run_on_host  # noqa: E402


def test_tune_checks_each_candidate_through_check_random(monkeypatch):
    from gemmspec.runtime.executor import Executable

    monkeypatch.setattr(verify, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(Executable, "__call__", run_on_host)
    timed = []

    def timer(call, repeat):
        assert isinstance(call, verify.RandomCall) and call.report.ok
        timed.append(call.exe.schedule)
        return [1.0 + 0.1 * len(timed)] * repeat

    references = []
    run_direct = verify.run_direct

    def counted(*args, **kwargs):
        references.append(args[0].name)
        return run_direct(*args, **kwargs)

    monkeypatch.setattr(verify, "run_direct", counted)
    runner = tuning.gpu_runner(lengths={"expert": cases.RAGGED}, seed=2)
    report = tuning.tune(cases.FP8, only=[(128, 128), (64, 64)], runner=runner, timer=timer, repeat=3)
    assert report.ok, report.table()
    assert len(references) == 1  # the candidates share the first one's float64 reference
    assert [o.candidate.label for o in report.outcomes] == ["as written (heuristic: 128x192)", "tile(128, 128)", "tile(64, 64)"]
    assert all(o.dims == {"T": sum(cases.RAGGED)} and o.useful_flops > 0 for o in report.outcomes)
    assert len(timed) == 3 and report.fastest.candidate.is_default and report.suggestion is None
    tiles = [(x.signature.tile_m, x.signature.tile_n) for s in timed for x in s.launches]
    assert tiles == [(128, 192), (128, 128), (64, 64)]
