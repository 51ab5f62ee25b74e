"""gemmspec.torch's custom ops on the CPU: each op's spec computed by its direct
semantics (gemmspec.reference, float64 on numpy) in place of the kernels, so code built
on the ops (the expert-parallel layer over gloo, the tests of the derived backward) runs
on CPU tensors exactly as it does on the GPU, with the same quantization and derived
backward, only slower. A call's tensors are checked first as the op's executable checks
them on the GPU (dtypes, shapes, strides, the offsets' type, shape and values), so a bad
argument raises the same `ArgumentError`."""

from __future__ import annotations

import numpy as np
import torch

from . import torch as gt
from .reference.data import Runtime, TensorData, dim_size, element_offsets, scale_grid_shape
from .reference.direct import run_direct

__all__ = ["reference_kernel", "register_reference"]

_LIB: torch.library.Library | None = None  # kept alive: it owns the CPU registrations
_REGISTERED: set[str] = set()
def reference_kernel(gemm_op: gt.GemmOp):
    """The op's functional form by the reference, on CPU tensors (fresh outputs). A
    segment_major tensor is its storage buffer (padding rows included) and anchored
    [128, 1] scales have spare rows, as the op sizes them; the reference's logical values
    are read from and written to those buffers."""
    spec = gemm_op.exe.spec
    anchored = {x.scale.name: x for x in spec.tensors if x.scale is not None and x.scale.anchor}

    def logical(rt, t, buffer: np.ndarray) -> np.ndarray:
        if t.layout.kind != "segment_major":
            return buffer
        return buffer.reshape(-1)[element_offsets(spec, rt, t)]

    def stored(rt, name: str, values: np.ndarray, size: list[int]) -> np.ndarray:
        if name in anchored:  # rows past the counted blocks: unwritten
            out = np.zeros(size)
            out[: values.shape[0]] = values
            return out
        t = next((x for x in spec.tensors if x.name == name), None)
        if t is None or t.layout.kind != "segment_major":
            return values
        out = np.zeros(int(np.prod(size)))
        out[element_offsets(spec, rt, t)] = values
        return out.reshape(size)

    def run(*args):
        given = gemm_op.checked_on_host(dict(zip(gemm_op.inputs, args)))
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
                data[t.name] = TensorData(logical(rt, t, given[t.name].double().numpy()), scale)
        init = {}
        for t in spec.tensors:
            if t.name in gemm_op.outputs:
                init[t.name] = np.zeros(tuple(dim_size(spec, rt, d) for d in t.dims))
                if t.scale is not None:
                    init[t.scale.name] = np.zeros(scale_grid_shape(spec, rt, t))
        try:
            outs = run_direct(spec, rt, data, init)
        except gt.ArgumentError:
            raise
        except ValueError as e:  # offsets, counts or row numbers the spec's groups cannot take
            raise gt.ArgumentError(f"{spec.name}: {e}") from e
        result = [
            torch.from_numpy(stored(rt, s.name, outs[s.name], size)).to(gt.torch_dtype(s.dtype))
            for s, size in zip(gemm_op.shapes, gemm_op.output_sizes(given))
        ]
        return result[0] if len(result) == 1 else tuple(result)

    return run


def register_reference(*ops: gt.GemmOp) -> None:
    """Register the reference as the CPU implementation of `ops`' functional forms (once
    each, for the life of the process)."""
    global _LIB
    if _LIB is None:
        _LIB = torch.library.Library("gemmspec", "IMPL")
    for o in ops:
        if o.name not in _REGISTERED:
            _LIB.impl(o.name, reference_kernel(o), "CPU")
            _REGISTERED.add(o.name)
