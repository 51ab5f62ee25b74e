"""A compiled spec you can call: validate run-time arguments, then launch.

`Executable` owns the emitted program, compiles it with NVRTC on first use
(cubins cached on disk, modules loaded per device), allocates the workspaces that
pre-passes write, and launches pre-passes, leaf-table builders and grouped GEMMs
in schedule order on one stream. What the host can see (names, dtypes, shapes,
strides, alignment, overlaps) is checked before anything is launched and a bad
argument raises `ArgumentError`. The values of offsets and counts are checked on
the device before anything reads them (codegen/validate.py: in launch 0's leaf-table
builder, or a small kernel that runs first), so a call never waits for the GPU;
`check=True` waits and raises on what it found. A call
whose run-time dims leave nothing to write (no tokens at all, say) launches nothing.

A call plans its launches once per argument signature (dtypes, shapes, strides,
device) and stream, and reuses that plan, with its workspaces, for every later
call of the same shapes: only the pointers change. Such a call reads each tensor's
metadata (torch tensors and DeviceArrays directly, without converting them), finds
the plan by it (the last call's by one comparison), checks what depends on the
pointers (alignment, null pointers, outputs overlapping other arguments) with an
expression the plan compiled from ranges it computed once, writes the pointers into
cells its launches share, and launches kernels whose parameters were packed when
the plan was first launched.
"""

from __future__ import annotations

import dataclasses
import functools
import operator
import os
import sys
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from ..codegen.emit import EmittedProgram
from ..codegen.kernels import include_dir
from ..codegen.manifest import CHECK_FLAGS, Manifest, launch_manifest
from ..codegen.validate import group_chain_count, index_rows
from ..codegen.variants import DecodeVariant, decode_variant
from ..errors import ArgumentError, GemmspecError
from ..lower.schedule import Schedule
from ..spec import INDEX_TYPE, Spec, Tensor
from .arrays import DeviceArray, DeviceBuffer, as_device_array, copy_to_host
from .checks import check_outputs, check_sizes, check_written_layouts
from .launch import ArgumentCells, LoadedKernel, num_sms
from .nvrtc import CompiledCubin, compile_cubin
from .plan import plan_steps
from .streams import caller_stream, is_capturing, keep_context, on_device, stream_key, torch_stream

GS_LEAF_BYTES = 144
ALIGN = 16
PLAN_CACHE = 32  # plans kept per executable; a plan captured in a CUDA graph is never dropped


_CHECK_VARIABLE = "GEMMSPEC_CHECK"
_CHECK_KEY = os.environ.encodekey(_CHECK_VARIABLE)
_CHECK_OFF = (None, "", "0", b"", b"0")  # unset, empty or 0, as str or as bytes
_PDL_VARIABLE = "GEMMSPEC_PDL"


def programmatic_launches() -> bool:
    """Whether GEMM kernels are launched as programmatic dependents of their leaf-table
    builders, as the manifest says (GEMMSPEC_PDL=0: the ordinary way). Read when a
    plan's launches are packed, on its first launch, not on every call."""
    return os.environ.get(_PDL_VARIABLE, "1").strip() != "0"


def debug_checks() -> bool:
    """GEMMSPEC_CHECK=1 makes every call behave as if passed check=True (read on every
    call, so it can be switched at run time)."""
    # os.environ.get encodes the name and decodes the value in Python each time, most of
    # a microsecond on a call path of a few; the table behind os.environ, keyed by the
    # encoded name, holds the same value.
    table = getattr(os.environ, "_data", None)
    if table is None:  # os.environ replaced by a plain mapping
        return os.environ.get(_CHECK_VARIABLE) not in _CHECK_OFF
    return table.get(_CHECK_KEY) not in _CHECK_OFF


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _Bound:
    """Arguments of one call after validation."""

    arrays: dict[str, DeviceArray]
    dims: dict[str, int]
    offsets: dict[str, np.ndarray] | None  # host copies of offsets/counts, when read back
    workspace: list = field(default_factory=list)


@dataclass(frozen=True)
class _Arg:
    """A user array in a planned launch, filled in with the pointer of each call."""

    name: str


@dataclass(frozen=True)
class _PointerGuard:
    """The pointer checks of a call of one signature, as plain arithmetic.

    The plan's arrays fix each argument's byte range relative to its pointer, so a
    later call of the same signature only needs its pointers: each aligned, none null
    where there are elements, no output's range meeting another argument's. `check`
    says whether pointers pass; False sends the call through the full checks, which say
    what is wrong.
    """

    aligned: tuple[tuple[int, int], ...]  # (argument index, alignment in bytes)
    present: tuple[int, ...]  # arguments with elements: a null pointer is an error
    apart: tuple[tuple[int, int, int, int, int, int], ...]  # (i, lo, hi, j, lo, hi)
    check: Callable[[tuple[int, ...]], bool] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "check", self._compile())

    def _compile(self) -> Callable[[tuple[int, ...]], bool]:
        """The checks as one expression over the pointers `p`, with the numbers written
        in: a third of the time a loop over the tuples takes, on every call."""
        failures = [f"p[{int(i)}] % {int(a)}" for i, a in self.aligned]
        failures += [f"not p[{int(i)}]" for i in self.present]
        # [p[i] + lo, p[i] + hi) meets [p[j] + lo2, p[j] + hi2) when
        # lo - hi2 < p[j] - p[i] < hi - lo2.
        failures += [
            f"{int(lo - hi2)} < p[{int(j)}] - p[{int(i)}] < {int(hi - lo2)}"
            for i, lo, hi, j, lo2, hi2 in self.apart
        ]
        if not failures:
            return lambda p: True
        return eval(f"lambda p: not ({' or '.join(failures)})", {"__builtins__": {}})


