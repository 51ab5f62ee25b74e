"""The spec's direct semantics on logical arrays, in float64.

No schedule, no layouts, no offsets formulas: each statement is evaluated as its
index notation says, with group membership taken from the definitions of
ragged, split, uniform and masked groups, and rows read or written through an
index tensor (`x[idx[t], k]`, `y[idx[t], n] = ...`) taken from its values (an index
outside the tensor's rows, or two rows written to one element, is a ValueError; so are
offsets or counts that break their group's definition, data.check_group_values). Derived tensors are computed from
their sources first (requantize: dequantize, then quantize with the target's
blocks, in float32 as the kernel does, with `rows` and `weight` as
data.requantize_rows_values says; quantize: the same rounding from unscaled values; transpose: same values;
swiglu_grad: as data.swiglu_grad_values says, once what it reads is written; a view: its
source's values reshaped, once the source is final).
Row passes (`rowdot`, `rowscale`, `scatter_add`) run once what they read is written, as data.row_pass_values says.
An FP8 output is the result rounded to bf16 and quantized as `quantize` does, with its
own scale grid (returned under the scale's name beside the values); any other output
(and a row pass's target) is rounded to its own type, as the kernels store it, so a
statement that reads it (or adds into it) sees what the device would have stored.
"""

from __future__ import annotations

import itertools

import numpy as np

from ..analyse import dependency_order
from ..spec import FP8_TYPES, Access, Gemm, Spec, Tensor
from .data import (
    Runtime,
    TensorData,
    block_index,
    check_group_values,
    dim_size,
    fp8_output_values,
    quantize,
    quantize_values,
    real_values,
    requantize_rows_values,
    requantize_values,
    row_pass_values,
    rows_through,
    scale_grid_shape,
    segments,
    swiglu_grad_values,
)


def derive(spec: Spec, rt: Runtime, data: dict[str, TensorData]) -> dict[str, TensorData]:
    """Add to `data` every derived tensor not in it yet whose sources are (returns a new
    dict): all of them where every source is passed in; a swiglu_grad once the statements
    and row passes it reads have run, and a requantize of it then."""
    out = dict(data)
    grown = True
    while grown:
        grown = False
        for t in spec.tensors:
            if t.derived is None or t.name in out or t.derived.op == "gather":
                continue
            if all(n in out for n in t.derived.reads):
                out[t.name] = _derived(spec, rt, t, out)
                grown = True
    return out


def _derived(spec: Spec, rt: Runtime, t: Tensor, data: dict[str, TensorData]) -> TensorData:
    """The values of derived tensor `t` from the sources in `data` (the statements read a
    gathered x[idx[t], k] as written: the gather pre-pass is the schedule's business,
    schedule_exec.run_prepass)."""
    src = spec.tensor(t.derived.source)
    if t.view_of is not None:  # the source's values reshaped in row-major order
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        return TensorData(data[src.name].values.reshape(shape))
    if t.derived.op == "transpose":
        return TensorData(data[src.name].values, data[src.name].scale_grid)
    if t.derived.op == "swiglu_grad":
        other = spec.tensor(t.derived.other)
        q, grid = swiglu_grad_values(
            spec, rt, t, data[src.name].values, src.dtype, data[other.name].values, other.dtype
        )
    elif t.derived.op == "quantize":
        q, grid = quantize_values(spec, rt, data[src.name].values, t)
    elif t.derived.index is not None or t.derived.weight is not None:
        index, weight = (None if n is None else data[n].values for n in (t.derived.index, t.derived.weight))
        q, grid = requantize_rows_values(spec, rt, src, data[src.name], t, index, weight)
    else:
        q, grid = requantize_values(spec, rt, src, data[src.name], t)
    return TensorData(q, grid)


def _group_mask(spec: Spec, rt: Runtime, group: str, chain: dict[str, int]) -> np.ndarray:
    """Positions of the group's dim that belong to segment chain[group] (with its outer indices)."""
    g = spec.group(group)
    n = dim_size(spec, rt, g.dim)
    mask = np.zeros(n, dtype=bool)
    names = chain_names(spec, group)
    want = tuple(chain[x] for x in names)
    for seg in segments(spec, rt, group):
        if seg.chain == want:
            mask[seg.start : seg.start + seg.length] = True
    return mask


def chain_names(spec: Spec, group: str) -> tuple[str, ...]:
    return tuple(g.name for g in reversed(spec.enclosing(group)))


def run_statement(spec: Spec, rt: Runtime, gemm: Gemm, data: dict[str, TensorData], out: np.ndarray,
                  covered: dict[str, np.ndarray] | None = None) -> np.ndarray:
    """Return the new value of the output tensor (float64, logical shape); `covered`, where
    given, gathers the elements the statement writes under the output's name."""
    total, written = statement_result(spec, rt, gemm, data, out.shape)
    _cover(covered, gemm.out.tensor, written)
    if gemm.accumulate:
        return out + total
    return np.where(written, total, out)


