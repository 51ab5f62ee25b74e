"""Claims of docs/language.md checked against the front end and the float64 reference.

Declaration order (a group `within` a later group, a count dim from a later group's
`[E = N]`), masked groups where only a ragged, split or uniform group fits, a count dim
both declared and given by a group, output names that the grammar reads as keywords,
and ragged offsets and masked counts given to the reference: the example of the ragged
section, and values that break a group's definition, which both executors refuse with a
ValueError instead of reading them as other segments."""

from __future__ import annotations

import numpy as np
import pytest
from located import assert_located, check_error, edited

from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, check_group_values, random_inputs
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

BASE = """\
gemm g {
  dim T
  dim N = 16, K = 200
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : f32 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

GROUP = "  group expert[E = 3] = ragged(T, offsets = offs)\n"


# ---- declaration order ---------------------------------------------------------------


def test_within_a_group_declared_later_says_so() -> None:
    text = edited(GROUP, "  group inner[I = 2] = ragged(T within expert, offsets = io)\n" + GROUP, BASE)
    err = check_error(text)
    assert "declared within 'expert', which is declared after it (at 5:9)" in err.message, err.render()
    assert "must come after OUTER" in err.message
    assert err.note is not None and "move the declaration of 'expert' above 'inner'" in err.note
    assert_located(text, "expert, offsets = io", "which is declared after it")


def test_within_an_undeclared_group_is_still_unknown() -> None:
    text = edited(GROUP, GROUP + "  group inner[I = 2] = ragged(T within expurt, offsets = io)\n", BASE)
    assert_located(text, "expurt", "unknown group 'expurt'")


def test_a_count_dim_from_a_later_group_says_so() -> None:
    text = edited(GROUP, "  group other[E] = ragged(T, offsets = o2)\n" + GROUP, BASE)
    err = check_error(text)
    assert "which group 'expert' declares later (at 5:16)" in err.message, err.render()
    assert err.note is not None and "write [E = 3] here" in err.note
    assert_located(text, "E] = ragged", "declares later")


def test_a_count_dim_declared_nowhere_needs_a_count() -> None:
    text = edited("group expert[E = 3]", "group expert[E]", BASE)
    assert_located(text, "E] = ragged", "needs a group count: write [E = N] or declare `dim E = N`")


def test_a_count_dim_from_dim_may_be_declared_anywhere() -> None:
    text = edited("group expert[E = 3]", "group expert[E]", BASE).replace("  tensor y", "  dim E = 3\n  tensor y")
    (lowered,) = lower_file(parse(text, "spec.gspec"))
    assert lowered.spec.group("expert").count == 3


def test_a_group_may_repeat_the_size_of_a_declared_count_dim() -> None:
    same = edited("  dim T\n", "  dim T, E = 3\n", BASE)
    (lowered,) = lower_file(parse(same, "spec.gspec"))
    assert lowered.spec.dim("E").size == 3
    assert_located(edited("E = 3]", "E = 4]", same), "E = 4]", "dim 'E' is given two sizes: 4 here, 3")
    runtime = edited("  dim T\n", "  dim T, E\n", BASE)
    assert_located(runtime, "E = 3]", "given two sizes: 3 here, known at run time")


# ---- masked groups where segments are needed ------------------------------------------

MASKED = """\
gemm m {
  dim T = 128, N = 128, K = 128
  group expert[E = 4] = masked(T, counts = cnt)
  tensor dy : bf16 [E, T, N]
  tensor x : bf16 [E, T, K]
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t] dy[e, t, n] * x[e, t, k]
}
"""


def test_a_masked_group_is_used_through_a_batch_index() -> None:
    (lowered,) = lower_file(parse(MASKED, "spec.gspec"))
    assert [ax.group for ax in lowered.spec.gemms[0].leaf_axes] == ["expert"]


def test_a_sum_restricted_to_a_masked_group_says_it_is_masked() -> None:
    text = edited("sum[t] dy", "sum[t in expert(e)] dy", MASKED)
    err = check_error(text)
    assert "group 'expert' is masked" in err.message and "ragged, split or uniform" in err.message
    assert err.note is not None and "batch index over E" in err.note
    assert_located(text, "expert(e)", "is masked")


def test_segment_major_over_a_masked_group_says_it_is_masked() -> None:
    text = edited(
        "  tensor y : f32 [T, N]",
        "  group pad[P = 2] = masked(N, counts = cnt)\n  tensor y : f32 [T, N] layout segment_major(pad)",
        BASE,
    )
    err = check_error(text)
    assert "it is masked" in err.message, err.render()
    assert_located(text, "pad)", "segment_major stores the segments of a ragged, split or uniform group")


# ---- output names the grammar reads as keywords --------------------------------------------

KEYWORDS = """\
gemm kw {
  dim T
  dim N = 256, K = 256
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [N, K] scale f32 [128, 128]
  tensor OUT : bf16 [T, N]
PREV
  OUT[t, n] = sum[k] x[t, k] * w[n, k]
}
"""
AFTER_PLAIN = "  tensor z : bf16 [T, N]"
AFTER_SCALE = "  tensor z : e4m3 [T, N] scale f32 [1, 128]"
AFTER_STATEMENT = "  tensor z : bf16 [T, N]\n  z[t, n] = sum[k] x[t, k] * w[n, k]"


def keyword_output(name: str, prev: str) -> str:
    return KEYWORDS.replace("OUT", name).replace("PREV", prev)


@pytest.mark.parametrize("name", ["accumulate", "gather", "tile", "dim"])
def test_an_output_named_after_an_item_word_does_not_parse(name: str) -> None:
    with pytest.raises(SpecError):
        parse(keyword_output(name, AFTER_STATEMENT), "spec.gspec")


@pytest.mark.parametrize(
    ("name", "breaks", "parses"),
    [
        ("layout", AFTER_PLAIN, AFTER_STATEMENT),
        ("scale", AFTER_PLAIN, AFTER_SCALE),
        ("per", AFTER_SCALE, AFTER_PLAIN),
        ("as", AFTER_SCALE, AFTER_PLAIN),
        ("pow2", AFTER_SCALE, AFTER_PLAIN),
    ],
)
def test_an_output_named_after_a_continuation_word_fails_only_where_it_continues(
    name: str, breaks: str, parses: str
) -> None:
    with pytest.raises(SpecError):
        parse(keyword_output(name, breaks), "spec.gspec")
    (lowered,) = lower_file(parse(keyword_output(name, parses), "spec.gspec"))
    assert name in lowered.spec.written


# ---- ragged offsets and masked counts in the reference ----------------------------------------

T = 10


def lowered_base(text: str = BASE):
    (lowered,) = lower_file(parse(text, "spec.gspec"))
    return lowered


def both(lowered, rt: Runtime) -> tuple[np.ndarray, np.ndarray, dict]:
    data = random_inputs(lowered.spec, rt, np.random.default_rng(3))
    init = {"y": np.full((rt.dims["T"], 16), np.nan)}
    direct = run_direct(lowered.spec, rt, data, init)["y"]
    flat = run_schedule(lowered.spec, rt, lowered.schedule, data, init)["y"]
    return direct, flat, data


def test_the_ragged_example_of_the_doc() -> None:
    """T = 10, E = 3, offsets [0, 4, 4, 10]: expert 0 owns tokens 0..3, expert 1 none,
    expert 2 tokens 4..9 (K = 200 is not a multiple of 128)."""
    lowered = lowered_base()
    rt = Runtime({"T": T}, {"offs": np.array([0, 4, 4, 10], dtype=np.int32)})
    direct, flat, data = both(lowered, rt)
    x, w = data["x"].values, data["w"].values
    want = np.concatenate([x[:4] @ w[0].T, x[4:] @ w[2].T])
    np.testing.assert_allclose(direct, want, rtol=1e-6, atol=1e-6)  # y is f32
    np.testing.assert_allclose(flat, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("offsets", "fragment"),
    [
        ([0, 6, 3, 10], "decrease: entry 1 is 6, entry 2 is 3"),
        ([0, 4, 4, 12], "must start at 0 and end at T = 10, got 0..12"),
        ([2, 4, 6, 10], "must start at 0 and end at T = 10, got 2..10"),
        ([0, 4, 4, 8], "must start at 0 and end at T = 10, got 0..8"),
        ([0, 4, 10], "must have shape [4], got [3]"),
    ],
)
def test_invalid_offsets_are_an_error_in_both_executors(offsets: list[int], fragment: str) -> None:
    lowered = lowered_base()
    rt = Runtime({"T": T}, {"offs": np.array(offsets, dtype=np.int32)})
    data = random_inputs(lowered.spec, Runtime({"T": T}, {"offs": np.array([0, 4, 4, 10])}), np.random.default_rng(0))
    init = {"y": np.zeros((T, 16))}
    with pytest.raises(ValueError, match="offsets 'offs' of 'expert'") as info:
        run_direct(lowered.spec, rt, data, init)
    assert fragment in str(info.value)
    with pytest.raises(ValueError, match="offsets 'offs' of 'expert'"):
        run_schedule(lowered.spec, rt, lowered.schedule, data, init)


def test_a_capacity_group_may_end_below_the_dim_but_not_past_it() -> None:
    lowered = lowered_base(edited("offsets = offs)", "offsets = offs, capacity)", BASE))
    direct, flat, _ = both(lowered, Runtime({"T": T}, {"offs": np.array([0, 4, 4, 8], dtype=np.int32)}))
    assert np.isnan(direct[8:]).all() and np.isnan(flat[8:]).all()
    assert not np.isnan(direct[:8]).any()
    with pytest.raises(ValueError, match="end at or below T = 10, got 0..11"):
        check_group_values(lowered.spec, Runtime({"T": T}, {"offs": np.array([0, 4, 4, 11])}))


NESTED = """\
gemm nested {
  dim T
  dim N = 16, K = 200
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [L, E, N, K]
  tensor y : f32 [T, N]
  y[t, n] = sum[k] x[t, k] * w[lora(t), expert(t), n, k]
}
"""


def test_nested_offsets_rows_span_their_outer_segments() -> None:
    lowered = lowered_base(NESTED)
    lora = np.array([0, 6, 10], dtype=np.int32)
    good = np.array([[0, 2, 2, 6], [6, 9, 10, 10]], dtype=np.int32)  # the doc's example
    direct, flat, _ = both(lowered, Runtime({"T": T}, {"lora_offsets": lora, "expert_offsets": good}))
    np.testing.assert_allclose(flat, direct, rtol=1e-6, atol=1e-6)
    short = np.array([[0, 2, 2, 5], [6, 9, 10, 10]], dtype=np.int32)  # row 0 stops at 5, not 6
    with pytest.raises(ValueError, match="row 0 runs 0..5, but its 'lora' segment is 0..6"):
        check_group_values(lowered.spec, Runtime({"T": T}, {"lora_offsets": lora, "expert_offsets": short}))
    down = np.array([[0, 2, 2, 6], [6, 10, 9, 10]], dtype=np.int32)
    with pytest.raises(ValueError, match="decrease in row 1: entry 1 is 10, entry 2 is 9"):
        check_group_values(lowered.spec, Runtime({"T": T}, {"lora_offsets": lora, "expert_offsets": down}))


def test_masked_counts_are_clamped_to_the_padded_size_and_never_negative() -> None:
    lowered = lowered_base(MASKED)
    spec = lowered.spec
    rt = Runtime({}, {"cnt": np.array([0, 1, 128, 500], dtype=np.int32)})  # 500: all 128 rows
    data = random_inputs(spec, rt, np.random.default_rng(1))
    init = {"dw": np.zeros((4, 128, 128))}
    direct = run_direct(spec, rt, data, init)["dw"]
    flat = run_schedule(spec, rt, lowered.schedule, data, init)["dw"]
    dy, x = data["dy"].values, data["x"].values
    for e, rows in enumerate([0, 1, 128, 128]):
        np.testing.assert_allclose(direct[e], dy[e, :rows].T @ x[e, :rows], rtol=1e-6, atol=1e-5)  # dw is f32
    np.testing.assert_allclose(flat, direct, rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="counts 'cnt' of 'expert' holds -1 at 2"):
        run_direct(spec, Runtime({}, {"cnt": np.array([0, 1, -1, 3], dtype=np.int32)}), data, init)


def test_offsets_of_a_group_no_statement_reads_are_not_checked() -> None:
    text = edited(GROUP, GROUP + "  group spare[S = 2] = ragged(T, offsets = spare_offs)\n", BASE)
    lowered = lowered_base(text)
    rt = Runtime({"T": T}, {"offs": np.array([0, 4, 4, 10]), "spare_offs": np.array([5, 1, 0])})
    check_group_values(lowered.spec, rt)
