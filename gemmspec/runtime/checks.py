"""Run-time argument checks that mirror the checker's compile-time limits.

The checker bounds what a spec fixes (docs/language.md, "Limits"); what the shapes
of a call fix is checked here, before anything is planned or launched:

- `check_sizes`: every run-time dim fits the kernels' 32-bit row, column and K
  indices (a padded segment_major tensor's rows with their padding too), each
  launch's output tiles fit the leaf table's 32-bit prefix sum, and every number a
  launch hands a kernel fits that parameter's type (grids within CUDA's limits,
  workspaces within 64-bit byte offsets).
- `check_written_layouts`: a written tensor whose layout depends on run-time dims
  keeps its elements at distinct addresses for these sizes.
- `check_outputs`: outputs are writable and share no byte with any other argument.

The first two depend on the shapes alone, so the executor runs them once per plan;
the last depends on the pointers and runs on every call, in O(n log n) for n
arguments.
"""

from __future__ import annotations

from ..aliasing import ENUMERATE_LIMIT, UNDECIDED, element_collision
from ..analyse import LaunchPlan, tile_bound
from ..codegen.formula import NUM_SMS
from ..codegen.manifest import KernelLaunch, Manifest, Upload
from ..codegen.validate import group_chain_count
from ..errors import ArgumentError
from ..lower.schedule import Schedule
from ..spec import MAX_EXTENT, MAX_OFFSET, MAX_TILES_PER_LAUNCH, Layout, Spec, Tensor
from .arrays import DeviceArray

__all__ = ["check_outputs", "check_sizes", "check_written_layouts"]

# What a C++ parameter of an emitted kernel holds.
_RANGES = {"int": (-(2**31), 2**31 - 1), "long long": (-(2**63), MAX_OFFSET)}
# CUDA's grid limits, x then y and z; the SM count only scales persistent grids.
_GRID_LIMITS = (2**31 - 1, 65535, 65535)
_MANY_SMS = 1024


def _dims_text(dims: dict[str, int]) -> str:
    return ", ".join(f"{d} = {n}" for d, n in dims.items())


def check_sizes(spec: Spec, schedule: Schedule, manifest: Manifest, dims: dict[str, int]) -> None:
    """Raise ArgumentError when the run-time dims of a call exceed what the kernels index."""
    for d, n in dims.items():
        if n > MAX_EXTENT:
            source = next(t.name for t in spec.tensors if t.derived is None and d in t.dims)
            raise ArgumentError(
                f"{spec.name}: run-time dim {d} = {n} (from the shape of '{source}') is more "
                "than 2^31 - 1: the kernels index rows, columns and K with 32-bit signed "
                "integers; split the call"
            )
    for t in spec.tensors:
        lay = t.layout
        if not lay.pad_rows:
            continue
        d = t.dims[lay.seg_axis]
        rows = dims.get(d, spec.dim(d).size) + lay.pad_rows
        if rows > MAX_EXTENT:
            raise ArgumentError(
                f"{spec.name}: with {_dims_text(dims)}, '{t.name}' ({lay}) has {rows} rows "
                f"along {d} with its padding, more than 2^31 - 1: the kernels index the "
                "padded rows with 32-bit integers; split the call"
            )
    for launch in schedule.launches:
        g = spec.gemms[launch.statement]
        sig = launch.signature
        # A work unit of a cluster spans its CTAs' neighbouring row or column blocks.
        unit_m, unit_n = sig.unit_shape
        plan = LaunchPlan(launch.statement, launch.problems.fixed_axes, unit_m, unit_n)
        tiles = tile_bound(spec, g, plan, launch.leaf_count, dims)
        if tiles is not None and tiles > MAX_TILES_PER_LAUNCH:
            raise ArgumentError(
                f"{spec.name}: with {_dims_text(dims)}, launch {launch.index} (statement "
                f"#{g.index}) can have up to {tiles} output tiles of "
                f"{unit_m}x{unit_n}, more than 2^31 - 1: the kernels "
                "count tiles in 32-bit signed integers; split the call"
            )
    _check_manifest_values(spec, manifest, dims)


def _check_manifest_values(spec: Spec, manifest: Manifest, dims: dict[str, int]) -> None:
    """Every number the launches would hand a kernel, as the plan will compute it."""
    if not manifest.runtime_dims:
        return  # every value is fixed, and the emitted code compiled with it
    env = {**{d: int(dims[d]) for d in manifest.runtime_dims}, NUM_SMS: _MANY_SMS}
    where = f"{spec.name}: with {_dims_text(dims)}"
    for w in manifest.workspaces:
        nbytes = w.bytes.evaluate(env)
        if nbytes > MAX_OFFSET:
            raise ArgumentError(
                f"{where}, {w.purpose} would need {nbytes} bytes, past 2^63 - 1: byte offsets "
                "are 64-bit signed integers"
            )
    for step in manifest.steps:
        if isinstance(step, Upload):
            for f in step.int32:
                value = f.evaluate(env)
                if not _RANGES["int"][0] <= value <= _RANGES["int"][1]:
                    raise ArgumentError(
                        f"{where}, a table of '{step.workspace}' would hold {value}, which does "
                        "not fit its 32-bit integers"
                    )
            continue
        assert isinstance(step, KernelLaunch)
        grid = tuple(f.evaluate(env) for f in step.grid)
        if any(n > limit for n, limit in zip(grid, _GRID_LIMITS)):
            raise ArgumentError(
                f"{where}, kernel '{step.symbol}' would need a grid of {list(grid)}, beyond "
                "CUDA's limits (x below 2^31, y and z at most 65,535)"
            )
        for p in step.params:
            if p.source.kind not in ("dim", "value") or p.ctype not in _RANGES:
                continue
            value = env[p.source.ref] if p.source.kind == "dim" else p.source.value.evaluate(env)
            low, high = _RANGES[p.ctype]
            if not low <= value <= high:
                raise ArgumentError(
                    f"{where}, kernel '{step.symbol}' would get {p.name} = {value}, which does "
                    f"not fit its {p.ctype}"
                )


