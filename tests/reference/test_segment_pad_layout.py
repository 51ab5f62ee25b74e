"""The definition of `segment_major(G) pad P` (reference/data.py): element (t, c) of
segment g lives at P_g * C + c * round_up(n_g, P) + (t - s_g), P_g the sum of
round_up(n_h, P) over the segments h before g in flat order, and the storage a caller
allocates, (T + (P - 1) * segments) rows, holds every segment."""

from __future__ import annotations

import numpy as np
import pytest

from gemmspec.check import check
from gemmspec.parse import parse
from gemmspec.reference.data import Runtime, element_offsets, storage_elements

SPEC = """
gemm s {
  dim T
  dim C = 3, K = 16
  group expert[E = 4] = ragged(T, offsets = offs%(capacity)s)
  tensor a : e4m3 [T, C] layout segment_major(expert)%(pad)s scale f32 [128, 1] per expert
  tensor b : e4m3 [T, K] layout segment_major(expert)%(pad)s scale f32 [128, 1] per expert
  tensor d : f32 [E, C, K]
  d[e, c, k] += sum[t in expert(e)] a[t, c] * b[t, k]
}
"""


def tensor(pad: str = " pad 16", capacity: str = ""):
    (spec,) = check(parse(SPEC % {"pad": pad, "capacity": capacity}, "s.gspec"))
    return spec, spec.tensor("a")


def by_hand(lengths: list[int], pad: int, columns: int) -> dict[tuple[int, int], int]:
    out, start, first = {}, 0, 0
    for n in lengths:
        pitch = -(-n // pad) * pad
        for i in range(n):
            for c in range(columns):
                out[(start + i, c)] = first * columns + c * pitch + i
        start += n
        first += pitch
    return out


@pytest.mark.parametrize("lengths", [[0, 1, 15, 16], [17, 0, 127, 129], [5, 5, 5, 5], [0, 0, 0, 0]])
def test_elements_sit_where_the_definition_puts_them(lengths):
    spec, a = tensor()
    t = sum(lengths)
    rt = Runtime({"T": t}, {"offs": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)})
    off = element_offsets(spec, rt, a)
    want = by_hand(lengths, 16, 3)
    assert {(i, c): int(off[i, c]) for i in range(t) for c in range(3)} == want
    # Distinct, and all inside the (T + 15 * 4) x C storage a caller allocates.
    assert len(set(want.values())) == len(want)
    assert storage_elements(spec, rt, a) == (t + 60) * 3
    assert off.size == 0 or int(off.max()) < (t + 60) * 3


def test_without_pad_the_layout_is_unchanged():
    spec, a = tensor(pad="")
    lengths = [3, 0, 17, 1]
    rt = Runtime({"T": 21}, {"offs": np.array([0, 3, 3, 20, 21], np.int32)})
    off = element_offsets(spec, rt, a)
    start = 0
    for n in lengths:  # s*C + c*n + (t - s): the segment's own start, its own length
        for i in range(n):
            assert [int(off[start + i, c]) for c in range(3)] == [start * 3 + c * n + i for c in range(3)]
        start += n
    assert storage_elements(spec, rt, a) == 21 * 3


def test_capacity_segments_fit_the_storage_of_the_capacity():
    """Offsets ending below T (a capacity group): T + 60 rows still hold every segment."""
    spec, a = tensor(capacity=", capacity")
    rt = Runtime({"T": 40}, {"offs": np.array([0, 1, 18, 18, 33], np.int32)})
    off = element_offsets(spec, rt, a)
    used = off[:33]
    assert (off[33:] == -1).all()  # rows past the offsets' end are not stored
    assert int(used.max()) < storage_elements(spec, rt, a) == (40 + 60) * 3
    assert sorted(by_hand([1, 17, 0, 15], 16, 3).values()) == sorted(int(v) for v in used.ravel())


def test_nested_groups_pad_in_flat_order():
    src = """
gemm n {
  dim T
  dim K = 8, R = 2
  group lora[L = 2]   = ragged(T, offsets = lo)
  group expert[E = 2] = ragged(T within lora, offsets = eo)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""
    (spec,) = check(parse(src, "n.gspec"))
    x = spec.tensor("x")
    assert x.layout.pad_rows == 7 * 4
    lengths = [3, 9, 0, 1]  # (lora 0: 3, 9), (lora 1: 0, 1)
    rt = Runtime({"T": 13}, {"lo": np.array([0, 12, 13], np.int32), "eo": np.array([[0, 3, 12], [12, 12, 13]], np.int32)})
    off = element_offsets(spec, rt, x)
    want = by_hand(lengths, 8, 8)
    assert {(i, c): int(off[i, c]) for i in range(13) for c in range(8)} == want
    assert storage_elements(spec, rt, x) == (13 + 28) * 8
