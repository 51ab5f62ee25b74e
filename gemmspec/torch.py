"""gemmspec as PyTorch operators: `op(spec)` and, for training, `function(spec)`.

`op(spec)` registers the spec as two `torch.library` custom ops, so `torch.compile`
(fullgraph=True included) sees one opaque node per call and CUDA graphs capture it:

- `gemmspec::<name>`: the inputs (tensors, scales, offsets/counts, index tensors) in,
  every output returned, freshly allocated (an output that a statement `+=` or scatters
  rows into starts from zeros);
- `gemmspec::<name>_out`: the inputs and the outputs in, the outputs written in place
  (declared as mutated, so torch.compile functionalizes it).

Both have a fake (meta) implementation that allocates outputs of the right shape and
dtype from the input shapes, which is all torch.compile needs to trace. The object
`op` returns picks one: called without outputs it returns them, with all of them it
fills them. Only this module imports torch; the rest of gemmspec does not need it.

Called eagerly with nothing watching the dispatcher (not compiling or tracing, no
torch-function or dispatch mode, no functorch transform, no profiler, no input that
needs a gradient) and arguments that fit a plan the spec already made, the object
launches that plan itself: what the dispatcher would add is a few microseconds of
argument boxing and fallbacks that do nothing for such a call. Everything else (a
first call, a bad argument, torch.compile's graphs) goes through the dispatcher, and
so does every call of an op whose `direct` is set to False.

`quantize(value, dtype, block)` makes FP8 operands and their scales from BF16, F16 or
F32 tensors by the rule of the language's `quantize` pass: on the GPU with that pass's
kernel, one launch per tensor (the custom op `gemmspec::quantize`, direct in the same
way), elsewhere and for tensors the kernel does not take with torch operations that
compute the same bits. `function(spec)` quantizes its FP8 operands with it.
"""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass
from pathlib import Path

import torch

from . import ast
from .codegen.validate import group_chain_count
from .errors import ArgumentError, GemmspecError
from .runtime.arrays import DeviceArray, as_device_array
from .runtime.executor import take
from .runtime.quantize import QuantizeLaunch, plan_quantize
from .runtime.streams import keep_context, torch_stream

__all__ = ["BackwardFeed", "GemmFunction", "GemmOp", "Quantization", "function", "op", "quantize", "torch_dtype"]

_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "i32": torch.int32,
}
# The element types of host tensors as the executables name them (uint8 and uint16: FP8
# and 16-bit data stored untyped, which the spec's declared type gives meaning to).
_HOST_ELEMENTS = {
    **{v: k for k, v in _DTYPES.items()},
    torch.float64: "f64",
    torch.int64: "i64",
    torch.uint8: "u8",
    torch.uint16: "raw16",
}
_LIB = torch.library.Library("gemmspec", "FRAGMENT")  # kept alive: it owns the registrations
_OPS: dict[str, GemmOp] = {}


def _torch_watchers() -> tuple | None:
    """Torch's queries of what could watch an op call besides autograd, or None where this
    torch lacks one (its calls then always take the dispatcher)."""
    try:
        return (
            torch.compiler.is_compiling,  # torch.compile and export (first: dynamo folds it)
            torch._C._is_torch_function_mode_enabled,
            torch._C._len_torch_dispatch_stack,  # fake tensors, make_fx, debug modes
            torch._C._are_functorch_transforms_active,  # vmap, grad, functionalize
            torch._C._get_tracing_state,  # torch.jit.trace
            torch._C._autograd._profiler_enabled,
        )
    except AttributeError:
        return None


_WATCHERS = _torch_watchers()


def _unwatched() -> bool:
    """Whether an op call may skip the dispatcher, as far as anything but autograd goes:
    nothing but the kernel would run for it."""
    if _WATCHERS is None:
        return False
    compiling, function_mode, dispatch_modes, transforms, tracing, profiling = _WATCHERS
    return not (
        compiling()
        or function_mode()
        or dispatch_modes()
        or transforms()
        or tracing() is not None
        or profiling()
    )


_requires_grad = operator.attrgetter("requires_grad")


def _need_grad(tensors) -> bool:
    """Whether autograd would record a call on `tensors` (the functional op's autograd
    kernel, whose backward refuses: the op has no derivative)."""
    return torch.is_grad_enabled() and any(map(_requires_grad, tensors))


def _refuse_host(op: object, named) -> None:
    """The error `gemmspec.build`'s executables give for a tensor on the host, where the op
    has no CPU kernel: the dispatcher would otherwise refuse the call in terms of its
    dispatch keys. `named`: (name, value) pairs; `op`: the OpOverload the call goes to. A
    CPU kernel registered for the op (a test's reference) takes such calls instead."""
    for name, value in named:
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            if not torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU"):
                raise ArgumentError(f"tensor {name!r} is on the host; pass a CUDA tensor")
            return


def _refuse_mixed(spec: str, named) -> None:
    """An ArgumentError for an argument that is not a tensor, or tensors on more than one
    device (the dispatcher would pick one tensor's kernel, the meta one for any meta
    tensor, and so compute nothing). `named`: (name, value) pairs."""
    first = None
    for name, value in named:
        if not isinstance(value, torch.Tensor):
            raise ArgumentError(f"{spec}: {name!r} is a {type(value).__qualname__}, not a torch tensor")
        if first is None:
            first = (name, value.device)
        elif value.device != first[1]:
            raise ArgumentError(
                f"{spec}: tensors are on different devices ({first[0]!r} on {first[1]}, "
                f"{name!r} on {value.device}); pass every tensor on one device"
            )


