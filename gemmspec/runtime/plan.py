"""A launch manifest's steps as a Python run: the same kernels, grids and arguments, in
the same order, as the emitted host launcher (`<spec>_host.cu`) issues them.

The executor validates arguments and owns the run; this module only walks the
manifest (codegen/manifest.py): it allocates each workspace, encodes and uploads the
tensor-map templates and int32 tables, and appends every kernel with its arguments.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..codegen.formula import NUM_SMS
from ..codegen.manifest import KernelLaunch, Manifest, Param, Upload
from .tensormap import encode_tile_map

# Scalar parameter types of the emitted kernels and their fixed-width numpy types.
_SCALARS = {"int": np.int32, "long long": np.int64}


def plan_steps(
    manifest: Manifest,
    run,
    tensors: dict[str, object],
    dims: dict[str, int],
    sms: int,
    kernel: Callable[[KernelLaunch], object],
    extent: Callable[[str, int], int],
) -> dict[str, object]:
    """Append `manifest`'s steps to `run` (a PreparedRun) and return its workspaces by
    name. `tensors` gives what each spec argument's pointer is in this run (an array or
    a placeholder); `kernel` loads a step's kernel; `extent(argument, axis)` is an
    argument's length along an axis in this call."""
    env = {**{d: int(dims[d]) for d in manifest.runtime_dims}, NUM_SMS: int(sms)}
    uploaded = {s.workspace for s in manifest.steps if isinstance(s, Upload)}
    buffers: dict[str, object] = {}
    for w in manifest.workspaces:
        if w.name not in uploaded:
            buffers[w.name] = run.allocate(max(w.bytes.evaluate(env), 1))
    for step in manifest.steps:
        if isinstance(step, Upload):
            buffers[step.workspace] = run.upload(_contents(step, buffers, env))
            continue
        grid = tuple(g.evaluate(env) for g in step.grid)
        if min(grid) <= 0:
            continue  # an empty grid has nothing to do (the host launcher skips it too)
        args = [_argument(p, tensors, buffers, env, extent) for p in step.params]
        run.add(kernel(step), grid, step.block, step.dynamic_smem, *args, programmatic=step.programmatic)
    return buffers


def _contents(step: Upload, buffers: dict[str, object], env: dict[str, int]) -> np.ndarray:
    if step.templates:
        address = buffers[step.address_of].ptr
        maps = b"".join(encode_tile_map(m.dtype, m.box_rows, m.box_inner, address) for m in step.templates)
        return np.frombuffer(maps, dtype=np.uint8)
    return np.array([v.evaluate(env) for v in step.int32], dtype=np.int32)


def _argument(p: Param, tensors: dict[str, object], buffers: dict[str, object], env: dict[str, int], extent):
    s = p.source
    if s.kind == "tensor":
        return tensors[s.ref]
    if s.kind == "workspace":
        return buffers[s.ref]
    if s.kind == "null":
        return None
    if s.kind == "extent":
        return _SCALARS[p.ctype](extent(s.ref, s.axis))
    value = env[s.ref] if s.kind == "dim" else s.value.evaluate(env)
    return _SCALARS[p.ctype](value)
