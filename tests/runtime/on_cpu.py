"""A torch function mode for running the bench's procedures on the CPU in tests: tensors
a procedure places on "cuda" are made on the CPU instead (`.cuda()` is the identity)."""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode


class OnCpu(TorchFunctionMode):
    """Tensors the bench places on "cuda" are made on the CPU instead."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0]
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)
