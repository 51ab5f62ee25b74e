"""The judge of every GPU result (verify.check_random, compare_output and the guard bytes
of GuardedBuffer) fails each kind of wrong result, saying where, and passes the right one.

Element-wise rule first (compare_output on numpy arrays: the least value over the bound
of every output type, a zero row judged against its own row's rms), then whole calls on
the CPU: the flat-schedule executor computes on host buffers where the kernels would
(tests/reference/host_device.py), and a corruption applied to what it left stands for a
wrong kernel. The calls cover ragged groups whose leaves have 0, 1, 63, 64, 65, 127 and
129 rows (a strided output with gaps between rows), a capacity group, masked groups
(an FP8 output with its scales, an `+=` output), an `+=` output with capacity rows and a
padded segment_major copy."""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gemmspec
from gemmspec.reference.data import NUMPY_TYPES
from gemmspec.runtime import verify
from gemmspec.runtime.executor import Executable
from gemmspec.runtime.verify import GUARD_BYTES, check_random, compare_output, tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from host_device import HostBuffer, run_on_host  # noqa: E402

LENGTHS = [0, 1, 63, 64, 65, 127, 129]  # rows of the seven leaves
STARTS = np.concatenate([[0], np.cumsum(LENGTHS)])  # [0, 0, 1, 64, 128, 193, 320, 449]
USED = int(STARTS[-1])
LAST_ROWS = {n: int(STARTS[i + 1]) - 1 for i, n in enumerate(LENGTHS) if n}  # leaf's rows: its last
ONE_ROW = LAST_ROWS[1]  # the row of the leaf of one row
CAPACITY_ROWS = 40  # rows past the offsets' end in the capacity specs

N = 136
ROW = 141  # the strided output's row stride: 5 elements of every row belong to no element

SPECS = {
    # name: (text, lengths, dims)
    "ragged": (f"""
gemm ragged_out {{
  dim T
  dim N = {N}, K = 128
  group expert[E = 7] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N] layout strides({ROW}, 1)
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}""", {"expert": LENGTHS}, None),
    "capacity": (f"""
gemm capacity_out {{
  dim T
  dim N = {N}, K = 128
  group expert[E = 7] = ragged(T, offsets = offs, capacity)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}""", {"expert": LENGTHS}, {"T": USED + CAPACITY_ROWS}),
    "capacity_acc": (f"""
gemm capacity_acc {{
  dim T
  dim N = {N}, K = 128
  group expert[E = 7] = ragged(T, offsets = offs, capacity)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] += sum[k] x[t, k] * w[expert(t), n, k]
}}""", {"expert": LENGTHS}, {"T": USED + CAPACITY_ROWS}),
    "masked_acc": ("""
gemm masked_acc {
  dim N = 128, K = 128, M = 130
  group batch[B = 7] = masked(M, counts = counts)
  tensor x : bf16 [B, M, K]
  tensor w : bf16 [B, N, K]
  tensor y : f32 [B, M, N]
  y[b, m, n] += sum[k] x[b, m, k] * w[b, n, k]
}""", {"batch": LENGTHS}, None),
    "masked_fp8": ("""
gemm masked_fp8 {
  dim N = 256, K = 128, M = 130
  group batch[B = 7] = masked(M, counts = counts)
  tensor x : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [B, M, N] scale f32 [1, 1, 128]
  y[b, m, n] = sum[k] x[b, m, k] * w[b, n, k]
}""", {"batch": LENGTHS}, None),
    "padded_copy": ("""
gemm padded_copy {
  dim T
  dim F = 256, K = 128
  group expert[E = 7] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, F, K] scale f32 [1, 128, 128]
  tensor h : e4m3 [T, F] scale f32 [1, 128]
  tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = copy(h)
  h[t, f] = sum[k] x[t, k] * w[expert(t), f, k]
}""", {"expert": LENGTHS}, None),
}
M, NM = 130, 128  # masked_acc: rows per batch, columns
NF = 256  # masked_fp8 and padded_copy: columns