def statement_result(spec: Spec, rt: Runtime, gemm: Gemm, data: dict[str, TensorData], shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """The statement's result before it meets the output (float64, the output's logical
    shape), and which elements it writes."""
    a_t, b_t = spec.tensor(gemm.a.tensor), spec.tensor(gemm.b.tensor)
    a_real = real_values(spec, rt, a_t, data[a_t.name])
    b_real = real_values(spec, rt, b_t, data[b_t.name])
    # A SwiGLU over gate and up rows not interleaved: up row j is row swiglu_up_rows + j of
    # its weight (B itself for stacked halves), read with B's indices.
    up_t = spec.tensor(gemm.swiglu_up) if gemm.swiglu_up is not None else None
    up_real = real_values(spec, rt, up_t, data[up_t.name]) if up_t is not None else None
    size = {r: dim_size(spec, rt, gemm.role(r).dim) for r in "mnk"}
    total = np.zeros(shape)
    written = np.zeros(shape, dtype=bool)
    for combo in itertools.product(*[range(ax.count) for ax in gemm.leaf_axes]):
        at = {ax.name: i for ax, i in zip(gemm.leaf_axes, combo)}
        masks = {r: np.ones(size[r], dtype=bool) for r in "mnk"}
        for ax in gemm.leaf_axes:
            if ax.group is None:
                continue
            g = spec.group(ax.group)
            for r in "mnk":
                if gemm.role(r).dim != g.dim:
                    continue
                if g.kind == "masked":
                    count = int(rt.tensors[g.tensor][at[g.name]])
                    masks[r] &= np.arange(size[r]) < count
                else:
                    masks[r] &= _group_mask(spec, rt, g.name, at)
        a = _slice(gemm.a, a_real, at, ("m", "k"))
        b = _slice(gemm.b, b_real, at, ("n", "k"))
        im, in_, ik = (np.flatnonzero(masks[r]) for r in "mnk")
        # Rows of A: the leaf's rows, or the rows its index tensor picks (`x[idx[t], k]`:
        # the scales came with the rows, as real values of A's own rows).
        a_rows = im if not gemm.gather else rows_through(data, gemm.gather, im, a.shape[0], a_t.name)
        # Only the rows, columns and contraction range this leaf covers.
        part = a[np.ix_(a_rows, ik)] @ b[np.ix_(in_, ik)].T
        if up_t is not None:
            up = _slice(Access(up_t.name, gemm.b.uses), up_real, at, ("n", "k"))
            part = silu(part) * (a[np.ix_(a_rows, ik)] @ up[np.ix_(in_ + gemm.swiglu_up_rows, ik)].T)
        elif gemm.swiglu:
            part, in_ = swiglu_pairs(part, in_)
        part = apply_epilogue(gemm, data, at, im, in_, part)
        sel = _out_index(gemm, at)
        view = total[sel]
        wview = written[sel]
        mn_order = [u.role for u in gemm.out.uses if u.kind == "role"]
        d_rows = im
        if gemm.scatter:
            # `y[idx[t], n] = ...`: the leaf's row t lands on row idx[t]; two rows landing on
            # one element is an error of the caller's (the kernels would race).
            axis = gemm.out.axis_of_role("m")
            d_rows = rows_through(data, gemm.scatter, im, shape[axis], gemm.out.tensor)
            _distinct(gemm, im, d_rows)
        where = np.ix_(in_, d_rows) if mn_order == ["n", "m"] else np.ix_(d_rows, in_)
        if gemm.scatter and wview[where].any():
            raise ValueError(
                f"statement #{gemm.index} ({gemm.text}): index tensor '{gemm.scatter}' sends rows "
                f"of two leaves to one element of '{gemm.out.tensor}'; scattered rows must be distinct"
            )
        view[where] += part.T if mn_order == ["n", "m"] else part
        wview[where] = True
        total[sel] = view
        written[sel] = wview
    return total, written


def run_fp8_copy(
    spec: Spec, rt: Runtime, gemm: Gemm, data: dict[str, TensorData], old: TensorData,
    covered: dict[str, np.ndarray] | None = None,
) -> TensorData:
    """`T = copy(D)` of an `=` statement into the FP8 output D (docs/language.md, section 7
    and FP8 outputs): the statement's result rounded to bf16, then quantized with T's own
    scale blocks ([128, 1] per segment of the row group) exactly as quantize(SOURCE) would
    quantize that bf16 tensor into T. The checker makes the statement write every row
    (a ragged group without capacity), so every element and scale of T is written (and
    `covered`, where given, says so under T's name and its scale's, in their logical
    shapes: a padded layout's padding rows and a call's spare scale rows lie outside)."""
    t = spec.tensor(gemm.copy)
    total, written = statement_result(spec, rt, gemm, data, old.values.shape)
    assert written.all(), "a copy's statement writes every row"
    q, grid = fp8_output_values(spec, rt, total, t)
    _cover(covered, t.name, written)
    _cover(covered, t.scale.name, _block_counts(spec, rt, t, written) > 0)
    return TensorData(q, grid)


def run_fp8_statement(
    spec: Spec, rt: Runtime, gemm: Gemm, data: dict[str, TensorData], old: TensorData,
    covered: dict[str, np.ndarray] | None = None,
) -> TensorData:
    """An `=` statement into an FP8 output: the written elements' result rounded to bf16
    and quantized per scale block (`fp8_output_values`); elements and scales the statement
    does not write keep `old`'s. A block is written whole or not at all (the checker makes
    the output's columns whole blocks of one leaf). `covered`, where given, gathers the
    elements written under the output's name and the scale blocks written under its
    scale's."""
    t = spec.tensor(gemm.out.tensor)
    total, written = statement_result(spec, rt, gemm, data, old.values.shape)
    q, grid = fp8_output_values(spec, rt, np.where(written, total, 0.0), t)
    per_block = _block_counts(spec, rt, t, written)
    whole = _block_counts(spec, rt, t, np.ones_like(written))
    assert ((per_block == 0) | (per_block == whole)).all(), "a scale block written in part"
    _cover(covered, t.name, written)
    _cover(covered, t.scale.name, per_block > 0)
    return TensorData(np.where(written, q, old.values), np.where(per_block > 0, grid, old.scale_grid))


def _cover(covered: dict[str, np.ndarray] | None, name: str, written: np.ndarray) -> None:
    """Add `written` (a boolean mask of `name`'s logical shape) to what `covered` holds
    for `name`: statements writing one output add up."""
    if covered is not None:
        covered[name] = written | covered[name] if name in covered else written


def _block_counts(spec: Spec, rt: Runtime, t: Tensor, mask: np.ndarray) -> np.ndarray:
    """How many elements of `mask` each block of `t`'s scale grid holds."""
    counts = np.zeros(scale_grid_shape(spec, rt, t), dtype=np.int64)
    np.add.at(counts, np.ix_(*[block_index(spec, rt, t, a) for a in range(t.rank)]), mask.astype(np.int64))
    return counts


def _distinct(gemm: Gemm, rows: np.ndarray, picked: np.ndarray) -> None:
    """A scattered `=` output: no two rows of a leaf may land on one row."""
    values, counts = np.unique(picked, return_counts=True)
    if (counts > 1).any():
        s = int(values[np.flatnonzero(counts > 1)[0]])
        both = rows[picked == s][:2]
        raise ValueError(
            f"statement #{gemm.index} ({gemm.text}): index tensor '{gemm.scatter}' sends rows "
            f"{both[0]} and {both[1]} to row {s} of '{gemm.out.tensor}'; scattered rows must be "
            "distinct (duplicates would race)"
        )


def silu(x: np.ndarray) -> np.ndarray:
    """x / (1 + exp(-x)) in float64; exp overflows to inf for x < -709, where silu is -0."""
    with np.errstate(over="ignore"):
        return x / (1.0 + np.exp(-x))


def swiglu_pairs(part: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """h[:, j] = silu(part[:, 2j]) * part[:, 2j + 1] over the product's columns `cols`
    (rows of the interleaved weight): each gate column 2j with its up column 2j + 1 is
    output column j. Returns h and its output columns."""
    gate = np.flatnonzero(cols % 2 == 0)
    up = np.searchsorted(cols, cols[gate] + 1)
    assert np.array_equal(cols[np.minimum(up, len(cols) - 1)], cols[gate] + 1), "unpaired gate row"
    return silu(part[:, gate]) * part[:, up], cols[gate] // 2


def apply_epilogue(gemm: Gemm, data: dict[str, TensorData], at: dict[str, int], im: np.ndarray, in_: np.ndarray, part: np.ndarray) -> np.ndarray:
    """`alpha * row_weight * part + bias` for one leaf's rows `im` and columns `in_`:
    each operand read at the leaf's indices and the rows or columns it varies along."""
    for e in gemm.epilogue:
        values = np.asarray(data[e.access.tensor].values, dtype=np.float64)
        index = tuple(
            at[u.axis] if u.kind == "leaf" else (im if u.role == "m" else in_) for u in e.access.uses
        )
        v = values[index]
        if e.kind == "alpha":
            part = part * v
        elif e.kind == "row":
            part = part * v[:, None]
        else:
            part = part + v[None, :]
    return part


def _slice(acc, real: np.ndarray, at: dict[str, int], roles: tuple[str, str]) -> np.ndarray:
    """The 2-D (roles[0], roles[1]) view of an operand at one leaf-axis assignment."""
    index = []
    order = []
    for u in acc.uses:
        if u.kind == "leaf":
            index.append(at[u.axis])
        else:
            index.append(slice(None))
            order.append(u.role)
    view = real[tuple(index)]
    return view if order == list(roles) else view.T


def _out_index(gemm: Gemm, at: dict[str, int]) -> tuple:
    return tuple(at[u.axis] if u.kind == "leaf" else slice(None) for u in gemm.out.uses)


def run_direct(
    spec: Spec,
    rt: Runtime,
    inputs: dict[str, TensorData],
    init: dict[str, np.ndarray],
    given: dict[str, TensorData] | None = None,
    covered: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Evaluate every statement in order; `init` holds each output's starting values (an
    FP8 output's scale grid may start from `init[<scale name>]`, else NaN). An FP8
    output's scale grid is returned under its scale's name. `covered`, where given,
    receives for each output of a statement the elements the statements write (boolean,
    its logical shape), and for an FP8 output and an FP8 copy the blocks of their scale
    grids written too (under the scale's name): an `+=` output keeps its starting values
    where no leaf adds, and a written element may happen to hold its starting value, so
    the values cannot tell those elements apart. A row pass's target (every element
    written) and an output taken from `given` are not reported. `given` names outputs to take
    as they are (values, and an FP8 output's scales) instead of computing them, so that
    what reads them can be checked against what a device wrote: FP8 rounding is
    discontinuous, and a result a hair away from the reference's may round to the next
    FP8 value; a row pass that sums rows (`scatter_add`) would otherwise inherit the sum of
    its source rows' errors."""
    given = given or {}
    check_group_values(spec, rt)
    data = derive(spec, rt, inputs)
    results = {k: v.copy() for k, v in init.items()}
    for t in fp8_outputs(spec):
        if t.scale.name not in results:
            results[t.scale.name] = np.full(scale_grid_shape(spec, rt, t), np.nan)
    # Statements take effect in data-dependency order (writers before readers); a row pass
    # and a derived tensor once what they read is written.
    statements = list(dependency_order(spec))
    rows = list(spec.row_passes)
    while statements or rows:
        data = derive(spec, rt, data)
        ready = next((i for i in statements if all(r in data for r in spec.gemms[i].reads)), None)
        if ready is None:
            t = next(t for t in rows if all(r in data for r in t.row_pass.reads))
            # Stored in the target's type, as the pass stores it (what reads it sees that).
            results[t.name] = quantize(row_pass_values(spec, rt, t, data), t.dtype)
            data[t.name] = TensorData(results[t.name])
            rows.remove(t)
            continue
        statements.remove(ready)
        gemm = spec.gemms[ready]
        name = gemm.out.tensor
        # A view of the output shows what was there before: derived again once it is written.
        for v in spec.tensors:
            if v.view_of == name:
                data.pop(v.name, None)
        out_t = spec.tensor(name)
        if out_t.dtype in FP8_TYPES:
            if name in given:
                d = given[name]
            else:
                d = run_fp8_statement(
                    spec, rt, gemm, data, TensorData(results[name], results[out_t.scale.name]), covered
                )
            results[name], results[out_t.scale.name] = d.values, d.scale_grid
            data[name] = d
            if gemm.copy is not None:
                c_t = spec.tensor(gemm.copy)
                if gemm.copy in given:
                    c = given[gemm.copy]
                else:
                    c = run_fp8_copy(
                        spec, rt, gemm, data, TensorData(results[gemm.copy], results[c_t.scale.name]), covered
                    )
                results[gemm.copy], results[c_t.scale.name] = c.values, c.scale_grid
                data[gemm.copy] = c
            continue
        if name in given:
            results[name] = given[name].values
            data[name] = given[name]
            continue
        # Rounded to the output's type as the kernel stores it: a statement that reads the
        # output (or adds into it) sees the stored values, not the exact ones.
        results[name] = quantize(run_statement(spec, rt, gemm, data, results[name], covered), out_t.dtype)
        data[name] = TensorData(results[name])
    return results


def fp8_outputs(spec: Spec) -> list[Tensor]:
    """The tensors statements write in FP8 (with the scales their epilogue writes), an
    output's copy after it."""
    names = dict.fromkeys(w for g in spec.gemms for w in g.writes)
    return [spec.tensor(n) for n in names if spec.tensor(n).dtype in FP8_TYPES]
