"""The bench row of examples/lora_moe_scaled.gspec against separate launches, without a
GPU: it is registered and selectable, its specs build, the separate spec computes the
fused one's leaves, and the whole case runs on the CPU with the schedule reference
executor standing in for the kernels (its checks pass, and fail on a wrong result)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec import bench
from gemmspec.bench import measure, specs
from gemmspec.reference.data import Runtime, TensorData
from gemmspec.reference.schedule_exec import run_schedule

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora_moe_scaled.gspec"
NAME = "lora_expand_L4xE8_R16_N4096_T8192"


def _plain():
    return gemmspec.build(bench.LORA_EXPAND.format(n=4096, r=16, l=4, e=8))


def test_case_is_registered_selectable_and_memory_bound():
    (case,) = [c for c in bench.CASES if c.name == NAME]
    assert case.run is measure.lora_expand
    assert case.shape == {"counts": bench.LORA_EXPAND_COUNTS, "r": 16, "n": 4096} and case.anchors == ()
    assert case.memory_bound
    assert case.target == bench.Target(vs_separate=1.0)
    assert case.target.describe() == "faster than separate launches"
    assert bench.selected_cases(["lora_expand"]) == [case]
    assert case in bench.selected_cases(["lora"]) and case in bench.selected_cases(None)


def test_counts_are_ragged_with_empty_and_odd_segments():
    counts = bench.LORA_EXPAND_COUNTS
    assert [len(row) for row in counts] == [8] * 4
    assert sum(map(sum, counts)) == 8192
    flat = [c for row in counts for c in row]
    assert {0, 1, 127, 129} <= set(flat)
    assert any(c % 2 and c > 129 for c in flat)


def test_performance_notes_describe_the_row():
    notes = (EXAMPLE.parents[1] / "docs" / "performance.md").read_text(encoding="utf-8")
    assert "`gemmspec bench --only lora_expand`" in notes
    assert round(measure.lora_expand_bytes(bench.LORA_EXPAND_COUNTS, 4096, 16) / 1e6) == 138
    assert "written: 138 MB" in notes


def test_specs_build_without_a_gpu():
    fused, plain = gemmspec.build(EXAMPLE), _plain()
    assert set(fused.argument_names()) == {"h", "wb", "scaling", "route_w", "bias", "y", "lora_offsets", "expert_offsets"}
    assert set(plain.argument_names()) == {"h", "wb", "y2", "lora_offsets", "expert_offsets"}
    assert fused.sources and plain.sources


def test_separate_spec_has_the_fused_leaves_without_the_epilogue():
    (fused,) = gemmspec.build(EXAMPLE).schedule.launches
    (plain,) = _plain().schedule.launches
    f, p = fused.problems, plain.problems
    assert p.leaf_count == f.leaf_count == 32
    assert p.leaf_axes == f.leaf_axes and p.fixed_axes == f.fixed_axes
    assert p.extents == f.extents
    assert p.a == f.a and p.b == f.b
    assert dataclasses.replace(p.d, tensor="y") == f.d
    assert p.epilogue == () and [e.kind for e in f.epilogue] == ["alpha", "row", "bias"]
    fs, ps = fused.signature, plain.signature
    assert (ps.a_type, ps.b_type, ps.d_type, ps.a_k_major, ps.b_k_major) == (fs.a_type, fs.b_type, fs.d_type, fs.a_k_major, fs.b_k_major)
    assert fs.accumulate and not ps.accumulate
    # Each as a user gets it: the plain GEMM's tile is the heuristic's own (it may be wider).


# ------------------------------------------------------------------ the case, on the CPU
torch = pytest.importorskip("torch")
from on_cpu import OnCpu as _OnCpu  # noqa: E402

SMALL_COUNTS = [
    [1, 0, 3, 0, 5, 2, 0, 7],
    [0, 0, 0, 0, 0, 0, 0, 0],
    [4, 1, 1, 0, 9, 0, 2, 3],
    [0, 6, 0, 1, 0, 0, 11, 2],
]



class _ReferenceRun:
    """A prepared launch whose `enqueue` runs the schedule reference executor on the
    bound tensors and writes the outputs back, rounded to their types, in place."""

    def __init__(self, exe, tensors, broken: bool):
        self.exe, self.tensors, self.broken = exe, tensors, broken

    def enqueue(self):
        spec = self.exe.spec
        offsets = {g.tensor for g in spec.groups if g.kind == "ragged"}
        written = {w for g in spec.gemms for w in g.writes}
        rt = Runtime({"T": self.tensors["h"].shape[0]}, {k: self.tensors[k].numpy() for k in offsets})
        inputs = {k: TensorData(v.double().numpy()) for k, v in self.tensors.items() if k not in offsets | written}
        init = {k: self.tensors[k].double().numpy() for k in written}
        for name, values in run_schedule(spec, rt, self.exe.schedule, inputs, init).items():
            out = self.tensors[name]
            result = torch.from_numpy(np.ascontiguousarray(values.reshape(out.shape)))
            if self.broken:  # a kernel that drops one row's update
                result[0] = self.tensors[name][0].double()
            out.copy_(result.to(out.dtype))


class _ReferenceExecutable:
    def __init__(self, exe, broken: bool):
        self.exe, self.broken = exe, broken

    def prepare(self, stream, **tensors):
        assert set(tensors) == set(self.exe.argument_names())
        return _ReferenceRun(self.exe, tensors, self.broken)


def _run_on_cpu(monkeypatch, broken_fused: bool = False):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def build(text):
        exe = gemmspec.build(text)
        return _ReferenceExecutable(exe, broken_fused and exe.spec.name == "lora_moe_scaled")

    monkeypatch.setattr(specs, "build_spec", build)
    timed = []

    def time(fn, repeat, before=None):
        # Two launches from the restored y must leave the same result as one.
        for _ in range(2):
            before()
            fn()
        timed.append(fn)
        return bench.Timing([1e-3] * repeat, None)

    monkeypatch.setattr(measure, "timed", time)
    with _OnCpu():
        (case,) = bench.selected_cases(["lora_expand"])
        return dataclasses.replace(case, shape={**case.shape, "counts": SMALL_COUNTS}).measure(1), timed


def test_case_runs_on_the_cpu_checked_against_every_path(monkeypatch):
    results, timed = _run_on_cpu(monkeypatch)
    assert [r.impl for r in results] == [
        "gemmspec fused (scale, route_w, bias, +=)",
        "gemmspec BF16 GEMM + torch element-wise",
        "torch._grouped_mm (32 groups) + element-wise",
    ]
    assert len(timed) == 3 and all(r.case == NAME and r.unit == "TB/s" for r in results)
    check = results[0].check
    for against in ("float64 reference (sampled rows)", "gemmspec BF16 GEMM + torch element-wise", "torch._grouped_mm"):
        assert against in check
    t, leaves = sum(map(sum, SMALL_COUNTS)), sum(1 for row in SMALL_COUNTS for c in row if c)
    assert results[0].work == (t * 16 + leaves * 4096 * 16 + 8 * 4096) * 2 + (4 + t) * 4 + 2 * t * 4096 * 2


def test_case_check_fails_on_a_wrong_fused_result(monkeypatch):
    with pytest.raises(AssertionError, match="gemmspec differs from"):
        _run_on_cpu(monkeypatch, broken_fused=True)
