"""Run a compiled spec on random data and compare with the float64 reference.

Inputs are fresh random values quantized with the spec's own scales (never
zeros); `=` outputs are poisoned with NaN first and must come back fully
written; `+=` outputs start from random values, and the elements no leaf adds into (rows
past a masked count or a capacity group's end) count as elements the reference does not
write: they must keep those values bit for bit. The reference is the spec's
direct semantics on the dequantized inputs (gemmspec.reference.direct). An FP8
output's scales are poisoned too, and it is compared dequantized (values times scales)
with the reference's, which quantizes the float64 result by the same rule; statements
that read an FP8 output are checked against the reference run on the FP8 values and
scales the GPU wrote (a result a hair from the reference's may round to the next FP8
value, and the reference of what reads it would carry that step along).

Every output is judged element by element (`compare_output`), not by a norm over the
whole tensor, which a few wrong elements among millions hardly move:

- every element the reference writes satisfies
  ``|got - ref| <= rtol * |ref| + atol * rms(row)``, where rms(row) is the root mean
  square of the reference over that element's logical row (all indices but the last
  fixed; a 1-D output is one row), with rtol and atol from `TOLERANCES` by output type;
- none of those elements is NaN or infinite;
- every element the reference does not write keeps the bytes it was given (a NaN poison
  stays that very NaN), and so does every unwritten entry of an FP8 output's scales;
- the guard bytes before and after each output's storage (`GuardedBuffer`: random bytes,
  `GUARD_BYTES` each side) and the bytes of the storage that belong to no element (row
  strides' gaps, padded segments) are unchanged bit for bit.

The global relative error is reported for information only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, replace

import numpy as np

from ..reference.data import (
    NUMPY_TYPES,
    Runtime,
    TensorData,
    dim_size,
    element_offsets,
    expand_scales,
    random_inputs,
    random_runtime,
    scale_grid_shape,
    scale_offsets,
    segments,
    storage_elements,
)
from ..reference.direct import run_direct
from ..spec import FP8_TYPES, Tensor
from .arrays import DeviceArray, DeviceBuffer
from .executor import Executable, PreparedRun

# (rtol, atol) by output type; atol is in units of rms(row), the root mean square of the
# reference over the element's output row. "f32 fp8" is an f32 output of FP8 operands.
TOLERANCES: dict[str, tuple[float, float]] = {
    # Twice the largest rounding of the result itself (half an ulp is at most 2^-8 of a
    # bf16 value, 2^-11 of an f16 one); accumulation error grows with the row, not the
    # element, and stays well inside atol. The operands' own precision does not enter:
    # the reference is computed on the dequantized inputs the kernel reads.
    "bf16": (2.0**-7, 1e-2),
    "f16": (2.0**-10, 1e-2),
    # f32 accumulation of 16-bit operands.
    "f32": (1e-4, 1e-3),
    # FP8 tensor cores keep about 14 bits of each 128-wide K block's sum (truncated), so
    # an element's error scales with the sum of its products' magnitudes, not with the
    # element: over millions of elements the tail reaches 1.7e-3 of rms(row) (measured
    # on the H200, WGRAD at K = 4354..6166 and per-channel at K = 200), and a product of
    # two such sums (SwiGLU) carries the relative error of its smaller factor.
    "f32 fp8": (2.0**-8, 4e-3),
    # One step of the format: the device's f32 result and the reference's float64 one may
    # round to neighbouring FP8 values (and their block scales differ by a bf16 step).
    "e4m3": (2.0**-3, 1e-2),
    "e5m2": (2.0**-2, 1e-2),
}
# How many of the worst elements a check keeps, and of the changed guard bytes.
WORST = 5
GUARD_OFFSETS = 8


def tolerance(dtype: str, operand_dtype: str | None = None) -> tuple[float, float]:
    """(rtol, atol) of `TOLERANCES` for an output of type `dtype` computed from operands
    of type `operand_dtype` (only an f32 output's depends on it)."""
    key = f"{dtype} fp8" if dtype == "f32" and operand_dtype in FP8_TYPES else dtype
    try:
        return TOLERANCES[key]
    except KeyError:
        raise ValueError(f"no tolerance for {dtype} outputs; expected one of {sorted(TOLERANCES)}") from None


@dataclass(frozen=True)
class ElementError:
    """One element outside its bound (or not finite): where, the values and the bound."""

    index: tuple[int, ...]
    ref: float
    got: float
    bound: float

    def describe(self) -> str:
        return f"{list(self.index)} ref {self.ref:.6g} got {self.got:.6g} (bound {self.bound:.2g})"


@dataclass(frozen=True)
class OutputCheck:
    """The element-wise verdict on one output (see the module's note for the rule)."""

    tensor: str
    rtol: float
    atol: float  # in units of rms(row)
    elements: int = 0  # elements the reference writes
    max_abs_error: float = 0.0  # over the written elements with finite values
    over_bound: int = 0  # written elements with finite values outside their bound
    worst: tuple[ElementError, ...] = ()  # the worst few, non-finite ones first
    non_finite: int = 0  # written elements that are NaN or infinite (unwritten included)
    unwritten: int = 0  # written elements left NaN
    clobbered: int = 0  # elements (and FP8 scales) the reference leaves alone that changed
    guard_bytes_changed: int = 0  # guard bytes and bytes of no element that changed
    guard_offsets: tuple[tuple[str, int], ...] = ()  # the first few: (buffer, byte offset from its storage)
    rel_error: float = 0.0  # ||got - ref|| / ||ref|| over the written elements: information only

    @property
    def ok(self) -> bool:
        return not (self.over_bound or self.non_finite or self.unwritten or self.clobbered
                    or self.guard_bytes_changed)

    def describe(self) -> str:
        """One line: the largest error, every count and the verdict (with the worst
        elements and changed guard bytes when there are any)."""
        line = (
            f"{self.tensor}: max abs error {self.max_abs_error:.3e}, {self.over_bound} of "
            f"{self.elements} over {self.rtol:.2g}*|ref| + {self.atol:.2g}*rms(row), non-finite "
            f"{self.non_finite}, unwritten {self.unwritten}, clobbered {self.clobbered}, guard bytes "
            f"changed {self.guard_bytes_changed} (rel error {self.rel_error:.3e}): "
            f"{'ok' if self.ok else 'FAIL'}"
        )
        if self.worst:
            line += "; worst " + ", ".join(e.describe() for e in self.worst)
        if self.guard_offsets:
            line += "; changed bytes " + ", ".join(f"{b}{o:+d}" for b, o in self.guard_offsets)
        return line


def compare_output(
    name: str,
    got: np.ndarray,
    ref: np.ndarray,
    *,
    dtype: str,
    operand_dtype: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    got_raw: np.ndarray | None = None,
    initial_raw: np.ndarray | None = None,
    guards: Mapping[str, np.ndarray] | None = None,
) -> OutputCheck:
    """Judge one output element by element (numpy in, no device needed).

    `got`: the output's values as the device left them (an FP8 output's dequantized);
    `ref`: the float64 reference of the same shape, NaN where the reference writes nothing.
    Every element the reference writes must satisfy ``|got - ref| <= rtol * |ref| + atol *
    rms(row)`` (rms(row): the reference's root mean square over the element's row, all
    indices but the last fixed; the whole tensor when it is 1-D) and be finite (an
    infinite reference must be matched exactly). `rtol` and `atol` default to
    `tolerance(dtype, operand_dtype)`; a caller may pass its own.

    Every element the reference does not write must be unchanged: bit for bit against
    `initial_raw` given `got_raw` (the stored elements after and before the call, in any
    dtype of the output's size), else still NaN. `guards` maps a buffer's name to the byte
    offsets that changed outside its elements (`GuardedBuffer.changed_outside`)."""
    default_rtol, default_atol = tolerance(dtype, operand_dtype)
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        raise ValueError(f"{name}: got shape {got.shape}, reference shape {ref.shape}")

    # In place where it can be: outputs run to hundreds of millions of elements.
    written = ~np.isnan(ref)
    judged = written & np.isfinite(ref)
    got_finite = np.isfinite(got)
    valid = judged & got_finite
    rms, ref_square_sum = _row_rms(ref, judged)
    bound = np.abs(ref)
    bound[~judged] = 0.0
    bound *= rtol
    bound += atol * rms
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(got - ref)
    err[~valid] = 0.0
    # A finite value against an infinite reference is out of bound; an infinite one equal
    # to it is right.
    over = (valid & (err > bound)) | (written & ~judged & got_finite)
    non_finite = written & ~got_finite & (got != ref)
    unwritten = written & np.isnan(got)

    if got_raw is not None and initial_raw is not None:
        changed = _bits(got_raw) != _bits(initial_raw)
    else:
        changed = ~np.isnan(got)
    clobbered = int((changed & ~written).sum())

    flat_err = err.reshape(-1)
    max_abs = float(flat_err.max()) if flat_err.size else 0.0
    # A non-finite value counts as 0 in the norm (its count says the rest).
    missed = ref[judged & ~got_finite]
    diff_square_sum = float(np.dot(flat_err, flat_err)) + float(np.dot(missed, missed))
    rel = float(np.sqrt(diff_square_sum) / (np.sqrt(ref_square_sum) or 1.0))

    changed_guards = {b: np.asarray(o) for b, o in (guards or {}).items()}
    guard_offsets = tuple((b, int(o)) for b, offs in changed_guards.items() for o in offs[:GUARD_OFFSETS])
    return OutputCheck(
        tensor=name,
        rtol=rtol,
        atol=atol,
        elements=int(written.sum()),
        max_abs_error=max_abs,
        over_bound=int(over.sum()),
        worst=_worst(got, ref, err, bound, over, non_finite),
        non_finite=int(non_finite.sum()),
        unwritten=int(unwritten.sum()),
        clobbered=clobbered,
        guard_bytes_changed=sum(int(o.size) for o in changed_guards.values()),
        guard_offsets=guard_offsets[:GUARD_OFFSETS],
        rel_error=rel,
    )


def _row_rms(ref: np.ndarray, judged: np.ndarray) -> tuple[np.ndarray, float]:
    """The root mean square of the judged reference values over each element's row
    (the last index; the whole tensor when it is 1-D or 0-D), broadcast to ref's shape,
    and the sum of their squares."""
    sq = np.where(judged, ref, 0.0)
    sq *= sq
    if ref.ndim <= 1:
        total = float(sq.sum())
        return np.full(ref.shape, np.sqrt(total / max(int(judged.sum()), 1))), total
    sums = sq.sum(axis=-1, keepdims=True)
    count = np.maximum(judged.sum(axis=-1, keepdims=True), 1)
    return np.broadcast_to(np.sqrt(sums / count), ref.shape), float(sums.sum())


def _bits(values: np.ndarray) -> np.ndarray:
    """Stored elements as unsigned integers of their size, to compare bit for bit."""
    values = np.ascontiguousarray(values)
    return values.view(f"u{values.dtype.itemsize}")


def _worst(got, ref, err, bound, over, non_finite) -> tuple[ElementError, ...]:
    """The elements furthest outside their bound, non-finite ones first."""
    bad = np.flatnonzero((over | non_finite).reshape(-1))
    if not bad.size:
        return ()
    flat_err, flat_bound = err.reshape(-1)[bad], bound.reshape(-1)[bad]
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(flat_bound > 0, flat_err / flat_bound, np.inf)
    ratio = np.where(non_finite.reshape(-1)[bad] | ~np.isfinite(ref.reshape(-1)[bad]), np.inf, ratio)
    order = np.argsort(-ratio, kind="stable")[:WORST]
    picked = bad[order]
    return tuple(
        ElementError(
            tuple(int(i) for i in np.unravel_index(int(p), ref.shape)),
            float(ref.reshape(-1)[p]),
            float(got.reshape(-1)[p]),
            float(bound.reshape(-1)[p]),
        )
        for p in picked
    )


GUARD_BYTES = 256


def guard_pattern(nbytes: int, seed: int = 0) -> np.ndarray:
    """`nbytes` random bytes from 1 to 255 (never zero, so a store of zeros shows; random,
    so no value the kernels write, NaN included, matches them but by chance)."""
    return np.random.default_rng(seed).integers(1, 256, nbytes, dtype=np.uint8)


class GuardedBuffer:
    """A tensor's storage on the device with `guard` bytes of a random pattern before and
    after it (one allocation), so that a write past either end shows.

    `storage` is the host array uploaded between the guards (flattened, in its dtype).
    Given `elements` (flat element offsets into it), the storage's other elements are
    bytes of no element too and are checked with the guards; `fill_gaps` fills them with
    the random pattern first (so that any store into them shows, a NaN's included)."""

    def __init__(self, storage: np.ndarray, elements: np.ndarray | None = None, *,
                 fill_gaps: bool = False, guard: int = GUARD_BYTES):
        host = np.ascontiguousarray(storage).reshape(-1)
        self.guard = guard
        self._gaps = np.zeros(0, dtype=np.int64)
        if elements is not None:
            mask = np.ones(host.size, dtype=bool)
            mask[np.asarray(elements, dtype=np.int64).reshape(-1)] = False
            self._gaps = np.flatnonzero(mask)
            if fill_gaps and self._gaps.size:
                host = host.copy()
                slots = host.view(np.uint8).reshape(host.size, host.dtype.itemsize)
                slots[self._gaps] = guard_pattern(self._gaps.size * host.dtype.itemsize, seed=1).reshape(
                    self._gaps.size, host.dtype.itemsize)
        self.host = host
        raw = host.view(np.uint8)
        pattern = guard_pattern(2 * guard, seed=raw.size)
        self.uploaded = np.concatenate([pattern[:guard], raw, pattern[guard:]])
        self.nbytes = raw.size
        self.buffer = DeviceBuffer.from_numpy(self.uploaded)

    @property
    def ptr(self) -> int:
        """The device address of the storage's first byte (past the leading guard)."""
        return self.buffer.ptr + self.guard

    def view(self, shape: tuple[int, ...], dtype: str, strides: tuple[int, ...] | None = None) -> DeviceArray:
        """A DeviceArray over the storage (C-contiguous unless `strides` are given)."""
        return self.buffer.view(shape, dtype, strides, offset=self.guard)

    def read(self) -> np.ndarray:
        """The whole allocation, guards included, as bytes (after all device work)."""
        return self.buffer.to_numpy((self.uploaded.size,), np.uint8)

    def storage(self, raw: np.ndarray | None = None) -> np.ndarray:
        """The storage as the device left it, flat in the uploaded dtype (from `raw`, a
        `read()`, when given)."""
        raw = self.read() if raw is None else raw
        return raw[self.guard:self.guard + self.nbytes].view(self.host.dtype)

    def to_numpy(self, shape: tuple[int, ...] | int, dtype: str | np.dtype) -> np.ndarray:
        """The storage's leading bytes as an array of `shape` and `dtype` (as
        DeviceBuffer.to_numpy reads a buffer's)."""
        from .arrays import numpy_dtype

        np_dtype = numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)
        count = int(np.prod(shape))
        data = self.read()[self.guard:self.guard + self.nbytes]
        return data[:count * np_dtype.itemsize].view(np_dtype).reshape(shape).copy()

    def changed_outside(self, raw: np.ndarray | None = None) -> np.ndarray:
        """Byte offsets from the storage's first byte (negative: the leading guard) of every
        guard byte and byte of no element that differs from what was uploaded."""
        raw = self.read() if raw is None else raw
        g, n, up = self.guard, self.nbytes, self.uploaded
        found = [np.flatnonzero(raw[:g] != up[:g]) - g, np.flatnonzero(raw[g + n:] != up[g + n:]) + n]
        if self._gaps.size:
            size = self.host.dtype.itemsize
            now = raw[g:g + n].reshape(-1, size)[self._gaps]
            then = up[g:g + n].reshape(-1, size)[self._gaps]
            rows, cols = np.nonzero(now != then)
            found.append(self._gaps[rows] * size + cols)
        return np.sort(np.concatenate(found))


