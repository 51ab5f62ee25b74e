"""Integer formulas over run-time dims: grids, kernel arguments and workspace sizes.

The launch manifest spells every run-time quantity as one of these, and the three
consumers evaluate the same tree: the Python runtime (`evaluate`), the emitted host
launcher (`c`) and readers of the manifest (`str`, a documented little syntax:
integers, names, `+`, `-`, `*`, `/` rounding down, `ceil_div(a, b)`, `max(a, b)`
and parentheses). Values are 64-bit signed; every operand the compiler builds is
non-negative except inside `max(..., 0)`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from ..expr import Poly

NUM_SMS = "num_sms"  # the one name that is not a dim: multiprocessors of the device

_PRECEDENCE = {"add": 1, "sub": 1, "mul": 2, "div": 2}
_SYMBOL = {"add": "+", "sub": "-", "mul": "*", "div": "/"}


@dataclass(frozen=True)
class Formula:
    op: str  # "const", "var", "add", "sub", "mul", "div", "ceil_div", "max"
    args: tuple[Formula, ...] = ()
    value: int = 0  # const
    name: str = ""  # var

    # ---- construction, folding constants so the text stays short -------------------
    @staticmethod
    def const(value: int) -> Formula:
        return Formula("const", value=int(value))

    @staticmethod
    def var(name: str) -> Formula:
        return Formula("var", name=name)

    @staticmethod
    def of(x: Formula | int) -> Formula:
        return x if isinstance(x, Formula) else Formula.const(x)

    @staticmethod
    def poly(p: Poly) -> Formula:
        """A polynomial over dim names."""
        total = Formula.const(0)
        for mono, coeff in p.terms:
            term = Formula.const(coeff)
            for sym in mono:
                term = term * Formula.var(sym)
            total = total + term
        return total

    @property
    def is_const(self) -> bool:
        return self.op == "const"

    def _binary(self, op: str, other: Formula | int) -> Formula:
        other = Formula.of(other)
        a, b = self, other
        if a.is_const and b.is_const:
            return Formula.const(_APPLY[op](a.value, b.value))
        if op == "add" and a.is_const and a.value == 0:
            return b
        if op in ("add", "sub") and b.is_const and b.value == 0:
            return a
        if op == "mul":
            if (a.is_const and a.value == 0) or (b.is_const and b.value == 0):
                return Formula.const(0)
            if a.is_const and a.value == 1:
                return b
            if b.is_const and b.value == 1:
                return a
        if op in ("div", "ceil_div") and b.is_const and b.value == 1:
            return a
        return Formula(op, (a, b))

    def __add__(self, other: Formula | int) -> Formula:
        return self._binary("add", other)

    def __radd__(self, other: int) -> Formula:
        return Formula.of(other)._binary("add", self)

    def __sub__(self, other: Formula | int) -> Formula:
        return self._binary("sub", other)

    def __mul__(self, other: Formula | int) -> Formula:
        return self._binary("mul", other)

    def __rmul__(self, other: int) -> Formula:
        return Formula.of(other)._binary("mul", self)

    def __floordiv__(self, other: Formula | int) -> Formula:
        return self._binary("div", other)

    def ceil_div(self, other: Formula | int) -> Formula:
        return self._binary("ceil_div", other)

    def max(self, other: Formula | int) -> Formula:
        return self._binary("max", other)

    # ---- use ---------------------------------------------------------------------------
    @property
    def names(self) -> frozenset[str]:
        if self.op == "var":
            return frozenset((self.name,))
        return frozenset().union(*(a.names for a in self.args))

    def evaluate(self, env: Mapping[str, int]) -> int:
        if self.op == "const":
            return self.value
        if self.op == "var":
            return int(env[self.name])
        a, b = (x.evaluate(env) for x in self.args)
        return _APPLY[self.op](a, b)

    def __str__(self) -> str:
        return self._render(str, lambda v: str(v), {"ceil_div": "ceil_div", "max": "max"})

    def c(self, name: Callable[[str], str]) -> str:
        """A C++ `long long` expression; `name` spells each variable; gs_ceil_div and
        gs_max are the host launcher's helpers."""
        return self._render(name, lambda v: f"{v}LL", {"ceil_div": "gs_ceil_div", "max": "gs_max"})

    def _render(self, name, literal, calls, parent: int = 0, right: bool = False) -> str:
        if self.op == "const":
            return literal(self.value)
        if self.op == "var":
            return name(self.name)
        if self.op in calls:
            a, b = (x._render(name, literal, calls) for x in self.args)
            return f"{calls[self.op]}({a}, {b})"
        prec = _PRECEDENCE[self.op]
        a = self.args[0]._render(name, literal, calls, prec)
        b = self.args[1]._render(name, literal, calls, prec, right=True)
        text = f"{a} {_SYMBOL[self.op]} {b}"
        # Left-associative: a right operand of equal precedence keeps its parentheses.
        if prec < parent or (prec == parent and right):
            return f"({text})"
        return text


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_APPLY: dict[str, Callable[[int, int], int]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "div": lambda a, b: a // b,
    "ceil_div": _ceil_div,
    "max": max,
}