_TORCH_TENSORS: tuple[type, ...] = ()  # torch.Tensor and nn.Parameter once torch is loaded


def _torch_tensor_types() -> tuple[type, ...]:
    global _TORCH_TENSORS
    torch = sys.modules.get("torch")  # None where `import torch` is blocked: no torch tensors
    if not _TORCH_TENSORS and torch is not None:
        _TORCH_TENSORS = (torch.Tensor, torch.nn.Parameter)
    return _TORCH_TENSORS


def _read(objects: tuple) -> tuple[tuple, tuple[int, ...], int, bool] | None:
    """(signature, pointers, device, whether any is a torch tensor) of a call's arguments,
    read without converting them; None when one is neither a torch tensor nor a
    DeviceArray, or the first is not on a CUDA device (the call then converts every
    argument, which says what is wrong). A signature holds what a plan depends on: dtype
    as the object names it, shape, strides, device (a torch tensor's torch.device, which
    also says whether it is a CUDA one; a DeviceArray's ordinal), and the read-only flag
    a DeviceArray carries. `device` is the first argument's ordinal."""
    torch_types = _TORCH_TENSORS or _torch_tensor_types()
    signature, pointers, from_torch = [], [], False
    for o in objects:
        kind = type(o)
        if kind in torch_types:
            signature.append((o.dtype, o.shape, o.stride(), o.device))
            pointers.append(o.data_ptr())
            from_torch = True
        elif kind is DeviceArray:
            signature.append((o.dtype, o.shape, o.strides, o.device, o.readonly))
            pointers.append(o.ptr)
        else:
            return None
    device = signature[0][3]
    if type(device) is not int:  # a torch.device
        if device.type != "cuda":
            return None
        device = device.index
    return tuple(signature), tuple(pointers), device, from_torch


