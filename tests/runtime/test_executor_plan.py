"""prepare() turns every example into the right launch list (no GPU needed):
kernel order, grid/block/shared memory, and one argument per kernel parameter."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.reference.data import dim_size, random_index, random_runtime, scale_grid_shape
from gemmspec.runtime import executor
from gemmspec.runtime.arrays import DeviceArray

# The kernel definitions as the CUDA text spells them: an independent view of what the
# manifest says each kernel takes.
_ENTRY = re.compile(
    r'^extern "C" __global__ void\s+(?:__launch_bounds__\([^)]*\)\s*)?(?:__cluster_dims__\([^)]*\)\s*)?'
    r"(\w+)\(([^)]*)\)",
    re.MULTILINE,
)


def entry_points(source: str) -> list[str]:
    return [f"void {name}({params})" for name, params in _ENTRY.findall(source)]


EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))


def _arrays(exe, host, rng):
    spec = exe.spec
    rt = random_runtime(spec, rng, dims={d: 300 for d in spec.runtime_dims})
    args = {}
    ptr = 1 << 20
    for t in spec.tensors:
        if t.derived is not None:
            continue
        shape = t.layout.storage_shape(tuple(dim_size(spec, rt, d) for d in t.dims))
        strides = tuple(s.evaluate(rt.dims) for s in t.layout.strides) if t.layout.kind == "strided" else executor._row_major(shape)
        args[t.name] = DeviceArray(ptr, shape, strides, t.dtype, 0, None)
        if t.dtype == "i32":  # an index tensor: the host reads its values back
            host[ptr] = random_index(spec, rt, rng, t.name).astype(np.int32)
        # Apart by at least its bytes (the decode FFN's weights are 7.5 GB), 1 GB at least.
        extent = args[t.name].byte_extent()
        ptr += max(1 << 30, -(-(extent[1] - ptr) // (1 << 30)) * (1 << 30) if extent else 0)
        if t.scale:
            grid = scale_grid_shape(spec, rt, t)
            sstr = tuple(s.evaluate(rt.dims) for s in t.scale.layout.strides)
            args[t.scale.name] = DeviceArray(ptr, grid, sstr, "f32", 0, None)
            ptr += 1 << 30
    for name, values in rt.tensors.items():
        args[name] = DeviceArray(ptr, values.shape, executor._row_major(values.shape), "i32", 0, None)
        host[ptr] = np.asarray(values)
        ptr += 1 << 20
    return args


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_prepare_builds_one_argument_per_parameter(path, offline):
    exe = gemmspec.build(path)
    run = exe.prepare(None, **_arrays(exe, offline, np.random.default_rng(0)))
    program = run.program  # as compiled, or its decode variant at this size
    params = {}
    for source in program.sources().values():
        for decl in entry_points(source):
            name = decl.split("void ", 1)[1].split("(", 1)[0]
            params[name] = decl.count(",") + 1
    names = [k.name for k, *_ in run.launches]
    # The offsets check runs in launch 0's leaf-table builder, or as a kernel of its own
    # that comes first.
    check = program.check
    alone = check is not None and not check.fused
    assert (names[0] == f"gs_{exe.spec.name}_check") == alone
    names = names[alone:]
    launched = [k for x in program.launches for k in x.kernels]
    after = [k for p in program.postpasses for k in p.kernels]  # row passes: after the launches
    expected = len(program.prepasses) + len(launched) + len(after)
    assert len(names) == expected
    for kernel, grid, block, smem, args, _ in run.launches:
        assert len(args) == params[kernel.name], kernel.name
        assert grid and block in (128, 256, 384, 1024) and 0 <= smem <= 227 * 1024  # 1024: scatter_add's scan
        assert all(not isinstance(a, (int, float)) or isinstance(a, np.generic) for a in args)
    # Every launch is a table builder followed by its GEMM (or a GEMM that builds its
    # table), after all pre-passes.
    assert names[len(program.prepasses):len(names) - len(after)] == launched
