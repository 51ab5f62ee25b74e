"""Integer polynomials over named run-time values.

Strides, offsets and extents in gemmspec are sums of products of integers and
symbols: run-time dims (`T`), per-leaf quantities (`start.M`, `len.K`) and group
indices (`g.expert`). A small canonical polynomial keeps them comparable,
printable and evaluable without knowing any target language.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

Monomial = tuple[str, ...]  # sorted symbol names; () is the constant term


@dataclass(frozen=True)
class Poly:
    terms: tuple[tuple[Monomial, int], ...] = ()  # sorted, no zero coefficients

    @staticmethod
    def const(value: int) -> Poly:
        return Poly((((), value),) if value else ())

    @staticmethod
    def sym(name: str) -> Poly:
        return Poly((((name,), 1),))

    @staticmethod
    def _make(acc: dict[Monomial, int]) -> Poly:
        return Poly(tuple(sorted((m, c) for m, c in acc.items() if c)))

    def __add__(self, other: Poly | int) -> Poly:
        other = _lift(other)
        acc = dict(self.terms)
        for m, c in other.terms:
            acc[m] = acc.get(m, 0) + c
        return Poly._make(acc)

    __radd__ = __add__

    def __mul__(self, other: Poly | int) -> Poly:
        other = _lift(other)
        acc: dict[Monomial, int] = {}
        for m1, c1 in self.terms:
            for m2, c2 in other.terms:
                m = tuple(sorted(m1 + m2))
                acc[m] = acc.get(m, 0) + c1 * c2
        return Poly._make(acc)

    __rmul__ = __mul__

    def exact_quotient(self, divisor: Poly) -> Poly | None:
        """self / divisor where `divisor` is one term that divides every term of self
        (its symbols among the term's, its coefficient a factor of the term's); else None."""
        if len(divisor.terms) != 1:
            return None
        (dm, dc), = divisor.terms
        acc: dict[Monomial, int] = {}
        for m, c in self.terms:
            rest = list(m)
            for s in dm:
                if s not in rest:
                    return None
                rest.remove(s)
            if c % dc:
                return None
            acc[tuple(rest)] = c // dc
        return Poly._make(acc)

    @property
    def is_const(self) -> bool:
        return all(m == () for m, _ in self.terms)

    @property
    def value(self) -> int:
        """The constant value; only valid when `is_const`."""
        assert self.is_const, self
        return self.terms[0][1] if self.terms else 0

    @property
    def symbols(self) -> frozenset[str]:
        return frozenset(s for m, _ in self.terms for s in m)

    def evaluate(self, env: Mapping[str, int]) -> int:
        total = 0
        for m, c in self.terms:
            v = c
            for s in m:
                v *= int(env[s])
            total += v
        return total

    def __str__(self) -> str:
        if not self.terms:
            return "0"
        parts = []
        for m, c in self.terms:
            if not m:
                parts.append(str(c))
            elif c == 1:
                parts.append("*".join(m))
            else:
                parts.append(f"{c}*" + "*".join(m))
        return " + ".join(parts)


def _lift(x: Poly | int) -> Poly:
    return x if isinstance(x, Poly) else Poly.const(int(x))


ZERO = Poly()
ONE = Poly.const(1)
