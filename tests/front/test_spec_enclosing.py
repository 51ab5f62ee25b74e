"""`Spec.enclosing`: a group and each group enclosing it, innermost first."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.parse import parse

NESTED = """\
gemm nested {
  dim T
  dim K = 256, R = 16
  group tenant[P = 2]  = ragged(T, offsets = tenant_offsets)
  group lora[L = 3]    = ragged(T within tenant, offsets = lora_offsets)
  group expert[E = 4]  = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K]
  tensor wa : bf16 [P, L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[tenant(t), lora(t), expert(t), r, k]
}
"""


@pytest.fixture(scope="module")
def spec():
    (checked,) = check(parse(NESTED, "nested.gspec"))
    return checked


def test_innermost_first(spec):
    chain = spec.enclosing("expert")
    assert [g.name for g in chain] == ["expert", "lora", "tenant"]
    assert chain == (spec.group("expert"), spec.group("lora"), spec.group("tenant"))


def test_middle_group_starts_at_itself(spec):
    assert [g.name for g in spec.enclosing("lora")] == ["lora", "tenant"]


def test_top_level_group_is_alone(spec):
    assert spec.enclosing("tenant") == (spec.group("tenant"),)


def test_unknown_name_raises_as_group_does(spec):
    with pytest.raises(KeyError) as by_group:
        spec.group("nope")
    with pytest.raises(KeyError) as by_enclosing:
        spec.enclosing("nope")
    assert by_enclosing.value.args == by_group.value.args
