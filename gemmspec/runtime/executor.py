"""A compiled spec you can call: validate run-time arguments, then launch.

`Executable` owns the emitted program, compiles it with NVRTC on first use
(cubins cached on disk), allocates the workspaces that pre-passes write, and
launches pre-passes, leaf-table builders and grouped GEMMs in schedule order on
one stream. Every argument is checked before anything is launched; a bad one
raises `ArgumentError` naming the tensor and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..codegen.emit import EmittedLaunch, EmittedPrePass, EmittedProgram
from ..codegen.kernels import RequantKernelConfig, TransposeKernelConfig, include_dir
from ..errors import ArgumentError
from ..explain import explain_text
from ..lower.schedule import Schedule
from ..spec import Spec, Tensor
from .arrays import DeviceArray, DeviceBuffer, as_device_array, copy_to_host
from .launch import LoadedKernel, current_stream, num_sms
from .nvrtc import compile_cubin

GS_LEAF_BYTES = 136
ALIGN = 16


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Bound:
    """Arguments of one call after validation."""

    arrays: dict[str, DeviceArray]
    dims: dict[str, int]
    offsets: dict[str, np.ndarray]  # host copies of offsets/counts tensors
    workspace: list = field(default_factory=list)


class Executable:
    def __init__(self, spec: Spec, schedule: Schedule, program: EmittedProgram):
        self.spec = spec
        self.schedule = schedule
        self.program = program
        self._kernels: dict[str, LoadedKernel] = {}

    @property
    def sources(self) -> dict[str, str]:
        return self.program.sources()

    def explain(self) -> str:
        return explain_text(self.spec, self.schedule)

    # ---- arguments -------------------------------------------------------------------
    def argument_names(self) -> list[str]:
        """Every run-time tensor a call needs, by the names the spec gives them."""
        names = []
        for t in self.spec.tensors:
            if t.derived is not None:
                continue
            names.append(t.name)
            if t.scale is not None:
                names.append(t.scale.name)
        for g in self.spec.groups:
            if g.tensor:
                names.append(g.tensor)
        return names

    def _bind(self, tensors: dict[str, object]) -> _Bound:
        expected = self.argument_names()
        missing = [n for n in expected if n not in tensors]
        if missing:
            raise ArgumentError(f"{self.spec.name}: missing tensor(s): {', '.join(missing)}")
        unknown = [n for n in tensors if n not in expected]
        if unknown:
            raise ArgumentError(
                f"{self.spec.name}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(expected)}"
            )
        arrays: dict[str, DeviceArray] = {}
        for name in expected:
            hint = None
            t = self._tensor_named(name)
            if t is not None and t.dtype in ("e4m3", "e5m2", "bf16"):
                hint = t.dtype
            arrays[name] = as_device_array(tensors[name], name=name, dtype_hint=hint)
        devices = {a.device for a in arrays.values()}
        if len(devices) > 1:
            raise ArgumentError(f"{self.spec.name}: tensors are on different devices {sorted(devices)}")
        dims = self._runtime_dims(arrays)
        offsets = self._check_group_tensors(arrays, dims)
        for t in self.spec.tensors:
            if t.derived is None:
                self._check_tensor(t, arrays, dims, offsets)
        return _Bound(arrays, dims, offsets)

    def _tensor_named(self, name: str) -> Tensor | None:
        for t in self.spec.tensors:
            if t.name == name:
                return t
        return None

    def _runtime_dims(self, arrays: dict[str, DeviceArray]) -> dict[str, int]:
        dims: dict[str, int] = {}
        for t in self.spec.tensors:
            if t.derived is not None:
                continue
            shape = arrays[t.name].shape
            if len(shape) != t.rank:
                raise ArgumentError(
                    f"tensor '{t.name}' must have {t.rank} dims [{', '.join(t.dims)}], got shape {shape}"
                )
            for d, n in zip(t.dims, shape):
                if self.spec.dim(d).size is None:
                    if dims.setdefault(d, int(n)) != n:
                        raise ArgumentError(
                            f"dim {d} is {dims[d]} in an earlier tensor but {n} in '{t.name}'"
                        )
        return dims

    def _check_group_tensors(self, arrays, dims) -> dict[str, np.ndarray]:
        host: dict[str, np.ndarray] = {}
        for g in self.spec.groups:
            if not g.tensor:
                continue
            a = arrays[g.tensor]
            if a.dtype != "i32":
                raise ArgumentError(f"'{g.tensor}' must be int32, got {a.dtype}")
            chain = []
            outer = g
            while outer.within:
                outer = self.spec.group(outer.within)
                chain.insert(0, outer.count)
            shape = (*chain, g.count + 1) if g.kind == "ragged" else (g.count,)
            if tuple(a.shape) != shape:
                raise ArgumentError(f"'{g.tensor}' must have shape {shape}, got {tuple(a.shape)}")
            if a.strides != _row_major(shape):
                raise ArgumentError(f"'{g.tensor}' must be contiguous")
            values = copy_to_host(a, shape)
            host[g.tensor] = values
            size = dims.get(g.dim, self.spec.dim(g.dim).size)
            if g.kind == "masked":
                if (values < 0).any():
                    raise ArgumentError(f"'{g.tensor}' holds a negative count")
                continue
            rows = values.reshape(-1, g.count + 1)
            if (np.diff(rows, axis=1) < 0).any():
                raise ArgumentError(f"'{g.tensor}' must be non-decreasing along each row")
            if g.within is None and (rows[0, 0] != 0 or rows[0, -1] != size):
                raise ArgumentError(
                    f"'{g.tensor}' must start at 0 and end at {g.dim} = {size}, got {rows[0, 0]}..{rows[0, -1]}"
                )
            if g.within is not None:
                outer_off = host[self.spec.group(g.within).tensor].reshape(-1)
                starts, ends = outer_off[:-1], outer_off[1:]
                if (rows[:, 0] != starts).any() or (rows[:, -1] != ends).any():
                    raise ArgumentError(
                        f"'{g.tensor}': each row must span its '{g.within}' segment exactly"
                    )
        return host

    def _check_tensor(self, t: Tensor, arrays, dims, offsets) -> None:
        from ..reference.data import Runtime, scale_grid_shape

        a = arrays[t.name]
        if a.dtype != t.dtype:
            raise ArgumentError(f"tensor '{t.name}' must be {t.dtype}, got {a.dtype}")
        shape = tuple(dims.get(d) or self.spec.dim(d).size for d in t.dims)
        if tuple(a.shape) != shape:
            raise ArgumentError(f"tensor '{t.name}' must have shape {list(shape)}, got {list(a.shape)}")
        env = dict(dims)
        if t.layout.kind == "strided":
            want = tuple(s.evaluate(env) for s in t.layout.strides)
            ok = all(w == s or n <= 1 for w, s, n in zip(want, a.strides, shape))
        else:
            want = _row_major(shape)  # a flat buffer holding the segments one after another
            ok = a.strides == want or 0 in shape
        if not ok:
            raise ArgumentError(
                f"tensor '{t.name}' must have element strides {list(want)} ({t.layout}), got {list(a.strides)}"
            )
        if a.ptr % ALIGN:
            raise ArgumentError(f"tensor '{t.name}' must be {ALIGN}-byte aligned")
        if t.scale is None:
            return
        s = arrays[t.scale.name]
        if s.dtype != "f32":
            raise ArgumentError(f"scale '{t.scale.name}' must be float32, got {s.dtype}")
        grid = scale_grid_shape(self.spec, Runtime(dims, offsets), t)
        if tuple(s.shape) != grid:
            raise ArgumentError(f"scale '{t.scale.name}' must have shape {list(grid)}, got {list(s.shape)}")
        want = tuple(x.evaluate(env) for x in t.scale.layout.strides)
        if not all(w == x or n <= 1 for w, x, n in zip(want, s.strides, grid)):
            raise ArgumentError(
                f"scale '{t.scale.name}' must have element strides {list(want)} ({t.scale.layout}), got {list(s.strides)}"
            )
        if s.ptr % ALIGN:
            raise ArgumentError(f"scale '{t.scale.name}' must be {ALIGN}-byte aligned")

    # ---- launching --------------------------------------------------------------------
    def _kernel(self, source: str, name: str) -> LoadedKernel:
        if name not in self._kernels:
            compiled = compile_cubin(source, name=name, include_dirs=[include_dir()])
            self._kernels[name] = LoadedKernel(compiled, name)
        return self._kernels[name]

    def __call__(self, stream: object = None, **tensors: object) -> None:
        """Validate, then run the whole schedule on `stream` and wait for it."""
        self.prepare(stream, **tensors)()

    def prepare(self, stream: object = None, **tensors: object):
        """Validate once; return a function that runs the schedule and waits for it."""
        bound = self._bind(tensors)
        s = current_stream(stream)

        def run() -> None:
            ptrs: dict[str, object] = dict(bound.arrays)
            for p in self.program.prepasses:
                self._run_prepass(p, bound, ptrs, s)
            for x in self.program.launches:
                self._run_launch(x, bound, ptrs, s)
            s.sync()  # workspaces in `bound` must outlive the kernels that use them
            bound.workspace.clear()

        return run

    def _run_prepass(self, p: EmittedPrePass, bound: _Bound, ptrs: dict, stream) -> None:
        spec = self.spec
        src, dst = spec.tensor(p.prepass.source), spec.tensor(p.prepass.target)
        env = dict(bound.dims)
        shape = [bound.dims.get(d) or spec.dim(d).size for d in src.dims]
        nbytes = max(int(np.prod(shape)), 1)
        out = DeviceBuffer(_ceil(nbytes, ALIGN) * ALIGN)
        bound.workspace.append(out)
        if p.prepass.kind == "transpose":
            cfg = TransposeKernelConfig()
            rows, cols = shape
            kern = self._kernel(p.source, p.kernel)
            kern.launch(
                cfg.grid(1, rows, cols), cfg.threads, 0, stream,
                ptrs[src.name], out, np.int32(1), np.int32(rows), np.int32(cols),
                np.int64(rows * cols), np.int64(src.layout.strides[0].evaluate(env)),
                np.int64(rows * cols), np.int64(dst.layout.strides[1].evaluate(env)),
            )
            ptrs[dst.name] = out
            ptrs[dst.scale.name] = ptrs[src.scale.name]
            return
        cfg = RequantKernelConfig(in_type=src.dtype, out_type=dst.dtype)
        tokens, channels = shape
        if dst.layout.kind == "segment_major":
            group = spec.group(dst.layout.group)
            offsets = ptrs[group.tensor]
            groups = group.count
        else:  # one segment spanning all tokens
            offsets = DeviceBuffer.from_numpy(np.array([0, tokens], dtype=np.int32))
            bound.workspace.append(offsets)
            groups = 1
        rows = cfg.scale_rows_bound(tokens, groups)
        sy = DeviceBuffer(max(rows * channels, 1) * 4)
        bound.workspace.append(sy)
        kern = self._kernel(p.source, p.kernel)
        kern.launch(
            cfg.grid(tokens, channels, groups), cfg.threads, 0, stream,
            ptrs[src.name], np.int64(src.layout.strides[0].evaluate(env)),
            ptrs[src.scale.name], np.int64(src.scale.layout.strides[0].evaluate(env)),
            np.int64(src.scale.layout.strides[1].evaluate(env)),
            offsets, np.int32(groups), np.int32(tokens), np.int32(channels), out, sy,
        )
        ptrs[dst.name], ptrs[dst.scale.name] = out, sy

    def _run_launch(self, x: EmittedLaunch, bound: _Bound, ptrs: dict, stream) -> None:
        table = DeviceBuffer((x.leaf_count + 1) * GS_LEAF_BYTES)
        bound.workspace.append(table)
        builder = self._kernel(x.source, x.table_kernel)
        args = [table] + [ptrs[t] for t in x.table_params] + [np.int64(bound.dims[d]) for d in x.dim_params]
        builder.launch(1, 256, 0, stream, *args)
        pg = x.launch.problems
        gemm = self._kernel(x.source, x.gemm.name)
        sa = ptrs[pg.sa.tensor] if pg.sa else None
        sb = ptrs[pg.sb.tensor] if pg.sb else None
        gemm.launch(
            num_sms(), x.gemm.threads, x.gemm.smem_bytes, stream,
            table, np.int32(x.leaf_count), ptrs[pg.a.tensor], ptrs[pg.b.tensor], ptrs[pg.d.tensor], sa, sb,
        )


def _row_major(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= int(n)
    return tuple(reversed(out))