@dataclass(frozen=True)
class RunReport:
    spec: str
    dims: dict
    checks: tuple[OutputCheck, ...]
    seconds: float
    useful_flops: float

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def describe(self) -> str:
        """One line: the spec, its dims and every output's check."""
        return f"{self.spec} {self.dims}: " + "; ".join(c.describe() for c in self.checks)

    @property
    def tflops(self) -> float:
        return self.useful_flops / self.seconds / 1e12 if self.seconds else 0.0


def _flat_buffer(spec, rt, t: Tensor, values: np.ndarray, fill: float,
                 output: bool = False) -> tuple[np.ndarray, GuardedBuffer]:
    """t's storage on the host (every element in place, `fill` elsewhere) and on the
    device between guard bytes. An output's bytes of no element are filled with the
    guards' random pattern, and checked with them after the call."""
    off = element_offsets(spec, rt, t)
    n = max(int(off.max(initial=-1)) + 1, storage_elements(spec, rt, t))
    if t.layout.padded:
        fill = np.nan  # the padding of padded segments is never read: poison it
    flat = np.full(n, fill, dtype=np.float64)
    flat[off] = values
    host = flat.astype(NUMPY_TYPES[t.dtype])
    buf = GuardedBuffer(host, off if output else None, fill_gaps=output)
    return buf.host, buf


