"""The element-wise rule of verify.compare_output and the guard bytes of GuardedBuffer,
on the CPU: the verdict the GPU tests and `gemmspec run` rest on."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gemmspec.runtime import verify
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.verify import (
    GUARD_BYTES,
    TOLERANCES,
    GuardedBuffer,
    compare_output,
    guard_pattern,
    tolerance,
)


def reference(shape=(64, 256), seed=0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(shape)


def test_the_tolerances_by_output_type():
    assert tolerance("bf16") == (2.0**-7, 1e-2) == tolerance("bf16", "e4m3")
    assert tolerance("f16") == (2.0**-10, 1e-2)
    assert tolerance("f32") == (1e-4, 1e-3) == tolerance("f32", "bf16")
    assert tolerance("f32", "e4m3") == (2.0**-8, 4e-3) == tolerance("f32", "e5m2")
    assert tolerance("e4m3") == (2.0**-3, 1e-2)
    assert tolerance("e5m2") == (2.0**-2, 1e-2)
    assert set(TOLERANCES) == {"bf16", "f16", "f32", "f32 fp8", "e4m3", "e5m2"}
    with pytest.raises(ValueError, match="no tolerance for i32"):
        tolerance("i32")


def test_rounding_to_the_output_type_passes():
    ref = reference()
    for dtype, np_dtype in (("bf16", ml_dtypes.bfloat16), ("f16", np.float16), ("f32", np.float32)):
        got = ref.astype(np_dtype)
        check = compare_output("y", got, ref, dtype=dtype)
        assert check.ok, check.describe()
        assert check.elements == ref.size and check.max_abs_error > 0


@pytest.mark.parametrize("dtype", ["bf16", "f16", "f32"])
def test_one_element_off_by_ten_times_rtol_fails_and_is_named(dtype):
    ref = reference((512, 2048))  # a million elements: the norm hardly moves
    rtol, atol = tolerance(dtype)
    got = ref.copy()
    ref[300, 1234] = 3.0
    got[300, 1234] = 3.0 * (1 + 10 * rtol) + atol  # past the bound whatever the row's rms
    check = compare_output("y", got, ref, dtype=dtype)
    assert not check.ok and check.over_bound == 1
    assert check.rel_error < rtol  # a global norm would have passed it
    (worst,) = check.worst
    assert worst.index == (300, 1234) and worst.ref == 3.0 and worst.got == got[300, 1234]
    assert "[300, 1234] ref 3 got" in check.describe()


def test_the_worst_are_ordered_and_few():
    ref = reference()
    ref[:, 7] = 0.0  # bound: atol * rms(row) alone
    got = ref.copy()
    rms = np.sqrt((ref**2).mean(axis=-1))
    for i in range(8):
        got[i, 7] = (i + 1) * rms[i]  # 100 (i + 1) times its bound
    check = compare_output("y", got, ref, dtype="bf16")
    assert check.over_bound == 8 and len(check.worst) == verify.WORST
    assert [e.index for e in check.worst] == [(i, 7) for i in (7, 6, 5, 4, 3)]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_written_element_fails(value):
    ref = reference()
    got = ref.copy()
    got[5, 9] = value
    check = compare_output("y", got, ref, dtype="bf16")
    assert not check.ok and check.non_finite == 1 and check.over_bound == 0
    assert check.unwritten == (1 if np.isnan(value) else 0)
    assert check.worst[0].index == (5, 9)


def test_an_infinite_reference_must_be_matched():
    ref = reference((4, 8))
    ref[1, 2] = np.inf
    got = ref.copy()
    assert compare_output("y", got, ref, dtype="f32").ok
    got[1, 2] = 1e30
    assert compare_output("y", got, ref, dtype="f32").over_bound == 1
    got[1, 2] = -np.inf
    assert compare_output("y", got, ref, dtype="f32").non_finite == 1


def test_each_row_is_judged_against_its_own_rms():
    ref = reference((4, 256))
    ref[2] *= 1e-6  # a row of tiny values beside rows of order one
    rms = np.sqrt((ref[2] ** 2).mean())
    got = ref.copy()
    got[2, 10] += 0.5 * 1e-3 * rms  # within atol of its own row's rms
    assert compare_output("y", got, ref, dtype="f32").ok
    got[2, 10] = ref[2, 10] + 50 * 1e-3 * rms  # far less than the tensor's rms, far past the row's
    check = compare_output("y", got, ref, dtype="f32")
    assert check.over_bound == 1 and check.worst[0].index == (2, 10)


def test_a_one_dimensional_output_is_one_row():
    ref = np.array([1000.0, 1000.0, 1e-3, 1e-3])
    got = ref.copy()
    got[2] = 0.5  # within 1e-3 of the whole tensor's rms (about 707)
    assert compare_output("drw", got, ref, dtype="f32").ok
    got[2] = 2.0
    assert not compare_output("drw", got, ref, dtype="f32").ok


def test_a_row_whose_reference_is_zero_must_be_zero():
    ref = reference((3, 16))
    ref[1] = 0.0
    got = ref.copy()
    assert compare_output("dw", got, ref, dtype="f32").ok
    got[1, 3] = 1e-30
    assert compare_output("dw", got, ref, dtype="f32").over_bound == 1


def test_a_caller_may_pass_its_own_tolerances():
    ref = reference()
    got = ref * (1 + 2e-3)
    assert not compare_output("y", got, ref, dtype="f32").ok
    check = compare_output("y", got, ref, dtype="f32", rtol=3e-3)
    assert check.ok and check.rtol == 3e-3 and check.atol == 1e-3
    assert compare_output("y", got, ref, dtype="f32", atol=0.1).ok


def test_fp8_outputs_are_judged_one_step_of_their_format():
    ref = np.full((2, 128), 1.0)
    up = ref.copy()
    up[0, 0] = 1.125  # the next e4m3 value
    assert compare_output("y", up, ref, dtype="e4m3").ok
    up[0, 0] = 1.25  # two steps
    assert not compare_output("y", up, ref, dtype="e4m3").ok
    assert compare_output("y", up, ref, dtype="e5m2").ok  # one e5m2 step


def test_unwritten_elements_keep_their_poison_bit_for_bit():
    ref = reference((8, 32))
    ref[3:5] = np.nan  # rows no leaf writes
    initial = np.where(np.isnan(ref), np.nan, 0.0).astype(ml_dtypes.bfloat16)
    after = np.where(np.isnan(ref), initial.astype(np.float64), ref).astype(ml_dtypes.bfloat16)
    check = compare_output("y", after.astype(np.float64), ref, dtype="bf16", got_raw=after, initial_raw=initial)
    assert check.ok and check.elements == 6 * 32, check.describe()
    # Zero where the poison was: clobbered, with or without the raw bytes.
    zeroed = after.copy()
    zeroed[4, 7] = 0.0
    for raw in ({"got_raw": zeroed, "initial_raw": initial}, {}):
        check = compare_output("y", zeroed.astype(np.float64), ref, dtype="bf16", **raw)
        assert not check.ok and check.clobbered == 1 and check.over_bound == 0
    # Another NaN in its place: only the raw bytes tell.
    other = after.copy()
    other.view(np.uint16)[3, 0] = 0x7FC1
    assert compare_output("y", other.astype(np.float64), ref, dtype="bf16").ok
    check = compare_output("y", other.astype(np.float64), ref, dtype="bf16", got_raw=other, initial_raw=initial)
    assert check.clobbered == 1


def test_a_left_poison_is_unwritten():
    ref = reference((4, 4))
    got = ref.copy()
    got[0, 1] = np.nan
    check = compare_output("y", got, ref, dtype="bf16")
    assert check.unwritten == 1 and check.non_finite == 1 and not check.ok


def test_changed_guard_bytes_fail_and_are_named():
    ref = reference((2, 4))
    check = compare_output("y", ref, ref, dtype="f32", guards={"y": np.array([-3, 32]), "y_scale": np.zeros(0)})
    assert not check.ok and check.guard_bytes_changed == 2
    assert check.guard_offsets == (("y", -3), ("y", 32))
    assert check.describe().endswith("; changed bytes y-3, y+32")


def test_shapes_must_agree():
    with pytest.raises(ValueError, match="got shape"):
        compare_output("y", np.zeros((2, 3)), np.zeros((3, 2)), dtype="f32")


# ---- guarded buffers, in host memory standing in for the device -------------------------


class HostMemory:
    """DeviceBuffer's allocation in host memory: what a kernel stores is a write to `data`."""

    _next = 1 << 40

    def __init__(self, data: np.ndarray):
        self.data, self.nbytes, self.device = data, data.nbytes, 0
        self.ptr = HostMemory._next
        HostMemory._next += 1 << 32

    @classmethod
    def from_numpy(cls, array: np.ndarray) -> HostMemory:
        return cls(np.ascontiguousarray(array).view(np.uint8).reshape(-1).copy())

    view = DeviceBuffer.view

    def to_numpy(self, shape, dtype):
        return self.data.view(dtype)[: int(np.prod(shape))].reshape(shape).copy()


