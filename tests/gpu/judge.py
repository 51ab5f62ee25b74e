"""The element-wise check of the GPU tests that compare arrays they made themselves (torch
tensors, numpy results of hand-made calls) with a reference: the rule of
gemmspec.runtime.verify.compare_output (the one `gemmspec run` applies), asserted, and
outputs allocated between guard bytes.

- `assert_close_elementwise(got, ref, dtype=...)`: every element the reference writes
  within ``rtol*|ref| + atol*rms(row)`` (rtol and atol by output type, or the caller's),
  none NaN or infinite, every element it does not write unchanged (bit for bit against
  the contents before the call, else still NaN), no guard byte changed; prints the
  check's line, and fails with it.
- `GuardedTensor(shape, dtype)`: a torch output inside a larger flat allocation, with
  random guard bytes before and after it, for calls that write into outputs the test
  allocates (`GuardedBuffer` of gemmspec.runtime.verify does the same for DeviceBuffers).
"""

from __future__ import annotations

from collections.abc import Mapping
from math import prod
from typing import Any, Protocol

import numpy as np

from gemmspec.runtime.verify import GUARD_BYTES, OutputCheck, compare_output, guard_pattern

__all__ = ["GuardedTensor", "as_float64", "assert_close_elementwise", "stored"]


class Guarded(Protocol):
    def changed_outside(self) -> np.ndarray: ...


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch")


def as_float64(x: Any) -> np.ndarray:
    """A torch tensor (any device, FP8 included) or numpy array as float64 numpy."""
    if _is_torch(x):
        return x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64)


def stored(x: Any) -> np.ndarray:
    """The elements as stored, as unsigned integers of their size (torch or numpy), to
    compare bit for bit."""
    if _is_torch(x):
        import torch

        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]
        return x.detach().contiguous().cpu().view(ints).numpy().view(f"u{x.element_size()}")
    x = np.ascontiguousarray(x)
    return x.view(f"u{x.dtype.itemsize}")


def assert_close_elementwise(
    got: Any,
    ref: Any,
    *,
    dtype: str,
    name: str = "output",
    operand_dtype: str | None = None,
    rtol: float | None = None,
    atol: float | None = None,
    before: Any = None,
    got_raw: Any = None,
    guards: Guarded | Mapping[str, Guarded] | None = None,
    rel_norm_limit: float | None = None,
) -> OutputCheck:
    """Assert compare_output's rule on `got` (what the device left: torch or numpy, its
    values, e.g. an FP8 output dequantized) against `ref` (float64, NaN where the
    reference writes nothing), as an output of type `dtype`; return the check.

    `before`: the output's stored elements before the call; the elements the reference
    does not write must keep them bit for bit (against `got_raw`, the stored elements
    after it, by default `got` itself). Without it they must still be NaN. `guards`: a
    GuardedTensor or GuardedBuffer (or {name: one}) whose guard bytes must be unchanged.
    `rel_norm_limit`: also assert ||got - ref|| / ||ref|| below it, where a test held
    the output to a norm before and keeps that bound beside the element-wise one."""
    values, reference = as_float64(got), as_float64(ref)
    raw = {}
    if before is not None:
        raw = {"got_raw": stored(got if got_raw is None else got_raw), "initial_raw": stored(before)}
    if guards is None:
        changed = None
    elif isinstance(guards, Mapping):
        changed = {n: g.changed_outside() for n, g in guards.items()}
    else:
        changed = {name: guards.changed_outside()}
    check = compare_output(name, values, reference, dtype=dtype, operand_dtype=operand_dtype,
                           rtol=rtol, atol=atol, guards=changed, **raw)
    print(check.describe())
    assert check.ok, check.describe()
    if rel_norm_limit is not None:
        assert check.rel_error < rel_norm_limit, f"{name}: rel error {check.rel_error:.3e} (limit {rel_norm_limit:.0e})"
    return check


class GuardedTensor:
    """A torch tensor of `shape` and `dtype` (`tensor`) inside one flat byte allocation,
    `guard` bytes of a random pattern before and after it; filled with `fill` (NaN: the
    poison of an output; an FP8 NaN for FP8). `changed_outside()` gives the offsets (from
    the tensor's first byte; negative before it) of the guard bytes that changed."""

    def __init__(self, shape, dtype, *, fill: float | None = float("nan"), device: str = "cuda",
                 guard: int = GUARD_BYTES):
        import torch

        shape = tuple(int(n) for n in shape)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        self.guard, self.nbytes = guard, prod(shape) * itemsize
        pattern = torch.from_numpy(guard_pattern(2 * guard, seed=self.nbytes)).to(device)
        self.flat = torch.empty(2 * guard + self.nbytes, dtype=torch.uint8, device=device)
        self.flat[:guard] = pattern[:guard]
        self.flat[guard + self.nbytes:] = pattern[guard:]
        self.tensor = self.flat[guard:guard + self.nbytes].view(dtype).view(shape)
        if fill is not None:
            self.tensor.copy_(torch.full(shape, fill).to(dtype))
        self.uploaded = self.flat.cpu().numpy().copy()

    def changed_outside(self) -> np.ndarray:
        now = self.flat.cpu().numpy()
        g, n, up = self.guard, self.nbytes, self.uploaded
        return np.concatenate([np.flatnonzero(now[:g] != up[:g]) - g, np.flatnonzero(now[g + n:] != up[g + n:]) + n])
