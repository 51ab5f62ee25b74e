"""Whether a strided layout puts two elements at one address (gemmspec/aliasing.py),
and the checker's use of it for written tensors whose sizes and strides are fixed."""

from __future__ import annotations

import itertools
import random

import pytest
from test_errors import BASE, edit
from test_hardening import front, located

from gemmspec.aliasing import ENUMERATE_LIMIT, UNDECIDED, element_collision


def brute_force(axes):
    seen = {}
    for idx in itertools.product(*(range(n) for n, _ in axes)):
        offset = sum(i * s for i, (_, s) in zip(idx, axes))
        if offset in seen:
            return True
        seen[offset] = idx
    return False


def offset(axes, idx):
    return sum(i * s for i, (_, s) in zip(idx, axes))


@pytest.mark.parametrize(
    "axes",
    [
        [(4, 4), (4, 1)],  # row-major
        [(4, 1), (4, 4)],  # column-major
        [(3, 2), (2, 3)],  # interleaved, yet distinct: 0, 3, 2, 5, 4, 7
        [(3, 2), (100_000, 3)],  # the same, too large to enumerate
        [(1, 0), (5, 1)],  # a zero stride on a dim of one element
        [(0, 0), (5, 0)],  # no elements at all
        [(2048, 4096), (4096, 1)],  # padded rows
        [(4, -4), (4, 1)],  # a negative stride
    ],
)
def test_layouts_without_collisions(axes):
    assert element_collision(axes) is None


@pytest.mark.parametrize(
    "axes, first, second",
    [
        ([(4, 3), (4, 2)], (0, 3), (2, 0)),
        ([(5, 0), (3, 1)], (0, 0), (1, 0)),
        ([(1000, 100), (256, 1)], (0, 100), (1, 0)),  # rows 100 apart, 256 wide
        ([(4, 2), (4, -3)], (0, 0), (3, 2)),  # opposite signs: 3*2 - 2*3 = 0
        ([(2, 6), (2, 10), (2, 15), (2, 1)], None, None),  # only three axes together collide
    ],
)
def test_layouts_with_collisions(axes, first, second):
    clash = element_collision(axes)
    assert clash is not None and clash is not UNDECIDED
    a, b, at = clash
    assert a != b and offset(axes, a) == offset(axes, b) == at
    assert all(0 <= i < n for i, (n, _) in zip(a + b, axes + axes))
    if first is not None:
        assert (a, b) == (first, second)


def test_interleaved_layouts_too_large_to_enumerate_are_undecided():
    axes = [(64, 65), (64, 67), (64, 64)]
    assert 64**3 > ENUMERATE_LIMIT
    assert element_collision(axes) is UNDECIDED


def test_agrees_with_enumeration():
    rng = random.Random(10)
    for _ in range(3000):
        rank = rng.randint(1, 4)
        axes = [(rng.randint(0, 6), rng.randint(-12, 12)) for _ in range(rank)]
        clash = element_collision(axes)
        assert clash is not UNDECIDED
        assert (clash is not None) == brute_force(axes), axes


# ---- the checker -------------------------------------------------------------------


def test_a_large_fixed_layout_with_overlapping_rows():
    # 256,000 elements: beyond enumeration, decided by the two-axis rule.
    text = edit(BASE, 2, "dim T", "dim T = 1000")
    text = edit(text, 7, "bf16 [T, N]", "bf16 [T, N] layout strides(100, 1)")
    located(text, 7, "layout", "(T=0, N=100) and (T=1, N=0) are both at offset 100")


BATCHED = """\
gemm g {
  dim B = 64, M = 64, N = 64, K = 64
  tensor a : bf16 [B, M, K]
  tensor b : bf16 [B, N, K]
  tensor y : bf16 [B, M, N] layout strides(65, 67, 64)
  y[e, m, n] = sum[k] a[e, m, k] * b[e, n, k]
}
"""


def test_an_undecidable_written_layout_is_rejected():
    located(BATCHED, 5, "layout", "cannot be checked for two elements at one address")


def test_a_nested_batched_layout_is_accepted():
    front(BATCHED.replace("strides(65, 67, 64)", "strides(4096, 1, 64)"))
