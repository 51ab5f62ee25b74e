"""On a Hopper GPU: a ragged group nested within a split or uniform group matches the
float64 reference on empty and tile-edge segments, and offsets whose rows do not span
their compile-time outer segment are refused by the device check and by the host."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from test_nest_in_fixed_groups import OUTERS, nested  # noqa: E402

pytestmark = pytest.mark.gpu

LENGTHS = {"split": [0, 1, 199, 0, 0, 0, 129, 0, 1], "uniform": [110, 0, 0, 1, 109, 0, 0, 0, 110]}


@pytest.mark.parametrize("outer", sorted(OUTERS))
def test_matches_reference(outer):
    exe = gemmspec.build(nested(outer))
    report = run_random(exe, lengths={"expert": LENGTHS[outer]}, seed=3, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()


def test_rows_must_span_the_outer_segment():
    from gemmspec.runtime.arrays import DeviceBuffer

    exe = gemmspec.build(nested("split"))
    x = DeviceBuffer(330 * 200 * 2).view((330, 200), "bf16")
    wa = DeviceBuffer(3 * 3 * 16 * 200 * 2).view((3, 3, 16, 200), "bf16")
    y = DeviceBuffer(330 * 16 * 4).view((330, 16), "f32")
    # Row 1 should span the empty segment [200, 200) of the split; it ends at 201.
    bad = np.array([[0, 100, 150, 200], [200, 200, 201, 201], [200, 250, 300, 330]], np.int32)
    offs = DeviceBuffer.from_numpy(bad).view((3, 4), "i32")
    with pytest.raises(ArgumentError, match="span its 'part' segment"):
        exe(x=x, wa=wa, y=y, expert_offsets=offs, check=True)  # the device found it
    with pytest.raises(ArgumentError, match="span its 'part' segment"):
        exe.prepare(x=x, wa=wa, y=y, expert_offsets=offs)  # the host reads the offsets