def _useful_flops(spec, rt) -> float:
    """2*M*N*K summed over the leaves' real extents (no padding, no masked-off rows)."""
    total = 0.0

    for g in spec.gemms:
        sizes = {r: dim_size(spec, rt, g.role(r).dim) for r in "mnk"}
        leaves = 1
        for ax in g.leaf_axes:
            if ax.group is None:
                leaves *= ax.count
        split = [r for r in "mnk" if g.role(r).group or g.role(r).masked_by]
        if not split:
            total += 2.0 * leaves * sizes["m"] * sizes["n"] * sizes["k"]
            continue
        r = split[0]
        others = [x for x in "mnk" if x != r]
        rd = g.role(r)
        if rd.masked_by:
            lens = [int(c) for c in rt.tensors[spec.group(rd.masked_by).tensor]]
            lens = [min(max(c, 0), sizes[r]) for c in lens]
        else:
            lens = [s.length for s in segments(spec, rt, rd.group)]
        total += 2.0 * sum(lens) * sizes[others[0]] * sizes[others[1]] * leaves
    return total


def run_random(exe: Executable, dims: dict[str, int] | None = None, lengths: dict | None = None, seed: int = 0, repeats: int = 10) -> RunReport:
    """One call on random inputs checked against the float64 reference, then the median
    wall time of `repeats` calls (the offsets check included; 0 when `repeats` is 0)."""
    call = check_random(exe, dims=dims, lengths=lengths, seed=seed)
    seconds = _time(call.prepare(), repeats) if repeats else 0.0
    return replace(call.report, seconds=seconds)


