"""What statements and pre-passes write: each tensor by one statement (or
accumulated), never read by the statement writing it, and no two written elements
at one address."""

from __future__ import annotations

from .. import ast
from ..aliasing import ENUMERATE_LIMIT, UNDECIDED, element_collision
from ..expr import Poly
from ..spec import Gemm, Layout
from .context import SWIGLU_GRAD_OP, Context

# Derivations whose pre-pass writes the target's scales.
SCALING_OPS = frozenset({"requantize", "quantize"})


def check_written_once(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    written: dict[str, int] = {}
    for g, s in zip(gemms, ctx.ast.statements):
        if g.out.tensor in written and not g.accumulate:
            raise ctx.error(
                f"'{g.out.tensor}' is already written by the statement on line "
                f"{written[g.out.tensor]}; use += to accumulate",
                s.out.tensor.pos,
            )
        written.setdefault(g.out.tensor, g.line)
        for operand in g.reads:
            if operand == g.out.tensor:
                raise ctx.error(
                    f"'{operand}' is both read and written by one statement", s.out.tensor.pos
                )


def check_outputs_do_not_alias(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    """Two elements of a written tensor at one address would be a write race (and a
    wrong sum with +=). Decided exactly where it can be: a zero stride or two equal
    strides on dims of more than one element always alias; all-constant strides are
    checked in full."""
    written: dict[str, None] = {}
    for g in gemms:
        written.setdefault(g.out.tensor)
    read = {t for g in gemms for t in (g.a.tensor, g.b.tensor)}
    for t in ctx.tensors.values():
        if t.derived is not None and t.name in read:  # written by its pre-pass
            written.setdefault(t.name)
    for name in written:
        t, decl = ctx.tensors[name], ctx.tensor_ast[name]
        pos = decl.layout.pos if decl.layout else decl.name.pos
        _check_injective(ctx, t.name, t.dims, t.layout, pos)
        if t.derived is not None and (t.derived.op in SCALING_OPS or t.derived.op == SWIGLU_GRAD_OP) and t.scale is not None:
            # A requantize or quantize pass writes the target's scales too.
            assert decl.scale is not None
            spos = decl.scale.layout.pos if decl.scale.layout else decl.scale.pos
            _check_injective(ctx, f"{t.name}'s scale", t.dims, t.scale.layout, spos, t.scale.block)


def _check_injective(
    ctx: Context, owner: str, dims: tuple[str, ...], layout: Layout, pos: ast.Pos,
    block: tuple[int | str, ...] | None = None,
) -> None:
    if layout.kind != "strided":
        return  # segment_major stores every segment as its own dense block
    sizes: list[int | None] = []
    for i, name in enumerate(dims):
        size = ctx.dims[name].size
        if block is not None and isinstance(block[i], str):
            size = 1  # one block over the whole run-time dim
        elif size is not None and block is not None:
            size = -(-size // block[i])
        sizes.append(size)
    # Dims that can hold more than one element (a run-time dim may).
    wide = [i for i, n in enumerate(sizes) if n is None or n > 1]
    by_stride: dict[Poly, int] = {}
    for i in wide:
        stride = layout.strides[i]
        if not stride.terms:
            raise ctx.error(
                f"'{owner}' is written, but its stride along {dims[i]} is 0: every "
                f"element along {dims[i]} lands on one address (a write race)",
                pos,
                "give every dim of a written tensor its own non-zero stride",
            )
        if stride in by_stride:
            j = by_stride[stride]
            raise ctx.error(
                f"'{owner}' is written, but {dims[j]} and {dims[i]} have the same stride "
                f"{stride}: ({dims[j]}=1, {dims[i]}=0) and ({dims[j]}=0, {dims[i]}=1) land "
                "on one address (a write race)",
                pos,
            )
        by_stride[stride] = i
    if any(sizes[i] is None or not layout.strides[i].is_const for i in wide):
        return  # depends on run-time sizes: not decidable here
    clash = element_collision([(sizes[i], layout.strides[i].value) for i in wide])
    if clash is UNDECIDED:
        raise ctx.error(
            f"'{owner}' is written, and its strides interleave in a way that cannot be "
            f"checked for two elements at one address (more than {ENUMERATE_LIMIT} "
            "elements, three or more interleaved dims)",
            pos,
            "use strides where each one passes the farthest offset the smaller ones reach",
        )
    if clash is not None:
        first, second, offset = clash
        names = [dims[i] for i in wide]
        a = ", ".join(f"{n}={v}" for n, v in zip(names, first))
        b = ", ".join(f"{n}={v}" for n, v in zip(names, second))
        raise ctx.error(
            f"'{owner}' is written, but its layout puts two elements at one address: "
            f"({a}) and ({b}) are both at offset {offset} (a write race)",
            pos,
        )
