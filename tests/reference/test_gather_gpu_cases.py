"""The GPU tests of gathered rows and scattered outputs (tests/gpu/test_gather_gpu.py), run
on the CPU: verify.run_random end to end, with the flat-schedule executor computing on
host buffers where the GPU would. Each case's sizes admit its indices, the buffers carry
int32 indices, and the checks count every row an index names as written and every other
row as untouched, so the GPU tests check the kernels and nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_device import HostBuffer, run_on_host  # noqa: E402

_PATH = Path(__file__).resolve().parents[1] / "gpu" / "test_gather_gpu.py"
_SPEC = importlib.util.spec_from_file_location("gather_gpu_cases", _PATH)
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(cases.CASES))
def test_cases_run_on_the_reference(key, monkeypatch):
    """run_random end to end with the flat-schedule executor as the device: the case's
    sizes admit its indices, the buffers carry int32 indices, and the checks count every
    row the index names as written and every other row as untouched."""
    from gemmspec.runtime import verify

    exe = gemmspec.build(cases.spec_text(key))
    monkeypatch.setattr(verify, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(type(exe), "__call__", run_on_host)
    dims, lengths = cases.dims_and_lengths(key)
    report = run_random(exe, dims=dims, lengths=lengths, seed=len(key), repeats=0)
    assert report.ok, report.describe()  # within the output type's rounding, nothing missed


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(k for k in cases.CASES if "gather" in k))
def test_cases_with_the_rows_copied_first_run_on_the_reference(key, monkeypatch):
    """The same with every gathered A copied by the gather pre-pass where it can be."""
    from gemmspec.runtime import verify

    exe = gemmspec.build(cases.with_directive(cases.spec_text(key), "gather(prepass)"))
    monkeypatch.setattr(verify, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(type(exe), "__call__", run_on_host)
    dims, lengths = cases.dims_and_lengths(key)
    report = run_random(exe, dims=dims, lengths=lengths, seed=len(key) + 2, repeats=0)
    assert report.ok, report.describe()
