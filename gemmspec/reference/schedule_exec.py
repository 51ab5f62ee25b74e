"""Execute a flat grouped schedule on flat memory, the way the GPU does.

Tensors live in flat float64 buffers laid out by their declared layouts. For
every launch, leaf by leaf in leaf order, the per-leaf symbols are computed from
the run-time offsets tensors (as the device-side table builder does), each
operand is gathered through its offset/stride polynomials (rows read through an
index tensor take their numbers from it, as the kernels do), the product is
formed one 128-wide K block at a time with that block's scales, and D is stored
or accumulated through its own polynomial (and index tensor); an FP8 D is quantized
per row and 128 columns of the leaf first, its scales stored through their own.
"""

from __future__ import annotations

import numpy as np

from ..lower.schedule import (
    COPY_BLOCK_START,
    Extent,
    IndexMap,
    Launch,
    OperandMap,
    PostPass,
    PrePass,
    ProblemGenerator,
    ScaleMap,
    Schedule,
    SegmentPad,
)
from ..spec import Spec
from .data import (
    Runtime,
    TensorData,
    check_group_values,
    element_offsets,
    gathered_rows,
    pack,
    quantize,
    quantize_rows,
    quantize_values,
    requantize_rows_values,
    requantize_values,
    row_pass_values,
    scale_offsets,
    segments,
    swiglu_grad_values,
    unpack,
)
from .direct import chain_names, fp8_outputs, silu, swiglu_pairs

K_BLOCK = 128


def _segment_of(spec: Spec, rt: Runtime, ext: Extent, idx: dict[str, int]) -> tuple[int, int]:
    """(start, length) of a leaf along one role."""
    if ext.kind == "fixed":
        return 0, ext.size.evaluate(rt.dims)
    if ext.kind == "masked":
        count = int(rt.tensors[ext.tensor][idx[ext.group]])
        return 0, max(0, min(count, ext.size.evaluate(rt.dims)))
    if ext.group_kind == "ragged":
        off = np.asarray(rt.tensors[ext.tensor])
        row = off[tuple(idx[a] for a in ext.index_axes[:-1])]
        g = idx[ext.index_axes[-1]]
        return int(row[g]), int(row[g + 1] - row[g])
    g = idx[ext.group]
    return ext.starts[g], ext.sizes[g]


