"""gemmspec as PyTorch operators: `op(spec)` and, for training, `function(spec)`.

`op(spec)` registers the spec as two `torch.library` custom ops, so `torch.compile`
(fullgraph=True included) sees one opaque node per call and CUDA graphs capture it:

- `gemmspec::<name>`: the inputs (tensors, scales, offsets/counts) in, every output
  returned, freshly allocated (an output that a statement `+=` starts from zeros);
- `gemmspec::<name>_out`: the inputs and the outputs in, the outputs written in place
  (declared as mutated, so torch.compile functionalizes it).

Both have a fake (meta) implementation that allocates outputs of the right shape and
dtype from the input shapes, which is all torch.compile needs to trace. The object
`op` returns picks one: called without outputs it returns them, with all of them it
fills them. Only this module imports torch; the rest of gemmspec does not need it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from . import ast
from .errors import ArgumentError, GemmspecError

__all__ = ["GemmOp", "op", "torch_dtype"]

_DTYPES = {
    "e4m3": torch.float8_e4m3fn,
    "e5m2": torch.float8_e5m2,
    "bf16": torch.bfloat16,
    "f16": torch.float16,
    "f32": torch.float32,
    "i32": torch.int32,
}
_LIB = torch.library.Library("gemmspec", "FRAGMENT")  # kept alive: it owns the registrations
_OPS: dict[str, GemmOp] = {}


def torch_dtype(dtype: str) -> torch.dtype:
    """The torch dtype of a gemmspec element type ('e4m3' -> torch.float8_e4m3fn)."""
    return _DTYPES[dtype]


@dataclass(frozen=True)
class OutputShape:
    """How to size an output from the inputs: per dim, a fixed size or (input, axis)."""

    name: str
    dtype: str
    dims: tuple[int | tuple[str, int], ...]
    zero: bool  # a statement adds into it: a fresh one starts from zeros


class GemmOp:
    """A spec as a torch operator; call it with the spec's argument names."""

    def __init__(self, exe, opname: str):
        self.exe = exe
        self.name = opname
        spec = exe.spec
        written = []
        for g in spec.gemms:
            if g.out.tensor not in written:
                written.append(g.out.tensor)
        self.outputs = tuple(written)
        self.inputs = tuple(n for n in exe.argument_names() if n not in written)
        self.shapes = tuple(self._output_shape(name) for name in self.outputs)
        self._define()

    # ---- shapes -------------------------------------------------------------------------
    def _output_shape(self, name: str) -> OutputShape:
        spec = self.exe.spec
        t = spec.tensor(name)
        where: dict[str, tuple[str, int]] = {}
        for other in spec.tensors:
            if other.derived is None and other.name in self.inputs:
                for axis, d in enumerate(other.dims):
                    where.setdefault(d, (other.name, axis))
        dims: list[int | tuple[str, int]] = []
        for d in t.dims:
            size = spec.dim(d).size
            if size is None and d not in where:
                raise GemmspecError(
                    f"{spec.name}: output '{name}' has run-time dim {d}, which no input "
                    "tensor has, so a fresh output cannot be sized; pass it in"
                )
            dims.append(size if size is not None else where[d])
        accumulate = any(g.accumulate and g.out.tensor == name for g in spec.gemms)
        return OutputShape(name, t.dtype, tuple(dims), accumulate)

    def output_sizes(self, inputs: dict[str, torch.Tensor]) -> list[list]:
        return [
            [d if isinstance(d, int) else inputs[d[0]].shape[d[1]] for d in s.dims]
            for s in self.shapes
        ]

    def _allocate(self, inputs: dict[str, torch.Tensor], device) -> list[torch.Tensor]:
        out = []
        for s, size in zip(self.shapes, self.output_sizes(inputs)):
            make = torch.zeros if s.zero else torch.empty
            out.append(make(size, dtype=_DTYPES[s.dtype], device=device))
        return out

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
        self.functional = getattr(torch.ops.gemmspec, self.name).default
        self.in_place = getattr(torch.ops.gemmspec, f"{self.name}_out").default

    def _run(self, *args: torch.Tensor):
        inputs = dict(zip(self.inputs, args))
        outs = self._allocate(inputs, args[0].device)
        self.exe(**inputs, **dict(zip(self.outputs, outs)))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _run_out(self, *args: torch.Tensor) -> None:
        self.exe(**dict(zip(self.inputs + self.outputs, args)))

    def _fake(self, *args: torch.Tensor):
        inputs = dict(zip(self.inputs, args))
        outs = [
            torch.empty(size, dtype=_DTYPES[s.dtype], device=args[0].device)
            for s, size in zip(self.shapes, self.output_sizes(inputs))
        ]
        return outs[0] if len(outs) == 1 else tuple(outs)

    def _fake_out(self, *args: torch.Tensor) -> None:
        return None

    # ---- calling -------------------------------------------------------------------------
    def __call__(self, **tensors: torch.Tensor):
        """Without the outputs: returns them (one tensor, or a tuple in statement order).
        With every output: writes them in place and returns them."""
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
            return self.functional(*args)
        if len(given) != len(self.outputs):
            raise ArgumentError(
                f"{self.exe.spec.name}: pass every output ({', '.join(self.outputs)}) or none"
            )
        outs = [tensors[n] for n in self.outputs]
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
    exe = _load(spec, name)
    digest = hashlib.sha256(str(exe.spec).encode()).hexdigest()[:10]
    opname = f"{exe.spec.name}_{digest}"
    if opname not in _OPS:
        _OPS[opname] = GemmOp(exe, opname)
    return _OPS[opname]
