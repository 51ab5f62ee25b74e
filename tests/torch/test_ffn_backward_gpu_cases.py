"""The GPU tests of the router weight's gradient (tests/gpu/test_ffn_backward_gpu.py) on
the CPU, gemmspec.reference standing in for the kernels: what they check here is their
own bookkeeping (inputs, shapes, references, tolerances), so that on the GPU they check
the kernels and nothing else. The down-projection runs at smaller compile-time dims."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from reference_ops import CpuKernels, reference_kernel  # noqa: E402

import gemmspec.torch as gt  # noqa: E402

_PATH = Path(__file__).resolve().parents[1] / "gpu" / "test_ffn_backward_gpu.py"
_SPEC = importlib.util.spec_from_file_location("ffn_backward_gpu_cases", _PATH)
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)  # puts tests/gpu on the path: its judge module too


@pytest.fixture
def on_cpu(monkeypatch):
    kernels = CpuKernels()
    op, function = gt.op, gt.function

    def cpu_op(spec, name=None):
        o = op(spec, name)
        if o.name not in kernels.registered:
            kernels.lib.impl(o.name, reference_kernel(o), "CPU")
            kernels.registered.add(o.name)
        return o

    def fresh(o, inputs):
        """The reference writes fresh outputs: copied into guarded ones, as a kernel
        would write them (every element, no guard byte)."""
        outs = o(**inputs)
        written = {}
        for name, value in zip(o.outputs, outs if isinstance(outs, tuple) else (outs,)):
            written[name] = cases.GuardedTensor(value.shape, value.dtype, device="cpu")
            written[name].tensor.copy_(value)
        return written

    monkeypatch.setattr(cases, "DEVICE", "cpu")
    monkeypatch.setattr(cases, "run_op", fresh)
    monkeypatch.setattr(gt, "op", cpu_op)
    monkeypatch.setattr(gt, "function", lambda spec, name=None: kernels(function(spec, name)))
    smaller = cases.DOWN.replace("H = 7168, F = 2048", "H = 256, F = 256")
    monkeypatch.setattr(cases, "DOWN", smaller)
    yield


@pytest.mark.parametrize("rows", [0, 1, 129])
def test_the_row_pass_case(rows, on_cpu):
    cases.test_the_row_passes_match_float64_and_repeat_bit_for_bit(rows)


def test_the_autograd_case(on_cpu, monkeypatch):
    # The case's sizes, scaled to the smaller dims: 7168 x 2048 weights become 256 x 256.
    real_randn = torch.randn

    def randn(*shape, **kw):
        shape = tuple(256 if s in (7168, 2048) else s for s in shape)
        return real_randn(*shape, **kw)

    monkeypatch.setattr(cases.torch, "randn", randn)
    cases.test_an_autograd_step_of_the_down_projection_matches_float64(cases.COUNTS * 2)


def test_the_whole_ffn_autograd_case(on_cpu, monkeypatch):
    small = cases.FFN
    for old, new in (("H = 7168", "H = 256"), ("N = 4096", "N = 512"), ("F = 2048", "F = 256")):
        assert old in small
        small = small.replace(old, new)
    monkeypatch.setattr(cases, "FFN", small)
    cases.test_an_autograd_step_of_the_whole_ffn_matches_float64([0, 1, 127, 129, 1, 0, 3, 2])
