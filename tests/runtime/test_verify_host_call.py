"""verify.check_random end to end on the CPU: the flat-schedule executor computes on host
buffers where the kernels would (tests/reference/host_device.py), and a call that goes
wrong in one place (one element, an element left poisoned or a poisoned one zeroed, a
byte past the storage, a byte in the gap of a strided row, a scale no leaf has) fails
its check, saying where."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gemmspec
from gemmspec.runtime import verify
from gemmspec.runtime.executor import Executable
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from host_device import HostBuffer, run_on_host  # noqa: E402

ROW = 141  # y's row stride: 5 elements of every row belong to no element

STRIDED = f"""
gemm strided_out {{
  dim T
  dim N = 136, K = 128
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N] layout strides({ROW}, 1)
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""
LENGTHS = {"expert": [0, 1, 40]}

FP8_MASKED = """
gemm masked_fp8_out {
  dim N = 256, K = 128, M = 130
  group batch[B = 3] = masked(M, counts = counts)
  tensor x : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [B, M, N] scale f32 [1, 1, 128]
  y[b, m, n] = sum[k] x[b, m, k] * w[b, n, k]
}
"""
COUNTS = {"batch": [0, 3, 129]}


def run_with(monkeypatch, text: str, lengths: dict, after=None):
    """run_random on the host; `after(args)` changes what the call left, as a wrong kernel
    would have."""
    monkeypatch.setattr(verify, "DeviceBuffer", HostBuffer)

    def call(exe, check=None, **args):
        run_on_host(exe, check, **args)
        if after is not None:
            after(args)

    monkeypatch.setattr(Executable, "__call__", call)
    (check,) = run_random(gemmspec.build(text), lengths=lengths, seed=5, repeats=0).checks
    print(check.describe())
    return check


@pytest.mark.parametrize("text, lengths", [(STRIDED, LENGTHS), (FP8_MASKED, COUNTS)], ids=["strided", "fp8"])
def test_a_right_call_passes(monkeypatch, text, lengths):
    check = run_with(monkeypatch, text, lengths)
    assert check.ok and check.elements == (41 * 136 if text is STRIDED else 132 * 256)


def test_one_wrong_element_fails_with_its_index(monkeypatch):
    def wrong(args):
        y = args["y"].flat(ml_dtypes.bfloat16)
        y[17 * ROW + 100] = y[17 * ROW + 100] * 2 + 1

    check = run_with(monkeypatch, STRIDED, LENGTHS, wrong)
    assert not check.ok and check.over_bound == 1 and check.worst[0].index == (17, 100)
    assert check.rel_error < 0.05  # the norm alone would not have said


def test_an_element_left_poisoned_is_unwritten(monkeypatch):
    def left(args):
        args["y"].flat(ml_dtypes.bfloat16)[3 * ROW + 7] = np.nan

    check = run_with(monkeypatch, STRIDED, LENGTHS, left)
    assert check.unwritten == 1 and check.non_finite == 1 and check.worst[0].index == (3, 7)


def test_a_store_into_a_row_gap_or_past_the_end_changes_guard_bytes(monkeypatch):
    def gap(args):
        args["y"].flat(np.uint16)[5 * ROW + 138] = 0

    check = run_with(monkeypatch, STRIDED, LENGTHS, gap)
    assert check.guard_bytes_changed >= 1 and not check.ok
    assert {o // 2 for b, o in check.guard_offsets} == {5 * ROW + 138}

    def past(args):
        y = args["y"]
        y.buf.data[y.offset - 1] ^= 0x80  # the byte before the storage
        y.buf.data[-1] ^= 0x80  # the last of the guard after it

    check = run_with(monkeypatch, STRIDED, LENGTHS, past)
    assert check.guard_bytes_changed == 2 and check.guard_offsets[0] == ("y", -1)


def test_a_poisoned_element_zeroed_and_a_scale_no_leaf_has_are_clobbered(monkeypatch):
    # Batch 0 has no rows: its values and scales are the poison, and must stay it.
    def zeroed(args):
        args["y"].flat(np.uint8)[5 * 256 + 9] = 0

    check = run_with(monkeypatch, FP8_MASKED, COUNTS, zeroed)
    assert check.clobbered == 1 and not check.ok

    def scale(args):
        args["y_scale"].flat(np.float32)[4 * 2 + 1] = 1.0  # batch 0, row 4, second block

    check = run_with(monkeypatch, FP8_MASKED, COUNTS, scale)
    assert check.clobbered == 1 and check.over_bound == 0 and not check.ok