@pytest.fixture
def host_memory(monkeypatch):
    monkeypatch.setattr(verify, "DeviceBuffer", HostMemory)


def test_the_guard_pattern_is_random_and_never_zero():
    p = guard_pattern(4096)
    assert p.min() >= 1 and len(np.unique(p)) > 200
    assert not np.array_equal(p.view(np.uint16) & 0x7F80, np.full(2048, 0x7F80))  # no NaN-only fill


def test_a_store_past_either_end_changes_a_guard_byte(host_memory):
    host = np.arange(12, dtype=np.float32)
    buf = GuardedBuffer(host)
    view = buf.view((3, 4), "f32")
    assert view.ptr == buf.buffer.ptr + GUARD_BYTES and view.shape == (3, 4)
    assert buf.changed_outside().size == 0
    assert np.array_equal(buf.storage(), host) and np.array_equal(buf.to_numpy((3, 4), np.float32), host.reshape(3, 4))
    memory = buf.buffer.data
    memory[GUARD_BYTES + 48] ^= 0xFF  # the first byte past the storage
    memory[GUARD_BYTES - 1] ^= 0x01  # the last byte before it
    memory[GUARD_BYTES + 4] ^= 0x10  # an element: not a guard byte
    assert buf.changed_outside().tolist() == [-1, 48]