def _past_capacity(spec, g) -> bool:
    """Whether statement `g` writes no element of its output past a capacity group's end:
    a group splitting its rows or columns, or its leaves, is one (or lies in one) over a
    dim its output has (a WGRAD's capacity dim is its K: every element is written)."""
    out_dims = spec.tensor(g.out.tensor).dims
    names = [role.group for role in (g.m, g.n) if role.group] + [ax.group for ax in g.leaf_axes if ax.group]
    return any(
        group.capacity and group.dim in out_dims for name in names for group in spec.enclosing(name)
    )


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a gemmspec element type ('e4m3' -> torch.float8_e4m3fn)."""
    return _DTYPES[dtype]


@dataclass(frozen=True)
class OutputShape:
    """How to size an output from the inputs: per dim, a fixed size or (input, axis,
    rows added): the input's extent there plus that many rows (the difference of the two
    tensors' padding rows when either is stored segment_major with `pad`, else 0)."""

    name: str
    dtype: str
    dims: tuple[int | tuple[str, int, int] | tuple[str, int, int, int] | None, ...]  # None: unsized
    zero: bool  # a statement adds into it or scatters rows into it: a fresh one starts from zeros
    # Why no fresh one can be made (a run-time dim that no input has): the in-place form
    # takes it as given, the functional form raises this.
    unsized: str | None = None


