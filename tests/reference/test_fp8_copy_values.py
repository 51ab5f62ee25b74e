"""`T = copy(D)` on the CPU: the reference's copy is, bit for bit, the same statement with
a BF16 output followed by quantize(SOURCE) into T's layout and [128, 1] blocks per
segment (values and scales); the flat schedule executor writes the same, at the padded
segment-major addresses, and never touches the padding."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import (
    TensorData,
    dim_size,
    element_offsets,
    quantize,
    quantize_values,
    random_inputs,
    random_runtime,
    scale_grid_shape,
)
from gemmspec.reference.direct import run_direct
from gemmspec.reference.schedule_exec import run_schedule

EDGE = [0, 1, 127, 129, 300]

SPEC = """
gemm g {{
  dim T, S
  dim N = 256, F = 256, K = 300, NU = 512
  group expert[E = 5] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor xs : e4m3 [S, K] scale f32 [1, 128]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wu : e4m3 [E, NU, K] scale f32 [1, 128, 128]
  tensor rw : f32 [T]
  tensor bias : bf16 [E, N]
  tensor y : {t} [{cols}]{s}
  {copy}
  {statement}
}}
"""
COPY = "tensor y_t : {t} [T, {c}] layout segment_major(expert){pad} scale f32 [128, 1] per expert{pow2} = copy(y)"
CASES = {
    "plain": ("N", "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]"),
    "epilogue": ("N", "y[t, n] = rw[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]"),
    # The FFN up-projection: gathered rows, SwiGLU over interleaved gate/up rows.
    "swiglu-gather": (
        "F",
        "y[t, j] = silu(sum[k] xs[idx[t], k] * wu[expert(t), 2*j, k]) * sum[k] xs[idx[t], k] * wu[expert(t), 2*j + 1, k]",
    ),
}


def spec_text(case: str, out_type: str, pad: int = 1, pow2: bool = False, with_copy: bool = True) -> str:
    cols, statement = CASES[case]
    scale = "" if out_type == "bf16" else " scale f32 [1, 128]"
    copy = COPY.format(t=out_type, c=cols, pad=f" pad {pad}" if pad > 1 else "", pow2=" pow2" if pow2 else "")
    return SPEC.format(t=out_type, cols=f"T, {cols}", s=scale, copy=copy if with_copy else "", statement=statement)


def lowered(text: str):
    (x,) = lower_file(text)
    return x


def problem(spec, seed: int):
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths={"expert": EDGE})
    return rt, random_inputs(spec, rt, rng)


def poisoned(spec, rt) -> dict[str, np.ndarray]:
    out = {}
    for name in ("y", "y_t"):
        t = spec.tensor(name)
        out[name] = np.full(tuple(dim_size(spec, rt, d) for d in t.dims), np.nan)
        out[t.scale.name] = np.full(scale_grid_shape(spec, rt, t), np.nan)
    return out


@pytest.mark.parametrize("pow2", [False, True], ids=["amax-scales", "pow2-scales"])
@pytest.mark.parametrize("out_type", ["e4m3", "e5m2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_copy_is_the_bf16_output_then_quantize(case, out_type, pow2):
    fp8 = lowered(spec_text(case, out_type, pad=16, pow2=pow2))
    bf16 = lowered(spec_text(case, "bf16", with_copy=False))
    for seed in range(2):
        rt, data = problem(fp8.spec, seed)
        got = run_direct(fp8.spec, rt, data, poisoned(fp8.spec, rt))
        wide = run_direct(bf16.spec, rt, data, {"y": np.full(got["y"].shape, np.nan)})["y"]
        assert not np.isnan(wide).any()
        y_t = fp8.spec.tensor("y_t")
        q, grid = quantize_values(fp8.spec, rt, quantize(wide, "bf16"), y_t)
        assert np.array_equal(got["y_t"], q, equal_nan=True), case
        assert np.array_equal(got["y_t_scale"], grid), case
        # One scale per column and 128 rows of each segment: ceil(len / 128) rows each.
        assert got["y_t_scale"].shape[0] == sum(-(-n // 128) for n in EDGE)
        if pow2:
            finite = grid[grid > 0]
            assert np.array_equal(np.frexp(finite)[0], np.full(finite.shape, 0.5))


@pytest.mark.parametrize("pad", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_schedule_writes_what_the_spec_says(case, pad):
    x = lowered(spec_text(case, "e4m3", pad=pad))
    spec = x.spec
    for seed in range(2):
        rt, data = problem(spec, seed)
        init = poisoned(spec, rt)
        direct = run_direct(spec, rt, data, init)
        flat = run_schedule(spec, rt, x.schedule, data, init)
        for name in ("y", "y_scale", "y_t", "y_t_scale"):
            assert np.array_equal(direct[name], flat[name]), name


def test_the_padding_rows_are_never_written():
    from gemmspec.reference.data import pack, storage_elements
    from gemmspec.reference.schedule_exec import run_launch

    x = lowered(spec_text("plain", "e4m3", pad=16))
    spec = x.spec
    rt, data = problem(spec, 0)
    flat = {}
    for name, d in data.items():
        t = spec.tensor(name)
        flat[name] = pack(element_offsets(spec, rt, t), d.values)
        if d.scale_grid is not None:
            from gemmspec.reference.data import scale_offsets

            flat[t.scale.name] = pack(scale_offsets(spec, rt, t), d.scale_grid)
    for name in ("y", "y_t"):
        t = spec.tensor(name)
        flat[name] = np.full(storage_elements(spec, rt, t), 1234.5)
        from gemmspec.reference.data import scale_offsets

        flat[t.scale.name] = np.full(int(scale_offsets(spec, rt, t).max()) + 1, 1234.5)
    (launch,) = x.schedule.launches
    run_launch(spec, rt, launch, flat)
    used = np.zeros(len(flat["y_t"]), dtype=bool)
    used[element_offsets(spec, rt, spec.tensor("y_t")).ravel()] = True
    assert (flat["y_t"][~used] == 1234.5).all()  # padding untouched
    assert (flat["y_t"][used] != 1234.5).all()  # every element written
    assert (flat["y_t_scale"] != 1234.5).all()
    # Storage: T + (P - 1) * E rows of F.
    t_rows = dim_size(spec, rt, "T")
    assert len(flat["y_t"]) == (t_rows + 15 * 5) * 256


@pytest.mark.slow
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(st.integers(0, 300), min_size=5, max_size=5), pad=st.sampled_from([1, 8, 16, 128]), seed=st.integers(0, 2**16))
def test_schedule_equals_spec_on_random_segments(lengths, pad, seed):
    x = lowered(spec_text("plain", "e4m3", pad=pad))
    spec = x.spec
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths={"expert": lengths})
    data = random_inputs(spec, rt, rng)
    init = poisoned(spec, rt)
    direct = run_direct(spec, rt, data, init)
    flat = run_schedule(spec, rt, x.schedule, data, init)
    for name in ("y", "y_scale", "y_t", "y_t_scale"):
        assert np.array_equal(direct[name], flat[name]), name


def test_given_copies_are_taken_as_they_are():
    x = lowered(spec_text("plain", "e4m3"))
    spec = x.spec
    rt, data = problem(spec, 1)
    init = poisoned(spec, rt)
    mine = TensorData(np.zeros_like(init["y_t"]), np.ones_like(init["y_t_scale"]))
    got = run_direct(spec, rt, data, init, given={"y_t": mine})
    assert (got["y_t"] == 0).all() and (got["y_t_scale"] == 1).all()