def test_bytes_of_no_element_are_filled_and_checked(host_memory):
    # Rows of 3 elements 5 apart: 2 elements of each row belong to no element.
    storage = np.full(15, np.nan, dtype=ml_dtypes.bfloat16)
    elements = (np.arange(3)[:, None] * 5 + np.arange(3)[None, :]).reshape(-1)
    buf = GuardedBuffer(storage, elements, fill_gaps=True)
    gaps = np.setdiff1d(np.arange(15), elements)
    assert not np.isnan(buf.host[gaps].astype(np.float32)).all()  # the random pattern, not the NaN fill
    assert np.isnan(buf.host[elements].astype(np.float32)).all()
    buf.view((3, 3), "bf16", (5, 1))
    memory = buf.buffer.data
    memory[GUARD_BYTES + 2 * elements[4]] = 0  # an element: allowed
    assert buf.changed_outside().size == 0
    memory[GUARD_BYTES + 2 * 8 + 1] ^= 0x40  # element slot 8 belongs to no element
    assert buf.changed_outside().tolist() == [17]


def test_an_empty_storage_still_has_its_guards(host_memory):
    buf = GuardedBuffer(np.zeros(0, np.float32))
    assert buf.nbytes == 0 and buf.view((0, 4), "f32").shape == (0, 4)
    buf.buffer.data[GUARD_BYTES] ^= 1
    assert buf.changed_outside().tolist() == [0]


def test_a_view_at_an_offset_must_fit_and_start_on_an_element():
    from gemmspec.errors import ArgumentError

    memory = HostMemory(np.zeros(64, np.uint8))
    assert memory.view((4, 4), "f32", offset=0).ptr == memory.ptr
    assert memory.view((3, 4), "f32", offset=16).ptr == memory.ptr + 16
    with pytest.raises(ArgumentError, match="needs 68 bytes"):
        memory.view((4, 4), "f32", offset=4)
    with pytest.raises(ArgumentError, match="cannot start 2 bytes into"):
        memory.view((2,), "f32", offset=2)


def test_each_stage_of_the_decode_ffn_is_judged_on_what_the_gpu_wrote_before_it():
    # h (FP8) against the float64 reference; y_rows against the reference run on h as
    # written; y, the scatter_add combine, on the rows y_rows as written.
    from gemmspec.bench import specs
    from gemmspec.pipeline import lower_file
    from gemmspec.reference.data import (
        dim_size,
        quantize,
        random_inputs,
        random_runtime,
        scatter_add_values,
    )
    from gemmspec.reference.direct import run_direct

    (low,) = lower_file(specs.ffn_decode_text(hidden=256, f=128, e=4, name="small"))
    spec = low.spec
    rng = np.random.default_rng(4)
    rt = random_runtime(spec, rng, dims={"S": 6, "T": 24})
    data = random_inputs(spec, rt, rng)
    init = {n: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims), np.nan) for n in spec.written}
    reference = run_direct(spec, rt, data, init)
    scale = spec.tensor("h").scale.name
    results = {k: v.copy() for k, v in reference.items()}
    results[scale] = reference[scale] * 2.0  # the GPU's h dequantizes to twice the reference's
    results["y_rows"] = quantize(rng.standard_normal(reference["y_rows"].shape), "bf16")
    src = data["src"].values.astype(int)
    results["y"] = quantize(scatter_add_values(results["y_rows"], src, 6), "bf16")
    judged = verify._reference_on_written_inputs(spec, rt, data, init, reference, results, set(spec.written))
    assert np.array_equal(judged["h"], reference["h"]) and np.array_equal(judged[scale], reference[scale])
    ratio = judged["y_rows"] / reference["y_rows"]
    assert np.allclose(ratio[np.isfinite(ratio) & (reference["y_rows"] != 0)], 2.0, rtol=2.0**-7)
    assert np.array_equal(judged["y"], results["y"])