# ---- written layouts ---------------------------------------------------------------


def _written(spec: Spec) -> list[tuple[str, Tensor, bool]]:
    """(what, tensor, its scale?) for every tensor a call writes: statement outputs,
    derived tensors a pre-pass writes, and the scales a (re)quantize pass writes."""
    read = {t for g in spec.gemms for t in (g.loaded_a.tensor, g.b.tensor)}
    out: dict[str, tuple[str, Tensor, bool]] = {}
    for w in spec.written:  # an FP8 output's copy and row passes' targets too
        out.setdefault(w, (f"output '{w}'", spec.tensor(w), False))
    for t in spec.tensors:
        if t.derived is not None and t.name in read:
            out.setdefault(t.name, (f"'{t.name}', which a pre-pass writes,", t, False))
            if t.derived.op in ("requantize", "quantize", "swiglu_grad", "gather") and t.scale is not None:
                out[t.scale.name] = (f"'{t.scale.name}', which a pre-pass writes,", t, True)
    return list(out.values())


def _depends_on_runtime(spec: Spec, t: Tensor, layout: Layout) -> bool:
    return any(spec.dim(d).size is None for d in t.dims) or not all(
        s.is_const for s in layout.strides
    )


def check_written_layouts(spec: Spec, dims: dict[str, int]) -> None:
    """A written layout that depends on run-time dims must not put two elements at one
    address for these sizes (the checker decided the others)."""
    for what, t, is_scale in _written(spec):
        layout = t.scale.layout if is_scale else t.layout
        if layout.kind != "strided" or not _depends_on_runtime(spec, t, layout):
            continue
        sizes = [dims[d] if d in dims else spec.dim(d).size for d in t.dims]
        if is_scale:
            sizes = _scale_rows(spec, t, sizes)
        strides = [s.evaluate(dims) for s in layout.strides]
        clash = element_collision(list(zip(sizes, strides)))
        if clash is None:
            continue
        shape = f"{list(sizes)} with strides {strides} ({layout}) for {_dims_text(dims)}"
        if clash is UNDECIDED:
            raise ArgumentError(
                f"{spec.name}: {what} has shape {shape}, which interleaves its dims in a way "
                f"that cannot be checked for two elements at one address (more than "
                f"{ENUMERATE_LIMIT} elements); pick sizes or strides where each stride "
                "passes the farthest offset the smaller ones reach"
            )
        first, second, offset = clash
        a = ", ".join(f"{d}={v}" for d, v in zip(t.dims, first))
        b = ", ".join(f"{d}={v}" for d, v in zip(t.dims, second))
        raise ArgumentError(
            f"{spec.name}: {what} has shape {shape}: elements ({a}) and ({b}) are both at "
            "offset " + str(offset) + ", a write race; a written tensor needs its own "
            "address for every element"
        )


def _scale_rows(spec: Spec, t: Tensor, sizes: list[int]) -> list[int]:
    """The scale grid's extent per axis (along an anchored dim, the most rows the
    segments can need)."""
    assert t.scale is not None
    rows = []
    for axis, (d, n) in enumerate(zip(t.dims, sizes)):
        b = t.scale.block[axis]
        g = spec.group(t.scale.anchor) if t.scale.anchor else None
        if g is None or g.dim != d:
            rows.append(t.scale.blocks_along(axis, n))
        elif g.kind != "ragged":
            rows.append(sum(-(-size // b) for size in g.sizes))
        else:
            rows.append((n + group_chain_count(spec, g.name) * g.count * (b - 1)) // b)
    return rows


# ---- outputs against every other argument ------------------------------------------------


def check_outputs(arrays: dict[str, DeviceArray], roles: dict[str, str]) -> None:
    """Outputs are writable and share no byte with any other argument.

    An argument's extent is the byte range from its lowest to its highest element,
    as its shape and strides place them, gaps included, so views interleaved in one buffer (two column blocks of
    one matrix, say) count as overlapping even where no element is shared: the rule
    is conservative, and adjacent ranges are fine. Inputs may overlap each other.
    """
    order = {name: i for i, name in enumerate(roles)}
    spans = []
    for name, role in roles.items():
        a = arrays[name]
        if role == "output" and a.readonly:
            raise ArgumentError(f"output '{name}' is read-only; pass a writable tensor")
        extent = a.byte_extent()
        if extent is not None:
            spans.append((extent[0], order[name], extent[1], name))
    spans.sort()
    reach_any = reach_out = None  # (end, name) of the farthest-reaching earlier span
    for start, _, end, name in spans:
        output = roles[name] == "output"
        other = reach_any if output else reach_out
        if other is not None and other[0] > start:
            _overlap(arrays, roles, order, name, other[1])
        if reach_any is None or end > reach_any[0]:
            reach_any = (end, name)
        if output and (reach_out is None or end > reach_out[0]):
            reach_out = (end, name)


def _overlap(arrays, roles, order, one: str, two: str) -> None:
    first, second = sorted((one, two), key=order.__getitem__)
    out, other = (first, second) if roles[first] == "output" else (second, first)
    a, b = arrays[out].byte_extent(), arrays[other].byte_extent()
    how = "is the same memory as" if a == b else "overlaps"
    raise ArgumentError(
        f"output '{out}' {how} {roles[other]} '{other}' "
        f"(bytes [{a[0]:#x}, {a[1]:#x}) and [{b[0]:#x}, {b[1]:#x})); "
        "an output must not share memory with any other argument"
    )
