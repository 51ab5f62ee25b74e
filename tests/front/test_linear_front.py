"""The front half (parse, check, analyse, lower) takes time linear in the size of the
spec when every statement brings a run-time dim and a ragged group of its own, and the
spec declares as many run-time dims that nothing uses. Lowering once compared every
run-time dim of the spec with every formula of each launch: quadratic in the statements.

The test compares two sizes (a ratio, not a time): ten times the statements may take at
most twenty times as long; the quadratic lowering took over a hundred times as long."""

from __future__ import annotations

import gc
import time

import pytest

from gemmspec.analyse import analyse
from gemmspec.check import check
from gemmspec.lower.lowering import lower
from gemmspec.parse import parse


def own_dims_and_groups(statements: int) -> str:
    """`statements` statements, each over its own run-time dim and ragged group, beside as
    many run-time dims that no tensor uses."""
    lines = ["gemm many {", "  dim N = 64, K = 64"]
    for i in range(statements):
        lines += [
            f"  dim T{i}, U{i}",
            f"  group g{i}[E{i} = 2] = ragged(T{i}, offsets = offsets{i})",
            f"  tensor x{i} : bf16 [T{i}, K]",
            f"  tensor w{i} : bf16 [E{i}, N, K]",
            f"  tensor y{i} : bf16 [T{i}, N]",
        ]
    lines += [f"  y{i}[t, n] = sum[k] x{i}[t, k] * w{i}[g{i}(t), n, k]" for i in range(statements)]
    return "\n".join([*lines, "}"]) + "\n"


def front_half_seconds(text: str, repeats: int) -> float:
    """The least time of `repeats` runs of parse, check, analyse and lower (the least: the
    machine's other work only ever adds), with the cyclic garbage collector paused: its
    full passes cost in proportion to everything the test process holds (what earlier
    tests left), which grew the larger spec's time past the ratio in a long test run."""
    best = float("inf")
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            start = time.perf_counter()
            (spec,) = check(parse(text, "many.gspec"))
            schedule = lower(spec, analyse(spec))
            best = min(best, time.perf_counter() - start)
    finally:
        gc.enable()
    assert len(schedule.launches) == len(spec.gemms)
    return best


@pytest.mark.slow
def test_ten_times_the_statements_take_at_most_twenty_times_as_long() -> None:
    small = front_half_seconds(own_dims_and_groups(100), repeats=3)
    large = front_half_seconds(own_dims_and_groups(1000), repeats=2)
    assert large / small < 20, f"100 statements: {small:.3f} s, 1000: {large:.3f} s"


def test_a_launch_lists_only_the_run_time_dims_it_reads() -> None:
    (spec,) = check(parse(own_dims_and_groups(3), "many.gspec"))
    schedule = lower(spec, analyse(spec))
    assert [x.problems.runtime_dims for x in schedule.launches] == [("T0",), ("T1",), ("T2",)]