class Judge:
    """check_random on the host. `run(spec, corrupt)` applies `corrupt(args)` to what the
    call left (as a wrong kernel would have) and returns {output: OutputCheck}; what
    compare_output was given is kept in `seen` ({output: (got, ref, rtol, atol)}).

    The right call of each spec runs in full (the host executor, the reference without a
    memo); the corrupted calls of the same spec (same seed: the same inputs, checked bit
    for bit) start from the bytes the right call left and share one reference memo."""

    def __init__(self):
        self.exes: dict[str, Executable] = {}
        self.right: dict[str, dict] = {}
        self.right_seen: dict[str, dict] = {}
        self.memo: dict[str, dict] = {}
        self.left: dict[str, tuple[dict, dict]] = {}  # spec: (arguments' bytes before, after)
        self.key: str | None = None
        self.corrupt = None
        self.seen: dict[str, tuple] = {}
        self.before: dict[str, np.ndarray] = {}  # each argument's storage before the call, as bytes

    def call(self, exe, check=None, **args):
        self.before = {name: a.flat(np.uint8).copy() for name, a in args.items()}
        if self.key in self.left:
            before, after = self.left[self.key]
            for name, a in args.items():
                assert np.array_equal(a.buf.data, before[name]), "the same inputs as the right call"
                a.buf.data[:] = after[name]
        else:
            before = {name: a.buf.data.copy() for name, a in args.items()}
            run_on_host(exe, check, **args)
            self.left[self.key] = (before, {name: a.buf.data.copy() for name, a in args.items()})
        if self.corrupt is not None:
            self.corrupt(args)

    def compare(self, name, got, ref, **kw):
        check = compare_output(name, got, ref, **kw)
        self.seen[name] = (np.array(got, dtype=np.float64), np.array(ref, dtype=np.float64), check.rtol, check.atol)
        return check

    def run(self, key: str, corrupt=None) -> dict:
        text, lengths, dims = SPECS[key]
        if key not in self.exes:
            self.exes[key] = gemmspec.build(text)
        fresh = key not in self.right
        self.key, self.corrupt = key, corrupt
        memo = None if fresh else self.memo.setdefault(key, {})
        report = check_random(self.exes[key], dims=dims, lengths=lengths, seed=5, reference_memo=memo).report
        checks = {c.tensor: c for c in report.checks}
        for c in report.checks:
            print(c.describe())
        return checks

    def right_call(self, key: str) -> dict:
        """The checks of the call nothing corrupted (run once per spec, in full)."""
        if key not in self.right:
            self.right[key] = self.run(key)
            self.right_seen[key] = dict(self.seen)
        return self.right[key]

    def reference(self, key: str, name: str) -> tuple:
        """(got, ref, rtol, atol) that compare_output saw for `name` in the right call."""
        self.right_call(key)
        return self.right_seen[key][name]


@pytest.fixture(scope="module")
def judge():
    j = Judge()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(verify, "DeviceBuffer", HostBuffer)
        mp.setattr(Executable, "__call__", lambda exe, check=None, **args: j.call(exe, check, **args))
        mp.setattr(verify, "compare_output", j.compare)
        yield j


def fails(judge: Judge, key: str, corrupt, output: str | None = None):
    """The right call passes, the corrupted one fails: returns the failing output's check
    (`output`, or the spec's only one)."""
    right = judge.right_call(key)
    assert all(c.ok for c in right.values()), [c.describe() for c in right.values()]
    checks = judge.run(key, corrupt)
    check = checks[output] if output else next(iter(checks.values()))
    assert not check.ok, check.describe()
    assert "FAIL" in check.describe()
    others = [c for name, c in checks.items() if name != check.tensor]
    assert all(c.ok for c in others), "only the corrupted output fails"
    return check


def rows_named(check) -> set[int]:
    return {e.index[0] for e in check.worst}


# ---- the element-wise rule on arrays -----------------------------------------------------


def _row_bound(ref: np.ndarray, index: tuple[int, ...], rtol: float, atol: float) -> float:
    row = ref[index[:-1]] if ref.ndim > 1 else ref
    row = row[np.isfinite(row)]
    return rtol * abs(ref[index]) + atol * float(np.sqrt((row**2).mean()))


@pytest.mark.parametrize("dtype, operand", [("bf16", None), ("f16", None), ("f32", None), ("f32", "e4m3"),
                                            ("e4m3", None), ("e5m2", None)])