@dataclass(frozen=True)
class RandomCall:
    """A checked call on random inputs: its report (no time yet) and the device arguments,
    kept alive so that the same call can be prepared again and timed."""

    exe: Executable
    report: RunReport
    args: dict
    keep: tuple

    def prepare(self) -> PreparedRun:
        return self.exe.prepare(**self.args)


def check_random(exe: Executable, dims: dict[str, int] | None = None, lengths: dict | None = None, seed: int = 0,
                 reference_memo: dict | None = None, rtol: float | None = None,
                 atol: float | None = None) -> RandomCall:
    """Random inputs quantized with the spec's scales, `=` outputs poisoned, one call,
    every output compared with the float64 reference (see the module's note). `rtol` and
    `atol` replace the output type's tolerances (`TOLERANCES`) where given.

    `reference_memo`, a dict shared by calls of specs that differ only in their tiles (same
    dims, lengths and seed: the same inputs), keeps the float64 reference of the first so
    the others skip it; on large problems the reference costs more than the GPU call."""
    spec = exe.spec
    rng = np.random.default_rng(seed)
    rt: Runtime = random_runtime(spec, rng, lengths=lengths, dims=dims)
    data = random_inputs(spec, rt, rng)
    outputs = set(spec.written)
    init = {}
    for name in outputs:
        t = spec.tensor(name)
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        init[name] = data.pop(name).values if name in data else np.full(shape, np.nan)
    scale_bufs: dict = {}
    args, keep, out_bufs = device_arguments(spec, rt, data, init, scale_bufs)
    exe(**args)
    results = {}
    stored: dict[str, tuple[np.ndarray, np.ndarray]] = {}  # output: (after, before) as stored
    scales_stored: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    guards: dict[str, dict[str, np.ndarray]] = {}
    for name, (buf, host) in out_bufs.items():
        t = spec.tensor(name)
        raw = buf.read()
        off = element_offsets(spec, rt, t)
        after = buf.storage(raw)[off]
        stored[name] = (after, host[off])
        results[name] = after.astype(np.float64)
        guards[name] = {name: buf.changed_outside(raw)}
        if name in scale_bufs:
            sbuf, _, grid_off = scale_bufs[name]
            sraw = sbuf.read()
            grid = sbuf.storage(sraw)[grid_off]
            scales_stored[name] = (grid, sbuf.host[grid_off])
            results[t.scale.name] = grid.astype(np.float64)
            guards[name][t.scale.name] = sbuf.changed_outside(sraw)
    covered: dict[str, np.ndarray] = {}  # elements each statement output's statements write
    if reference_memo is None:
        reference = run_direct(spec, rt, data, init, covered=covered)
    else:
        if "reference" not in reference_memo:
            reference_memo["reference"] = run_direct(spec, rt, data, init, covered=covered)
            reference_memo["covered"] = covered
        reference, covered = reference_memo["reference"], reference_memo["covered"]
    accumulated = {g.out.tensor for g in spec.gemms if g.accumulate}
    reference = _reference_on_written_inputs(spec, rt, data, init, reference, results, outputs)
    checks = []
    for name in sorted(outputs):
        t = spec.tensor(name)
        ref, got = reference[name], results[name]
        if name in accumulated:
            # The reference of an `+=` output holds its starting values where no leaf adds:
            # those elements are not written, and must keep their bytes (not come within
            # the tolerance of them).
            ref = np.where(covered[name], ref, np.nan)
        scale_clobbered = 0
        if t.dtype in FP8_TYPES:
            # Dequantized; an unwritten scale (NaN) makes its block's values unwritten too.
            ref = ref * expand_scales(spec, rt, t, reference[t.scale.name])
            got = got * expand_scales(spec, rt, t, results[t.scale.name])
            # The scales the reference leaves alone keep their poison, bit for bit.
            after, before = scales_stored[name]
            unwritten_scales = np.isnan(reference[t.scale.name])
            scale_clobbered = int((after.view(np.uint32) != before.view(np.uint32))[unwritten_scales].sum())
        writer = next((g.a.tensor for g in spec.gemms if name in g.writes), None)
        a_t = spec.tensor(writer if writer is not None else t.row_pass.source)
        after, before = stored[name]
        check = compare_output(name, got, ref, dtype=t.dtype, operand_dtype=a_t.dtype, rtol=rtol, atol=atol,
                               got_raw=after, initial_raw=before, guards=guards[name])
        if scale_clobbered:
            check = replace(check, clobbered=check.clobbered + scale_clobbered)
        checks.append(check)
    report = RunReport(spec.name, dict(rt.dims), tuple(checks), 0.0, _useful_flops(spec, rt))
    return RandomCall(exe, report, args, tuple(keep))


