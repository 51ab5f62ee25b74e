"""A view reads its source's values reshaped: on random ragged data the flat schedule
(the view's strides over the source's buffer) equals the direct semantics (the source's
values reshaped), both equal the QKV LoRA computed by hand, and the expand reads what the
shrink wrote whichever statement the source writes first."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_schedule_matches_spec import assert_same, both_executors  # noqa: E402
from view_spec import expected, qkv_view  # noqa: E402

from gemmspec.pipeline import lower_file  # noqa: E402
from gemmspec.reference.data import random_inputs, random_runtime  # noqa: E402
from gemmspec.reference.direct import run_direct  # noqa: E402

EDGE_LENGTHS = st.sampled_from([0, 1, 2, 127, 128, 129, 200])
SETTINGS = settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3),
    k=st.sampled_from([64, 200]),
    y=st.sampled_from(["bf16", "f32"]),
    expand_first=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_flat_schedule_equals_direct_semantics(lengths, k, y, expand_first, seed):
    direct, flat = both_executors(qkv_view(k, y, expand_first), seed, {"lora": lengths})
    assert set(direct) == {"a", "y"}  # the view is no output: it is a's bytes
    assert_same(direct, flat)


@settings(max_examples=6, deadline=None)
@given(lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3), expand_first=st.booleans(), seed=st.integers(0, 2**16))
def test_direct_semantics_is_the_lora_by_hand(lengths, expand_first, seed):
    (lowered,) = lower_file(qkv_view(expand_first=expand_first))
    spec = lowered.spec
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths={"lora": lengths})
    data = random_inputs(spec, rt, rng)
    assert set(data) == {"x", "wa", "wb"}  # the caller passes a (an output), never a3
    t = sum(lengths)
    init = {"a": np.full((t, 48), np.nan), "y": np.full((t, 96), np.nan)}
    got = run_direct(spec, rt, data, init)
    want = expected(data["x"].values, data["wa"].values, data["wb"].values, lengths, "bf16")
    for name in ("a", "y"):
        np.testing.assert_allclose(got[name], want[name], rtol=2**-7, atol=1e-12, err_msg=name)


@settings(max_examples=4, deadline=None)
@given(lengths=st.lists(EDGE_LENGTHS, min_size=3, max_size=3), seed=st.integers(0, 2**16))
def test_a_column_major_view_of_a_column_major_source(lengths, seed):
    # Both store T contiguous: the view's strides (1, 16*T, T) address a's (1, T).
    text = qkv_view().replace("tensor a  : bf16 [T, R3]", "tensor a  : bf16 [T, R3] layout major(T)")
    text = text.replace("[T, S, R] = view(a)", "[T, S, R] layout major(T) = view(a)")
    assert_same(*both_executors(text, seed, {"lora": lengths}))
