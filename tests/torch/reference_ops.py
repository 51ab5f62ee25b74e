"""gemmspec.torch's custom ops on the CPU, for tests without a GPU: each op's spec runs
by its direct semantics (gemmspec.reference, float64) in place of the kernels, so the
derivation, the quantization recipe and the autograd plumbing can be tested here."""

from __future__ import annotations

import numpy as np
import torch

import gemmspec.torch as gt
from gemmspec.reference.data import Runtime, TensorData, dim_size, element_offsets, scale_grid_shape
from gemmspec.reference.direct import run_direct


def reference_kernel(gemm_op):
    """Run an op's spec with gemmspec.reference on CPU tensors (fresh outputs). A
    segment_major tensor is its storage buffer (padding rows included) and its anchored
    [128, 1] scales have spare rows, as the op sizes them; the reference's logical values
    are read from and written to those buffers."""
    spec = gemm_op.exe.spec

    def logical(spec, rt, t, buffer: np.ndarray) -> np.ndarray:
        if t.layout.kind != "segment_major":
            return buffer
        return buffer.reshape(-1)[element_offsets(spec, rt, t)]

    def stored(spec, rt, name: str, values: np.ndarray, size: list[int]) -> np.ndarray:
        of = {x.scale.name: x for x in spec.tensors if x.scale is not None}
        if name in of and of[name].scale.anchor:  # rows past the counted blocks: unwritten
            out = np.zeros(size)
            out[: values.shape[0]] = values
            return out
        t = spec.tensor(name) if name not in of else None
        if t is None or t.layout.kind != "segment_major":
            return values
        out = np.zeros(int(np.prod(size)))
        out[element_offsets(spec, rt, t)] = values
        return out.reshape(size)

    def run(*args):
        given = dict(zip(gemm_op.inputs, args))
        dims = {}
        for t in spec.tensors:
            if t.name in given:
                for axis, (d, n) in enumerate(zip(t.dims, given[t.name].shape)):
                    if spec.dim(d).size is None:
                        dims[d] = int(n) - (t.layout.pad_rows if axis == t.layout.seg_axis else 0)
        offsets = {g.tensor: given[g.tensor].numpy().astype(np.int64) for g in spec.groups if g.tensor}
        rt = Runtime(dims, offsets)
        data = {}
        for t in spec.tensors:
            if t.name in given:
                scale = given[t.scale.name].double().numpy() if t.scale else None
                if t.scale is not None and t.scale.anchor:
                    scale = scale[: scale_grid_shape(spec, rt, t)[0]]
                data[t.name] = TensorData(logical(spec, rt, t, given[t.name].double().numpy()), scale)
        init = {}
        for t in spec.tensors:
            if t.name in gemm_op.outputs:
                init[t.name] = np.zeros(tuple(dim_size(spec, rt, d) for d in t.dims))
                if t.scale is not None:
                    init[t.scale.name] = np.zeros(scale_grid_shape(spec, rt, t))
        outs = run_direct(spec, rt, data, init)
        result = [
            torch.from_numpy(stored(spec, rt, s.name, outs[s.name], size)).to(gt.torch_dtype(s.dtype))
            for s, size in zip(gemm_op.shapes, gemm_op.output_sizes(given))
        ]
        return result[0] if len(result) == 1 else tuple(result)

    return run


def reference_kernel_out(gemm_op):
    """The in-place op (`<name>_out`) by the reference: the outputs come after the inputs
    and are overwritten (`=` statements only: the reference starts every output from
    zeros, so a `+=` would not add to what the caller passed)."""
    assert not any(g.accumulate for g in gemm_op.exe.spec.gemms), "only '=' outputs are modelled"
    run = reference_kernel(gemm_op)
    n_inputs = len(gemm_op.inputs)

    def run_out(*args):
        results = run(*args[:n_inputs])
        results = (results,) if isinstance(results, torch.Tensor) else results
        for target, value in zip(args[n_inputs:], results):
            target.copy_(value)

    return run_out


class CpuKernels:
    """Registers the reference as the CPU implementation of a function's ops (once each;
    the registrations live as long as this object). `in_place=True` also registers the
    forward op's in-place form, which a call given its outputs runs."""

    def __init__(self) -> None:
        self.lib = torch.library.Library("gemmspec", "IMPL")
        self.registered: set[str] = set()

    def __call__(self, fn, in_place: bool = False):
        for o in (fn.forward_op, fn.backward_op):
            if o.name not in self.registered:
                self.lib.impl(o.name, reference_kernel(o), "CPU")
                self.registered.add(o.name)
        name = f"{fn.forward_op.name}_out"
        if in_place and name not in self.registered:
            self.lib.impl(name, reference_kernel_out(fn.forward_op), "CPU")
            self.registered.add(name)
        return fn