class Executable:
    def __init__(
        self,
        spec: Spec,
        schedule: Schedule,
        program: EmittedProgram,
        explain: Callable[..., str] | None = None,
    ):
        """`explain` renders what `explain()` returns (gemmspec.build passes the
        `gemmspec explain` text; the runtime does not render it itself)."""
        self.spec = spec
        self.schedule = schedule
        self.program = program
        self._explain = explain
        self._kernels: dict[tuple[int, str, str], LoadedKernel] = {}
        self._cubins: dict[str, CompiledCubin] = {}
        self._plans: OrderedDict[tuple, PreparedRun] = OrderedDict()
        self._recent: tuple[tuple, PreparedRun] | None = None  # the last call's key and plan
        # Whether a call picks its launches' decode variant by the run-time dims (see
        # codegen/variants.py); False runs `program` at every size (for comparisons).
        self.choose_at_call = True
        self._variant_manifests: dict[int, Manifest] = {}

    @property
    def sources(self) -> dict[str, str]:
        return self.program.sources()

    def explain(self, width: int | None = None) -> str:
        """The `gemmspec explain` text: one line per item, or wrapped at `width` columns
        as the command prints it (`width=100`)."""
        if self._explain is None:
            raise GemmspecError(f"{self.spec.name}: made without an explain renderer (gemmspec.build gives one)")
        if width is None:
            return self._explain(self.spec, self.schedule)
        return self._explain(self.spec, self.schedule, width=width)

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

    @functools.cached_property
    def _names(self) -> tuple[str, ...]:
        return tuple(self.argument_names())

    @functools.cached_property
    def _take(self) -> Callable[[dict], tuple]:
        """The arguments of a call's keywords in `argument_names()` order (KeyError for
        one missing), in one C call."""
        return take(self._names)

    def _ordered(self, tensors: dict[str, object]) -> tuple:
        """The arguments in `argument_names()` order; ArgumentError for a name missing
        or unknown."""
        if len(tensors) == len(self._names):
            try:
                return self._take(tensors)
            except KeyError:
                pass
        self._check_names(tensors)
        raise AssertionError("unreachable: the names differ")

    def _check_names(self, tensors: dict[str, object]) -> None:
        expected = self._names
        if len(tensors) != len(expected) or any(n not in tensors for n in expected):
            missing = [n for n in expected if n not in tensors]
            if missing:
                raise ArgumentError(f"{self.spec.name}: missing tensor(s): {', '.join(missing)}")
            unknown = [n for n in tensors if n not in expected]
            raise ArgumentError(
                f"{self.spec.name}: unknown argument(s) {', '.join(unknown)}; expected {', '.join(expected)}"
            )

    def _bind(self, tensors: dict[str, object], *, read_offsets: bool = True) -> _Bound:
        """Every check; with `read_offsets`, the offsets values too (a host wait)."""
        arrays = self._arrays(tensors)
        dims = self._check_metadata(arrays)
        self._check_pointers(arrays)
        if not read_offsets:
            return _Bound(arrays, dims, None)
        offsets = self._check_group_values(arrays, dims)
        for t in self.spec.tensors:
            if t.derived is None and t.scale is not None:
                self._check_scale(t, arrays, dims, offsets)
        self._check_index_values(arrays, dims, offsets)
        return _Bound(arrays, dims, offsets)

    def _arrays(self, tensors: dict[str, object]) -> dict[str, DeviceArray]:
        self._check_names(tensors)
        expected = self._names
        arrays: dict[str, DeviceArray] = {}
        for name in expected:
            arrays[name] = as_device_array(tensors[name], name=name, dtype_hint=self._hints.get(name))
        devices = {a.device for a in arrays.values()}
        if len(devices) > 1:
            where = ", ".join(f"{n} on device {a.device}" for n, a in arrays.items())
            raise ArgumentError(
                f"{self.spec.name}: tensors are on different devices {sorted(devices)} ({where}); "
                "pass every tensor on one device"
            )
        return arrays

    @property
    def _hints(self) -> dict[str, str]:
        hints = self.__dict__.get("_hint_cache")
        if hints is None:
            hints = {
                t.name: t.dtype
                for t in self.spec.tensors
                if t.derived is None and t.dtype in ("e4m3", "e5m2", "bf16")
            }
            self.__dict__["_hint_cache"] = hints
        return hints

    def _check_metadata(self, arrays: dict[str, DeviceArray]) -> dict[str, int]:
        """What the shapes, dtypes and strides say; nothing that depends on a pointer."""
        dims = self._runtime_dims(arrays)
        self._check_group_metadata(arrays)
        for t in self.spec.tensors:
            if t.derived is None:
                self._check_tensor(t, arrays, dims)
                if t.scale is not None:
                    self._check_scale_bounds(t, arrays, dims)
        check_sizes(self.spec, self.schedule, self.manifest, dims)
        check_written_layouts(self.spec, dims)
        return dims

    def _check_pointers(self, arrays: dict[str, DeviceArray]) -> None:
        """What depends on the addresses: checked on every call."""
        for t in self.spec.tensors:
            if t.derived is not None:
                continue
            if t.dtype == INDEX_TYPE:  # read an int32 at a time
                a = arrays[t.name]
                if a.ptr % a.itemsize:
                    raise ArgumentError(
                        f"index tensor '{t.name}' must be {a.itemsize}-byte aligned (int32), "
                        f"got address {a.ptr:#x}"
                    )
                continue
            if arrays[t.name].ptr % ALIGN:
                raise ArgumentError(f"tensor '{t.name}' must be {ALIGN}-byte aligned")
            if t.scale is not None and arrays[t.scale.name].ptr % ALIGN:
                raise ArgumentError(f"scale '{t.scale.name}' must be {ALIGN}-byte aligned")
        for g in self.spec.groups:
            if g.tensor:
                a = arrays[g.tensor]
                if a.ptr % a.itemsize:
                    raise ArgumentError(
                        f"'{g.tensor}' must be {a.itemsize}-byte aligned (int32), "
                        f"got address {a.ptr:#x}"
                    )
        self._check_outputs(arrays)

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
        """The shape as declared, run-time dims by name: '[T, 7168]'; a padded
        segment_major tensor's buffer with its padding rows: '[T + 120, 7168]'."""
        sizes = [self.spec.dim(d).size for d in t.dims]
        out = [d if n is None else str(n) for d, n in zip(t.dims, sizes)]
        if t.layout.pad_rows:
            axis, n = t.layout.seg_axis, sizes[t.layout.seg_axis]
            out[axis] = f"{out[axis]} + {t.layout.pad_rows}" if n is None else str(n + t.layout.pad_rows)
        return "[" + ", ".join(out) + "]"

    def _padding_note(self, t: Tensor) -> str:
        """Why a padded segment_major tensor's buffer has more rows than its dim."""
        lay = t.layout
        return (
            f" ({lay}: {lay.pad - 1} rows of padding for each of its "
            f"{lay.pad_rows // (lay.pad - 1)} segments, {lay.pad_rows} rows beyond "
            f"{t.dims[lay.seg_axis]})"
        )

    def _runtime_dims(self, arrays: dict[str, DeviceArray]) -> dict[str, int]:
        dims: dict[str, int] = {}
        padded: list[tuple[Tensor, str, int]] = []
        for t in self.spec.tensors:
            if t.derived is not None:
                continue
            shape = arrays[t.name].shape
            if len(shape) != t.rank:
                raise ArgumentError(
                    f"tensor '{t.name}' must have {t.rank} dims {self._declared_shape(t)}, "
                    f"got shape {list(shape)}"
                )
            for axis, (d, n) in enumerate(zip(t.dims, shape)):
                if t.layout.pad_rows and axis == t.layout.seg_axis:
                    padded.append((t, d, int(n)))  # read after the plain shapes
                    continue
                if self.spec.dim(d).size is None:
                    if dims.setdefault(d, int(n)) != n:
                        raise ArgumentError(
                            f"dim {d} is {dims[d]} in an earlier tensor but {n} in '{t.name}'"
                        )
        # A padded segment_major buffer has the dim's rows plus the padding along it: it
        # gives the dim when no other tensor does (its shape is checked with the rest).
        for t, d, n in padded:
            if self.spec.dim(d).size is None and d not in dims:
                if n < t.layout.pad_rows:
                    raise ArgumentError(
                        f"tensor '{t.name}' must have shape {self._declared_shape(t)}"
                        f"{self._padding_note(t)}, got {list(arrays[t.name].shape)}"
                    )
                dims[d] = n - t.layout.pad_rows
        return dims

    def _group_tensor_shape(self, g) -> tuple[int, ...]:
        # One axis per enclosing group, outermost first.
        outer = tuple(o.count for o in reversed(self.spec.enclosing(g.name)[1:]))
        return (*outer, g.count + 1) if g.kind == "ragged" else (g.count,)

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

    def _check_group_values(self, arrays, dims) -> dict[str, np.ndarray]:
        host: dict[str, np.ndarray] = {}
        for g in self.spec.read_groups:  # the values no kernel reads are not checked
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
            end_ok = 0 <= rows[0, -1] <= size if g.capacity else rows[0, -1] == size
            if g.within is None and (rows[0, 0] != 0 or not end_ok):
                at = "at or below" if g.capacity else "at"
                raise ArgumentError(
                    f"'{g.tensor}' must start at 0 and end {at} {g.dim} = {size}, "
                    f"got {rows[0, 0]}..{rows[0, -1]}"
                )
            if g.within is not None:
                outer = self.spec.group(g.within)
                if outer.kind == "ragged":
                    outer_rows = host[outer.tensor].reshape(-1, outer.count + 1)
                    starts, ends = outer_rows[:, :-1].reshape(-1), outer_rows[:, 1:].reshape(-1)
                else:  # split or uniform: compile-time segments
                    starts = np.asarray(outer.starts, dtype=np.int64)
                    ends = starts + np.asarray(outer.sizes, dtype=np.int64)
                if (rows[:, 0] != starts).any() or (rows[:, -1] != ends).any():
                    raise ArgumentError(
                        f"'{g.tensor}': each row must span its '{g.within}' segment exactly"
                    )
        return host

    def _index_entries_read(self, x, dims, offsets) -> int:
        """How many entries of index tensor x.tensor the statements read: all, or up to
        the end of a capacity group's offsets, or the largest count of a masked group."""
        n = self._dim_size(x.rows, dims)
        if x.limit is None:
            return n
        g = self.spec.group(x.limit)
        values = offsets[g.tensor].reshape(-1)
        end = int(values.max(initial=0)) if g.kind == "masked" else int(values[g.count])
        return max(0, min(end, n))

    def _check_index_values(self, arrays, dims, offsets) -> None:
        """Index tensors, read back: every row number a statement reads lies in the rows
        it picks from, and a scattered output's row numbers are distinct (two rows stored
        to one would race)."""
        read = index_rows(self.spec)
        values: dict[str, np.ndarray] = {}
        for x in read:
            if x.tensor not in values:
                shape = self._shape(self.spec.tensor(x.tensor), dims)
                a = arrays[x.tensor]
                host = copy_to_host(a, shape) if a.size else np.zeros(0)
                values[x.tensor] = host.astype(np.int64).reshape(-1)
            v = values[x.tensor][: self._index_entries_read(x, dims, offsets)]
            bound = self._dim_size(x.bound, dims)
            bad = np.flatnonzero((v < 0) | (v >= bound))
            if len(bad):
                of = " and ".join(f"'{n}'" for n in x.of)
                raise ArgumentError(
                    f"'{x.tensor}' holds a row number outside the {x.bound} rows of {of}: "
                    f"{x.tensor}[{bad[0]}] = {v[bad[0]]}, {x.bound} = {bound}"
                )
        for g in self.spec.gemms:
            if g.scatter is None:
                continue
            x = next(r for r in read if r.tensor == g.scatter and g.out.tensor in r.of)
            v = values[g.scatter][: self._index_entries_read(x, dims, offsets)]
            unique, counts = np.unique(v, return_counts=True)
            if (counts > 1).any():
                row = unique[np.flatnonzero(counts > 1)[0]]
                at = np.flatnonzero(v == row)[:2]
                raise ArgumentError(
                    f"'{g.scatter}' sends rows {at[0]} and {at[1]} to row {row} of output "
                    f"'{g.out.tensor}' ({g.text}); a scattered output's row numbers must be distinct"
                )

    def _check_tensor(self, t: Tensor, arrays, dims) -> None:
        a = arrays[t.name]
        if a.dtype != t.dtype:
            raise ArgumentError(f"tensor '{t.name}' must be {t.dtype}, got {a.dtype}")
        # A padded segment_major tensor's buffer has the padding rows along its segmented dim.
        shape = t.layout.storage_shape(self._shape(t, dims))
        if tuple(a.shape) != shape:
            note = ""
            if t.layout.pad_rows:
                sizes = ", ".join(f"{d} = {dims[d]}" for d in dict.fromkeys(t.dims) if d in dims)
                note = self._padding_note(t) + f", which is {list(shape)}" + (f" for {sizes}" if sizes else "")
            raise ArgumentError(
                f"tensor '{t.name}' must have shape {self._declared_shape(t)}{note}, got {list(a.shape)}"
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
        if t.scale is not None:
            s = arrays[t.scale.name]
            if s.dtype != "f32":
                raise ArgumentError(f"scale '{t.scale.name}' must be float32, got {s.dtype}")
            if len(s.shape) != t.rank:
                raise ArgumentError(f"scale '{t.scale.name}' must have {t.rank} dims, got {len(s.shape)}")
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
        cached = self.__dict__.get("_roles")
        if cached is not None:
            return cached
        roles = self.__dict__["_roles"] = {}
        for t in self.spec.tensors:
            if t.derived is None:
                roles[t.name] = "index" if t.dtype == INDEX_TYPE else "input"
                if t.scale is not None:
                    roles[t.scale.name] = "scale"
        for g in self.spec.groups:
            if g.tensor:
                roles[g.tensor] = "counts" if g.kind == "masked" else "offsets"
        for w in self.spec.written:  # outputs, an FP8 output's copy, row passes' targets
            roles[w] = "output"  # even when a later statement reads it
            scale = self.spec.tensor(w).scale
            if scale is not None:  # an FP8 output's scales are written with it
                roles[scale.name] = "output"
        return roles

    def _check_outputs(self, arrays: dict[str, DeviceArray]) -> None:
        """Outputs are writable and share no byte with any other argument (checks.py).
        A tensor one statement writes and a later one reads is one argument."""
        check_outputs(arrays, self._argument_roles())

    def _pointer_guard(self, arrays: dict[str, DeviceArray]) -> _PointerGuard:
        """`_check_pointers` (and the null-pointer check of `as_device_array`) for later
        calls of the signature of `arrays`, which passed them."""
        index = {n: i for i, n in enumerate(self._names)}
        aligned = []
        for t in self.spec.tensors:
            if t.derived is None:
                aligned.append((index[t.name], arrays[t.name].itemsize if t.dtype == INDEX_TYPE else ALIGN))
                if t.scale is not None:
                    aligned.append((index[t.scale.name], ALIGN))
        for g in self.spec.groups:
            if g.tensor:
                aligned.append((index[g.tensor], arrays[g.tensor].itemsize))
        present = tuple(i for n, i in index.items() if arrays[n].size)
        roles = self._argument_roles()
        names = list(roles)
        extents = {}
        for n in names:
            e = arrays[n].byte_extent()
            extents[n] = None if e is None else (e[0] - arrays[n].ptr, e[1] - arrays[n].ptr)
        apart = []  # an output and any other argument, both with elements
        for i, first in enumerate(names):
            for second in names[i + 1 :]:
                if "output" not in (roles[first], roles[second]):
                    continue
                a, b = extents[first], extents[second]
                if a is not None and b is not None:
                    apart.append((index[first], *a, index[second], *b))
        return _PointerGuard(tuple(aligned), present, tuple(apart))

    def _check_scale(self, t: Tensor, arrays, dims, offsets) -> None:
        from ..reference.data import Runtime, scale_grid_shape

        s = arrays[t.scale.name]
        grid = scale_grid_shape(self.spec, Runtime(dims, offsets), t)
        if tuple(s.shape) != grid:
            raise ArgumentError(
                f"scale '{t.scale.name}' must have shape {list(grid)}, got {list(s.shape)}"
            )

    def _check_scale_bounds(self, t: Tensor, arrays, dims) -> None:
        """The scale grid's shape as far as the shapes alone decide it.

        Along a dim whose blocks restart at each segment of a ragged group, the row
        count follows from the offsets: the host checks the range it must lie in, the
        device that it holds the counted rows.
        """
        s = arrays[t.scale.name]
        want, exact = [], True
        for axis, d in enumerate(t.dims):
            n, b = self._dim_size(d, dims), t.scale.block[axis]
            g = self.spec.group(t.scale.anchor) if t.scale.anchor else None
            if g is None or g.dim != d:
                rows = t.scale.blocks_along(axis, n)
                want.append(str(rows))
                if s.shape[axis] != rows:
                    exact = False
            elif g.kind != "ragged":
                rows = sum(_ceil(size, b) for size in g.sizes)
                want.append(str(rows))
                exact = exact and s.shape[axis] == rows
            else:
                segments = group_chain_count(self.spec, g.name) * g.count
                low = 0 if self._capacity_of(g.name) else _ceil(n, b)
                high = (n + segments * (b - 1)) // b
                want.append(f"{low}..{high}" if low != high else str(low))
                exact = exact and low <= s.shape[axis] <= high
        if not exact:
            raise ArgumentError(
                f"scale '{t.scale.name}' must have shape [{', '.join(want)}], got {list(s.shape)}"
            )

    def _capacity_of(self, group: str) -> bool:
        """Whether the segments of `group` may end below its dim (its outermost group says)."""
        return self.spec.enclosing(group)[-1].capacity

    # ---- launching --------------------------------------------------------------------
    def _kernel(self, source: str, name: str, device: int = 0) -> LoadedKernel:
        """Kernel `name` of `source` on `device`; each source is compiled once, whatever
        it defines, and loaded once per device. Kernels are known by their source as well
        as their name: two programs of one spec (as compiled, the decode variant) must
        never share a kernel because two sources happen to name it alike."""
        key = (device, name, source)
        if key not in self._kernels:
            if source not in self._cubins:
                self._cubins[source] = compile_cubin(source, name=name, include_dirs=[include_dir()])
            self._kernels[key] = LoadedKernel(self._cubins[source], name, device=device)
        return self._kernels[key]

    @functools.cached_property
    def manifest(self) -> Manifest:
        """Every kernel of a call in order, with its arguments (`<spec>.manifest.json`)."""
        return launch_manifest(self.spec, self.program, self.program.spec)

    @functools.cached_property
    def decode(self) -> DecodeVariant | None:
        """The decode variant of the launches over ragged rows of a run-time dim, with the
        rule that picks it per call (None: no launch has one). Made from `program` when
        first asked for."""
        return decode_variant(self.spec, self.schedule, self.program)

    def program_for(self, dims: dict[str, int]) -> EmittedProgram:
        """The program a call with these run-time dims runs: the decode variant where its
        rule picks it, else the program as compiled."""
        if self.choose_at_call and self.decode is not None and self.decode.rule.picks_decode(dims):
            return self.decode.program
        return self.program

    def manifest_of(self, program: EmittedProgram) -> Manifest:
        """The manifest of `program`: `manifest` for the program as compiled, else made once
        (the decode variant's)."""
        if program is self.program:
            return self.manifest
        found = self._variant_manifests.get(id(program))
        if found is None:
            found = self._variant_manifests[id(program)] = launch_manifest(self.spec, program, program.spec)
        return found

    def _step_kernel(self, run: PreparedRun, program: EmittedProgram):
        sources = program.sources()
        return lambda step: self._kernel(sources[step.file], step.symbol, run.device)

    def _compile_variants(self, device: int) -> None:
        """Compile (and load) every kernel of both programs once, so that no later call
        compiles: a call whose size crosses the rule's threshold, a CUDA-graph capture
        included, finds its kernels ready."""
        if not self.choose_at_call or self.decode is None:
            return
        for program in (self.program, self.decode.program):
            sources = program.sources()
            for step in self.manifest_of(program).kernels:
                self._kernel(sources[step.file], step.symbol, device)

    def _writes_nothing(self, dims: dict[str, int]) -> bool:
        """No statement has an element to write: each output is empty, or adds a sum
        over an empty range. (`=` over an empty sum still writes zeros.)"""
        for g in self.spec.gemms:
            if 0 in self._shape(self.spec.tensor(g.out.tensor), dims):
                continue
            if g.accumulate and self._dim_size(g.k.dim, dims) == 0:
                continue
            return False
        # A row pass writes its target (a dot product over no columns is 0).
        return all(0 in self._shape(t, dims) for t in self.spec.row_passes)

    def __call__(self, stream: object = None, *, check: bool | None = None, **tensors: object) -> None:
        """Run the whole schedule on `stream` (default: the caller's current stream).

        Does not wait for the GPU: offsets and counts are checked by the device. With
        `check=True` (or GEMMSPEC_CHECK=1) it waits and raises `ArgumentError` for what
        the device found.
        """
        self._call(self._ordered(tensors), stream, check)

    def _call(self, objects: tuple, stream: object, check: bool | None) -> None:
        """A call on `objects`, the arguments in `argument_names()` order."""
        if not self._call_planned(objects, stream, check):
            self._call_checked(objects, stream, check)

    def _key(self, objects: tuple, stream: object) -> tuple[tuple, tuple[int, ...]] | None:
        """The plan key of a call (signature, device, stream handle) and its pointers, read
        from torch tensors and DeviceArrays without converting them; None for any other
        argument."""
        read = _read(objects)
        if read is None:
            return None
        signature, pointers, device, from_torch = read
        if stream is None:
            handle = torch_stream(device) if from_torch else 0
        else:
            handle = stream_key(stream, objects, device)
        return (signature, device, handle), pointers

    def _call_planned(self, objects: tuple, stream: object, check: bool | None) -> bool:
        """The call on a cached plan, if one fits; False, with nothing done, when none does."""
        planned = self._planned(objects, stream)
        if planned is None:
            return False
        self._launch_planned(*planned, objects, check)
        return True

    def _planned(self, objects: tuple, stream: object) -> tuple[PreparedRun, tuple[int, ...]] | None:
        """The cached plan that fits a call, and the call's pointers: the arguments'
        signature and stream are the plan's and the pointers pass its checks (every other
        check held when it was made). Launches nothing."""
        found = self._key(objects, stream)
        if found is None:
            return None
        key, pointers = found
        # Calls mostly repeat the last one's key: one comparison, no hashing.
        recent = self._recent
        if recent is not None and recent[0] == key:
            run = recent[1]
        else:
            run = self._plans.get(key)
            if run is None:
                return None
            self._plans.move_to_end(key)
            self._recent = (key, run)
        return (run, pointers) if run.guard.check(pointers) else None

    def _launch_planned(self, run: PreparedRun, pointers: tuple[int, ...], objects: tuple, check) -> None:
        """Launch a plan `_planned` found for `objects`; wait and check if asked to."""
        if run.launches:
            run.launch(pointers)
            if check or (check is None and debug_checks()):
                run.check(self._arrays(dict(zip(self._names, objects))))

    def _call_checked(self, objects: tuple, stream: object, check: bool | None) -> None:
        """The call with every check, planning it when its signature or stream is new.
        The caller's current context (torch's current device) is the same after it."""
        with keep_context():
            self._call_checked_here(objects, stream, check)

    def _call_checked_here(self, objects: tuple, stream: object, check: bool | None) -> None:
        arrays = self._arrays(dict(zip(self._names, objects)))
        device = next(iter(arrays.values())).device
        found = self._key(objects, stream)
        if found is None:
            key = (_signature(arrays), device, stream_key(stream, objects, device))
        else:
            key = found[0]
        run = self._plans.get(key)
        if run is None:
            run = self._plan_call(key, arrays, stream, objects)
        else:
            self._plans.move_to_end(key)
            self._recent = (key, run)
            self._check_pointers(arrays)
        if not run.launches:
            return
        run.enqueue(arrays)
        if check or (check is None and debug_checks()):
            run.check(arrays)

    def _plan_call(self, key: tuple, arrays: dict[str, DeviceArray], stream, objects) -> PreparedRun:
        """A plan for a new signature and stream. Inside a CUDA-graph capture nothing may
        be allocated: the capture then takes over a plan of the same shapes made before."""
        signature, device, _ = key
        dims = self._check_metadata(arrays)
        self._check_pointers(arrays)
        stream = caller_stream(stream, objects, device)
        if is_capturing(stream):
            for (sig, dev, _), run in self._plans.items():
                if (sig, dev) == (signature, device):
                    # Same launches and workspaces on the capturing stream; the graph keeps
                    # their addresses, so this plan is never dropped.
                    captured = dataclasses.replace(run, stream=stream, pinned=True)
                    self._plans[key] = captured
                    self._recent = (key, captured)
                    return captured
            raise GemmspecError(
                f"{self.spec.name}: first call with these shapes is inside a CUDA-graph "
                "capture; call it once before capturing (a warm-up), so its workspaces exist"
            )
        run = self._plan(_Bound(arrays, dims, None), stream, keep=False)
        run.guard = self._pointer_guard(arrays)
        self._plans[key] = run
        while len(self._plans) > PLAN_CACHE:
            old = next((k for k, r in self._plans.items() if not r.pinned), None)
            if old is None:
                break
            del self._plans[old]  # its buffers are freed in order on their own stream
        if key in self._plans:  # (not when every other plan is pinned)
            self._recent = (key, run)
        return run

    def prepare(self, stream: object = None, *, check: bool = True, **tensors: object) -> PreparedRun:
        """Validate once, allocate workspaces, and return the launch list.

        `check=True` also reads the offsets back and checks their values on the host
        (one wait). `enqueue()` on the result issues every kernel on the stream without
        synchronising (so it can be timed or captured in a CUDA graph).
        """
        with keep_context():  # the caller's current device stays its own
            bound = self._bind(tensors, read_offsets=check)
            device = next(iter(bound.arrays.values())).device
            return self._plan(bound, caller_stream(stream, tensors.values(), device), keep=True)

    def _plan(self, bound: _Bound, stream, *, keep: bool) -> PreparedRun:
        device = next(iter(bound.arrays.values())).device
        # A cached plan keeps no array of the call that made it: holding a framework's
        # tensor would keep its memory alive (and out of a CUDA-graph pool's books).
        arrays = dict(bound.arrays) if keep else {}
        run = PreparedRun(stream, workspace=[], device=device, arrays=arrays)
        run.names = tuple(bound.arrays)
        # A cached plan refers back weakly: a cycle would leave its workspaces to the
        # cyclic collector, which may free them in the middle of someone's CUDA-graph
        # capture (a free on another stream then invalidates the capture).
        run.executable = self if keep else weakref.proxy(self)
        run.dims = dict(bound.dims)
        if self._writes_nothing(bound.dims):
            return run
        program = self.program_for(bound.dims)
        manifest = self.manifest_of(program)
        run.program = program
        with on_device(device):
            self._compile_variants(device)
            ptrs: dict[str, object] = {name: _Arg(name) for name in bound.arrays}
            # The same steps, in the same order, as the emitted host launcher; the offsets
            # check among them (its flags and checked copies are workspaces).
            buffers = plan_steps(
                manifest, run, ptrs, bound.dims, num_sms(run.device), self._step_kernel(run, program),
                lambda name, axis: bound.arrays[name].shape[axis],
            )
        # Every workspace by its manifest name (`prepass0.x_q` ...): what reads a derived
        # tensor or a scale grid back after a call, as the tests of the passes do.
        run.buffers = buffers
        check = manifest.offsets_check
        if check is not None:
            run.flags, run.checks = buffers[CHECK_FLAGS], check.checks
        return run


class PlannedLaunch(NamedTuple):
    """One kernel of a run: its arguments (user arrays as placeholders) and whether it is
    launched as a programmatic dependent of the kernel before it."""

    kernel: LoadedKernel
    grid: tuple
    block: int
    smem: int
    args: tuple
    programmatic: bool = False


@dataclass
class PreparedRun:
    """Validated arguments, owned workspaces and the ordered kernel launches.

    Launch arguments that are user arrays stay placeholders: `enqueue(arrays)` runs
    the same plan on other arrays of the same signature.
    """

    stream: object
    workspace: list
    launches: list = field(default_factory=list)
    device: int = 0
    arrays: dict = field(default_factory=dict)
    flags: DeviceBuffer | None = None  # one int per check of the offsets check
    checks: tuple = ()
    pinned: bool = False  # captured in a CUDA graph: never dropped from the plan cache
    executable: object = None
    dims: dict = field(default_factory=dict)
    names: tuple = ()  # the arguments, in the order of the pointers `launch` takes
    buffers: dict = field(default_factory=dict)  # the workspaces by manifest name
    program: EmittedProgram | None = None  # what it launches: as compiled, or the decode variant
    guard: _PointerGuard | None = None  # the pointer checks of a cached plan
    # The cells of the pointers, the launches that read them, with their parameters
    # packed for this run's stream, and the switch to the run's device (made when first
    # launched; a plan taken over by a capture packs its own). One attribute, so two
    # threads never mix two packings.
    _bound: tuple[ArgumentCells, list, object] | None = field(default=None, init=False, repr=False, compare=False)

    def allocate(self, nbytes: int) -> DeviceBuffer:
        buf = DeviceBuffer(_ceil(nbytes, ALIGN) * ALIGN, device=self.device, stream=self.stream)
        self.workspace.append(buf)
        return buf

    def upload(self, array: np.ndarray) -> DeviceBuffer:
        buf = DeviceBuffer.from_numpy(array, device=self.device, stream=self.stream)
        self.workspace.append(buf)
        return buf

    def add(self, kernel: LoadedKernel, grid, block, smem: int, *args, programmatic: bool = False) -> None:
        self.launches.append(PlannedLaunch(kernel, grid, block, smem, args, programmatic))

    def enqueue(self, arrays: dict[str, DeviceArray] | None = None) -> None:
        """Issue every kernel on the stream, on the bound arrays or on `arrays` (same
        signature; not kept)."""
        bound = self.arrays if arrays is None else arrays
        self.launch(tuple([bound[n].ptr for n in self.names]))

    def launch(self, pointers: tuple[int, ...]) -> None:
        """Issue every kernel with `pointers` for the arguments (in `names` order)."""
        bound = self._bound
        if bound is None:
            with on_device(self.device):
                bound = self._bound = self._pack()
        cells, launches, switch = bound
        # The switch keeps the caller's context while the body runs: one entry at a time,
        # which the cells' lock ensures.
        with cells.lock, switch:
            cells.write(pointers)
            for launch in launches:
                launch.launch()

    def _pack(self) -> tuple[ArgumentCells, list, object]:
        """Each launch's arguments checked and packed once; user arrays become slots that
        read the run's argument cells."""
        index = {n: i for i, n in enumerate(self.names)}
        cells = ArgumentCells(len(self.names))
        packed = []
        pdl = programmatic_launches()
        for kernel, grid, block, smem, args, programmatic in self.launches:
            slots = {p: index[a.name] for p, a in enumerate(args) if type(a) is _Arg}
            values = [None if p in slots else a for p, a in enumerate(args)]
            packed.append(
                kernel.bind(grid, block, smem, self.stream, values, slots, cells, programmatic=programmatic and pdl)
            )
        return cells, packed, on_device(self.device)

    def synchronize(self) -> None:
        self.stream.sync()

    def check(self, arrays: dict[str, DeviceArray] | None = None) -> None:
        """Wait for the run and raise `ArgumentError` if the device found bad offsets,
        counts or anchored scale shapes (the launches then computed nothing)."""
        with keep_context():
            self._check_here(arrays)

    def _check_here(self, arrays: dict[str, DeviceArray] | None) -> None:
        self.synchronize()
        exe = self.executable
        if exe is not None and any(g.scatter for g in exe.spec.gemms):
            # A scattered output's row numbers must be distinct: no flag checks that, the host does.
            arrays = self.arrays if arrays is None else arrays
            exe._check_index_values(arrays, self.dims, exe._check_group_values(arrays, self.dims))
        if self.flags is None or not self.checks:
            return
        flags = self.flags.to_numpy(len(self.checks), np.int32)
        failed = [c for c, f in zip(self.checks, flags) if f]
        if not failed:
            return
        if exe is not None:  # the host checks say it with the values (its executable lives)
            arrays = self.arrays if arrays is None else arrays
            offsets = exe._check_group_values(arrays, self.dims)
            for t in exe.spec.tensors:
                if t.derived is None and t.scale is not None:
                    exe._check_scale(t, arrays, self.dims, offsets)
            exe._check_index_values(arrays, self.dims, offsets)
        dims = ", ".join(f"{d} = {n}" for d, n in self.dims.items())
        raise ArgumentError("; ".join(c.message for c in failed) + (f" ({dims})" if dims else ""))


def take(keys: tuple) -> Callable[[Mapping | Sequence], tuple]:
    """`items -> tuple(items[k] for k in keys)`, in one C call (KeyError or IndexError for
    a key missing)."""
    if len(keys) == 1:  # itemgetter of one key returns the bare value
        return lambda items: (items[keys[0]],)
    return operator.itemgetter(*keys)


def _signature(arrays: dict[str, DeviceArray]) -> tuple:
    """What a plan depends on: everything about the arrays except where they are."""
    return tuple((a.dtype, a.shape, a.strides) for a in arrays.values())


def _row_major(shape) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= int(n)
    return tuple(reversed(out))


