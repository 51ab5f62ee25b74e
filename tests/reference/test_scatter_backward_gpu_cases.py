"""The GPU tests of requantize(SOURCE, rows = IDX, weight = W) and of the example's derived
backward (tests/gpu/test_scatter_backward_gpu.py), run on the CPU with host stand-ins: the
requant kernel emulated from its documented storage (padded segments, per-segment scale
rows) and the executable computed by the flat-schedule executor. What they check here is
the tests' own bookkeeping (parameters, buffers, poison, shapes, tolerances), so that on
the GPU they check the kernels and nothing else."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

_PATH = Path(__file__).resolve().parents[1] / "gpu" / "test_scatter_backward_gpu.py"
_SPEC = importlib.util.spec_from_file_location("scatter_backward_gpu_cases", _PATH)
cases = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cases)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from host_device import HostBuffer, run_on_host  # noqa: E402


def _emulated_requant(p, arrays, grid, params):
    """The kernel's documented arithmetic and storage, written out on the host: per
    segment and 128-token block, each column's amax of fp8 * SX(row) * W[t] (float32),
    SY = amax / 448 (1 when zero) at scale row rowbase_g + block, Y at
    p_g * C + c * len'_g + (t - s_g) with len'_g the length rounded up to the pad."""
    a = {n: arrays[n] for n in params}
    c = int(a["C"])
    x = a["X"].data.view(ml_dtypes.float8_e4m3fn).astype(np.float32).reshape(-1, c)
    sx = a["SX"].data.view(np.float32).reshape(x.shape[0], -1)
    offs = a["offsets"].data.view(np.int32)
    y, sy = a["Y"].data, a["SY"].data.view(np.float32)
    pad = p.config.pad
    idx = a["idx"].data.view(np.int32) if "idx" in a else None
    w = a["W"].data.view(np.float32) if "W" in a else None
    rowbase = padbase = 0
    for g in range(int(a["G"])):
        s0, s1 = int(offs[g]), int(offs[g + 1])
        length = s1 - s0
        pitch = -(-length // pad) * pad
        for b0 in range(s0, s1, 128):
            b1 = min(b0 + 128, s1)
            vals = np.zeros((b1 - b0, c), np.float32)
            for r, t in enumerate(range(b0, b1)):
                src = t if idx is None else int(idx[t])
                if 0 <= src < x.shape[0]:
                    scale = np.repeat(sx[src], 128)[:c]
                    if w is not None:
                        scale = scale * w[t]
                    vals[r] = x[src] * scale
            amax = np.abs(vals).max(axis=0)
            block_sy = (amax / np.float32(448)).astype(np.float32)
            block_sy = np.where(block_sy > 0, block_sy, np.float32(1))
            sy[(rowbase + (b0 - s0) // 128) * c : (rowbase + (b0 - s0) // 128 + 1) * c] = block_sy
            q = np.clip(vals / block_sy, -448, 448).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
            base = (padbase if pad > 1 else s0) * c
            for r in range(b1 - b0):
                for col in range(c):
                    y[base + col * (pitch if pad > 1 else length) + (b0 - s0) + r] = q[r, col]
        rowbase += -(-length // 128)
        padbase += pitch


@pytest.mark.parametrize("counts", [cases.COUNTS, [129, 0, 127, 1]], ids=["up", "mixed"])
@pytest.mark.parametrize("form", sorted(cases.FORMS))
def test_the_bit_for_bit_case_on_an_emulated_kernel(form, counts, monkeypatch):
    from gemmspec.runtime import arrays

    monkeypatch.setattr(arrays, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(cases, "run_prepass", _emulated_requant)
    cases.test_requant_rows_kernel_is_the_reference_bit_for_bit(form, counts)


SMALL = {"H = 7168": "H = 384", "N = 4096": "N = 512", "F = 2048": "F = 256"}


@pytest.mark.parametrize("gather", ["auto", "fused"])
@pytest.mark.parametrize("counts", [cases.COUNTS * 2], ids=["up"])
def test_the_example_backward_case_on_the_flat_executor(counts, gather, monkeypatch, tmp_path):
    """The example's own statements at smaller compile-time dims."""
    from gemmspec.runtime import arrays, verify
    from gemmspec.runtime.executor import Executable

    text = cases.EXAMPLE.read_text()
    for old, new in SMALL.items():
        text = text.replace(old, new)
    small = tmp_path / "moe_ffn_fp8_train.gspec"
    small.write_text(text)
    monkeypatch.setattr(cases, "EXAMPLE", small)
    monkeypatch.setattr(arrays, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(verify, "DeviceBuffer", HostBuffer)  # the outputs' guarded buffers
    monkeypatch.setattr(Executable, "__call__", run_on_host)
    cases.test_the_example_backward_matches_float64(counts, gather)


def test_the_executable_case_on_the_flat_executor(monkeypatch):
    """run_random with the rows-and-weight pass, the flat executor standing in for the GPU."""
    from gemmspec.runtime import verify
    from gemmspec.runtime.executor import Executable

    monkeypatch.setattr(verify, "DeviceBuffer", HostBuffer)
    monkeypatch.setattr(Executable, "__call__", run_on_host)
    cases.test_requant_rows_prepass_through_the_executable_feeds_the_wgrad()