def _reference_on_written_inputs(spec, rt: Runtime, data: dict, init: dict, reference: dict, results: dict,
                                 outputs: set[str]) -> dict:
    """The reference each output is judged against. An FP8 output that something reads is
    judged against the float64 reference itself, and what reads it against the reference
    run on it as the GPU wrote it (FP8 rounding is discontinuous: a result a hair away from
    the reference's may round to the next FP8 value). A row pass (`scatter_add`) is judged
    on the source rows the GPU wrote, which are judged on their own: a sum of k rows would
    otherwise carry k rows' accumulation errors against one row's bound."""
    read_by_gemms = {r for g in spec.gemms for r in g.reads}
    read_by_passes = {r for t in spec.row_passes for r in t.row_pass.reads}
    fp8 = {n: TensorData(results[n], results[spec.tensor(n).scale.name]) for n in sorted(outputs)
           if spec.tensor(n).dtype in FP8_TYPES and n in read_by_gemms | read_by_passes}
    rows = {n: TensorData(results[n]) for n in sorted(outputs)
            if spec.tensor(n).dtype not in FP8_TYPES and n in read_by_passes}
    if not fp8 and not rows:
        return reference
    out = dict(reference)
    if fp8:
        kept = set(fp8) | {spec.tensor(n).scale.name for n in fp8}
        downstream = run_direct(spec, rt, data, init, given=fp8)
        out.update({k: v for k, v in downstream.items() if k not in kept})
    if rows:
        summed = run_direct(spec, rt, data, init, given={**fp8, **rows})
        for t in spec.row_passes:
            if t.name in outputs and set(t.row_pass.reads) & set(rows):
                out[t.name] = summed[t.name]
    return out


