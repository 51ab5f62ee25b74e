"""Run-time data for the reference executors: segments, scales, storage.

Everything here follows the spec's *definitions* (what a ragged offsets tensor
means, where a scale block starts, how a layout places elements), written
independently of the lowering, so that the two executors can check each other.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from ..errors import ArgumentError
from ..spec import FP8_TYPES, INDEX_TYPE, MAX_EXTENT, Spec, Tensor

FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
NUMPY_TYPES = {
    "e4m3": ml_dtypes.float8_e4m3fn,
    "e5m2": ml_dtypes.float8_e5m2,
    "bf16": ml_dtypes.bfloat16,
    "f16": np.float16,
    "f32": np.float32,
    "i32": np.int32,
}


@dataclass
class Runtime:
    """Values known only at run time: dim sizes and offsets/counts tensors."""

    dims: dict[str, int]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass(frozen=True)
class Segment:
    chain: tuple[int, ...]  # indices of the group and its enclosing groups, outermost first
    start: int
    length: int


def dim_size(spec: Spec, rt: Runtime, name: str) -> int:
    d = spec.dim(name)
    return d.size if d.size is not None else int(rt.dims[name])


def segments(spec: Spec, rt: Runtime, group: str) -> list[Segment]:
    """The segments of a partitioning group in flat order (outer groups first)."""
    g = spec.group(group)
    if g.kind in ("split", "uniform"):
        return [Segment((i,), s, n) for i, (s, n) in enumerate(zip(g.starts, g.sizes))]
    assert g.kind == "ragged"
    off = np.asarray(rt.tensors[g.tensor], dtype=np.int64)
    out = []
    for outer in np.ndindex(*off.shape[:-1]):
        row = off[outer]
        for i in range(g.count):
            out.append(Segment((*outer, i), int(row[i]), int(row[i + 1] - row[i])))
    return out


def check_group_values(spec: Spec, rt: Runtime) -> None:
    """ValueError unless every offsets or counts tensor in `rt` holds what its group's
    definition asks: a ragged group's offsets shaped [outer counts..., G + 1], each row
    non-decreasing; the outermost row from 0 to the dim's size (at or below it for a
    capacity group), a nested row from its outer segment's start to its end; a masked
    group's counts shaped [G] and non-negative. Other values have no meaning: the
    executors would read them as some other segments, or fail inside numpy. As at run
    time, only the groups the spec reads are checked (a statement's, a layout's or a
    scale's, with the groups they nest in)."""
    for g in spec.read_groups:
        if g.tensor not in rt.tensors:
            continue
        values = np.asarray(rt.tensors[g.tensor])
        if g.kind == "masked":
            if values.shape != (g.count,):
                raise ValueError(f"counts '{g.tensor}' of '{g.name}' must have shape [{g.count}], got {list(values.shape)}")
            if (values < 0).any():
                at = int(np.flatnonzero(values < 0)[0])
                raise ValueError(f"counts '{g.tensor}' of '{g.name}' holds {values[at]} at {at}; counts are non-negative")
            continue
        outer = [spec.group(n).count for n in _ancestors(spec, g.name)]
        shape = (*outer, g.count + 1)
        if values.shape != shape:
            raise ValueError(f"offsets '{g.tensor}' of '{g.name}' must have shape {list(shape)}, got {list(values.shape)}")
        rows = values.astype(np.int64).reshape(-1, g.count + 1)
        steps = np.diff(rows, axis=1)
        if (steps < 0).any():
            r, i = (int(x[0]) for x in np.nonzero(steps < 0))
            where = f" in row {r}" if g.within is not None else ""
            raise ValueError(
                f"offsets '{g.tensor}' of '{g.name}' decrease{where}: entry {i} is {rows[r, i]}, entry "
                f"{i + 1} is {rows[r, i + 1]}; offsets are non-decreasing positions along {g.dim}"
            )
        if g.within is None:
            if spec.dim(g.dim).size is None and g.dim not in rt.dims:
                continue  # no size to end at: the executors need one anyway
            size = dim_size(spec, rt, g.dim)
            end = int(rows[0, -1])
            if rows[0, 0] != 0 or end > size or (end != size and not g.capacity):
                at = "at or below" if g.capacity else "at"
                raise ValueError(
                    f"offsets '{g.tensor}' of '{g.name}' must start at 0 and end {at} "
                    f"{g.dim} = {size}, got {rows[0, 0]}..{end}"
                )
            continue
        for r, seg in enumerate(segments(spec, rt, g.within)):
            if rows[r, 0] != seg.start or rows[r, -1] != seg.start + seg.length:
                raise ValueError(
                    f"offsets '{g.tensor}' of '{g.name}': row {r} runs {rows[r, 0]}..{rows[r, -1]}, "
                    f"but its '{g.within}' segment is {seg.start}..{seg.start + seg.length}; each row "
                    "spans its outer segment exactly"
                )


def membership(spec: Spec, rt: Runtime, group: str) -> np.ndarray:
    """For each position of the group's dim, its index within the group (-1: none)."""
    g = spec.group(group)
    gid = np.full(dim_size(spec, rt, g.dim), -1, dtype=np.int64)
    for seg in segments(spec, rt, group):
        gid[seg.start : seg.start + seg.length] = seg.chain[-1]
    return gid


# ---- scales -----------------------------------------------------------------------------


def block_index(spec: Spec, rt: Runtime, t: Tensor, axis: int) -> np.ndarray:
    """Scale-grid row of every position along one dim of `t`."""
    sc = t.scale
    assert sc is not None
    dim, b = t.dims[axis], sc.block[axis]
    n = dim_size(spec, rt, dim)
    if sc.whole(axis):
        return np.zeros(n, dtype=np.int64)  # one block over the whole (run-time) dim
    anchor = sc.anchor if sc.anchor and spec.group(sc.anchor).dim == dim else None
    if anchor is None:
        return np.arange(n) // b
    idx = np.full(n, -1, dtype=np.int64)
    base = 0
    for seg in segments(spec, rt, anchor):
        idx[seg.start : seg.start + seg.length] = base + np.arange(seg.length) // b
        base += -(-seg.length // b)
    return idx


def scale_grid_shape(spec: Spec, rt: Runtime, t: Tensor) -> tuple[int, ...]:
    """Blocks per dim; one along a whole run-time dim even when it is empty."""
    assert t.scale is not None
    return tuple(
        1 if t.scale.whole(a) else int(block_index(spec, rt, t, a).max(initial=-1)) + 1
        for a in range(t.rank)
    )


def expand_scales(spec: Spec, rt: Runtime, t: Tensor, grid: np.ndarray) -> np.ndarray:
    """Per-element scale of `t` (logical shape) from its scale grid."""
    out = grid.astype(np.float64)
    for axis in range(t.rank):
        out = np.take(out, block_index(spec, rt, t, axis), axis=axis)
    return out


def quantize(values: np.ndarray, dtype: str) -> np.ndarray:
    """Round to `dtype` and return the rounded values as float64. A value past the type's
    range becomes non-finite (an infinity; NaN in e4m3, which has none) without a warning:
    the checks count non-finite values themselves."""
    with np.errstate(over="ignore"):
        return values.astype(NUMPY_TYPES[dtype]).astype(np.float64)


def quantize_real_values(spec: Spec, rt: Runtime, real: np.ndarray, target: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Real (float64) values quantized with `target`'s scale blocks: (fp8 values, scale
    grid), the scales amax / FP8 max in float64. For making FP8 test data from real values;
    not what any kernel computes (requantize(SOURCE) is `requantize_values`)."""
    sc = target.scale
    assert sc is not None
    shape = scale_grid_shape(spec, rt, target)
    amax = np.zeros(shape)
    idx = np.ix_(*[block_index(spec, rt, target, a) for a in range(target.rank)])
    np.maximum.at(amax, idx, np.abs(real))
    grid = (amax / FP8_MAX[target.dtype]).astype(np.float32)
    grid = np.where(grid > 0, grid, np.float32(1))  # all zeros, or a quotient under float32's range
    q = quantize(real / expand_scales(spec, rt, target, grid), target.dtype)
    return q, grid


def requantize_rows_values(
    spec: Spec,
    rt: Runtime,
    source: Tensor,
    data: TensorData,
    target: Tensor,
    index: np.ndarray | None,
    weight: np.ndarray | None,
) -> tuple[np.ndarray, np.ndarray]:
    """requantize(SOURCE, rows = IDX, weight = W) (docs/language.md, section 7): row t of the
    target is W[t] times row IDX[t] of the dequantized source (a zero row for an entry
    outside the source's rows), quantized with the target's blocks: (fp8 values, scale
    grid). Float32 throughout, as the kernel computes it: the row's scale times W[t], the
    FP8 value times that, amax per block (NaN ignored), scale = amax / FP8 max (1 where
    that is 0: `divided_scales`), value / scale rounded to nearest even and saturated to the finite
    range. Either keyword may be missing (the rows in order, a weight of 1)."""
    assert source.scale is not None and data.scale_grid is not None and target.scale is not None
    rows = dim_size(spec, rt, target.dims[0])
    picked = np.arange(rows) if index is None else np.asarray(index).astype(np.int64)
    inside = (picked >= 0) & (picked < data.values.shape[0])
    at = np.where(inside, picked, 0)
    # Exact in float32: FP8 values and f32 scales.
    q_src = np.asarray(data.values, dtype=np.float32)[at]
    sx = expand_scales(spec, rt, source, data.scale_grid).astype(np.float32)[at]
    if weight is not None:
        sx = sx * np.asarray(weight, dtype=np.float32)[:, None]
    real = np.where(inside[:, None], q_src * sx, np.float32(0)).astype(np.float32)
    fp8_max = np.float32(FP8_MAX[target.dtype])
    blocks = [block_index(spec, rt, target, a) for a in range(target.rank)]
    amax = np.zeros(scale_grid_shape(spec, rt, target), dtype=np.float32)
    np.fmax.at(amax, np.ix_(*blocks), np.abs(real))
    with np.errstate(invalid="ignore", divide="ignore"):
        grid = divided_scales(amax, target.dtype)
        ratio = np.clip(real / grid[np.ix_(*blocks)], -fp8_max, fp8_max)
    return ratio.astype(NUMPY_TYPES[target.dtype]).astype(np.float64), grid


def requantize_values(
    spec: Spec, rt: Runtime, source: Tensor, data: TensorData, target: Tensor
) -> tuple[np.ndarray, np.ndarray]:
    """requantize(SOURCE) (docs/language.md, section 7), as the requantize kernel computes
    it in float32: each FP8 value times its scale, amax per target block, scale = amax /
    FP8 max (1 where that is 0), (value x scale) / scale rounded to nearest even and
    saturated to the finite range: requantize with its rows in order and no weight."""
    return requantize_rows_values(spec, rt, source, data, target, None, None)


def divided_scales(amax: np.ndarray, dtype: str) -> np.ndarray:
    """quantize(SOURCE)'s scale of each block (float32): amax / FP8 max by true division,
    or 1 where that is 0: an all-zero block, or one whose amax is so small (a float32
    subnormal) that the quotient underflows, whose zeros would otherwise become 0 / 0."""
    quotient = np.asarray(amax, dtype=np.float32) / np.float32(FP8_MAX[dtype])
    return np.where(quotient > 0, quotient, np.float32(1)).astype(np.float32)


def pow2_scales(amax: np.ndarray, dtype: str) -> np.ndarray:
    """quantize(SOURCE, pow2)'s scale of each block (float32): the least power of two
    2^e with e >= -127 (UE8M0's range) and amax <= FP8 max * 2^e, exactly: with
    amax = m * 2^E (frexp, m in [0.5, 1)) and FP8 max = 0.875 * 2^F, e = E - F, plus 1
    when m > 0.875. 1 for an all-zero block, +inf for an infinite amax."""
    amax = np.asarray(amax, dtype=np.float32)
    f = np.frexp(np.float32(FP8_MAX[dtype]))[1]
    m, e = np.frexp(amax)
    e = np.maximum(e - f + (m > np.float32(0.875)), -127)
    scale = np.ldexp(np.float32(1), e).astype(np.float32)  # exact: 2^-127 is a subnormal
    scale = np.where(np.isinf(amax), amax, scale)
    return np.where(amax > 0, scale, np.float32(1)).astype(np.float32)


def quantize_values(spec: Spec, rt: Runtime, real: np.ndarray, target: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """quantize(SOURCE) of unscaled values (docs/language.md, section 7): (fp8 values,
    scale grid). Float32 throughout, as the kernel computes it: amax per block
    (NaN ignored), scale = amax / FP8 max by true division (`divided_scales`) or,
    with pow2, the power of two of `pow2_scales`, then x / scale rounded to nearest even,
    saturated to the finite range."""
    sc = target.scale
    assert sc is not None
    x = np.asarray(real, dtype=np.float32)  # exact: the source holds bf16/f16/f32 values
    fp8_max = np.float32(FP8_MAX[target.dtype])
    blocks = [block_index(spec, rt, target, a) for a in range(target.rank)]
    amax = np.zeros(scale_grid_shape(spec, rt, target), dtype=np.float32)
    np.fmax.at(amax, np.ix_(*blocks), np.abs(x))
    with np.errstate(invalid="ignore"):
        if _pow2(target):
            grid = pow2_scales(amax, target.dtype)
        else:
            grid = divided_scales(amax, target.dtype)
        scale = grid[np.ix_(*blocks)]
        with np.errstate(divide="ignore"):
            ratio = np.clip(x / scale, -fp8_max, fp8_max)  # NaN stays NaN
    return ratio.astype(NUMPY_TYPES[target.dtype]).astype(np.float64), grid


def swiglu_grad_values(
    spec: Spec, rt: Runtime, target: Tensor, gu: np.ndarray, gu_type: str, dh: np.ndarray, dh_type: str
) -> tuple[np.ndarray, np.ndarray]:
    """swiglu_grad(GU, DH) (docs/language.md): with g = GU[:, 2j], u = GU[:, 2j + 1],
    d = DH[:, j] as stored (rounded to their types) and s = sigmoid(g), column 2j is
    d * u * s * (1 + g * (1 - s)) (the gate's gradient) and column 2j + 1 is d * g * s (the
    up's), computed in float64 here (the kernel: float32), rounded to bf16, then quantized
    as quantize(...) does into the target's [1, 128] blocks."""
    x, d = quantize(np.asarray(gu), gu_type), quantize(np.asarray(dh), dh_type)
    g, u = x[:, 0::2], x[:, 1::2]
    with np.errstate(over="ignore"):
        s = 1.0 / (1.0 + np.exp(-g))
    out = np.empty_like(x)
    out[:, 0::2] = d * u * s * (1.0 + g * (1.0 - s))
    out[:, 1::2] = d * g * s
    return quantize_values(spec, rt, quantize(out, "bf16"), target)


def _pow2(t: Tensor) -> bool:
    """Whether `t`'s scales are powers of two: quantize(SOURCE, pow2), or an FP8 output
    declared `scale f32 [...] pow2`."""
    return (t.derived is not None and t.derived.pow2) or (t.scale is not None and t.scale.pow2)


def fp8_output_values(spec: Spec, rt: Runtime, result: np.ndarray, target: Tensor) -> tuple[np.ndarray, np.ndarray]:
    """An FP8 output's stored values and scale grid (docs/language.md, FP8 outputs): the
    statement's result rounded to bf16 (as a bf16 output stores it), then quantized as
    quantize(SOURCE) does with the output's [1, ..., 1, 128] blocks."""
    return quantize_values(spec, rt, quantize(result, "bf16"), target)


def quantize_rows(values: np.ndarray, dtype: str, pow2: bool = False, block: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """`values` [rows, cols] as an FP8 output's leaf stores it: rounded to bf16, then per
    row and `block` columns amax (NaN ignored), the scale (amax / FP8 max, or a power of
    two; 1 for an all-zero block or a quotient of 0) and fp8(value / scale), all in
    float32. The last block may be short (a copy's [128, 1] blocks along a segment).
    Returns (fp8 values as float64, scales [rows, ceil(cols / block)])."""
    rows, cols = values.shape
    whole = -(-cols // block) * block
    x = quantize(values, "bf16").astype(np.float32)
    if whole != cols:  # NaN fill: ignored by the amax, cut off below
        x = np.concatenate([x, np.full((rows, whole - cols), np.nan, np.float32)], axis=1)
    x = x.reshape(rows, whole // block, block)
    fp8_max = np.float32(FP8_MAX[dtype])
    amax = np.fmax.reduce(np.abs(x), axis=2, initial=np.float32(0))  # fmax: NaN ignored
    with np.errstate(invalid="ignore", divide="ignore"):
        scales = pow2_scales(amax, dtype) if pow2 else divided_scales(amax, dtype)
        scales = scales.astype(np.float32)
        ratio = np.clip(x / scales[:, :, None], -fp8_max, fp8_max)
    q = ratio.astype(NUMPY_TYPES[dtype]).astype(np.float64).reshape(rows, whole)[:, :cols]
    return q, scales


# ---- storage ------------------------------------------------------------------------------


def element_offsets(spec: Spec, rt: Runtime, t: Tensor) -> np.ndarray:
    """Offset in elements of every logical element of `t` (its layout's definition); -1
    for an element a segment_major layout does not store (a row past a capacity group's
    end, in no segment)."""
    shape = tuple(dim_size(spec, rt, d) for d in t.dims)
    lay = t.layout
    env = dict(rt.dims)
    if lay.kind == "strided":
        off = np.zeros(shape, dtype=np.int64)
        for axis, s in enumerate(lay.strides):
            ix = np.arange(shape[axis]).reshape([-1 if a == axis else 1 for a in range(len(shape))])
            off = off + ix * s.evaluate(env)
        return off
    axis = lay.seg_axis
    others = [a for a in range(t.rank) if a != axis]
    inner = int(np.prod([shape[a] for a in others]))
    off = np.full(shape, -1, dtype=np.int64)
    other_pos = np.zeros([shape[a] for a in others], dtype=np.int64)
    for j, a in enumerate(others):
        ix = np.arange(shape[a]).reshape([-1 if b == j else 1 for b in range(len(others))])
        other_pos = other_pos + ix * lay.other_strides[j].evaluate(env)
    first = 0  # the segment's first storage row: its start, or with padding the padded prefix
    for seg in segments(spec, rt, lay.group):
        pitch = -(-seg.length // lay.pad) * lay.pad  # rows of the block, padding included
        if lay.pad == 1:
            first = seg.start
        for i in range(seg.length):
            sl = [slice(None)] * t.rank
            sl[axis] = seg.start + i
            off[tuple(sl)] = first * inner + other_pos * pitch + i
        first += pitch
    return off


def storage_elements(spec: Spec, rt: Runtime, t: Tensor) -> int:
    """Elements the buffer of `t` holds as a caller allocates it: the elements of its
    storage shape (a padded segment_major layout's extra rows included), or for a strided
    layout the farthest element it reaches plus one."""
    shape = tuple(dim_size(spec, rt, d) for d in t.dims)
    if t.layout.kind != "strided":
        return int(np.prod(t.layout.storage_shape(shape), dtype=np.int64))
    return int(element_offsets(spec, rt, t).max(initial=-1)) + 1


def pack(offsets: np.ndarray, values: np.ndarray, fill: float = np.nan) -> np.ndarray:
    """`values` in a flat buffer at `offsets` (`fill` elsewhere); elements at offset -1 have
    no storage and are left out."""
    flat = np.full(int(offsets.max(initial=-1)) + 1, fill, dtype=np.float64)
    stored = offsets >= 0
    flat[offsets[stored]] = np.broadcast_to(values, offsets.shape)[stored]
    return flat


def unpack(flat: np.ndarray, offsets: np.ndarray, outside: np.ndarray | float = np.nan) -> np.ndarray:
    """The values at `offsets` of a flat buffer; `outside` where an element has no storage
    (offset -1)."""
    stored = offsets >= 0
    # An empty buffer stores nothing: every offset is -1 there.
    values = flat[np.where(stored, offsets, 0)] if flat.size else np.zeros(offsets.shape)
    return np.where(stored, values, outside)


def scale_offsets(spec: Spec, rt: Runtime, t: Tensor) -> np.ndarray:
    sc = t.scale
    assert sc is not None
    shape = scale_grid_shape(spec, rt, t)
    env = dict(rt.dims)
    off = np.zeros(shape, dtype=np.int64)
    for axis, s in enumerate(sc.layout.strides):
        ix = np.arange(shape[axis]).reshape([-1 if a == axis else 1 for a in range(len(shape))])
        off = off + ix * s.evaluate(env)
    return off


# ---- random problems ------------------------------------------------------------------------


def check_run_dims(spec: Spec, dims: Mapping[str, int]) -> None:
    """Raise ArgumentError unless every entry of `dims` names a run-time dim of `spec` and
    sizes it with an integer from 0 to 2^31 - 1 (the kernels index rows, columns and K
    with 32-bit integers). A dim the spec fixes takes no size at run time."""
    by_name = {d.name: d for d in spec.dims}
    runtime = ", ".join(spec.runtime_dims) or "none"
    for name, size in dims.items():
        dim = by_name.get(name)
        if dim is None:
            raise ArgumentError(f"spec '{spec.name}' has no dim '{name}' (its run-time dims: {runtime})")
        if dim.size is not None:
            raise ArgumentError(
                f"dim '{name}' of spec '{spec.name}' is fixed at {dim.size} by the spec, so it takes "
                f"no size at run time (its run-time dims: {runtime})"
            )
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
            raise ArgumentError(f"dim '{name}' must be an integer, got {size!r}")
        if not 0 <= size <= MAX_EXTENT:
            raise ArgumentError(
                f"dim '{name}' is {size}: expected 0 to {MAX_EXTENT} (2^31 - 1; the kernels index "
                "with 32-bit integers)"
            )


def random_runtime(spec: Spec, rng: np.random.Generator, lengths: dict[str, list[int]] | None = None, dims: dict[str, int] | None = None) -> Runtime:
    """Offsets and counts for every run-time group, with optional explicit lengths.

    `lengths[group]` gives the segment lengths in flat order; otherwise they are
    drawn at random (zero-length segments included). `dims` sizes run-time dims only
    (see `check_run_dims`); a ragged group over a fixed dim ends at its size, and the
    returned `Runtime.dims` holds run-time dims only.
    """
    lengths = dict(lengths or {})
    rt_dims = dict(dims or {})
    check_run_dims(spec, rt_dims)
    rt = Runtime(rt_dims)
    for g in spec.groups:
        if g.kind == "masked":
            bound = spec.dim(g.dim).size
            rt.tensors[g.tensor] = rng.integers(0, bound + 1, size=g.count).astype(np.int32)
            if g.name in lengths:
                rt.tensors[g.tensor] = np.asarray(lengths[g.name], dtype=np.int32)
            continue
        if g.kind != "ragged":
            continue
        if g.within is None:
            fixed = spec.dim(g.dim).size
            lens = lengths.get(g.name)
            if lens is None:
                total = fixed if fixed is not None else rt_dims.get(g.dim, int(rng.integers(0, 300)))
                lens = _random_split(rng, total, g.count)
            off = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
            if int(off[-1]) > MAX_EXTENT:  # the offsets are int32
                raise ArgumentError(f"lengths of {g.name} add up to {off[-1]}, more than {MAX_EXTENT} (2^31 - 1)")
            size = fixed if fixed is not None else rt_dims.setdefault(g.dim, int(off[-1]))
            # A capacity group's offsets may end below the dim; any other ends at it.
            if int(off[-1]) > size or (int(off[-1]) != size and not g.capacity):
                raise ArgumentError(f"lengths of {g.name} add up to {off[-1]}, not {g.dim}={size}")
            rt.tensors[g.tensor] = off.astype(np.int32)
        else:
            outer = segments(spec, rt, g.within)
            flat = lengths.get(g.name)
            rows = []
            for j, seg in enumerate(outer):
                lens = flat[j * g.count : (j + 1) * g.count] if flat else _random_split(rng, seg.length, g.count)
                rows.append(seg.start + np.concatenate([[0], np.cumsum(lens)]))
            outer_shape = tuple(spec.group(n).count for n in _ancestors(spec, g.name))
            rt.tensors[g.tensor] = np.asarray(rows, dtype=np.int32).reshape(*outer_shape, g.count + 1)
    # A dim whose rows are picked through an index tensor gets at least as many rows as
    # the index has entries (room for distinct indices), once those are known.
    gathered = {
        spec.tensor(acc.tensor).dims[acc.axis_of_role("m")]: spec.tensor(name).dims[0]
        for g in spec.gemms
        for acc, name in ((g.a, g.gather), (g.out, g.scatter))
        if name
    }
    for d in spec.dims:
        if d.size is None and d.name not in rt_dims and d.name not in gathered:
            rt_dims[d.name] = int(rng.integers(1, 300))
    for d, rows in gathered.items():
        if spec.dim(d).size is None and d not in rt_dims:
            rt_dims[d] = dim_size(spec, rt, rows) + int(rng.integers(0, 64))
    return rt


def _ancestors(spec: Spec, group: str) -> list[str]:
    """The groups enclosing `group`, outermost first."""
    return [g.name for g in reversed(spec.enclosing(group)[1:])]


def _random_split(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    cuts = np.sort(rng.integers(0, total + 1, size=parts - 1))
    edges = np.concatenate([[0], cuts, [total]])
    return [int(x) for x in np.diff(edges)]


@dataclass
class TensorData:
    """A tensor's stored values (already rounded to its type) and scale grid."""

    values: np.ndarray  # logical shape, float64 of the stored element values
    scale_grid: np.ndarray | None = None


def random_inputs(spec: Spec, rt: Runtime, rng: np.random.Generator) -> dict[str, TensorData]:
    """Random data for every tensor that no statement or row pass writes and no pass derives."""
    written = set(spec.written)
    # FP8 operands at half their range overflow an f16 output (max 65504) by orders of
    # magnitude; their scales are drawn smaller so the products stay in its range.
    feeds_f16 = {
        o.tensor for g in spec.gemms if spec.tensor(g.out.tensor).dtype == "f16" for o in (g.a, g.b)
    }
    data: dict[str, TensorData] = {}
    for t in spec.tensors:
        if t.derived is not None:
            continue
        if t.dtype == INDEX_TYPE:
            data[t.name] = TensorData(random_index(spec, rt, rng, t.name).astype(np.float64))
            continue
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        if t.name in written:
            if any(g.accumulate for g in spec.gemms if g.out.tensor == t.name):
                data[t.name] = TensorData(quantize(rng.standard_normal(shape), t.dtype))
            continue
        if t.dtype in FP8_TYPES and t.scale is None:  # no statement reads it: its codes alone
            data[t.name] = TensorData(quantize(rng.uniform(-FP8_MAX[t.dtype], FP8_MAX[t.dtype], size=shape), t.dtype))
        elif t.dtype in FP8_TYPES:
            low, high = (-11, -7) if t.name in feeds_f16 else (-4, 2)
            grid = (2.0 ** rng.uniform(low, high, size=scale_grid_shape(spec, rt, t))).astype(np.float32)
            q = quantize(rng.uniform(-FP8_MAX[t.dtype], FP8_MAX[t.dtype], size=shape) * 0.5, t.dtype)
            data[t.name] = TensorData(q, grid)
        else:
            data[t.name] = TensorData(quantize(rng.standard_normal(shape), t.dtype))
    return data


# ---- index tensors ----------------------------------------------------------------------------


def index_uses(spec: Spec, name: str) -> list[tuple[str, str, str]]:
    """Where index tensor `name` picks rows: (statement's tensor, "gather" or "scatter", the
    dim whose rows it numbers) per use."""
    uses = []
    for g in spec.gemms:
        for acc, via, kind in ((g.a, g.gather, "gather"), (g.out, g.scatter, "scatter")):
            if via == name:
                axis = acc.axis_of_role("m")
                uses.append((acc.tensor, kind, spec.tensor(acc.tensor).dims[axis]))
    for t in spec.tensors:  # requantize(SOURCE, rows = name): rows of SOURCE, repeats allowed
        if t.derived is not None and t.derived.op == "requantize" and t.derived.index == name:
            uses.append((t.derived.source, "gather", spec.tensor(t.derived.source).dims[0]))
        # scatter_add(SOURCE, rows = name): rows of the target, repeats added (so a "gather" here)
        if t.row_pass is not None and t.row_pass.index == name:
            uses.append((t.name, "gather", t.dims[0]))
    return uses


def index_bound(spec: Spec, rt: Runtime, name: str) -> int | None:
    """The rows every use of index tensor `name` can address: [0, bound)."""
    sizes = [dim_size(spec, rt, d) for _, _, d in index_uses(spec, name)]
    return min(sizes) if sizes else None


def random_index(spec: Spec, rt: Runtime, rng: np.random.Generator, name: str) -> np.ndarray:
    """Valid random values of index tensor `name`: distinct rows in a random order (a random
    permutation when it has as many entries as rows), or, for a gather with more entries
    than rows, random rows with repeats (a scatter needs distinct rows)."""
    rows = dim_size(spec, rt, spec.tensor(name).dims[0])
    bound = index_bound(spec, rt, name)
    if bound is None:
        return np.zeros(rows, dtype=np.int64)
    if rows <= bound:
        return rng.permutation(bound)[:rows]
    if any(kind == "scatter" for _, kind, _ in index_uses(spec, name)):
        raise ValueError(
            f"'{name}' has {rows} entries but scatters into {bound} rows: distinct indices need "
            "at least as many rows"
        )
    return rng.integers(0, bound, size=rows)


def rows_through(data: dict[str, TensorData], name: str, rows: np.ndarray, bound: int, tensor: str) -> np.ndarray:
    """Rows `rows` of a statement as rows of `tensor`, read through index tensor `name`;
    ValueError for an index outside [0, bound)."""
    picked = np.asarray(data[name].values).astype(np.int64)[rows]
    bad = (picked < 0) | (picked >= bound)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"index tensor '{name}' holds {picked[at]} at row {rows[at]}, outside the {bound} "
            f"rows of '{tensor}'"
        )
    return picked


def gathered_rows(index: np.ndarray, values: np.ndarray, grid: np.ndarray | None) -> tuple[np.ndarray, np.ndarray | None]:
    """The gather pre-pass: row t is row index[t] of `values` (of its [1, 128] scale grid
    too); an entry outside the rows gives a zero row, its scales 1."""
    picked = np.asarray(index).astype(np.int64)
    inside = (picked >= 0) & (picked < values.shape[0])
    rows = np.where(inside, picked, 0)
    q = np.where(inside[:, None], values[rows], 0)
    g = None if grid is None else np.where(inside[:, None], grid[rows], 1.0)
    return q, g


def real_values(spec: Spec, rt: Runtime, t: Tensor, d: TensorData) -> np.ndarray:
    if d.scale_grid is None:
        return d.values
    return d.values * expand_scales(spec, rt, t, d.scale_grid)


def scatter_add_values(a: np.ndarray, index: np.ndarray, rows: int, dtype=np.float64) -> np.ndarray:
    """out[s] = sum over the t with index[t] == s of a[t], the terms added in ascending t in
    `dtype` (float32 models the kernel's sums bit for bit); a row no t names is zero, an
    entry outside [0, rows) adds nothing."""
    picked = np.asarray(index).astype(np.int64).reshape(-1)
    a = np.asarray(a, dtype=dtype)  # [T, C]
    out = np.zeros((rows, a.shape[1]), dtype=dtype)
    inside = (picked >= 0) & (picked < rows)
    np.add.at(out, picked[inside], a[inside])  # unbuffered, in the order of the entries
    return out


def row_pass_values(spec: Spec, rt: Runtime, t: Tensor, data: dict[str, TensorData]) -> np.ndarray:
    """The target of a row pass (float64): rowdot(A, B)[r] = sum over c of A[r, c] * B[r, c]
    (B dequantized with its [1, 128] scales), rowscale(A, weight = W)[r, c] = W[r] * A[r, c],
    scatter_add(A, rows = IDX)[s, c] = sum over the t with IDX[t] == s of A[t, c] (zero
    where no t names s; an entry outside the target's rows adds nothing). An unscaled
    operand is read as stored, rounded to its type (a statement's bf16 output holds its
    result rounded); the kernels sum in float32 (rowdot; scatter_add in ascending t) and
    round the product once (rowscale)."""
    rp = t.row_pass

    def read(name: str) -> np.ndarray:
        x = spec.tensor(name)
        values = real_values(spec, rt, x, data[name])
        return values if x.scale is not None else quantize(values, x.dtype)

    a = read(rp.source)
    if rp.op == "rowdot":
        return (a * read(rp.other)).sum(axis=1)
    if rp.op == "scatter_add":
        return scatter_add_values(a, data[rp.index].values, dim_size(spec, rt, t.dims[0]))
    w = np.asarray(data[rp.weight].values, dtype=np.float64)
    return w[:, None] * a
