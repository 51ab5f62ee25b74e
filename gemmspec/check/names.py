"""Names and dims: identifiers that reach emitted C++, the one namespace that dims,
groups and tensors share, dim declarations, and size expressions folded to
polynomials."""

from __future__ import annotations

from .. import ast
from ..expr import ONE, Poly
from ..spec import MAX_EXTENT, MAX_NAME_LENGTH, Dim
from .context import Context
from .fixes import did_you_mean, fix, rename

# Names a spec may not use: they reach emitted C++ as parameter and symbol names.
CXX_RESERVED = frozenset(
    """
    alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t
    char16_t char32_t class compl concept const consteval constexpr constinit const_cast
    continue co_await co_return co_yield decltype default delete do double dynamic_cast
    else enum explicit export extern false float for friend goto if inline int long
    mutable namespace new noexcept not not_eq nullptr operator or or_eq private protected
    public register reinterpret_cast requires return short signed sizeof static
    static_assert static_cast struct switch template this thread_local throw true try
    typedef typeid typename union unsigned using virtual void volatile wchar_t while xor
    xor_eq main NULL threadIdx blockIdx blockDim gridDim warpSize half float2 float4 int2
    int4 dim3 size_t
    """.split()
)
RESERVED_PREFIXES = ("gs_", "GS_", "__", "cu", "nv")

# Stride and size expressions fold to polynomials; these bounds keep the folding
# cheap whatever is written (a product of sums multiplies term counts).
MAX_POLY_TERMS = 64
MAX_POLY_DEGREE = 8


# The words that open a declaration or a directive (grammar.lark): a spec named after one
# (`gemm tensor {`) reads as a declaration that lost its name.
LANGUAGE_WORDS = frozenset("accumulate dim flatten gather gemm group split sum target tensor tile".split())


def check_spec_name(ctx: Context, name: ast.Name) -> None:
    """A spec's name: an identifier that reaches emitted code, and not a word of the language."""
    check_identifier(ctx, name, "spec")
    if name.text in LANGUAGE_WORDS:
        raise ctx.error(
            f"spec name '{name.text}' is a word of the language; name the spec after what it computes",
            name.pos,
            f"e.g. `gemm {name.text}_gemm {{`",
            fix(rename(name, f"{name.text}_gemm")),
        )


def check_identifier(ctx: Context, name: ast.Name, what: str) -> None:
    text = name.text
    if len(text) > MAX_NAME_LENGTH:
        raise ctx.error(
            f"{what} name '{text[:20]}...' is {len(text)} characters long; names are at "
            f"most {MAX_NAME_LENGTH} (they become C++ symbols and file names)",
            name.pos,
        )
    if text in CXX_RESERVED:
        raise ctx.error(
            f"{what} name '{text}' is reserved in C++/CUDA and would reach emitted code",
            name.pos,
            "rename it",
        )
    if text.startswith(RESERVED_PREFIXES):
        raise ctx.error(
            f"{what} name '{text}' uses a prefix reserved for generated code "
            f"({', '.join(RESERVED_PREFIXES)})",
            name.pos,
        )


def claim(ctx: Context, name: ast.Name, what: str) -> None:
    """Dims, groups, tensors and run-time tensors share one namespace."""
    check_identifier(ctx, name, what)
    if name.text in ctx.names:
        other_what, other_pos = ctx.names[name.text]
        raise ctx.error(
            f"{what} '{name.text}' collides with the {other_what} declared at "
            f"{other_pos.line}:{other_pos.column}",
            name.pos,
        )
    ctx.names[name.text] = (what, name.pos)


def declare_dim(ctx: Context, name: ast.Name, size: int | None) -> None:
    if name.text in ctx.dims:
        old = ctx.dims[name.text]
        first = ctx.dim_pos[name.text]
        if old.size != size:
            was = "known at run time" if old.size is None else f"{old.size}"
            now = "known at run time" if size is None else f"{size}"
            raise ctx.error(
                f"dim '{name.text}' is given two sizes: {now} here, {was} at "
                f"{first.line}:{first.column}",
                name.pos,
            )
        raise ctx.error(f"dim '{name.text}' is declared twice", name.pos)
    if size is not None and size <= 0:
        raise ctx.error(f"dim '{name.text}' must be positive, not {size}", name.pos)
    if size is not None and size > MAX_EXTENT:
        raise ctx.error(
            f"dim '{name.text}' is {size}, more than {MAX_EXTENT} (2^31 - 1): the kernels "
            "index rows, columns and K with 32-bit signed integers",
            name.pos,
        )
    claim(ctx, name, "dim")
    ctx.dims[name.text] = Dim(name.text, size)
    if size is None:
        ctx.worst[name.text] = MAX_EXTENT
    ctx.dim_pos[name.text] = name.pos


def need_dim(ctx: Context, name: ast.Name) -> Dim:
    if name.text not in ctx.dims:
        note, fix = did_you_mean(name, list(ctx.dims), "dims")
        if fix is None:
            note = _suggest_dim(ctx)
        raise ctx.error(f"unknown dim '{name.text}'", name.pos, note, fix)
    return ctx.dims[name.text]


def _suggest_dim(ctx: Context) -> str:
    known = ", ".join(ctx.dims) or "none"
    return f"declare it with `dim NAME` or `dim NAME = SIZE` (known dims: {known})"


def const_expr(ctx: Context, e: ast.Expr, what: str) -> int:
    p = poly(ctx, e)
    if not p.is_const:
        raise ctx.error(f"{what} must be known at compile time, not '{p}'", e.pos)
    return p.value


def poly(ctx: Context, e: ast.Expr) -> Poly:
    """Fold an expression; recursion follows parentheses only (at most
    parse.MAX_EXPR_DEPTH deep), the operands of a chain are a loop."""
    if isinstance(e, ast.IntLit):
        return Poly.const(e.value)
    if isinstance(e, ast.NameRef):
        d = need_dim(ctx, e.name)
        return Poly.sym(d.name) if d.size is None else Poly.const(d.size)
    if isinstance(e, ast.Sum):
        acc = Poly()
        for term in e.terms:
            acc = _bounded(ctx, acc + poly(ctx, term), term)
        return acc
    acc = ONE
    for factor in e.factors:
        acc = _bounded(ctx, acc * poly(ctx, factor), factor)
    return acc


def _bounded(ctx: Context, p: Poly, at: ast.Expr) -> Poly:
    if len(p.terms) > MAX_POLY_TERMS or any(len(m) > MAX_POLY_DEGREE for m, _ in p.terms):
        raise ctx.error(
            f"expression too complex: it expands to more than {MAX_POLY_TERMS} terms or "
            f"multiplies more than {MAX_POLY_DEGREE} run-time dims",
            at.pos,
        )
    return p
