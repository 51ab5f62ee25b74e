"""The syntax tree of a .gspec file: what was written, where, nothing inferred.

Every node carries a `Pos` (1-based line and column) so that the checker can
point at the exact token a problem comes from.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class Pos:
    line: int
    column: int

    def __str__(self) -> str:
        return f"{self.line}:{self.column}"


@dataclass(frozen=True)
class Name:
    """An identifier as written, with its position."""

    text: str
    pos: Pos

    def __str__(self) -> str:
        return self.text


# ---- integer expressions -------------------------------------------------------


@dataclass(frozen=True)
class IntLit:
    value: int
    pos: Pos

    depth: ClassVar[int] = 0  # a leaf of an expression: no nesting

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class NameRef:
    name: Name

    depth: ClassVar[int] = 0

    @property
    def pos(self) -> Pos:
        return self.name.pos

    def __str__(self) -> str:
        return self.name.text


@dataclass(frozen=True)
class Sum:
    """`a + b + ...` as one flat list: a chain of any length is one node, so only
    parentheses make the tree deeper (the parser bounds that depth)."""

    terms: tuple[Expr, ...]
    pos: Pos  # the first term's
    depth: int = field(default=1, compare=False)  # nesting of sums and products

    def __str__(self) -> str:
        return "(" + " + ".join(str(t) for t in self.terms) + ")"


@dataclass(frozen=True)
class Product:
    """`a * b * ...` as one flat list, like `Sum`."""

    factors: tuple[Expr, ...]
    pos: Pos
    depth: int = field(default=1, compare=False)

    def __str__(self) -> str:
        return "(" + " * ".join(str(f) for f in self.factors) + ")"


Expr = IntLit | NameRef | Sum | Product


# ---- declarations --------------------------------------------------------------


@dataclass(frozen=True)
class DimDecl:
    name: Name
    size: int | None  # None: known only at run time


@dataclass(frozen=True)
class GroupKind:
    """How a group partitions a dimension.

    kind is one of "ragged", "split", "uniform", "masked".
    """

    kind: str
    dim: Name  # the dimension being partitioned
    pos: Pos
    within: Name | None = None  # ragged: the enclosing group
    tensor: Name | None = None  # ragged: offsets tensor; masked: counts tensor
    sizes: tuple[Expr, ...] = ()  # split: the segment sizes
    capacity: bool = False  # ragged: offsets may end at or below the dim (rows past them untouched)


@dataclass(frozen=True)
class GroupDecl:
    name: Name
    count_dim: Name  # the dimension that indexes the groups (L, E, S ...)
    count: int | None  # size given in the declaration, if any
    kind: GroupKind


@dataclass(frozen=True)
class LayoutDecl:
    """kind: "row_major", "major", "strides" or "segment_major"."""

    kind: str
    pos: Pos
    dim: Name | None = None  # major(D)
    group: Name | None = None  # segment_major(g)
    strides: tuple[Expr, ...] = ()
    pad: int | None = None
    pad_pos: Pos | None = None  # the number after `pad`


@dataclass(frozen=True)
class ScaleDecl:
    dtype: Name
    block: tuple[IntLit | Name, ...]  # a Name: a compile-time dim's size (the checker resolves it)
    pos: Pos
    layout: LayoutDecl | None = None
    anchor: Name | None = None  # `per GROUP`: blocks restart at each group's start
    name: Name | None = None  # `as NAME`: the scale tensor's run-time name
    pow2: tuple[Pos, ...] = ()  # each `pow2` written: power-of-two scales of an FP8 output


@dataclass(frozen=True)
class Derivation:
    op: Name  # "requantize", "transpose", "quantize" or "copy" (a second FP8 output)
    source: Name
    options: tuple[Name, ...] = ()  # after the source: `quantize(x, pow2)`
    # `KEY = NAME` after the source: `requantize(dy, rows = dst, weight = w)`
    keywords: tuple[tuple[Name, Name], ...] = ()


@dataclass(frozen=True)
class TensorDecl:
    name: Name
    dtype: Name
    shape: tuple[Name, ...]
    layout: LayoutDecl | None
    scale: ScaleDecl | None
    derived: Derivation | None


# ---- statements ----------------------------------------------------------------


@dataclass(frozen=True)
class Index:
    """`t`, `lora(t)` or `idx[t]` inside a tensor reference.

    `idx[t]` (`via` the int32 index tensor `idx`) reads the position at row `idx[t]`:
    `t` is the statement's row index, the position's dim is the tensor's own.
    """

    var: Name
    group: Name | None = None
    via: Name | None = None  # `idx[t]`: the index tensor

    @property
    def pos(self) -> Pos:
        return (self.group or self.via or self.var).pos

    def __str__(self) -> str:
        if self.via:
            return f"{self.via}[{self.var}]"
        return f"{self.group}({self.var})" if self.group else self.var.text


def _expr_text(e: Expr, top: bool = True) -> str:
    """An index expression as one would write it: `2*j + 1` (parentheses only inside)."""
    if isinstance(e, Sum):
        text = " + ".join(_expr_text(t, False) for t in e.terms)
        return text if top else f"({text})"
    if isinstance(e, Product):
        return "*".join(_expr_text(f, False) for f in e.factors)
    return str(e)


@dataclass(frozen=True)
class IndexExpr:
    """`2*j + 1` at a position of a tensor reference: an integer expression of index
    variables. Only the interleaved weight rows of a SwiGLU statement take one (the
    checker refuses it anywhere else)."""

    expr: Expr

    @property
    def pos(self) -> Pos:
        return self.expr.pos

    def __str__(self) -> str:
        return _expr_text(self.expr)


@dataclass(frozen=True)
class Ref:
    tensor: Name
    indices: tuple[Index | IndexExpr, ...]

    def __str__(self) -> str:
        return f"{self.tensor}[{', '.join(str(i) for i in self.indices)}]"


@dataclass(frozen=True)
class SumIndex:
    """`k`, or `t in expert(e)` (contraction restricted to one group's segment)."""

    var: Name
    group: Name | None = None
    group_var: Name | None = None

    def __str__(self) -> str:
        if self.group is None:
            return self.var.text
        return f"{self.var} in {self.group}({self.group_var})"


@dataclass(frozen=True)
class UpProduct:
    """`silu(GATE) * sum[k] A[...] * U[...]`: the up product of a SwiGLU statement. The
    gate is the statement's own product, the one inside `silu(...)`."""

    sums: tuple[SumIndex, ...]
    lhs: Ref
    rhs: Ref
    silu: Pos  # the `silu` keyword

    def __str__(self) -> str:
        return f"sum[{', '.join(str(s) for s in self.sums)}] {self.lhs} * {self.rhs}"


@dataclass(frozen=True)
class Statement:
    out: Ref
    accumulate: bool  # `+=`
    sums: tuple[SumIndex, ...]
    lhs: Ref
    rhs: Ref
    pos: Pos
    factors: tuple[Ref, ...] = ()  # `f[...] * ... * sum[...]`: epilogue factors
    bias: Ref | None = None  # `sum[...] A * B + bias[...]`: epilogue term
    up: UpProduct | None = None  # SwiGLU: `silu(sum ... A * B) * sum ... A * U`
    assign_pos: Pos | None = field(default=None, compare=False)  # the `=` or `+=`

    def __str__(self) -> str:
        op = "+=" if self.accumulate else "="
        sums = ", ".join(str(s) for s in self.sums)
        pre = "".join(f"{f} * " for f in self.factors)
        post = f" + {self.bias}" if self.bias is not None else ""
        body = f"sum[{sums}] {self.lhs} * {self.rhs}"
        if self.up is not None:
            body = f"silu({body}) * {self.up}"
        return f"{self.out} {op} {pre}{body}{post}"


@dataclass(frozen=True)
class Directive:
    """kind: "flatten", "split", "target", "tile" or "gather"."""

    kind: str
    pos: Pos
    args: tuple[str, ...] = ()


@dataclass(frozen=True)
class SpecAst:
    name: Name
    dims: tuple[DimDecl, ...]
    groups: tuple[GroupDecl, ...]
    tensors: tuple[TensorDecl, ...]
    statements: tuple[Statement, ...]
    directives: tuple[Directive, ...]


@dataclass(frozen=True)
class FileAst:
    path: str
    text: str
    specs: tuple[SpecAst, ...]
