"""gemmspec.torch's custom ops on the CPU, for tests without a GPU: each op's spec runs
by its direct semantics (gemmspec.reference, float64) in place of the kernels, so the
derivation, the quantization recipe and the autograd plumbing can be tested here."""

from __future__ import annotations

import torch

from gemmspec.torch_reference import reference_kernel, reference_kernel_out


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