@pytest.mark.parametrize("sign", [1, -1])
def test_a_value_just_over_the_bound_fails_just_under_passes(dtype, operand, sign):
    ref = np.random.default_rng(1).standard_normal((32, 256))
    rtol, atol = tolerance(dtype, operand)
    at = (31, 255)  # the last row's last column
    bound = _row_bound(ref, at, rtol, atol)
    got = ref.copy()
    got[at] = ref[at] + sign * bound * (1 - 1e-6)
    assert compare_output("y", got, ref, dtype=dtype, operand_dtype=operand).ok
    got[at] = ref[at] + sign * bound * (1 + 1e-6)
    check = compare_output("y", got, ref, dtype=dtype, operand_dtype=operand)
    assert not check.ok and check.over_bound == 1 and check.worst[0].index == at
    assert "[31, 255] ref" in check.describe()


def test_a_value_just_over_the_bound_of_a_one_dimensional_output_fails():
    ref = np.random.default_rng(2).standard_normal(1000)
    rtol, atol = tolerance("f32")
    bound = _row_bound(ref, (999,), rtol, atol)
    got = ref.copy()
    got[999] += bound * (1 - 1e-6)
    assert compare_output("d", got, ref, dtype="f32").ok
    got[999] = ref[999] + bound * (1 + 1e-6)
    check = compare_output("d", got, ref, dtype="f32")
    assert not check.ok and check.worst[0].index == (999,)


@pytest.mark.parametrize("dtype", ["bf16", "f32"])
def test_a_zero_row_of_small_values_fails_against_its_own_rms(dtype):
    ref = np.random.default_rng(3).standard_normal((8, 128))
    ref[5] *= 1e-4  # far below the tensor's rms: its elements' bounds come from its own
    got = ref.copy()
    assert compare_output("y", got, ref, dtype=dtype).ok
    got[5] = 0.0
    check = compare_output("y", got, ref, dtype=dtype)
    assert not check.ok and check.over_bound >= 120 and rows_named(check) == {5}


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_value_at_a_rows_last_column_fails(value):
    ref = np.random.default_rng(4).standard_normal((16, 64))
    got = ref.copy()
    assert compare_output("y", got, ref, dtype="bf16").ok
    got[9, 63] = value
    check = compare_output("y", got, ref, dtype="bf16")
    assert not check.ok and check.non_finite == 1 and check.worst[0].index == (9, 63)


# ---- whole calls on the host ---------------------------------------------------------------


@pytest.mark.parametrize("key", list(SPECS))
def test_the_right_call_passes(judge, key):
    checks = judge.right_call(key)
    assert checks and all(c.ok for c in checks.values())
    counts = {
        "ragged": {"y": USED * N},
        "capacity": {"y": USED * N},
        "capacity_acc": {"y": USED * N},
        "masked_acc": {"y": USED * NM},
        "masked_fp8": {"y": USED * NF},
        "padded_copy": {"h": USED * NF, "h_t": USED * NF},
    }
    for name, n in counts.get(key, {}).items():
        assert checks[name].elements == n


def _y(args, dtype=ml_dtypes.bfloat16):
    return args["y"].flat(dtype)


@pytest.mark.parametrize("row", [0, 100, USED - 1])
def test_a_wrong_element_at_a_rows_last_column_fails(judge, row):
    def wrong(args):
        y = _y(args)
        y[row * ROW + N - 1] = y[row * ROW + N - 1] * 2 + 1

    check = fails(judge, "ragged", wrong)
    assert check.over_bound == 1 and check.worst[0].index == (row, N - 1)


@pytest.mark.parametrize("leaf", sorted(LAST_ROWS))
def test_a_wrong_element_in_the_last_row_of_each_leaf_fails(judge, leaf):
    row = LAST_ROWS[leaf]

    def wrong(args):
        y = _y(args)
        y[row * ROW + 17] = y[row * ROW + 17] * 2 + 1

    check = fails(judge, "ragged", wrong)
    assert check.over_bound == 1 and check.worst[0].index == (row, 17)


def _storable_neighbours(limit: float, np_dtype) -> tuple[float, float]:
    """The largest positive value of the type at or under `limit` and the least over it."""
    if np.dtype(np_dtype).itemsize <= 2:
        bits = np.arange(1 << (8 * np.dtype(np_dtype).itemsize), dtype=np.uint32)
        with np.errstate(invalid="ignore"):  # the NaN patterns
            values = bits.astype(f"u{np.dtype(np_dtype).itemsize}").view(np_dtype).astype(np.float64)
        values = np.unique(values[np.isfinite(values) & (values > 0)])
    else:
        lo = np.float32(limit)
        lo = lo if float(lo) <= limit else np.nextafter(lo, np.float32(0))
        return float(lo), float(np.nextafter(lo, np.float32(np.inf)))
    i = int(np.searchsorted(values, limit, side="right"))
    return float(values[i - 1]), float(values[i])