def device_arguments(
    spec, rt: Runtime, data: dict, init: dict, scale_bufs: dict | None = None
) -> tuple[dict, list, dict]:
    """The arguments of a call on the device: the inputs of `data` with their scales, the
    outputs holding `init` (NaN where poisoned), and `rt`'s offsets and counts, each in a
    `GuardedBuffer`. Returns (arguments by name, the buffers to keep alive, {output:
    (guarded buffer, host copy of its storage)}); an FP8 output's scales are poisoned
    too, and given `scale_bufs`, recorded there as {output: (guarded buffer, floats, grid
    offsets)}."""
    args: dict[str, object] = {}
    keep = []
    for name, d in data.items():
        t = spec.tensor(name)
        host, buf = _flat_buffer(spec, rt, t, d.values, 0.0)
        args[name] = _shaped(buf, t, spec, rt)
        keep.append(buf)
        if d.scale_grid is not None:
            grid_off = scale_offsets(spec, rt, t)
            flat = np.zeros(int(grid_off.max(initial=-1)) + 1, dtype=np.float32)
            flat[grid_off] = d.scale_grid
            sbuf = GuardedBuffer(flat)
            keep.append(sbuf)
            shape = scale_grid_shape(spec, rt, t)
            strides = tuple(s.evaluate(rt.dims) for s in t.scale.layout.strides)
            args[t.scale.name] = sbuf.view(shape, "f32", strides)
    out_bufs = {}
    for name, v in init.items():
        t = spec.tensor(name)
        host, buf = _flat_buffer(spec, rt, t, v, np.nan, output=True)
        out_bufs[name] = (buf, host)
        keep.append(buf)
        args[name] = _shaped(buf, t, spec, rt)
        if t.dtype in FP8_TYPES:  # an FP8 output: its scales are written too, poisoned first
            grid_off = scale_offsets(spec, rt, t)
            flat = np.full(int(grid_off.max(initial=-1)) + 1, np.nan, dtype=np.float32)
            sbuf = GuardedBuffer(flat, grid_off, fill_gaps=True)
            keep.append(sbuf)
            if scale_bufs is not None:
                scale_bufs[name] = (sbuf, flat.size, grid_off)
            strides = tuple(s.evaluate(rt.dims) for s in t.scale.layout.strides)
            args[t.scale.name] = sbuf.view(scale_grid_shape(spec, rt, t), "f32", strides)
    for name, arr in rt.tensors.items():
        buf = GuardedBuffer(np.ascontiguousarray(arr, dtype=np.int32))
        keep.append(buf)
        args[name] = buf.view(arr.shape, "i32")
    return args, keep, out_bufs


def _shaped(buf: GuardedBuffer, t: Tensor, spec, rt) -> DeviceArray:
    # A padded segment_major buffer carries its padding rows in its shape.
    shape = t.layout.storage_shape(tuple(dim_size(spec, rt, d) for d in t.dims))
    if t.layout.kind == "strided":
        strides = tuple(s.evaluate(rt.dims) for s in t.layout.strides)
    else:
        strides = None
    return buf.view(shape, t.dtype, strides)


def _time(run: PreparedRun, repeats: int) -> float:
    """Median wall time of enqueue + synchronise (launch overhead included)."""
    run.enqueue()
    run.synchronize()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run.enqueue()
        run.synchronize()
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))


__all__ = [
    "GUARD_BYTES",
    "TOLERANCES",
    "ElementError",
    "GuardedBuffer",
    "OutputCheck",
    "RandomCall",
    "RunReport",
    "check_random",
    "compare_output",
    "device_arguments",
    "guard_pattern",
    "run_random",
    "tolerance",
]
