"""gemmspec.torch's custom ops on the CPU, for tests without a GPU: each op's spec runs
by its direct semantics (gemmspec.reference, float64) in place of the kernels, so the
derivation, the quantization recipe and the autograd plumbing can be tested here."""

from __future__ import annotations

import torch

from gemmspec.torch_reference import reference_kernel


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
