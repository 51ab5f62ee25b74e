"""gemmspec.torch's custom ops on the CPU: each op's spec computed by its direct
semantics (gemmspec.reference, float64 on numpy) in place of the kernels, so code built
on the ops (the expert-parallel layer over gloo, the tests of the derived backward) runs
on CPU tensors exactly as it does on the GPU, with the same quantization and derived
backward, only slower. Both forms of an op are served: the functional one (fresh
outputs) and the in-place one (`<name>_out`: the outputs given are written in place, an
`+=` output adding into what it holds, elements no statement writes keeping their
bytes). A call's tensors are checked first as the op's executable checks them on the GPU
(dtypes, shapes, strides, the offsets' type, shape and values, the inputs' alignment; for
the in-place form the outputs too, with their alignment and overlaps), so a bad argument
raises the same `ArgumentError`."""

from __future__ import annotations

import numpy as np
import torch

from . import torch as gt
from .reference.data import (
    Runtime,
    TensorData,
    check_group_values,
    dim_size,
    element_offsets,
    scale_grid_shape,
    unpack,
)
from .reference.direct import run_direct

__all__ = ["reference_kernel", "reference_kernel_out", "register_reference"]

_LIB: torch.library.Library | None = None  # kept alive: it owns the CPU registrations
_REGISTERED: set[str] = set()
# Same-size integer types, to move an element's bytes as they are.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class _Reference:
    """One op's spec by the reference on checked host tensors. A segment_major tensor is
    its storage buffer (padding rows included) and anchored [128, 1] scales have spare
    rows, as the op sizes them; the reference's logical values are read from and written
    to those buffers."""

    def __init__(self, gemm_op: gt.GemmOp) -> None:
        self.op = gemm_op
        self.spec = spec = gemm_op.exe.spec
        self.tensors = {t.name: t for t in spec.tensors}
        self.anchored = {x.scale.name: x for x in spec.tensors if x.scale is not None and x.scale.anchor}

    def runtime(self, inputs: dict[str, torch.Tensor]) -> Runtime:
        spec, dims = self.spec, {}
        for t in spec.tensors:
            if t.name in inputs:
                for axis, (d, n) in enumerate(zip(t.dims, inputs[t.name].shape)):
                    if spec.dim(d).size is None:
                        dims[d] = int(n) - (t.layout.pad_rows if axis == t.layout.seg_axis else 0)
        offsets = {g.tensor: inputs[g.tensor].numpy().astype(np.int64) for g in spec.groups if g.tensor}
        return Runtime(dims, offsets)

    def logical(self, rt: Runtime, name: str, buffer: torch.Tensor) -> np.ndarray:
        """The logical values (float64) of tensor or scale grid `name` stored in `buffer`."""
        values = buffer.double().numpy()
        if name in self.anchored:  # rows past the counted blocks: unused
            return values[: scale_grid_shape(self.spec, rt, self.anchored[name])[0]]
        t = self.tensors.get(name)
        if t is None or t.layout.kind != "segment_major":
            return values
        # Rows past a capacity group's end have no storage: zeros, which no statement reads.
        return unpack(values.reshape(-1), element_offsets(self.spec, rt, t), 0.0)

    def stored(self, rt: Runtime, name: str, values: np.ndarray, size: list[int]) -> np.ndarray:
        """Logical `values` in a fresh buffer of `size` (zeros where no element lies)."""
        if name in self.anchored:  # rows past the counted blocks: unwritten
            out = np.zeros(size)
            out[: values.shape[0]] = values
            return out
        t = self.tensors.get(name)
        if t is None or t.layout.kind != "segment_major":
            return values
        at = element_offsets(self.spec, rt, t)
        stored = at >= 0  # rows past a capacity group's end have no storage
        out = np.zeros(int(np.prod(size)))
        out[at[stored]] = values[stored]
        return out.reshape(size)

    def compute(self, inputs: dict[str, torch.Tensor], initial: dict[str, torch.Tensor] | None):
        """(runtime, every output's logical values, the elements statements write of each
        statement output and each FP8 output's or copy's scale grid) from checked
        `inputs`, each output (and an FP8 output's scales) starting from its values in
        `initial` (as stored) or, without it, from zeros."""
        spec = self.spec
        rt = self.runtime(inputs)
        try:
            check_group_values(spec, rt)
        except ValueError as e:  # offsets or counts the spec's groups cannot take
            raise gt.ArgumentError(f"{spec.name}: {e}") from e
        given = {**inputs, **(initial or {})}
        for name, t in self.anchored.items():
            # The rows the offsets imply, which the GPU's offsets check counts (the host only
            # knows the range they lie in); the GPU says it with the shape they make.
            grid = scale_grid_shape(spec, rt, t)
            if name in given and given[name].shape[0] < grid[0]:
                raise gt.ArgumentError(f"scale '{name}' must have shape {list(grid)}, got {list(given[name].shape)}")
        data = {}
        for t in spec.tensors:
            if t.name in inputs:
                scale = self.logical(rt, t.scale.name, inputs[t.scale.name]) if t.scale else None
                data[t.name] = TensorData(self.logical(rt, t.name, inputs[t.name]), scale)
        init = {}
        for t in spec.tensors:
            if t.name in self.op.outputs:
                names = (t.name,) if t.scale is None else (t.name, t.scale.name)
                for name in names:
                    if initial is not None:
                        init[name] = self.logical(rt, name, initial[name])
                    elif name == t.name:
                        init[name] = np.zeros(tuple(dim_size(spec, rt, d) for d in t.dims))
                    else:
                        init[name] = np.zeros(scale_grid_shape(spec, rt, t))
        covered: dict[str, np.ndarray] = {}
        try:
            outs = run_direct(spec, rt, data, init, covered=covered)
        except gt.ArgumentError:
            raise
        except ValueError as e:  # offsets, counts or row numbers the spec's groups cannot take
            raise gt.ArgumentError(f"{spec.name}: {e}") from e
        return rt, outs, covered

    def written(self, name: str, shape: tuple[int, ...], covered: dict[str, np.ndarray]) -> np.ndarray:
        """The logical elements (of logical `shape`) of output or scale grid `name` a call
        writes: those its statements write, as the reference reports them (`covered`)."""
        if name in covered:
            return covered[name]
        # Reported for every statement output and scale grid; what is left is a row pass's
        # target, every row of which the pass writes (zeros where a scatter_add names none).
        t = self.tensors.get(name)
        assert t is not None and t.row_pass is not None, f"no written elements reported for '{name}'"
        return np.ones(shape, dtype=bool)

    def write(self, rt: Runtime, name: str, target: torch.Tensor, values: np.ndarray, mask: np.ndarray) -> None:
        """Logical `values` into `target` (an output as given) where `mask` holds, as the
        bytes of the output's type; nothing else of `target` changes."""
        if not mask.any():
            return
        bits = _BITS[target.element_size()]
        new = torch.from_numpy(values).to(target.dtype).view(bits)
        where = torch.from_numpy(mask)
        if name in self.anchored:
            target.view(bits)[: values.shape[0]][where] = new[where]
            return
        t = self.tensors.get(name)
        if t is not None and t.layout.kind == "segment_major":  # row-major storage, as checked
            at = torch.from_numpy(element_offsets(self.spec, rt, t)[mask])
            target.view(bits).view(-1)[at] = new[where]
            return
        target.view(bits)[where] = new[where]


