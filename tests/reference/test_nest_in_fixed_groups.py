"""A ragged group nested `within` a split or uniform group: the flat schedule, executed
as the GPU would, equals the spec's direct semantics on random nested lengths (empty
segments and lengths around the 128-row tile), and the leaf-table builder that checks
the nested offsets against the compile-time outer segments compiles for sm_90a."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.codegen.validate import validation_kernel
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
from nvrtc_helper import compile_cubin, disassemble  # noqa: E402
from test_schedule_matches_spec import assert_same, both_executors  # noqa: E402

OUTERS = {
    "split": ("split(T, sizes = [200, 0, 130])", [200, 0, 130]),
    "uniform": ("uniform(T)", [110, 110, 110]),
}


def nested(outer: str) -> str:
    return f"""
gemm nested_in_{outer} {{
  dim T = 330
  dim K = 200, R = 16
  group part[P = 3]   = {OUTERS[outer][0]}
  group expert[E = 3] = ragged(T within part, offsets = expert_offsets)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [P, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[part(t), expert(t), r, k]
}}
"""


def split_lengths(outer_sizes, cuts):
    """Three lengths per outer segment, adding up to it: cut points from `cuts`."""
    out = []
    for size, (a, b) in zip(outer_sizes, cuts):
        lo, hi = sorted((a % (size + 1), b % (size + 1)))
        out += [lo, hi - lo, size - hi]
    return out


SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
CUT = st.sampled_from([0, 1, 127, 128, 129, 200])


@pytest.mark.parametrize("outer", sorted(OUTERS))
@SETTINGS
@given(cuts=st.lists(st.tuples(CUT, CUT), min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_schedule_matches_spec(outer, cuts, seed):
    lengths = split_lengths(OUTERS[outer][1], cuts)
    assert_same(*both_executors(nested(outer), seed, {"expert": lengths}))


@pytest.mark.parametrize("outer", sorted(OUTERS))
def test_the_nested_offsets_check_compiles(outer):
    ((x),) = lower_file(nested(outer))
    spec, schedule = x.spec, x.schedule
    # Each row of the nested offsets is held to the compile-time outer segment.
    starts = ", ".join(str(s) for s in spec.group("part").starts)
    assert f"starts[] = {{{starts}}}" in validation_kernel(spec).function
    first = emit(spec, schedule, inline_tables=False).launches[0]
    cubin, log = compile_cubin(first.source, [include_dir()], name=first.table_kernel)
    assert "warning" not in log, log
    assert first.table_kernel in disassemble(cubin)
