"""gemmspec.torch's custom ops on the CPU, for tests without a GPU: each op's spec runs
by its direct semantics (gemmspec.reference, float64) in place of the kernels, so the
derivation, the quantization recipe and the autograd plumbing can be tested here."""

from __future__ import annotations

import numpy as np
import torch

import gemmspec.torch as gt
from gemmspec.reference.data import Runtime, TensorData
from gemmspec.reference.direct import run_direct


def reference_kernel(gemm_op):
    """Run an op's spec with gemmspec.reference on CPU tensors (fresh outputs)."""
    spec = gemm_op.exe.spec

    def run(*args):
        given = dict(zip(gemm_op.inputs, args))
        dims = {}
        for t in spec.tensors:
            if t.name in given:
                for d, n in zip(t.dims, given[t.name].shape):
                    if spec.dim(d).size is None:
                        dims[d] = int(n)
        offsets = {g.tensor: given[g.tensor].numpy().astype(np.int64) for g in spec.groups if g.tensor}
        rt = Runtime(dims, offsets)
        data = {}
        for t in spec.tensors:
            if t.name in given:
                scale = given[t.scale.name].double().numpy() if t.scale else None
                data[t.name] = TensorData(given[t.name].double().numpy(), scale)
        init = {}
        for s, size in zip(gemm_op.shapes, gemm_op.output_sizes(given)):
            init[s.name] = np.zeros(size)
        outs = run_direct(spec, rt, data, init)
        result = [torch.from_numpy(outs[s.name]).to(gt.torch_dtype(s.dtype)) for s in gemm_op.shapes]
        return result[0] if len(result) == 1 else tuple(result)

    return run


class CpuKernels:
    """Registers the reference as the CPU implementation of a function's ops (once each;
    the registrations live as long as this object)."""

    def __init__(self) -> None:
        self.lib = torch.library.Library("gemmspec", "IMPL")
        self.registered: set[str] = set()

    def __call__(self, fn):
        for o in (fn.forward_op, fn.backward_op):
            if o.name not in self.registered:
                self.lib.impl(o.name, reference_kernel(o), "CPU")
                self.registered.add(o.name)
        return fn