def reference_kernel(gemm_op: gt.GemmOp):
    """The op's functional form by the reference, on CPU tensors (fresh outputs; an
    output that a statement adds into or scatters rows into starts from zeros, and so do
    elements no statement writes)."""
    ref = _Reference(gemm_op)

    def run(*args):
        inputs = gemm_op.checked_on_host(dict(zip(gemm_op.inputs, args)))
        rt, outs, _ = ref.compute(inputs, None)
        result = []
        for s, size, strides in zip(gemm_op.shapes, gemm_op.output_sizes(inputs), gemm_op.output_strides(inputs)):
            value = torch.from_numpy(ref.stored(rt, s.name, outs[s.name], size)).to(gt.torch_dtype(s.dtype))
            # Strided as the op allocates it on the GPU (a layout such as major(T) declares it).
            result.append(value if strides is None else torch.empty_strided(size, strides, dtype=value.dtype).copy_(value))
        return result[0] if len(result) == 1 else tuple(result)

    return run


def reference_kernel_out(gemm_op: gt.GemmOp):
    """The op's in-place form (`<name>_out`) by the reference, on CPU tensors: the inputs,
    then the outputs, which are checked as the GPU checks them and written in place as
    the kernels write them. Each output starts from what it holds (an `+=` adds into
    it); the elements no statement writes (rows past a masked count or a capacity
    group's end, a padded segment's padding rows, spare scale rows) keep their bytes."""
    ref = _Reference(gemm_op)
    n_inputs = len(gemm_op.inputs)

    def run_out(*args) -> None:
        given = gemm_op.checked_on_host(
            dict(zip(gemm_op.inputs, args[:n_inputs])), dict(zip(gemm_op.outputs, args[n_inputs:]))
        )
        inputs = {n: given[n] for n in gemm_op.inputs}
        rt, outs, covered = ref.compute(inputs, given)
        for name in gemm_op.outputs:
            mask = ref.written(name, outs[name].shape, covered)
            ref.write(rt, name, given[name], outs[name], mask)

    return run_out


def register_reference(*ops: gt.GemmOp) -> None:
    """Register the reference as the CPU implementation of `ops`' functional and in-place
    forms (once each, for the life of the process)."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("gemmspec", "IMPL")
    for o in ops:
        if o.name not in _REGISTERED:
            _LIB.impl(o.name, reference_kernel(o), "CPU")
            _LIB.impl(f"{o.name}_out", reference_kernel_out(o), "CPU")
            _REGISTERED.add(o.name)
