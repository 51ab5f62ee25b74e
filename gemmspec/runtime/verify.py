"""Run a compiled spec on random data and compare with the float64 reference.

Inputs are fresh random values quantized with the spec's own scales (never
zeros); `=` outputs are poisoned with NaN first and must come back fully
written; `+=` outputs start from random values. The reference is the spec's
direct semantics on the dequantized inputs (gemmspec.reference.direct). An FP8
output's scales are poisoned too, and it is compared dequantized (values times scales)
with the reference's, which quantizes the float64 result by the same rule; statements
that read an FP8 output are checked against the reference run on the FP8 values and
scales the GPU wrote (a result a hair from the reference's may round to the next FP8
value, and the reference of what reads it would carry that step along).
"""

from __future__ import annotations

import time
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
from .arrays import DeviceBuffer
from .executor import Executable, PreparedRun


@dataclass(frozen=True)
class OutputCheck:
    tensor: str
    rel_error: float
    unwritten: int  # elements the reference writes that the GPU left as NaN
    clobbered: int  # elements the reference leaves alone that the GPU changed
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.rel_error < self.tolerance and not self.unwritten and not self.clobbered

    def describe(self) -> str:
        return (
            f"{self.tensor}: rel error {self.rel_error:.3e} (limit {self.tolerance:.0e}), "
            f"unwritten {self.unwritten}, clobbered {self.clobbered}: {'ok' if self.ok else 'FAIL'}"
        )


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


def _flat_buffer(spec, rt, t: Tensor, values: np.ndarray, fill: float) -> tuple[np.ndarray, DeviceBuffer]:
    off = element_offsets(spec, rt, t)
    n = max(int(off.max(initial=-1)) + 1, storage_elements(spec, rt, t))
    if t.layout.padded:
        fill = np.nan  # the padding of padded segments is never read: poison it
    flat = np.full(n, fill, dtype=np.float64)
    flat[off] = values
    host = flat.astype(NUMPY_TYPES[t.dtype])
    return host, DeviceBuffer.from_numpy(host.view(np.uint8) if host.size else np.zeros(16, np.uint8))


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
                 reference_memo: dict | None = None) -> RandomCall:
    """Random inputs quantized with the spec's scales, `=` outputs poisoned, one call,
    every output compared with the float64 reference (see the module's note).

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
    for name, (buf, host) in out_bufs.items():
        t = spec.tensor(name)
        flat = buf.to_numpy(host.shape, host.dtype).astype(np.float64)
        results[name] = flat[element_offsets(spec, rt, t)]
        if name in scale_bufs:
            sbuf, size, grid_off = scale_bufs[name]
            grid = sbuf.to_numpy((size,), np.float32).astype(np.float64) if size else np.zeros(0)
            results[t.scale.name] = grid[grid_off]
    if reference_memo is None:
        reference = run_direct(spec, rt, data, init)
    else:
        if "reference" not in reference_memo:
            reference_memo["reference"] = run_direct(spec, rt, data, init)
        reference = reference_memo["reference"]
    read = {r for g in spec.gemms for r in g.reads}
    as_written = {
        n: TensorData(results[n], results[spec.tensor(n).scale.name])
        for n in outputs
        if spec.tensor(n).dtype in FP8_TYPES and n in read
    }
    if as_written:
        # The FP8 outputs themselves against the reference; what reads them against the
        # reference run on them as the GPU wrote them.
        downstream = run_direct(spec, rt, data, init, given=as_written)
        kept = set(as_written) | {spec.tensor(n).scale.name for n in as_written}
        reference = {k: (reference[k] if k in kept else v) for k, v in downstream.items()}
    checks = []
    for name in sorted(outputs):
        t = spec.tensor(name)
        ref, got = reference[name], results[name]
        if t.dtype in FP8_TYPES:
            # Dequantized; an unwritten scale (NaN) makes its block's values unwritten too.
            ref = ref * expand_scales(spec, rt, t, reference[t.scale.name])
            got = got * expand_scales(spec, rt, t, results[t.scale.name])
        should = ~np.isnan(ref)
        unwritten = int(np.isnan(got[should]).sum())
        clobbered = int((~np.isnan(got[~should])).sum())
        num = np.linalg.norm(np.nan_to_num(got[should]) - ref[should])
        den = np.linalg.norm(ref[should]) or 1.0
        writer = next((g.a.tensor for g in spec.gemms if name in g.writes), None)
        a_t = spec.tensor(writer if writer is not None else t.row_pass.source)
        if t.dtype in FP8_TYPES:
            # The GPU's f32 result and the reference's float64 one round to the same FP8
            # values but for those within the f32 error of a rounding boundary (of bf16, then
            # of FP8): one FP8 step apart, an eighth to a sixteenth of the value. A few
            # percent of such steps stay well under this; a wrong scale or rounding does not.
            tol = 3e-2
        else:
            tol = 4e-3 if t.dtype in ("bf16", "f16") else (1e-3 if a_t.dtype in ("e4m3", "e5m2") else 1e-4)
        checks.append(OutputCheck(name, float(num / den), unwritten, clobbered, tol))
    report = RunReport(spec.name, dict(rt.dims), tuple(checks), 0.0, _useful_flops(spec, rt))
    return RandomCall(exe, report, args, tuple(keep))


def device_arguments(
    spec, rt: Runtime, data: dict, init: dict, scale_bufs: dict | None = None
) -> tuple[dict, list, dict]:
    """The arguments of a call on the device: the inputs of `data` with their scales, the
    outputs holding `init` (NaN where poisoned), and `rt`'s offsets and counts. Returns
    (arguments by name, the buffers to keep alive, {output: (buffer, host copy)}); an FP8
    output's scales are poisoned too, and given `scale_bufs`, recorded there as
    {output: (buffer, floats, grid offsets)}."""
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
            sbuf = DeviceBuffer.from_numpy(flat if flat.size else np.zeros(4, np.float32))
            keep.append(sbuf)
            shape = scale_grid_shape(spec, rt, t)
            strides = tuple(s.evaluate(rt.dims) for s in t.scale.layout.strides)
            args[t.scale.name] = sbuf.view(shape, "f32", strides)
    out_bufs = {}
    for name, v in init.items():
        t = spec.tensor(name)
        host, buf = _flat_buffer(spec, rt, t, v, np.nan)
        out_bufs[name] = (buf, host)
        args[name] = _shaped(buf, t, spec, rt)
        if t.dtype in FP8_TYPES:  # an FP8 output: its scales are written too, poisoned first
            grid_off = scale_offsets(spec, rt, t)
            flat = np.full(int(grid_off.max(initial=-1)) + 1, np.nan, dtype=np.float32)
            sbuf = DeviceBuffer.from_numpy(flat if flat.size else np.zeros(4, np.float32))
            keep.append(sbuf)
            if scale_bufs is not None:
                scale_bufs[name] = (sbuf, flat.size, grid_off)
            strides = tuple(s.evaluate(rt.dims) for s in t.scale.layout.strides)
            args[t.scale.name] = sbuf.view(scale_grid_shape(spec, rt, t), "f32", strides)
    for name, arr in rt.tensors.items():
        buf = DeviceBuffer.from_numpy(np.ascontiguousarray(arr, dtype=np.int32))
        keep.append(buf)
        args[name] = buf.view(arr.shape, "i32")
    return args, keep, out_bufs


def _shaped(buf: DeviceBuffer, t: Tensor, spec, rt):
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


__all__ = ["run_random", "check_random", "device_arguments", "RandomCall", "RunReport", "OutputCheck"]
