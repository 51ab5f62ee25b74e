"""scatter_add's reference semantics: on the flat executor (its operands read through
their layouts after every launch) it equals the spec's direct semantics and a loop
written out in numpy, with repeated rows, entries outside the target's rows, rows no
entry names and a row named by more than 32 entries; the float32 model adds in
ascending t, as the kernel does."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import (
    TensorData,
    dim_size,
    quantize,
    random_inputs,
    random_runtime,
    real_values,
    scatter_add_values,
)
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scatter_add_spec import SCATTER_ADD_SPEC, K  # noqa: E402


def awkward_index(rng: np.random.Generator, t: int, s: int) -> np.ndarray:
    """Repeats, entries below 0 and at or past S, and (given the rows) row 0 named by
    40 entries."""
    src = rng.integers(-2, s + 3, size=t)
    if t >= 80 and s > 0:
        src[rng.permutation(t)[:40]] = 0
    return src


def loop(a: np.ndarray, src: np.ndarray, s: int) -> np.ndarray:
    out = np.zeros((s, a.shape[1]))
    for t, row in enumerate(src):
        if 0 <= row < s:
            out[row] += a[t]
    return out


@pytest.mark.parametrize("t, s", [(0, 0), (0, 5), (1, 1), (1, 3), (127, 40), (129, 300), (300, 7)])
def test_the_flat_executor_equals_the_direct_semantics_and_a_loop(t, s):
    (low,) = lower_file(SCATTER_ADD_SPEC)
    spec = low.spec
    rng = np.random.default_rng(t * 1000 + s)
    rt = random_runtime(spec, rng, dims={"T": t, "S": s})
    data = random_inputs(spec, rt, rng)
    assert not {"dxr", "dx", "dx2"} & set(data)  # outputs: the call writes them
    src = awkward_index(rng, t, s)
    data["src"] = TensorData(src.astype(np.float64))
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, low.schedule, data, init)
    g = real_values(spec, rt, spec.tensor("dy"), data["dy"]) @ real_values(spec, rt, spec.tensor("w"), data["w"]).T
    gi = np.asarray(data["gi"].values, dtype=np.float64)
    want = {"dx": loop(quantize(g, "bf16"), src, s), "dx2": loop(gi, src, s)}  # dx reads dxr as stored
    for name, value in want.items():
        value = quantize(value, spec.tensor(name).dtype)  # stored in its type
        assert direct[name].shape == value.shape == (s, g.shape[1]) and flat[name].shape == value.shape
        assert not np.isnan(direct[name]).any() and not np.isnan(flat[name]).any()
        scale = max(np.abs(value).max(initial=0.0), 1e-300)
        assert np.abs(direct[name] - value).max(initial=0.0) <= 1e-12 * scale, name
        assert np.abs(flat[name] - value).max(initial=0.0) <= 1e-12 * scale, name
    if t >= 80 and s > 0:
        assert (src == 0).sum() >= 40  # a bucket longer than a warp
    named = set(src[(src >= 0) & (src < s)].tolist())
    for row in set(range(s)) - named:
        assert (direct["dx"][row] == 0).all() and (flat["dx2"][row] == 0).all()


def test_random_inputs_draw_rows_of_the_target_with_repeats():
    (low,) = lower_file(SCATTER_ADD_SPEC)
    spec = low.spec
    rng = np.random.default_rng(5)
    rt = random_runtime(spec, rng, dims={"T": 200, "S": 9})
    src = random_inputs(spec, rt, rng)["src"].values
    assert src.shape == (200,) and src.min() >= 0 and src.max() < 9


def test_the_float32_model_adds_in_ascending_t_and_rounds_once():
    rng = np.random.default_rng(11)
    a = (rng.standard_normal((500, 24)) * 10.0 ** rng.integers(-3, 4, size=(500, 1))).astype(np.float32)
    src = rng.integers(-1, 6, size=500)
    got = scatter_add_values(a, src, 5, dtype=np.float32)
    assert got.dtype == np.float32
    want = np.zeros((5, 24), dtype=np.float32)
    for t in range(500):  # one float32 add at a time, in ascending t
        if 0 <= src[t] < 5:
            want[src[t]] = want[src[t]] + a[t]
    assert np.array_equal(got, want)
    # Another order of the same terms rounds differently somewhere: the order is part of
    # the result.
    backwards = np.zeros((5, 24), dtype=np.float32)
    for t in reversed(range(500)):
        if 0 <= src[t] < 5:
            backwards[src[t]] = backwards[src[t]] + a[t]
    assert not np.array_equal(backwards, want)


def test_rows_given_as_a_device_wrote_them_are_what_the_pass_sums():
    # The GPU check judges scatter_add on the rows the GPU wrote (`given`): the sum then
    # carries no source row's accumulation error, and the statement's rows are not recomputed.
    (low,) = lower_file(SCATTER_ADD_SPEC)
    spec = low.spec
    rng = np.random.default_rng(3)
    rt = random_runtime(spec, rng, dims={"T": 150, "S": 11})
    data = random_inputs(spec, rt, rng)
    src = awkward_index(rng, 150, 11)
    data["src"] = TensorData(src.astype(np.float64))
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    written = quantize(rng.standard_normal((150, K)) * 3.0, "bf16")  # not the statement's result
    direct = run_direct(spec, rt, data, init, given={"dxr": TensorData(written)})
    assert np.array_equal(direct["dxr"], written)
    assert np.array_equal(direct["dx"], quantize(loop(written, src, 11), "bf16"))
    computed = run_direct(spec, rt, data, init)
    assert not np.array_equal(computed["dx"], direct["dx"])