@pytest.mark.parametrize("row", [ONE_ROW, LAST_ROWS[65]])
def test_the_least_storable_value_over_the_bound_fails_and_the_one_under_passes(judge, row):
    # The reference's own value and bound: the least bf16 over ref + bound must fail.
    _, ref, rtol, atol = judge.reference("ragged", "y")
    col = int(np.flatnonzero(ref[row] > 0)[-1])
    bound = _row_bound(ref, (row, col), rtol, atol)
    under, over = _storable_neighbours(ref[row, col] + bound, ml_dtypes.bfloat16)
    assert under > ref[row, col]

    def store(value):
        def set_value(args):
            _y(args)[row * ROW + col] = value
        return set_value

    assert judge.run("ragged", store(under))["y"].ok
    check = fails(judge, "ragged", store(over))
    assert check.over_bound == 1 and check.worst[0].index == (row, col)


def test_the_least_storable_value_over_the_bound_of_an_f32_output_fails(judge):
    _, ref, rtol, atol = judge.reference("masked_acc", "y")
    b, m = 6, 128  # the last row of the batch of 129 rows
    col = int(np.flatnonzero(ref[b, m] > 0)[-1])
    bound = _row_bound(ref, (b, m, col), rtol, atol)
    under, over = _storable_neighbours(ref[b, m, col] + bound, np.float32)

    def store(value):
        def set_value(args):
            _y(args, np.float32)[(b * M + m) * NM + col] = value
        return set_value

    assert judge.run("masked_acc", store(under))["y"].ok
    check = fails(judge, "masked_acc", store(over))
    assert check.over_bound == 1 and check.worst[0].index == (b, m, col)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("row", [ONE_ROW, LAST_ROWS[129]])
def test_a_non_finite_element_fails(judge, value, row):
    def bad(args):
        _y(args)[row * ROW + N - 1] = value

    check = fails(judge, "ragged", bad)
    assert check.non_finite == 1 and check.worst[0].index == (row, N - 1)
    assert check.unwritten == (1 if np.isnan(value) else 0)


@pytest.mark.parametrize("row", [ONE_ROW, LAST_ROWS[63], LAST_ROWS[129]])
def test_a_whole_zero_row_fails(judge, row):
    def zero(args):
        _y(args)[row * ROW:row * ROW + N] = 0

    check = fails(judge, "ragged", zero)
    assert check.over_bound > N // 2 and rows_named(check) == {row}


@pytest.mark.parametrize("row", [ONE_ROW, LAST_ROWS[64]])
def test_a_row_left_poisoned_is_unwritten(judge, row):
    def skip(args):
        _y(args)[row * ROW:row * ROW + N] = np.nan

    check = fails(judge, "ragged", skip)
    assert check.unwritten == N and check.non_finite == N and rows_named(check) == {row}


def test_a_guard_byte_changed_before_or_after_the_storage_fails(judge):
    def before(args):
        args["y"].buf.data[args["y"].offset - 1] ^= 0x01

    check = fails(judge, "ragged", before)
    assert check.guard_bytes_changed == 1 and check.guard_offsets == (("y", -1),)
    assert "changed bytes y-1" in check.describe()

    nbytes = ((USED - 1) * ROW + N) * 2

    def after(args):
        args["y"].buf.data[args["y"].offset + nbytes] ^= 0x01  # the first byte past the storage

    check = fails(judge, "ragged", after)
    assert check.guard_bytes_changed == 1 and check.guard_offsets == (("y", nbytes),)

    def last(args):
        args["y"].buf.data[-1] ^= 0x80  # the last byte of the guard after it

    check = fails(judge, "ragged", last)
    assert check.guard_offsets == (("y", nbytes + GUARD_BYTES - 1),)