def _anchored_block_start(spec: Spec, rt: Runtime, group: str, idx: dict[str, int], block: int) -> int:
    """Scale blocks of all segments before this leaf's: sum of ceil(len / block)."""
    want = tuple(idx[n] for n in chain_names(spec, group))
    total = 0
    for seg in segments(spec, rt, group):
        if seg.chain == want:
            return total
        total += -(-seg.length // block)
    raise AssertionError("segment not found")


def _padded_start(spec: Spec, rt: Runtime, ext: Extent, idx: dict[str, int], pad: SegmentPad) -> int:
    """First storage row of the leaf's segment in a padded segment_major layout: the sum
    of round_up(len, P) over the segments before it (flat order), kept, as the table
    builder keeps it, so that the block ends inside the storage's rows."""
    want = tuple(idx[n] for n in chain_names(spec, ext.group))
    total, pitch = 0, None
    for seg in segments(spec, rt, ext.group):
        if seg.chain == want:
            pitch = -(-seg.length // pad.pad) * pad.pad
            break
        total += -(-seg.length // pad.pad) * pad.pad
    assert pitch is not None, "segment not found"
    return min(total, ext.size.evaluate(rt.dims) + pad.extra_rows - pitch)


def leaf_symbols(spec: Spec, rt: Runtime, pg: ProblemGenerator, leaf: int) -> dict[str, int]:
    """Every per-leaf symbol of the problem generator, for leaf number `leaf`."""
    idx = pg.leaf_indices(leaf)
    env: dict[str, int] = dict(rt.dims)
    for name, i in idx.items():
        env[f"g.{name}"] = i
    for ext in pg.extents:
        start, length = _segment_of(spec, rt, ext, idx)
        env[f"start.{ext.role}"], env[f"len.{ext.role}"] = start, length
    for sm in pg.scale_maps:
        for role, block, anchor in zip(sm.roles, sm.block, sm.anchors):
            if sm.rows is not None and role == sm.roles[0]:
                continue  # gathered rows find their scale blocks through the index
            if anchor is not None:
                env[f"bstart.{role}"] = _anchored_block_start(spec, rt, anchor, idx, block)
            else:
                # The checker guarantees aligned blocks, or one block over the whole dim.
                start = env[f"start.{role}"]
                assert start % block == 0 or start + env[f"len.{role}"] <= block, "straddling blocks"
                env[f"bstart.{role}"] = start // block
    if pg.sc is not None:
        # A copy's [128, 1] blocks restart at every segment of the row group.
        env[f"{COPY_BLOCK_START}.m"] = _anchored_block_start(spec, rt, pg.sc.anchors[0], idx, pg.sc.block[0])
    for pad in pg.pads:
        length = env[f"len.{pad.role}"]
        env[pad.length] = -(-length // pad.pad) * pad.pad
        env[pad.start] = _padded_start(spec, rt, pg.extent(pad.role), idx, pad)
    return env


def _gather(flat: np.ndarray, op: OperandMap | ScaleMap, env: dict[str, int], rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
    base = op.offset.evaluate(env)
    s0, s1 = (s.evaluate(env) for s in op.strides)
    return flat[base + rows[:, None] * s0 + cols[None, :] * s1]


def _picked(flat: dict[str, np.ndarray], rows: IndexMap | None, env: dict[str, int], rm: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The operand rows a leaf's rows `rm` stand for, and which of them exist: read from
    the index tensor as the kernels read it (a value outside [0, bound) is skipped: read
    as zeros, not stored), or the rows themselves."""
    if rows is None:
        return rm, np.ones(len(rm), dtype=bool)
    picked = flat[rows.tensor][rows.offset.evaluate(env) + rm].astype(np.int64)
    ok = (picked >= 0) & (picked < rows.bound.evaluate(env))
    return np.where(ok, picked, 0), ok


class _Halves:
    """A SwiGLU tile's columns as the kernel holds them when gate and up rows are not
    interleaved: tile t's column t*TN + o is weight row t*TN/2 + o % (TN/2), from the gate
    weight for o < TN/2 and from the up weight after; rows past the weight's (D's
    columns, n/2) load as zeros, as TMA fills them. Whole tiles, as the kernel computes
    them: the last tile's up half may lie past the leaf's n columns."""

    def __init__(self, tile_n: int, n: int):
        self.half = tile_n // 2
        cols = np.arange(-(-n // tile_n) * tile_n)
        o = cols % tile_n
        self.up = o >= self.half
        rows = (cols // tile_n) * self.half + o % self.half
        self.exists = rows < n // 2
        self.rows = np.where(self.exists, rows, 0)

    def pick(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """Per column, the gate's or the up weight's row (zeros past the weight)."""
        return np.where(self.up[:, None], up, gate) * self.exists[:, None]

    def pair(self, acc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """silu(gate column c) * up column c + TN/2, as D's column (the weight row)."""
        gate = np.flatnonzero(~self.up & self.exists)
        return silu(acc[:, gate]) * acc[:, gate + self.half], self.rows[gate]


def run_launch(spec: Spec, rt: Runtime, launch: Launch, flat: dict[str, np.ndarray]) -> None:
    pg = launch.problems
    sig = launch.signature
    for leaf in range(pg.leaf_count):
        env = leaf_symbols(spec, rt, pg, leaf)
        m, n, k = env["len.m"], env["len.n"], env["len.k"]
        if m == 0 or n == 0:
            continue
        rm, rn = np.arange(m), np.arange(n)
        a_rows, a_ok = _picked(flat, pg.a.rows, env, rm)
        d_rows, d_ok = _picked(flat, pg.d.rows, env, rm)
        halves = _Halves(sig.tile_n, n) if sig.swiglu_halves else None
        acc = np.zeros((m, n if halves is None else len(halves.rows)))
        for k0 in range(0, k, K_BLOCK):
            rk = np.arange(k0, min(k, k0 + K_BLOCK))
            a = _gather(flat[pg.a.tensor], pg.a, env, a_rows, rk) * a_ok[:, None]
            if halves is None:
                b = _gather(flat[pg.b.tensor], pg.b, env, rn, rk)
            else:
                b = halves.pick(_gather(flat[pg.b.tensor], pg.b, env, halves.rows, rk),
                                _gather(flat[pg.u.tensor], pg.u, env, halves.rows, rk))
            part = a @ b.T
            if sig.scaled:
                sa = _gather(flat[pg.sa.tensor], pg.sa, env, a_rows // pg.sa.block[0], np.array([k0 // pg.sa.block[1]]))
                kb = np.array([k0 // pg.sb.block[1]])
                if halves is None:
                    sb = _gather(flat[pg.sb.tensor], pg.sb, env, rn // pg.sb.block[0], kb)
                else:
                    sb = halves.pick(_gather(flat[pg.sb.tensor], pg.sb, env, halves.rows // pg.sb.block[0], kb),
                                     _gather(flat[pg.su.tensor], pg.su, env, halves.rows // pg.su.block[0], kb))
                part = part * sa * sb.T
            acc += part
        if halves is not None:
            acc, rn = halves.pair(acc)
        elif sig.swiglu:
            # Gate column 2j and up column 2j + 1 become D's column j (N is even).
            acc, rn = swiglu_pairs(acc, rn)
        for e in pg.epilogue:
            # The kernel's order: the f32 accumulator times the scalar and the row weight,
            # plus the bias, before the conversion to D's type.
            base = e.offset.evaluate(env)
            if e.kind == "alpha":
                acc = acc * flat[e.tensor][base]
            elif e.kind == "row":
                acc = acc * flat[e.tensor][base + rm * e.stride.evaluate(env)][:, None]
            else:
                acc = acc + flat[e.tensor][base + rn * e.stride.evaluate(env)][None, :]
        d_off = pg.d.offset.evaluate(env)
        ds0, ds1 = (s.evaluate(env) for s in pg.d.strides)
        where = (d_off + d_rows[:, None] * ds0 + rn[None, :] * ds1)[d_ok]
        result = acc  # the f32 result after the epilogue, before any quantization
        if pg.sd is not None:
            # FP8 D: per row and 128 of the leaf's D columns (n is a multiple of 128), the
            # bf16-rounded result quantized; the scales go where D's scale map says.
            acc, scales = quantize_rows(acc, sig.d_type, sig.d_scale_pow2, pg.sd.block[1])
            blocks = np.arange(scales.shape[1])
            sd_where = _gather(np.arange(len(flat[pg.sd.tensor])), pg.sd, env, d_rows, blocks)
            flat[pg.sd.tensor][sd_where[d_ok]] = scales[d_ok]
        if pg.c is not None and pg.sc is not None:
            # D's copy: the same bf16-rounded result, quantized per column and 128 of the
            # leaf's rows (blocks anchored at its first row), at the copy's own addresses.
            copy, cscales = quantize_rows(result.T, sig.d_type, sig.copy_scale_pow2, pg.sc.block[0])
            c_off = pg.c.offset.evaluate(env)
            cs0, cs1 = (s.evaluate(env) for s in pg.c.strides)
            flat[pg.c.tensor][c_off + rm[:, None] * cs0 + rn[None, :] * cs1] = copy.T
            blocks = np.arange(cscales.shape[1])
            sc_where = _gather(np.arange(len(flat[pg.sc.tensor])), pg.sc, env, blocks, rn)
            flat[pg.sc.tensor][sc_where] = cscales.T
        # Stored in D's type (an FP8 D is quantized above): one rounding of the f32 result,
        # or of the old value plus it for `+=`.
        if sig.accumulate:
            flat[pg.d.tensor][where] = quantize(flat[pg.d.tensor][where] + acc[d_ok], sig.d_type)
        else:
            flat[pg.d.tensor][where] = acc[d_ok] if pg.sd is not None else quantize(acc[d_ok], sig.d_type)


def run_prepass(spec: Spec, rt: Runtime, p: PrePass, flat: dict[str, np.ndarray]) -> None:
    """Produce the target's buffers from the source's (FP8 or, for quantize, bf16/f16/f32
    in; FP8 and scales out)."""
    src, dst = spec.tensor(p.source), spec.tensor(p.target)
    src_off, dst_off = element_offsets(spec, rt, src), element_offsets(spec, rt, dst)
    q_src = unpack(flat[src.name], src_off)
    if p.kind == "swiglu_grad":  # two unscaled sources
        other = spec.tensor(p.other)
        dh = unpack(flat[other.name], element_offsets(spec, rt, other))
        q, grid = swiglu_grad_values(spec, rt, dst, q_src, src.dtype, dh, other.dtype)
        flat[dst.name] = pack(dst_off, q)
        flat[dst.scale.name] = pack(scale_offsets(spec, rt, dst), grid)
        return
    if p.kind == "quantize":  # an unscaled source
        q, grid = quantize_values(spec, rt, q_src, dst)
        flat[dst.name] = pack(dst_off, q)
        flat[dst.scale.name] = pack(scale_offsets(spec, rt, dst), grid)
        return
    if p.kind == "gather":
        index = unpack(flat[p.index], element_offsets(spec, rt, spec.tensor(p.index)))
        grid = flat[src.scale.name][scale_offsets(spec, rt, src)] if src.scale else None
        q, grid = gathered_rows(index, q_src, grid)
        flat[dst.name] = pack(dst_off, q)
        if dst.scale is not None:
            flat[dst.scale.name] = pack(scale_offsets(spec, rt, dst), grid)
        return
    grid_src = flat[src.scale.name][scale_offsets(spec, rt, src)]
    if p.kind == "transpose":
        q, grid = q_src, grid_src
    elif p.index is not None or p.weight is not None:
        index, weight = (
            None if n is None else unpack(flat[n], element_offsets(spec, rt, spec.tensor(n)))
            for n in (p.index, p.weight)
        )
        q, grid = requantize_rows_values(spec, rt, src, TensorData(q_src, grid_src), dst, index, weight)
    else:
        q, grid = requantize_values(spec, rt, src, TensorData(q_src, grid_src), dst)
    flat[dst.name] = pack(dst_off, q)
    flat[dst.scale.name] = pack(scale_offsets(spec, rt, dst), grid)


def run_postpass(spec: Spec, rt: Runtime, p: PostPass, flat: dict[str, np.ndarray]) -> None:
    """A row pass on the flat buffers, where the schedule's order puts it: its operands read
    through their layouts, its target written through its own."""
    data = {}
    for name in (p.source, p.other, p.weight, p.index):
        if name is None:
            continue
        t = spec.tensor(name)
        values = unpack(flat[name], element_offsets(spec, rt, t))
        grid = flat[t.scale.name][scale_offsets(spec, rt, t)] if t.scale is not None else None
        data[name] = TensorData(values, grid)
    dst = spec.tensor(p.target)
    at = element_offsets(spec, rt, dst)
    stored = at >= 0
    flat[dst.name][at[stored]] = quantize(row_pass_values(spec, rt, dst, data), dst.dtype)[stored]


def run_schedule(spec: Spec, rt: Runtime, schedule: Schedule, inputs: dict[str, TensorData], init: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run pre-passes and launches on flat buffers; return each output's logical values."""
    check_group_values(spec, rt)
    flat: dict[str, np.ndarray] = {}
    for name, d in inputs.items():
        t = spec.tensor(name)
        flat[name] = pack(element_offsets(spec, rt, t), d.values)
        if d.scale_grid is not None:
            flat[t.scale.name] = pack(scale_offsets(spec, rt, t), d.scale_grid)
    # An FP8 output's scale grid starts from init (under the scale's name) or NaN.
    fp8 = {t.scale.name: t for t in fp8_outputs(spec)}
    for name, v in init.items():
        if name not in fp8:
            flat[name] = pack(element_offsets(spec, rt, spec.tensor(name)), v)
    for name, t in fp8.items():
        grid = init.get(name, np.full(scale_offsets(spec, rt, t).shape, np.nan))
        flat[name] = pack(scale_offsets(spec, rt, t), grid)
    run_step = {"prepass": run_prepass, "launch": run_launch, "postpass": run_postpass}
    for kind, _, x in schedule.steps():
        run_step[kind](spec, rt, x, flat)
    out = {}
    for name in init:
        if name not in fp8:  # an element with no storage keeps its starting value
            out[name] = unpack(flat[name], element_offsets(spec, rt, spec.tensor(name)), init[name])
    for name, t in fp8.items():
        out[name] = flat[name][scale_offsets(spec, rt, t)]
    return out


__all__ = ["run_schedule", "leaf_symbols"]
