"""A compiled spec you can call: validate run-time arguments, then launch.

`Executable` owns the emitted program, compiles it with NVRTC on first use
(cubins cached on disk), allocates the workspaces that pre-passes write, and
launches pre-passes, leaf-table builders and grouped GEMMs in schedule order on
one stream. Every argument is checked before anything is launched; a bad one
raises `ArgumentError` naming the tensor and what was expected. A call whose
run-time dims leave nothing to write (no tokens at all, say) launches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..codegen.emit import EmittedLaunch, EmittedPrePass, EmittedProgram
from ..codegen.kernels import RequantKernelConfig, TransposeKernelConfig, include_dir, map_specs
from ..errors import ArgumentError
from ..explain import explain_text
from ..lower.schedule import Schedule
from ..spec import Spec, Tensor
from .arrays import DeviceArray, DeviceBuffer, as_device_array, copy_to_host
from .launch import LoadedKernel, current_stream, num_sms
from .nvrtc import CompiledCubin, compile_cubin
from .tensormap import TENSOR_MAP_BYTES, operand_templates

GS_LEAF_BYTES = 144
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
        self._cubins: dict[str, CompiledCubin] = {}

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
        # Metadata first (no device access), then the values of offsets and counts,
        # then what depends on them (scale grids anchored at segment starts).
        dims = self._runtime_dims(arrays)
        self._check_group_metadata(arrays)
        for t in self.spec.tensors:
            if t.derived is None:
                self._check_tensor(t, arrays, dims)
        self._check_outputs(arrays)
        offsets = self._check_group_values(arrays, dims)
        for t in self.spec.tensors:
            if t.derived is None and t.scale is not None:
                self._check_scale(t, arrays, dims, offsets)
        return _Bound(arrays, dims, offsets)

    def _tensor_named(self, name: str) -> Tensor | None:
        for t in self.spec.tensors:
            if t.name == name:
                return t
        return None

    def _dim_size(self, name: str, dims: dict[str, int]) -> int:
        """A dim's size in this call: read from the shapes if run-time (0 included)."""
        return dims[name] if name in dims else self.spec.dim(name).size

    def _shape(self, t: Tensor, dims: dict[str, int]) -> tuple[int, ...]:
        return tuple(self._dim_size(d, dims) for d in t.dims)

    def _declared_shape(self, t: Tensor) -> str:
        """The shape as declared, run-time dims by name: '[T, 7168]'."""
        sizes = (self.spec.dim(d).size for d in t.dims)
        return "[" + ", ".join(d if n is None else str(n) for d, n in zip(t.dims, sizes)) + "]"

    def _runtime_dims(self, arrays: dict[str, DeviceArray]) -> dict[str, int]:
        dims: dict[str, int] = {}
        for t in self.spec.tensors:
            if t.derived is not None:
                continue
            shape = arrays[t.name].shape
            if len(shape) != t.rank:
                raise ArgumentError(
                    f"tensor '{t.name}' must have {t.rank} dims {self._declared_shape(t)}, "
                    f"got shape {list(shape)}"
                )
            for d, n in zip(t.dims, shape):
                if self.spec.dim(d).size is None:
                    if dims.setdefault(d, int(n)) != n:
                        raise ArgumentError(
                            f"dim {d} is {dims[d]} in an earlier tensor but {n} in '{t.name}'"
                        )
        return dims

    def _group_tensor_shape(self, g) -> tuple[int, ...]:
        chain = []
        outer = g
        while outer.within:
            outer = self.spec.group(outer.within)
            chain.insert(0, outer.count)
        return (*chain, g.count + 1) if g.kind == "ragged" else (g.count,)

    def _check_group_metadata(self, arrays) -> None:
        for g in self.spec.groups:
            if not g.tensor:
                continue
            a = arrays[g.tensor]
            shape = self._group_tensor_shape(g)
            if a.dtype != "i32":
                raise ArgumentError(f"'{g.tensor}' must be int32, got {a.dtype}")
            if tuple(a.shape) != shape:
                raise ArgumentError(f"'{g.tensor}' must have shape {list(shape)}, got {list(a.shape)}")
            if a.strides != _row_major(shape):
                raise ArgumentError(f"'{g.tensor}' must be contiguous")
            if a.ptr % a.itemsize:
                raise ArgumentError(
                    f"'{g.tensor}' must be {a.itemsize}-byte aligned (int32), "
                    f"got address {a.ptr:#x}"
                )

    def _check_group_values(self, arrays, dims) -> dict[str, np.ndarray]:
        host: dict[str, np.ndarray] = {}
        for g in self.spec.groups:
            if not g.tensor:
                continue
            values = copy_to_host(arrays[g.tensor], self._group_tensor_shape(g)).astype(np.int64)
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
                    f"'{g.tensor}' must start at 0 and end at {g.dim} = {size}, "
                    f"got {rows[0, 0]}..{rows[0, -1]}"
                )
            if g.within is not None:
                outer_off = host[self.spec.group(g.within).tensor].reshape(-1)
                starts, ends = outer_off[:-1], outer_off[1:]
                if (rows[:, 0] != starts).any() or (rows[:, -1] != ends).any():
                    raise ArgumentError(
                        f"'{g.tensor}': each row must span its '{g.within}' segment exactly"
                    )
        return host

    def _check_tensor(self, t: Tensor, arrays, dims) -> None:
        a = arrays[t.name]
        if a.dtype != t.dtype:
            raise ArgumentError(f"tensor '{t.name}' must be {t.dtype}, got {a.dtype}")
        shape = self._shape(t, dims)
        if tuple(a.shape) != shape:
            raise ArgumentError(
                f"tensor '{t.name}' must have shape {self._declared_shape(t)}, got {list(a.shape)}"
            )
        env = dict(dims)
        # An empty tensor addresses nothing: any strides describe it.
        if t.layout.kind == "strided":
            want = tuple(s.evaluate(env) for s in t.layout.strides)
            ok = all(w == s or n <= 1 for w, s, n in zip(want, a.strides, shape)) or 0 in shape
        else:
            want = _row_major(shape)  # a flat buffer holding the segments one after another
            ok = a.strides == want or 0 in shape
        if not ok:
            raise ArgumentError(
                f"tensor '{t.name}' must have element strides {list(want)} ({t.layout}), "
                f"got {list(a.strides)}"
            )
        if a.ptr % ALIGN:
            raise ArgumentError(f"tensor '{t.name}' must be {ALIGN}-byte aligned")
        if t.scale is not None:
            s = arrays[t.scale.name]
            if s.dtype != "f32":
                raise ArgumentError(f"scale '{t.scale.name}' must be float32, got {s.dtype}")
            if len(s.shape) != t.rank:
                raise ArgumentError(f"scale '{t.scale.name}' must have {t.rank} dims, got {len(s.shape)}")
            if s.ptr % ALIGN:
                raise ArgumentError(f"scale '{t.scale.name}' must be {ALIGN}-byte aligned")
            want = tuple(x.evaluate(env) for x in t.scale.layout.strides)
            if 0 not in s.shape and not all(
                w == x or n <= 1 for w, x, n in zip(want, s.strides, s.shape)
            ):
                raise ArgumentError(
                    f"scale '{t.scale.name}' must have element strides {list(want)} "
                    f"({t.scale.layout}), got {list(s.strides)}"
                )

    def _argument_roles(self) -> dict[str, str]:
        """What each argument is to a call: 'output', 'input', 'scale', 'offsets' or 'counts'."""
        roles = {}
        for t in self.spec.tensors:
            if t.derived is None:
                roles[t.name] = "input"
                if t.scale is not None:
                    roles[t.scale.name] = "scale"
        for g in self.spec.groups:
            if g.tensor:
                roles[g.tensor] = "counts" if g.kind == "masked" else "offsets"
        for g in self.spec.gemms:
            roles[g.out.tensor] = "output"  # even when a later statement reads it
        return roles

    def _check_outputs(self, arrays: dict[str, DeviceArray]) -> None:
        """Outputs are writable and share no byte with any other argument.

        Extents are byte ranges from shape and strides, so two views interleaved in one
        buffer count as overlapping. A tensor one statement writes and a later one
        reads is one argument, so it never overlaps itself.
        """
        roles = self._argument_roles()
        names = list(roles)
        for name in names:
            if roles[name] == "output" and arrays[name].readonly:
                raise ArgumentError(f"output '{name}' is read-only; pass a writable tensor")
        extents = {n: arrays[n].byte_extent() for n in names}
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                if "output" not in (roles[first], roles[second]):
                    continue
                a, b = extents[first], extents[second]
                if a is None or b is None or a[1] <= b[0] or b[1] <= a[0]:
                    continue
                out, other = (first, second) if roles[first] == "output" else (second, first)
                how = "is the same memory as" if a == b else "overlaps"
                raise ArgumentError(
                    f"output '{out}' {how} {roles[other]} '{other}' "
                    f"(bytes [{extents[out][0]:#x}, {extents[out][1]:#x}) and "
                    f"[{extents[other][0]:#x}, {extents[other][1]:#x})); "
                    "an output must not share memory with any other argument"
                )

    def _check_scale(self, t: Tensor, arrays, dims, offsets) -> None:
        from ..reference.data import Runtime, scale_grid_shape

        s = arrays[t.scale.name]
        grid = scale_grid_shape(self.spec, Runtime(dims, offsets), t)
        if tuple(s.shape) != grid:
            raise ArgumentError(
                f"scale '{t.scale.name}' must have shape {list(grid)}, got {list(s.shape)}"
            )

    # ---- launching --------------------------------------------------------------------
    def _kernel(self, source: str, name: str) -> LoadedKernel:
        """Kernel `name` of `source`; each source is compiled once, whatever it defines."""
        if name not in self._kernels:
            if source not in self._cubins:
                self._cubins[source] = compile_cubin(source, name=name, include_dirs=[include_dir()])
            self._kernels[name] = LoadedKernel(self._cubins[source], name)
        return self._kernels[name]

    def _writes_nothing(self, dims: dict[str, int]) -> bool:
        """No statement has an element to write: each output is empty, or adds a sum
        over an empty range. (`=` over an empty sum still writes zeros.)"""
        for g in self.spec.gemms:
            if 0 in self._shape(self.spec.tensor(g.out.tensor), dims):
                continue
            if g.accumulate and self._dim_size(g.k.dim, dims) == 0:
                continue
            return False
        return True

    def __call__(self, stream: object = None, **tensors: object) -> None:
        """Validate, then run the whole schedule on `stream` and wait for it."""
        run = self.prepare(stream, **tensors)
        if not run.launches:
            return
        run.enqueue()
        run.synchronize()

    def prepare(self, stream: object = None, **tensors: object) -> PreparedRun:
        """Validate once, allocate workspaces, and return the launch list.

        `enqueue()` on the result issues every kernel on the stream without
        synchronising (so it can be timed or captured in a CUDA graph).
        """
        bound = self._bind(tensors)
        run = PreparedRun(current_stream(stream), workspace=[])
        if self._writes_nothing(bound.dims):
            return run
        ptrs: dict[str, object] = dict(bound.arrays)
        for p in self.program.prepasses:
            self._plan_prepass(p, bound, ptrs, run)
        for x in self.program.launches:
            self._plan_launch(x, bound, ptrs, run)
        return run

    def _plan_prepass(self, p: EmittedPrePass, bound: _Bound, ptrs: dict, run: PreparedRun) -> None:
        spec = self.spec
        src, dst = spec.tensor(p.prepass.source), spec.tensor(p.prepass.target)
        env = dict(bound.dims)
        shape = [self._dim_size(d, bound.dims) for d in src.dims]
        out = run.allocate(max(int(np.prod(shape)), 1))
        kern = self._kernel(p.source, p.kernel)
        if p.prepass.kind == "transpose":
            cfg = TransposeKernelConfig()
            rows, cols = shape
            run.add(
                kern, cfg.grid(1, rows, cols), cfg.threads, 0,
                ptrs[src.name], out, np.int32(1), np.int32(rows), np.int32(cols),
                np.int64(rows * cols), np.int64(src.layout.strides[0].evaluate(env)),
                np.int64(rows * cols), np.int64(dst.layout.strides[1].evaluate(env)),
            )
            ptrs[dst.name] = out
            ptrs[dst.scale.name] = ptrs[src.scale.name]  # transpose keeps the scale grid
            return
        cfg = RequantKernelConfig(in_type=src.dtype, out_type=dst.dtype)
        tokens, channels = shape
        if dst.layout.kind == "segment_major":
            group = spec.group(dst.layout.group)
            offsets, groups = ptrs[group.tensor], group.count
        else:  # one segment spanning all tokens
            offsets, groups = run.upload(np.array([0, tokens], dtype=np.int32)), 1
        sy = run.allocate(max(cfg.scale_rows_bound(tokens, groups) * channels, 1) * 4)
        run.add(
            kern, cfg.grid(tokens, channels, groups), cfg.threads, 0,
            ptrs[src.name], np.int64(src.layout.strides[0].evaluate(env)),
            ptrs[src.scale.name], np.int64(src.scale.layout.strides[0].evaluate(env)),
            np.int64(src.scale.layout.strides[1].evaluate(env)),
            offsets, np.int32(groups), np.int32(tokens), np.int32(channels), out, sy,
        )
        ptrs[dst.name], ptrs[dst.scale.name] = out, sy

    def _plan_launch(self, x: EmittedLaunch, bound: _Bound, ptrs: dict, run: PreparedRun) -> None:
        pg = x.launch.problems
        a, b = ptrs[pg.a.tensor], ptrs[pg.b.tensor]
        table = run.allocate((x.leaf_count + 1) * GS_LEAF_BYTES)
        maps = run.allocate(len(map_specs(x.gemm)) * x.leaf_count * TENSOR_MAP_BYTES)
        templates = run.upload(operand_templates(x.gemm, maps.ptr))
        builder = self._kernel(x.source, x.table_kernel)
        args = [ptrs[t] for t in x.table_params] + [np.int64(bound.dims[d]) for d in x.dim_params]
        run.add(builder, 1, 256, 0, table, maps, templates, a, b, *args)
        gemm = self._kernel(x.source, x.gemm.name)
        sa = ptrs[pg.sa.tensor] if pg.sa else None
        sb = ptrs[pg.sb.tensor] if pg.sb else None
        # Persistent grid: one CTA per SM, whole clusters only.
        grid = max(num_sms() // x.gemm.cluster, 1) * x.gemm.cluster
        run.add(
            gemm, grid, x.gemm.threads, x.gemm.smem_bytes,
            table, maps, np.int32(x.leaf_count), a, b, ptrs[pg.d.tensor], sa, sb,
        )


@dataclass
class PreparedRun:
    """Validated arguments, owned workspaces and the ordered kernel launches."""

    stream: object
    workspace: list
    launches: list = field(default_factory=list)

    def allocate(self, nbytes: int) -> DeviceBuffer:
        buf = DeviceBuffer(_ceil(nbytes, ALIGN) * ALIGN)
        self.workspace.append(buf)
        return buf

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        buf = DeviceBuffer.from_numpy(array)
        self.workspace.append(buf)
        return buf

    def add(self, kernel: LoadedKernel, grid, block, smem: int, *args) -> None:
        self.launches.append((kernel, grid, block, smem, args))

    def enqueue(self) -> None:
        for kernel, grid, block, smem, args in self.launches:
            kernel.launch(grid, block, smem, self.stream, *args)

    def synchronize(self) -> None:
        self.stream.sync()


def _row_major(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= int(n)
    return tuple(reversed(out))