def test_a_store_into_the_gap_of_a_strided_row_fails(judge):
    def gap(args):
        _y(args)[ONE_ROW * ROW + N + 2] = 0  # between the row of one and the next

    check = fails(judge, "ragged", gap)
    assert check.guard_bytes_changed == 2 and {o // 2 for _, o in check.guard_offsets} == {ONE_ROW * ROW + N + 2}


# ---- rows past a group's end: untouched ------------------------------------------------------


@pytest.mark.parametrize("row", [USED, USED + CAPACITY_ROWS - 1])
def test_a_store_into_a_capacity_row_fails(judge, row):
    def store(args):
        _y(args)[row * N + 3] = 1.0

    check = fails(judge, "capacity", store)
    assert check.clobbered == 1 and check.over_bound == 0

    def other_nan(args):  # a NaN, but not the poison
        _y(args, np.uint16)[row * N + 3] = 0x7FC1

    check = fails(judge, "capacity", other_nan)
    assert check.clobbered == 1


@pytest.mark.parametrize("row", [USED, USED + CAPACITY_ROWS - 1])
def test_a_store_into_a_capacity_row_of_an_added_output_fails(judge, row):
    # `+=`: rows past the offsets' end keep what they held, bit for bit; one step of bf16
    # is within the tolerance of an element the statement adds into.
    def nudge(args):
        y = _y(args, np.uint16)
        y[row * N + 3] += 1

    check = fails(judge, "capacity_acc", nudge)
    assert check.clobbered == 1 and check.over_bound == 0

    def zero(args):
        _y(args)[row * N:(row + 1) * N] = 0

    check = fails(judge, "capacity_acc", zero)
    assert check.clobbered == N


@pytest.mark.parametrize("batch, count", [(0, 0), (1, 1), (6, 129)])
def test_a_store_into_a_masked_row_of_an_added_output_fails(judge, batch, count):
    def nudge(args):
        y = _y(args, np.uint32)
        y[(batch * M + count) * NM + NM - 1] += 1  # one f32 step, the first row past the count

    check = fails(judge, "masked_acc", nudge)
    assert check.clobbered == 1 and check.over_bound == 0


@pytest.mark.parametrize("batch, row", [(1, 0), (6, 128)])
def test_a_skipped_zero_or_overwritten_row_of_an_added_output_fails(judge, batch, row):
    def skipped(args):  # the row keeps what it held before the call: nothing added
        start = (batch * M + row) * NM
        _y(args, np.float32)[start:start + NM] = judge.before["y"].view(np.float32)[start:start + NM]

    def zero(args):
        start = (batch * M + row) * NM
        _y(args, np.float32)[start:start + NM] = 0

    def overwritten(args):  # `=` where the statement says `+=`: what it held is lost
        start = (batch * M + row) * NM
        y = _y(args, np.float32)
        y[start:start + NM] -= judge.before["y"].view(np.float32)[start:start + NM]

    for corrupt in (skipped, zero, overwritten):
        check = fails(judge, "masked_acc", corrupt)
        assert check.over_bound > NM // 2 and {e.index[:2] for e in check.worst} == {(batch, row)}


# ---- FP8 outputs and their scales -----------------------------------------------------------

E4M3 = NUMPY_TYPES["e4m3"]


def _scales(args, name="y_scale"):
    return args[name].flat(np.float32)


@pytest.mark.parametrize("batch, m", [(1, 0), (4, 64), (6, 128)])
def test_a_wrong_fp8_value_at_a_rows_last_column_fails(judge, batch, m):
    at = (batch * M + m) * NF + NF - 1

    def wrong(args):
        y = _y(args, E4M3)
        y[at] = -448.0 if float(y[at]) > 100 else 448.0

    check = fails(judge, "masked_fp8", wrong)
    assert check.over_bound == 1 and check.worst[0].index == (batch, m, NF - 1)


@pytest.mark.parametrize("scale", [2.0, 0.0, np.inf, np.nan])
def test_a_wrong_fp8_scale_fails_in_its_block(judge, scale):
    b, m = 1, 0  # the batch of one row

    def wrong(args):
        s = _scales(args)
        s[(b * M + m) * 2 + 1] = s[(b * M + m) * 2 + 1] * scale if scale == 2.0 else scale

    check = fails(judge, "masked_fp8", wrong)
    assert {e.index[:2] for e in check.worst} == {(b, m)} and all(e.index[2] >= 128 for e in check.worst)
    if np.isnan(scale):
        assert check.unwritten == 128
    elif np.isinf(scale):
        assert check.non_finite == 128
    else:
        assert check.over_bound > 100


def test_a_nan_fp8_value_fails(judge):
    at = (6 * M + 128) * NF + 5

    def nan(args):
        _y(args, np.uint8)[at] = 0x7F  # e4m3's NaN

    check = fails(judge, "masked_fp8", nan)
    assert check.unwritten == 1 and check.worst[0].index == (6, 128, 5)


def test_a_zero_fp8_row_fails(judge):
    at = (4 * M + 64) * NF  # the last row of the batch of 65

    def zero(args):
        _y(args, np.uint8)[at:at + NF] = 0

    check = fails(judge, "masked_fp8", zero)
    assert check.over_bound > NF // 2 and {e.index[:2] for e in check.worst} == {(4, 64)}


@pytest.mark.parametrize("batch, count", [(0, 0), (1, 1), (6, 129)])
def test_a_store_into_a_masked_fp8_row_or_its_scale_fails(judge, batch, count):
    def value(args):
        _y(args, np.uint8)[(batch * M + count) * NF + NF - 1] = 0x38  # 1.0

    check = fails(judge, "masked_fp8", value)
    assert check.clobbered == 1 and check.over_bound == 0

    def scale(args):
        _scales(args)[(batch * M + count) * 2 + 1] = 1.0

    check = fails(judge, "masked_fp8", scale)
    assert check.clobbered == 1 and check.over_bound == 0


def test_a_guard_byte_of_the_fp8_scales_fails(judge):
    nbytes = 7 * M * 2 * 4

    def after(args):
        s = args["y_scale"]
        s.buf.data[s.offset + nbytes] ^= 0x01

    check = fails(judge, "masked_fp8", after)
    assert check.guard_offsets == (("y_scale", nbytes),)

    def before(args):
        s = args["y_scale"]
        s.buf.data[s.offset - GUARD_BYTES] ^= 0x01

    check = fails(judge, "masked_fp8", before)
    assert check.guard_offsets == (("y_scale", -GUARD_BYTES),)


# ---- a padded segment_major output -----------------------------------------------------------

# h_t's segments in storage: element (t, c) of segment g at p_g * F + c * len'_g + (t - s_g),
# len'_g the segment's length rounded up to 16, p_g the sum of the earlier ones.
PITCH = [-(-n // 16) * 16 for n in LENGTHS]
FIRST = np.concatenate([[0], np.cumsum(PITCH)])


def _h_t_offset(leaf: int, i: int, c: int) -> int:
    return int(FIRST[leaf]) * NF + c * PITCH[leaf] + i


@pytest.mark.parametrize("leaf, i", [(1, 1), (1, 15), (4, 65), (6, 143)])
def test_a_store_into_the_padding_of_a_segment_fails(judge, leaf, i):
    at = _h_t_offset(leaf, i, 200)

    def pad(args):
        args["h_t"].flat(np.uint8)[at] = 0

    check = fails(judge, "padded_copy", pad, "h_t")
    assert check.guard_bytes_changed == 1 and check.guard_offsets == (("h_t", at),)


@pytest.mark.parametrize("leaf", [1, 4, 6])
def test_a_wrong_value_or_scale_in_the_last_row_of_a_segment_fails(judge, leaf):
    i = LENGTHS[leaf] - 1
    row = int(STARTS[leaf]) + i
    at = _h_t_offset(leaf, i, 7)

    def value(args):
        h_t = args["h_t"].flat(E4M3)
        h_t[at] = -448.0 if float(h_t[at]) > 100 else 448.0

    check = fails(judge, "padded_copy", value, "h_t")
    assert check.over_bound == 1 and check.worst[0].index == (row, 7)

    block = sum(-(-n // 128) for n in LENGTHS[:leaf]) + i // 128  # the segment's scale block row

    def scale(args):
        _scales(args, "h_t_scale")[block * NF + 7] *= 4.0

    check = fails(judge, "padded_copy", scale, "h_t")
    assert check.over_bound >= 1 and {e.index[1] for e in check.worst} == {7}
    assert rows_named(check) <= set(range(row - i, row + 1))  # the segment's block only
    if leaf == 1:
        assert check.over_bound == 1 and check.worst[0].index == (row, 7)
