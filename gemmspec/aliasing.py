"""Whether a strided layout puts two elements at one address.

Shared by the checker (layouts whose sizes and strides are fixed) and the executor
(layouts that depend on run-time dims, decided once the call gives their sizes).
The decision is exact, except for layouts that no test below settles: those are
reported as `UNDECIDED`, and both sides reject them rather than risk a write race.
"""

from __future__ import annotations

import itertools
import math

__all__ = ["ENUMERATE_LIMIT", "UNDECIDED", "Collision", "element_collision"]

# Layouts of at most this many elements that the quick tests do not settle are
# checked element by element.
ENUMERATE_LIMIT = 1 << 16

# (first index, second index, offset): two indices that share an offset.
Collision = tuple[tuple[int, ...], tuple[int, ...], int]


class _Undecided:
    def __repr__(self) -> str:
        return "UNDECIDED"


UNDECIDED = _Undecided()


def element_collision(axes: list[tuple[int, int]]) -> Collision | _Undecided | None:
    """Two index tuples with one offset under (size, stride) axes; None if every element
    has its own address; UNDECIDED if the layout is too large to tell.

    In order: strides (by magnitude) that each pass the farthest offset the smaller
    ones reach cannot collide (any row-major layout, padded or permuted); two axes
    collide exactly when ``|s_b|/g < n_a`` and ``|s_a|/g < n_b`` (g = gcd), which
    decides every layout of at most two axes of more than one element; beyond that,
    up to ENUMERATE_LIMIT elements are enumerated.
    """
    if any(size <= 0 for size, _ in axes):
        return None  # no elements at all
    wide = [i for i, (size, _) in enumerate(axes) if size > 1]
    reach = 0
    for i in sorted(wide, key=lambda i: abs(axes[i][1])):
        size, stride = axes[i]
        if abs(stride) <= reach:
            break
        reach += (size - 1) * abs(stride)
    else:
        return None
    for i in wide:
        if axes[i][1] == 0:  # every element along it on one address
            second = tuple(int(j == i) for j in range(len(axes)))
            return (0,) * len(axes), second, 0
    for a, b in itertools.combinations(wide, 2):
        clash = _pair_collision(len(axes), a, axes[a], b, axes[b])
        if clash is not None:
            return clash
    if len(wide) <= 2:
        return None  # no zero stride, and the one pair does not collide
    count = 1
    for i in wide:
        count *= axes[i][0]
        if count > ENUMERATE_LIMIT:
            return UNDECIDED
    seen: dict[int, tuple[int, ...]] = {}
    for idx in itertools.product(*(range(size) for size, _ in axes)):
        offset = sum(v * stride for v, (_, stride) in zip(idx, axes))
        if offset in seen:
            return seen[offset], idx, offset
        seen[offset] = idx
    return None


def _pair_collision(
    rank: int, a: int, axis_a: tuple[int, int], b: int, axis_b: tuple[int, int]
) -> Collision | None:
    """A collision along axes `a` and `b` alone (every other index 0), or None."""
    (na, sa), (nb, sb) = axis_a, axis_b
    first, second = [0] * rank, [0] * rank
    g = math.gcd(sa, sb)
    da, db = abs(sb) // g, abs(sa) // g  # the smallest steps with da*|sa| == db*|sb|
    if da >= na or db >= nb:
        return None
    if (sa > 0) == (sb > 0):
        first[b], second[a] = db, da  # the lexicographically smaller first
        return tuple(first), tuple(second), da * sa
    second[a], second[b] = da, db  # opposite signs: the step lands back on 0
    return tuple(first), tuple(second), 0