class GemmOp:
    """A spec as a torch operator; call it with the spec's argument names.

    `direct` (default True) lets an eager call launch a plan the spec already made
    without the dispatcher, when nothing watches it (see the module's docstring).
    """

    direct = True
    gradients = False  # a derived backward's op: its outputs are gradients (see _op)

    def __init__(self, exe, opname: str, gradients: bool = False):
        self.exe = exe
        self.name = opname
        self.gradients = gradients
        spec = exe.spec
        written = []
        for w in spec.written:  # outputs, an FP8 output's copy, row passes' targets
            written.append(w)
            scale = spec.tensor(w).scale
            if scale is not None:  # an FP8 output: its scales are written with it
                written.append(scale.name)
        self.outputs = tuple(written)
        self.inputs = tuple(n for n in exe.argument_names() if n not in written)
        self.shapes = tuple(self._output_shape(name) for name in self.outputs)
        # The op's arguments are its inputs, then its outputs; the executable's come in
        # `argument_names()` order.
        every = self.inputs + self.outputs
        self._take_every = take(every)
        self._take_inputs = take(self.inputs)
        self._to_executable = take(tuple(every.index(n) for n in exe.argument_names()))
        self._output_dims = tuple(  # per output, each dim: a size or (input index, axis, rows added)
            tuple(d if d is None or isinstance(d, int) else (self.inputs.index(d[0]), *d[1:]) for d in s.dims)
            for s in self.shapes
        )
        self._unsized = next((s.unsized for s in self.shapes if s.unsized), None)
        try:
            self._output_strides = tuple(self._declared_strides(name) for name in self.outputs)
        except GemmspecError as e:  # a stride's dim no input has: no fresh output either
            self._unsized = self._unsized or str(e)
            self._output_strides = (None,) * len(self.outputs)
        self._define()

    # ---- shapes -------------------------------------------------------------------------
    def _output_shape(self, name: str) -> OutputShape:
        spec = self.exe.spec
        of = {t.scale.name: t for t in spec.tensors if t.scale is not None and t.name in self.outputs}
        if name in of and of[name].scale.anchor:
            # A copy's [128, 1] scales per ragged segment: the most rows the segments can
            # need, (T + segments * 127) // 128, as the host check allows; the kernel writes
            # the first ceil(len / 128) per segment (the device check counts them).
            t = of[name]
            g = spec.group(t.scale.anchor)
            segments = group_chain_count(spec, g.name) * g.count
            dims = []
            for d, b in zip(t.dims, t.scale.block):
                try:
                    size = self._logical_dim(d, name)
                except GemmspecError as e:
                    return OutputShape(name, "f32", (None,) * len(t.dims), False, str(e))
                if d == g.dim:
                    grow = segments * (b - 1)
                    dims.append((size + grow) // b if isinstance(size, int) else (size[0], size[1], size[2] + grow, b))
                else:
                    dims.append(-(-size // b) if isinstance(size, int) else (*size[:3], b))
            return OutputShape(name, "f32", tuple(dims), False)
        if name in of:
            # An FP8 output's scale grid: one per row (as the output's rows) and per 128 of its
            # fixed columns (the checker's [1, ..., 1, 128] blocks).
            t = of[name]
            data = self._output_shape(t.name)
            if data.unsized:
                return OutputShape(name, "f32", (None,) * len(data.dims), False, data.unsized)
            dims = tuple(d if b == 1 else -(-d // b) for d, b in zip(data.dims, t.scale.block))
            return OutputShape(name, "f32", dims, False)
        t = spec.tensor(name)
        # A padded segment_major tensor's buffer has its padding rows along the segmented
        # dim: an input there gives the dim's size less them, an output needs them added.
        def extra(x, axis: int) -> int:
            return x.layout.pad_rows if x.layout.pad_rows and axis == x.layout.seg_axis else 0

        where: dict[str, tuple[str, int, int]] = {}
        for other in spec.tensors:
            if other.derived is None and other.name in self.inputs:
                for axis, d in enumerate(other.dims):
                    # Prefer an input whose extent is the dim itself.
                    if d not in where or (where[d][2] and not extra(other, axis)):
                        where[d] = (other.name, axis, -extra(other, axis))
        dims: list[int | tuple[str, int, int] | None] = []
        unsized = None
        for axis, d in enumerate(t.dims):
            size = spec.dim(d).size
            if size is None and d not in where:
                unsized = unsized or (
                    f"{spec.name}: output '{name}' has run-time dim {d}, which no input "
                    "tensor has, so a fresh output cannot be sized; pass it in"
                )
                dims.append(None)
                continue
            rows = extra(t, axis)
            dims.append(size + rows if size is not None else (*where[d][:2], where[d][2] + rows))
        # A statement adds into it, or writes only the rows an index tensor names: a fresh
        # one starts from zeros. So does a gradient (a derived backward's output) with rows
        # past a capacity group's end, which no statement writes: they reach no forward
        # output, and their gradient is zero, not whatever the memory held.
        zero = any(
            g.out.tensor == name and (g.accumulate or g.scatter or (self.gradients and _past_capacity(spec, g)))
            for g in spec.gemms
        )
        return OutputShape(name, t.dtype, tuple(dims), zero, unsized)

    def _logical_dim(self, d: str, name: str) -> int | tuple[str, int, int]:
        """Dim `d`'s size: fixed, or (input, axis, rows added) from an input holding it."""
        spec = self.exe.spec
        size = spec.dim(d).size
        if size is not None:
            return size
        for other in spec.tensors:
            if other.derived is None and other.name in self.inputs and d in other.dims:
                axis = other.dims.index(d)
                pad = other.layout.pad_rows if other.layout.pad_rows and axis == other.layout.seg_axis else 0
                if not pad:
                    return (other.name, axis, 0)
        for other in spec.tensors:
            if other.derived is None and other.name in self.inputs and d in other.dims:
                return (other.name, other.dims.index(d), -other.layout.pad_rows)
        raise GemmspecError(
            f"{spec.name}: output '{name}' has run-time dim {d}, which no input tensor has, so "
            "a fresh output cannot be sized; pass it in"
        )

    def _declared_strides(self, name: str) -> tuple | None:
        """How a fresh output `name` is strided where its layout is not row-major (`major(D)`,
        `row_major pad P`, `strides(...)`): its element strides as polynomials in run-time
        dims, and where each of those dims is read, (input index, axis, rows added). None
        where row-major storage is what the layout asks for (segment_major buffers are
        contiguous too). GemmspecError where a dim of the strides is in no input."""
        spec = self.exe.spec
        if any(t.scale is not None and t.scale.name == name for t in spec.tensors):
            return None  # the checker holds an output's scales row-major (the epilogue writes them so)
        layout = spec.tensor(name).layout
        if layout.kind != "strided" or layout.text == "row_major":
            return None
        where = {}
        for d in sorted(set().union(*(p.symbols for p in layout.strides))):
            at = self._logical_dim(d, name)
            where[d] = (self.inputs.index(at[0]), *at[1:])
        return layout.strides, where

    def _strides_of(self, inputs: tuple[torch.Tensor, ...]) -> tuple[tuple[int, ...] | None, ...]:
        """Each output's element strides for a fresh one, from the inputs in the op's order
        (None: row-major)."""
        if not any(self._output_strides):  # the common case, on every functional call
            return self._output_strides
        out = []
        for declared in self._output_strides:
            if declared is None:
                out.append(None)
                continue
            polys, where = declared
            env = {d: inputs[i].shape[axis] + rows for d, (i, axis, rows) in where.items()}
            out.append(tuple(int(p.evaluate(env)) for p in polys))
        return tuple(out)

    def output_sizes(self, inputs: dict[str, torch.Tensor]) -> list[list]:
        return self._sizes_of(self._take_inputs(inputs))

    def output_strides(self, inputs: dict[str, torch.Tensor]) -> tuple[tuple[int, ...] | None, ...]:
        """The element strides a fresh output has, as its layout declares them (None:
        row-major); `output_sizes`' companion."""
        return self._strides_of(self._take_inputs(inputs))

    def _sizes_of(self, inputs: tuple[torch.Tensor, ...]) -> list[list]:
        """The size of each output, from the inputs in the op's order."""
        if self._unsized:
            raise ArgumentError(self._unsized)
        try:
            sizes = [
                # (input, axis, rows added[, per]): a copy's anchored scale rows divide by `per`.
                [d if isinstance(d, int) else (inputs[d[0]].shape[d[1]] + d[2]) // (d[3] if len(d) > 3 else 1) for d in dims]
                for dims in self._output_dims
            ]
        except IndexError:  # an input with fewer dims than the spec declares
            for name, value in zip(self.inputs, inputs):
                t = self.exe._tensor_named(name)  # None: offsets, counts
                if t is not None and t.derived is None and value.dim() != t.rank:
                    raise ArgumentError(
                        f"tensor {name!r} must have {t.rank} dims {self.exe._declared_shape(t)}, "
                        f"got shape {list(value.shape)}"
                    ) from None
            raise
        if any(n < 0 for size in sizes for n in size):
            # A padded segment_major buffer with fewer rows than its padding, read for a dim
            # no other input has: say the shape it needs, as the executable says it.
            for name, value in zip(self.inputs, inputs):
                t = self.exe._tensor_named(name)
                if t is not None and t.layout.pad_rows and value.shape[t.layout.seg_axis] < t.layout.pad_rows:
                    raise ArgumentError(
                        f"tensor '{name}' must have shape {self.exe._declared_shape(t)}"
                        f"{self.exe._padding_note(t)}, got {list(value.shape)}"
                    )
            raise ArgumentError(f"{self.exe.spec.name}: the inputs give an output a negative size {sizes}")
        return sizes

    def _host_array(self, name: str, value: torch.Tensor) -> DeviceArray:
        """`value` described as the executable's checks read an argument (no device)."""
        element = _HOST_ELEMENTS.get(value.dtype)
        if element is None:
            raise ArgumentError(f"tensor {name!r} has unsupported element type {value.dtype}")
        raw = DeviceArray(value.data_ptr(), tuple(value.shape), tuple(value.stride()), element, -1)
        return as_device_array(raw, name=name, dtype_hint=self.exe._hints.get(name))

    def _allocate(self, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        """Fresh outputs for `inputs` (in the op's order), on their device, strided as their
        layouts declare."""
        device = inputs[0].device
        out = []
        for s, size, strides in zip(self.shapes, self._sizes_of(inputs), self._strides_of(inputs)):
            if strides is None:
                make = torch.zeros if s.zero else torch.empty
                out.append(make(size, dtype=_DTYPES[s.dtype], device=device))
                continue
            fresh = torch.empty_strided(size, strides, dtype=_DTYPES[s.dtype], device=device)
            out.append(fresh.zero_() if s.zero else fresh)
        return tuple(out)

    def checked_on_host(
        self, inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """The checks the executable makes of a call before it launches (dtypes, shapes,
        strides, the offsets' type and shape, sizes; then the addresses: alignment, no
        output sharing memory with another argument), made of host tensors, so a CPU
        implementation (gemmspec.torch_reference) raises what the GPU would. Without
        `outputs` (the functional form), beside outputs as the op allocates them; with
        them (the in-place form), of the outputs given. Returns the inputs (and the
        outputs) detached, untyped storage read as the type the spec declares."""
        tensors = {**inputs, **(outputs or {})}
        arrays = {name: self._host_array(name, value) for name, value in tensors.items()}
        if outputs is None:
            for s, size, declared in zip(self.shapes, self.output_sizes(inputs), self.output_strides(inputs)):
                strides = declared or tuple(math.prod(size[i + 1 :]) for i in range(len(size)))
                arrays[s.name] = DeviceArray(0, tuple(size), strides, s.dtype, -1)
        self.exe._check_metadata(arrays)
        if outputs is None:
            # Outputs the op allocates are aligned, writable and apart from every input, so of
            # the addresses only the inputs' alignment is left to check: empty stand-ins at
            # address 0 pass the outputs' checks.
            for s in self.shapes:
                shape = (0,) * len(arrays[s.name].shape)
                arrays[s.name] = DeviceArray(0, shape, arrays[s.name].strides, s.dtype, -1)
        self.exe._check_pointers(arrays)
        return {
            name: value.detach() if arrays[name].dtype == _HOST_ELEMENTS[value.dtype]
            else value.detach().view(_DTYPES[arrays[name].dtype])
            for name, value in tensors.items()
        }

    # ---- registration --------------------------------------------------------------------
    def _define(self) -> None:
        ins = ", ".join(f"Tensor {n}" for n in self.inputs)
        outs = ", ".join(f"Tensor(a{i}!) {n}" for i, n in enumerate(self.outputs))
        ret = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join(["Tensor"] * len(self.outputs)) + ")"
        _LIB.define(f"{self.name}({ins}) -> {ret}")
        _LIB.define(f"{self.name}_out({ins}, {outs}) -> ()")
        _LIB.impl(self.name, self._run, "CUDA")
        _LIB.impl(f"{self.name}_out", self._run_out, "CUDA")
        torch.library.register_fake(f"gemmspec::{self.name}", lib=_LIB)(self._fake)
        torch.library.register_fake(f"gemmspec::{self.name}_out", lib=_LIB)(self._fake_out)
        # No derivative: a backward through a fresh output says so (torch's fallback would
        # leave the inputs' gradients None with a warning).
        torch.library.register_autograd(f"gemmspec::{self.name}", self._no_backward, lib=_LIB)
        self.functional = getattr(torch.ops.gemmspec, self.name).default
        self.in_place = getattr(torch.ops.gemmspec, f"{self.name}_out").default

    def _run(self, *args: torch.Tensor):
        outs = self._allocate(args)
        self.exe._call(self._to_executable(args + outs), None, None)
        return outs[0] if len(outs) == 1 else outs

    def _run_out(self, *args: torch.Tensor) -> None:
        self.exe._call(self._to_executable(args), None, None)

    def _fake(self, *args: torch.Tensor):
        outs = [
            torch.empty(size, dtype=_DTYPES[s.dtype], device=args[0].device) if strides is None
            else torch.empty_strided(size, strides, dtype=_DTYPES[s.dtype], device=args[0].device)
            for s, size, strides in zip(self.shapes, self._sizes_of(args), self._strides_of(args))
        ]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _fake_out(self, *args: torch.Tensor) -> None:
        return None

    def _no_backward(self, ctx, *grads: torch.Tensor):
        raise GemmspecError(
            f"{self.exe.spec.name}: gemmspec.torch.op has no derivative; for gradients call "
            "gemmspec.torch.function(spec), or call the op on detached tensors"
        )

    # ---- calling -------------------------------------------------------------------------
    def __call__(self, **tensors: torch.Tensor):
        """Without the outputs: returns them (one tensor, or a tuple in statement order).
        With every output: writes them in place and returns them. Either way through the
        dispatcher, unless the call may launch a plan of the spec directly."""
        if self.direct and _unwatched():
            done = self._call_direct(tensors)
            if done is not None:
                return done
        return self._call_dispatched(tensors)

    def _call_direct(self, tensors: dict[str, torch.Tensor]):
        """The call without the dispatcher, if its arguments fit a plan made before
        (what it returns); None when they do not, with nothing launched."""
        n_inputs = len(self.inputs)
        if len(tensors) == n_inputs + len(self.outputs):
            try:
                args = self._take_every(tensors)
                if _need_grad(args):
                    return None
            except (KeyError, AttributeError):  # a name missing, or not a tensor: the dispatcher says
                return None
            if not self._launch_planned(args):
                return None
            return args[n_inputs] if len(args) == n_inputs + 1 else args[n_inputs:]
        if len(tensors) == n_inputs:
            try:
                inputs = self._take_inputs(tensors)
                # Outputs are allocated for CUDA inputs only (a plan never fits others).
                if _need_grad(inputs) or inputs[0].device.type != "cuda":
                    return None
                outs = self._allocate(inputs)
            except (KeyError, AttributeError):  # a name missing, or not a tensor: the dispatcher says
                return None
            if not self._launch_planned(inputs + outs):
                self.in_place(*inputs, *outs)  # the outputs are made: the in-place op fills them
            return outs[0] if len(outs) == 1 else outs
        return None

    def _launch_planned(self, args: tuple[torch.Tensor, ...]) -> bool:
        """Launch the plan that fits `args` (the op's order), if any; False otherwise."""
        objects = self._to_executable(args)
        try:
            planned = self.exe._planned(objects, None)
        except RuntimeError:  # torch cannot describe a tensor so (sparse, nested): the dispatcher says
            return False
        if planned is None:
            return False
        self.exe._launch_planned(*planned, objects, None)
        return True

    def _call_dispatched(self, tensors: dict[str, torch.Tensor]):
        missing = [n for n in self.inputs if n not in tensors]
        if missing:
            raise ArgumentError(f"{self.exe.spec.name}: missing tensor(s): {', '.join(missing)}")
        given = [n for n in self.outputs if n in tensors]
        unknown = [n for n in tensors if n not in self.inputs and n not in self.outputs]
        if unknown:
            raise ArgumentError(
                f"{self.exe.spec.name}: unknown argument(s) {', '.join(unknown)}; "
                f"expected {', '.join(self.inputs + self.outputs)}"
            )
        args = [tensors[n] for n in self.inputs]
        if not given:
            _refuse_host(self.functional, zip(self.inputs, args))
            _refuse_mixed(self.exe.spec.name, zip(self.inputs, args))
            return self.functional(*args)
        if len(given) != len(self.outputs):
            raise ArgumentError(
                f"{self.exe.spec.name}: pass every output ({', '.join(self.outputs)}) or none"
            )
        outs = [tensors[n] for n in self.outputs]
        _refuse_host(self.in_place, ((n, tensors[n]) for n in self.inputs + self.outputs))
        _refuse_mixed(self.exe.spec.name, ((n, tensors[n]) for n in self.inputs + self.outputs))
        self.in_place(*args, *outs)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _load(spec, name: str | None):
    from .build import build
    from .runtime.executor import Executable

    if isinstance(spec, Executable):
        return spec
    if isinstance(spec, (str, Path, ast.FileAst)):
        return build(spec, name)
    raise TypeError(f"op() takes a spec path, .gspec text, a parsed file or a built spec, not {type(spec).__name__}")


def op(spec, name: str | None = None) -> GemmOp:
    """Register `spec` (a path, .gspec text, parsed file or `gemmspec.build` result) as
    the custom ops `gemmspec::<spec>_<hash>` and `..._out`; the same spec gives the
    same operator."""
    return _op(_load(spec, name))


def _op(exe, gradients: bool = False) -> GemmOp:
    """The operator of a built spec; `gradients`: a derived backward's, whose fresh
    outputs start from zeros where rows past a capacity group's end go unwritten (a
    separate operator from the same spec's plain one)."""
    digest = hashlib.sha256(str(exe.spec).encode()).hexdigest()[:10]
    opname = f"{exe.spec.name}_{digest}{'_grad' if gradients else ''}"
    if opname not in _OPS:
        _OPS[opname] = GemmOp(exe, opname, gradients)
    return _OPS[opname]


# ---- quantization -----------------------------------------------------------------------
_FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}
# The kernel's names of the element types it reads (others are named for the refusal).
_SOURCE_TYPES = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.float64: "f64"}
QUANTIZE_PLANS = 256  # bound quantize launches kept (per shape, strides, device, stream)


def quantize(
    value: torch.Tensor, dtype: str, block: tuple[int | str, ...], *, kernel: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """`value` in FP8 (`dtype`: 'e4m3' or 'e5m2') with one f32 scale per block: (data,
    scale grid), both contiguous, the grid one entry per block. `block` holds a block
    size per dim (blocks at the edges may be short); a dim's name in place of a size is
    one block over the whole dim.

    The rule is the language's `quantize` (docs/language.md, section 7), in float32:
    amax per block with NaN ignored, scale = amax / FP8 max by true division (1 where
    that is 0: an all-zero block, or an amax so small the quotient underflows), each
    element x / scale rounded to nearest even and saturated to +-FP8 max. The results
    carry no gradient.

    On a CUDA tensor the kernel takes (see `gemmspec.runtime.quantize.plan_quantize`:
    bf16, f16 or f32, 2-D or 3-D, blocks [1, 128] or [128, 128], contiguous columns, a
    whole number of 128-column blocks) this is one launch of the kernel of the
    language's `quantize` pass, through a plan cached per dtype, shape, strides, device
    and stream; as the custom op `gemmspec::quantize` (with a fake implementation)
    torch.compile and CUDA graphs take it whole. Any other tensor, and `kernel=False`,
    get torch operations that compute the same rule bit for bit (a dozen small kernels).
    """
    if not isinstance(value, torch.Tensor) or not value.is_floating_point():
        what = value.dtype if isinstance(value, torch.Tensor) else type(value).__qualname__
        raise ArgumentError(f"quantize: value must be a floating-point torch tensor, got {what}")
    if dtype not in _FP8_MAX:
        raise ArgumentError(f"quantize: dtype must be 'e4m3' or 'e5m2', got {dtype!r}")
    block = tuple(block)
    sizes = (b for b in block if not isinstance(b, str))
    if len(block) != value.dim() or any(type(b) is not int or b < 1 for b in sizes):
        raise ArgumentError(
            f"quantize: blocks {list(block)} for shape {list(value.shape)}: give one positive "
            "size (or a dim's name, one block over all of it) per dim"
        )
    if value.requires_grad:
        value = value.detach()
    if kernel and value.device.type in ("cuda", "meta") and all(type(b) is int for b in block):
        if _unwatched():
            done = _QUANTIZER.direct(value, dtype, block)
            if done is not None:
                return done
        return _QUANTIZER.op(value, dtype, list(block))
    return _quantize_torch(value, dtype, block)


def _quantize_torch(value: torch.Tensor, dtype: str, block: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize` by torch operations: the CPU's, and the fallback for tensors the kernel
    refuses (columns not whole 128-blocks, other blocks, other ranks, float64). Written
    to match the kernel bit for bit: NaN left out of the amax (the kernel's fmaxf does),
    amax divided by a tensor of FP8 max (torch's CUDA division by a Python number
    multiplies by its reciprocal, which can differ in the last bit), and the quotient
    saturated before the cast (the kernel's conversion saturates; what torch's cast does
    past the largest FP8 value has changed between its versions)."""
    v = value.float()
    # A dim's name: one block over the whole (run-time) dim, so one entry along it even
    # where the dim is empty (an all-zero block: scale 1).
    grid = [1 if isinstance(b, str) else -(-n // b) for n, b in zip(v.shape, block)]
    block = tuple(max(n, 1) if isinstance(b, str) else b for n, b in zip(v.shape, block))
    pad = []
    for n, b, g in reversed(list(zip(v.shape, block, grid))):
        pad += [0, g * b - n]
    padded = torch.nn.functional.pad(v, pad) if any(pad) else v  # zeros leave amax alone
    shape = [x for g, b in zip(grid, block) for x in (g, b)]
    magnitude = padded.reshape(shape).abs().nan_to_num(nan=0.0, posinf=math.inf)
    amax = magnitude.amax(dim=tuple(range(1, 2 * len(grid), 2)))
    fp8_max = torch.full_like(amax, _FP8_MAX[dtype])
    quotient = amax / fp8_max  # 0 for an all-zero block or an amax that underflows it: scale 1
    scale = torch.where(quotient > 0, quotient, torch.ones_like(amax))
    expanded = scale
    for axis, b in enumerate(block):
        expanded = expanded.repeat_interleave(b, dim=axis)
    expanded = expanded[tuple(slice(0, n) for n in v.shape)]
    ratio = (v / expanded).clamp(-_FP8_MAX[dtype], _FP8_MAX[dtype])  # NaN stays NaN
    return ratio.to(_DTYPES[dtype]).contiguous(), scale.contiguous()


@dataclass(frozen=True)
class _QuantizeEntry:
    """What a quantize call of one signature does: launch (a bound kernel), nothing
    (an empty tensor), or the torch operations (`launch` None, not empty)."""

    launch: QuantizeLaunch | None
    fp8: torch.dtype
    scale_shape: tuple[int, ...]
    empty: bool


class _Quantizer:
    """The kernel path of `quantize`: the custom op `gemmspec::quantize` and the plans
    its calls made, by (dtype, shape, strides, FP8 type, blocks, device, stream)."""

    def __init__(self) -> None:
        self._entries: dict[tuple, _QuantizeEntry] = {}
        _LIB.define("quantize(Tensor value, str dtype, int[] block) -> (Tensor, Tensor)")
        _LIB.impl("quantize", self._run, "CUDA")
        _LIB.impl("quantize", self._run_torch, "CPU")
        torch.library.register_fake("gemmspec::quantize", lib=_LIB)(self._fake)
        self.op = torch.ops.gemmspec.quantize.default

    @staticmethod
    def _key(value: torch.Tensor, dtype: str, block: tuple[int, ...]) -> tuple:
        device = value.device.index
        return (value.dtype, value.shape, value.stride(), dtype, block, device, torch_stream(device))

    def direct(self, value: torch.Tensor, dtype: str, block: tuple[int, ...]):
        """The call without the dispatcher when an earlier call planned its signature
        (its results); None otherwise, with nothing done."""
        if value.device.type != "cuda":
            return None
        entry = self._entries.get(self._key(value, dtype, block))
        return None if entry is None else self._apply(entry, value, dtype, block)

    def _run(self, value: torch.Tensor, dtype: str, block: list[int]):
        block = tuple(block)
        key = self._key(value, dtype, block)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._plan(key, value, dtype, block)
        return self._apply(entry, value, dtype, block)

    def _plan(self, key: tuple, value: torch.Tensor, dtype: str, block: tuple[int, ...]) -> _QuantizeEntry:
        source = _SOURCE_TYPES.get(value.dtype, str(value.dtype).removeprefix("torch."))
        plan = plan_quantize(source, dtype, tuple(value.shape), tuple(value.stride()), block)
        launch = None
        if plan.config is not None and not plan.empty:
            with keep_context():  # torch's current device stays its own
                launch = QuantizeLaunch(plan, key[-2], key[-1])
        entry = _QuantizeEntry(launch, _DTYPES[dtype], plan.scale_shape, plan.config is not None and plan.empty)
        while len(self._entries) >= QUANTIZE_PLANS:
            del self._entries[next(iter(self._entries))]  # the oldest: a launch copies its parameters
        self._entries[key] = entry
        return entry

    @staticmethod
    def _apply(entry: _QuantizeEntry, value: torch.Tensor, dtype: str, block: tuple[int, ...]):
        if entry.launch is None and not entry.empty:
            return _quantize_torch(value, dtype, block)
        q = torch.empty(value.shape, dtype=entry.fp8, device=value.device)
        scale = torch.empty(entry.scale_shape, dtype=torch.float32, device=value.device)
        if entry.launch is not None:
            entry.launch.launch(value.data_ptr(), q.data_ptr(), scale.data_ptr())
        return q, scale

    @staticmethod
    def _run_torch(value: torch.Tensor, dtype: str, block: list[int]):
        return _quantize_torch(value, dtype, tuple(block))

    @staticmethod
    def _fake(value: torch.Tensor, dtype: str, block: list[int]):
        grid = [(n + b - 1) // b for n, b in zip(value.shape, block)]
        return value.new_empty(value.shape, dtype=_DTYPES[dtype]), value.new_empty(grid, dtype=torch.float32)


_QUANTIZER = _Quantizer()


# ---- autograd --------------------------------------------------------------------------
def _strided(value: torch.Tensor, layout, dims: dict[str, int]) -> torch.Tensor:
    """`value` stored as `layout` (a strided layout of the spec) says: itself when it is
    (a quantized tensor comes out row-major, as most operands are declared), else a copy."""
    if layout.kind != "strided":
        raise GemmspecError(f"layout {layout} cannot be made by gemmspec.torch")
    strides = [int(s.evaluate(dims)) for s in layout.strides]
    if value.stride() == tuple(strides):
        return value
    out = torch.empty_strided(tuple(value.shape), strides, dtype=value.dtype, device=value.device)
    return out.copy_(value)


@dataclass(frozen=True)
class Quantization:
    """A tensor `GemmFunction` quantizes with `quantize` on each call: an FP8 input of
    the forward spec (passed in high precision), or, in backward, the gradient of a
    forward output as the backward spec declares it. Everything else FP8 in the backward
    (the transposed weight, the WGRAD operands with 128x1 scales) is a pre-pass of the
    backward spec itself."""

    tensor: str
    dtype: str
    block: tuple[int | str, ...]
    step: str  # "forward" or "backward"

    def __str__(self) -> str:
        return f"{self.step}: {self.tensor} -> {self.dtype}, blocks {list(self.block)}"


class BackwardFeed:
    """What a forward call of a `GemmFunction` keeps for its backward, and how it feeds
    the backward op: the forward inputs the backward spec reads (or the caller
    transposes), the forward's copies (`T = copy(A)`) that its WGRADs read in place
    of requantize(A) (A itself is then kept only if the backward reads it elsewhere), and
    the forward outputs the backward reads as they are (an FP8 output the row pass of a
    row weight's gradient reads, with its scales)."""

    def __init__(self, forward_op: GemmOp, backward_op: GemmOp, backward) -> None:
        fspec, bspec = forward_op.exe.spec, backward_op.exe.spec
        self.forward_outputs = forward_op.outputs
        # backward input (the copy and its scales) -> the forward output holding it
        self.copy_inputs: dict[str, str] = {}
        for copy, name in backward.copies:
            self.copy_inputs[name] = copy
            self.copy_inputs[bspec.tensor(name).scale.name] = fspec.tensor(copy).scale.name
        transposed = {src for src, _ in backward.transposed}
        self.kept_inputs = frozenset(n for n in forward_op.inputs if n in backward_op.inputs or n in transposed)
        self.copy_outputs = frozenset(self.copy_inputs.values())
        read = [n for n in forward_op.outputs if n in backward_op.inputs]
        self.kept_outputs = tuple(dict.fromkeys([*self.copy_inputs.values(), *read]))

    def kept(self, inputs: dict[str, torch.Tensor], outputs: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
        """What a forward call with these (quantized) inputs and outputs keeps, by name."""
        kept = {n: v for n, v in inputs.items() if n in self.kept_inputs}
        by_name = dict(zip(self.forward_outputs, outputs))
        kept.update((n, by_name[n]) for n in self.kept_outputs)
        return kept

    def copies(self, kept: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The backward op's copy inputs: the forward's copies as it wrote them."""
        return {name: kept[output] for name, output in self.copy_inputs.items()}


class GemmFunction:
    """A spec's forward statements with autograd: backward runs the derived DGRAD and
    WGRAD statements (see gemmspec.backward). FP8 operands are passed in high precision
    and quantized with the spec's scale blocks (`quantize`: one kernel per tensor on the
    GPU; `quantizations` lists them); their gradients come back in the dtype they were
    passed in (straight through the quantization)."""

    def __init__(self, exe):
        from .build import build_backward

        self.forward_op = op(exe)
        spec = exe.spec
        self.spec = spec
        backward_exe, self.backward = build_backward(spec)
        if self.backward.skipped:
            why = "; ".join(f"#{s.forward}: {s.reason}" for s in self.backward.skipped)
            raise GemmspecError(f"{spec.name}: no derived backward for every statement ({why})")
        self.backward_op = _op(backward_exe, gradients=True)
        scales = {t.scale.name for t in spec.tensors if t.scale}
        self.args = tuple(n for n in self.forward_op.inputs if n not in scales)
        self._tensors = {t.name: t for t in spec.tensors}
        for t in spec.tensors:
            # An input's anchored scales (an output's are written with it).
            if t.scale is not None and t.scale.anchor and t.name in self.args:
                raise GemmspecError(
                    f"{spec.name}: '{t.name}' has scales anchored per {t.scale.anchor}; "
                    "gemmspec.torch.function quantizes inputs without the offsets"
                )
        bspec = backward_exe.spec
        self.feed = BackwardFeed(self.forward_op, self.backward_op, self.backward)
        self.quantizations = tuple(
            Quantization(t.name, t.dtype, t.scale.block, step)
            for step, names, of in (
                ("forward", self.args, spec),
                ("backward", [g for _, g in self.backward.output_grads], bspec),
            )
            for t in (of.tensor(n) for n in names if n in {x.name for x in of.tensors})
            if t.scale is not None
        )

    def _dims(self, values: dict[str, torch.Tensor]) -> dict[str, int]:
        dims = {}
        for t in self.spec.tensors:
            if t.name in values:
                for d, n in zip(t.dims, values[t.name].shape):
                    if self.spec.dim(d).size is None:
                        dims[d] = int(n)
        return dims

    def _quantized(self, t, value: torch.Tensor, dims) -> dict[str, torch.Tensor]:
        """`value` as the spec declares tensor `t`: quantized (with its scale) or cast."""
        if t.scale is None:
            return {t.name: _strided(value.to(_DTYPES[t.dtype]), t.layout, dims)}
        q, s = quantize(value, t.dtype, t.scale.block)
        return {t.name: _strided(q, t.layout, dims), t.scale.name: _strided(s, t.scale.layout, dims)}

    def __call__(self, **tensors: torch.Tensor):
        """The forward outputs (one tensor, or a tuple in the forward op's output order).
        Given every output by name as well (`forward_op.outputs`, an FP8 output's scales
        included), the call writes them in place and returns them, as `op` does; a test can
        so poison them first."""
        outputs = self.forward_op.outputs
        missing = [n for n in self.args if n not in tensors]
        unknown = [n for n in tensors if n not in self.args and n not in outputs]
        if missing or unknown:
            raise ArgumentError(
                f"{self.spec.name}: takes {', '.join(self.args)} (FP8 operands in high "
                f"precision, no scales) and optionally every output ({', '.join(outputs)}); "
                f"missing {missing or 'none'}, unknown {unknown or 'none'}"
            )
        given = [n for n in outputs if n in tensors]
        _refuse_mixed(self.spec.name, ((n, tensors[n]) for n in (*self.args, *given)))
        for name in self.args:
            t, value = self._tensors.get(name), tensors[name]
            if t is None or t.dtype == "i32":  # offsets, counts, index tensors: the op checks them
                continue
            if not value.is_floating_point():
                raise ArgumentError(
                    f"{self.spec.name}: '{name}' must be a floating-point tensor ({t.dtype} in the "
                    f"spec{', passed in high precision' if t.scale else ''}), got {value.dtype}"
                )
            if value.dim() != t.rank:
                raise ArgumentError(
                    f"{self.spec.name}: '{name}' must have {t.rank} dims "
                    f"{self.forward_op.exe._declared_shape(t)}, got shape {list(value.shape)}"
                )
        if given and len(given) != len(outputs):
            absent = [n for n in outputs if n not in tensors]
            raise ArgumentError(
                f"{self.spec.name}: pass every output ({', '.join(outputs)}) or none; "
                f"missing {', '.join(absent)}"
            )
        for name in given:
            if tensors[name].requires_grad:
                raise ArgumentError(
                    f"{self.spec.name}: output '{name}' requires grad; an output the call "
                    "writes in place must not (its gradient flows from what the call returns)"
                )
        if torch.is_grad_enabled():
            for name, why in self.backward.not_derived:
                if name in tensors and tensors[name].requires_grad:
                    raise ArgumentError(
                        f"{self.spec.name}: '{name}' requires grad, but its gradient is not "
                        f"derived ({why}); pass it detached (or with requires_grad=False)"
                    )
        # Before any quantization: the op would refuse the host tensors only after it.
        _refuse_host(
            self.forward_op.in_place if given else self.forward_op.functional,
            ((n, tensors[n]) for n in (*self.args, *given)),
        )
        # The given outputs travel as inputs of the autograd function, which marks them
        # written in place (so autograd tracks their new contents as its outputs).
        outs = _Autograd.apply(self, len(self.args), *[tensors[n] for n in self.args], *[tensors[n] for n in given])
        return outs[0] if len(outs) == 1 else outs

    def forward(self, values: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor] | None = None):
        dims = self._dims(values)
        inputs: dict[str, torch.Tensor] = {}
        for name, value in values.items():
            t = self._tensors.get(name)  # None: offsets, counts
            passed = t is None or t.dtype == "i32"  # offsets, counts, index tensors: as they are
            inputs.update({name: value} if passed else self._quantized(t, value, dims))
        outs = self.forward_op(**inputs, **(outputs or {}))
        return (outs,) if isinstance(outs, torch.Tensor) else tuple(outs), inputs, dims

    def backward_inputs(self, saved: dict[str, torch.Tensor], grads, dims) -> dict[str, torch.Tensor]:
        bspec = self.backward_op.exe.spec
        inputs = {n: v for n, v in saved.items() if n in self.backward_op.inputs}
        inputs.update(self.feed.copies(saved))
        for (_, name), grad in zip(self.backward.output_grads, grads):
            t = bspec.tensor(name)
            if grad is None:
                grad = torch.zeros(
                    [dims.get(d, bspec.dim(d).size) for d in t.dims], device=next(iter(saved.values())).device
                )
            inputs.update(self._quantized(t, grad, dims))
        for src, copy in self.backward.transposed:
            inputs[copy] = _strided(saved[src], bspec.tensor(copy).layout, dims)
        return inputs


class _Autograd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn: GemmFunction, n_args: int, *tensors: torch.Tensor):
        args, given = tensors[:n_args], tensors[n_args:]
        values = dict(zip(fn.args, args))
        outs, inputs, dims = fn.forward(values, dict(zip(fn.forward_op.outputs, given)))
        ctx.given = len(given)
        if given:
            ctx.mark_dirty(*given)
        kept = fn.feed.kept(inputs, outs)
        ctx.fn, ctx.dims, ctx.names = fn, dims, tuple(kept)
        ctx.arg_dtypes = {n: a.dtype for n, a in values.items()}
        ctx.save_for_backward(*kept.values())
        # Only the outputs the backward takes a gradient of are differentiable: a copy (and
        # its scales) is an FP8 form of another output, and an output another statement
        # reads (an FFN's h) gets its gradient from that statement's DGRAD.
        graded = {o for o, _ in fn.backward.output_grads}
        ctx.mark_non_differentiable(*(o for n, o in zip(fn.forward_op.outputs, outs) if n not in graded))
        return outs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        fn: GemmFunction = ctx.fn
        saved = dict(zip(ctx.names, ctx.saved_tensors))
        out_index = {o: i for i, o in enumerate(fn.forward_op.outputs)}
        ordered = [grads[out_index[o]] for o, _ in fn.backward.output_grads]
        inputs = fn.backward_inputs(saved, ordered, ctx.dims)
        outs = fn.backward_op(**inputs)
        outs = (outs,) if isinstance(outs, torch.Tensor) else outs
        by_name = dict(zip(fn.backward_op.outputs, outs))
        result = []
        for name in fn.args:
            grad = next((by_name[d.grad] for d in fn.backward.statements if d.wrt == name), None)
            result.append(None if grad is None else grad.to(ctx.arg_dtypes[name]))
        return (None, None, *result, *[None] * ctx.given)


def function(spec, name: str | None = None) -> GemmFunction:
    """`spec`'s forward with autograd: its backward runs the derived DGRAD and WGRAD
    statements (`explain` prints them)."""
    return GemmFunction(_load(spec, name))
