"""Tensor layouts, and the sizes the kernels' integer types can hold: strides,
padding, segment_major storage, and the bounds on strides and bytes."""

from __future__ import annotations

from .. import ast
from ..expr import Poly
from ..spec import MAX_EXTENT, MAX_OFFSET, Group, Layout
from .context import Context, row_major
from .groups import GROUP_KINDS_THAT_PARTITION
from .names import poly

_RUNTIME_AT_MOST = " (with every run-time dim at its largest, 2^31 - 1)"
_FIXED_PART = " with every run-time dim at 1"
MAX_PADDED_ROW = 2**31 - 1  # `pad N`: the padded contiguous dim, in elements


def check_layout(
    ctx: Context,
    decl: ast.LayoutDecl | None,
    shape: tuple[ast.Name, ...],
    owner: str,
    element_bytes: int,
    owner_pos: ast.Pos,
    sizes: list[Poly] | None = None,
) -> Layout:
    dims = [ctx.dims[n.text] for n in shape]
    if sizes is None:
        sizes = [Poly.const(d.size) if d.size is not None else Poly.sym(d.name) for d in dims]
    where = decl.pos if decl else owner_pos
    # The element count first: it bounds every stride a dense layout builds.
    check_bytes(ctx, owner, [_least(p) for p in sizes], element_bytes, where)
    kind = decl.kind if decl else "row_major"
    if kind == "strides":
        assert decl is not None
        if len(decl.strides) != len(shape):
            raise ctx.error(
                f"strides(...) gives {len(decl.strides)} strides for the "
                f"{len(shape)} dims of '{owner}'",
                decl.pos,
            )
        strides = tuple(poly(ctx, e) for e in decl.strides)
        for e, stride in zip(decl.strides, strides):
            if worst_case(ctx, stride) > MAX_OFFSET:
                raise ctx.error(
                    f"stride {stride} of '{owner}' can exceed 2^63 - 1"
                    f"{_RUNTIME_AT_MOST}: the kernels compute offsets in 64-bit signed "
                    "integers",
                    e.pos,
                )
        text = "strides(" + ", ".join(str(s) for s in strides) + ")"
        if decl.pad is not None:
            raise ctx.error(
                "pad applies to row_major, major(...) and segment_major(...) layouts",
                decl.pad_pos or decl.pos,
            )
        check_span(ctx, owner, sizes, strides, element_bytes, decl.pos)
        return Layout("strided", text, strides=strides)
    if kind == "segment_major":
        assert decl is not None and decl.group is not None
        gname = decl.group.text
        if gname not in ctx.groups:
            raise ctx.error(f"unknown group '{gname}'", decl.group.pos)
        group = ctx.groups[gname]
        names = [n.text for n in shape]
        if group.kind == "masked":
            raise ctx.error(
                f"segment_major({gname}): group '{gname}' does not split any dim of '{owner}' "
                "into segments: it is masked; segment_major stores the segments of a ragged, "
                "split or uniform group",
                decl.group.pos,
                f"a masked group's data is already one padded block per entry: declare '{owner}' "
                f"with its count dim {group.count_dim} as a dim and index it by a batch index",
            )
        if group.kind not in GROUP_KINDS_THAT_PARTITION or group.dim not in names:
            raise ctx.error(
                f"segment_major({gname}): group '{gname}' does not split any dim of "
                f"'{owner}' ({', '.join(names)})",
                decl.group.pos,
            )
        axis = names.index(group.dim)
        others = [i for i in range(len(shape)) if i != axis]
        pad, pad_rows = segment_pad(ctx, decl, group, owner)
        rows = sizes[axis] + pad_rows  # the storage's rows along the segmented dim
        if pad_rows:
            check_bytes(
                ctx, owner, [_least(rows if i == axis else p) for i, p in enumerate(sizes)],
                element_bytes, where,
            )
        # Inside a segment the other dims' strides are scaled by its (padded) length.
        check_dense_strides(ctx, owner, [sizes[i] for i in others] + [rows], None, where)
        other_strides = row_major([sizes[i] for i in others], None)
        text = f"segment_major({gname})" + (f" pad {pad}" if decl.pad is not None else "")
        return Layout(
            "segment_major", text, group=gname, seg_axis=axis,
            other_strides=tuple(other_strides), pad=pad, pad_rows=pad_rows,
        )
    order = list(range(len(shape)))
    text = "row_major"
    if kind == "major":
        assert decl is not None and decl.dim is not None
        names = [n.text for n in shape]
        if decl.dim.text not in names:
            raise ctx.error(
                f"major({decl.dim.text}): '{decl.dim.text}' is not a dim of '{owner}' "
                f"({', '.join(names)})",
                decl.dim.pos,
            )
        axis = names.index(decl.dim.text)
        order = [i for i in order if i != axis] + [axis]
        text = f"major({decl.dim.text})"
    pad = decl.pad if decl else None
    if pad is not None:
        if pad <= 0:
            raise ctx.error("pad must be positive", decl.pos)
        inner = dims[order[-1]]
        if inner.size is None:
            raise ctx.error(
                f"pad needs the contiguous dim '{inner.name}' to be known at compile time",
                decl.pos,
            )
        padded = -(-inner.size // pad) * pad
        if padded > MAX_PADDED_ROW:
            raise ctx.error(
                f"pad {pad} makes rows of {padded} elements; a padded row holds at most "
                f"{MAX_PADDED_ROW} (2^31 - 1: the kernels index a row with 32-bit integers)",
                decl.pad_pos or decl.pos,
            )
        text += f" pad {pad}"
    check_dense_strides(ctx, owner, [sizes[i] for i in order], pad, where)
    ordered = row_major([sizes[i] for i in order], pad)
    strides = [Poly()] * len(shape)
    for pos, axis in enumerate(order):
        strides[axis] = ordered[pos]
    if pad is not None:  # padding makes the span larger than the element count
        check_span(ctx, owner, sizes, strides, element_bytes, where)
    return Layout("strided", text, strides=tuple(strides))


def segment_pad(ctx: Context, decl: ast.LayoutDecl, group: Group, owner: str) -> tuple[int, int]:
    """`segment_major(G) pad P`: (P, the storage rows the padding adds). Each of G's
    segments (in flat order, nested ones included) may need up to P - 1 rows more."""
    if decl.pad is None:
        return 1, 0
    pad, pos = decl.pad, decl.pad_pos or decl.pos
    if pad <= 0 or pad & (pad - 1):
        raise ctx.error(
            f"the pad of a segment_major layout must be a power of two; got {pad}",
            pos,
            "pad 16 rounds every segment to whole 16-byte rows of FP8 (8 for 16-bit types), "
            "which TMA needs to load them",
        )
    segments = group.count
    g = group
    while g.within is not None:
        g = ctx.groups[g.within]
        segments *= g.count
    pad_rows = (pad - 1) * segments
    if pad_rows > MAX_EXTENT - 1:
        raise ctx.error(
            f"segment_major({group.name}) pad {pad} on '{owner}' adds up to {pad_rows} rows "
            f"({pad - 1} for each of {segments} segments), more than 2^31 - 2: the kernels "
            "index the padded rows with 32-bit integers",
            pos,
        )
    return pad, pad_rows


# Two bounds. A stride is a number the kernels multiply by an index: it must fit
# 64 bits for any run-time dims the kernels accept (each below 2^31). A tensor's
# bytes must fit 64 bits for the part fixed at compile time (run-time dims at 1);
# beyond that the tensor passed in is the bound, as no buffer holds 2^63 bytes.
def worst_case(ctx: Context, p: Poly) -> int:
    """The largest value `p` can take: run-time dims at MAX_EXTENT (all coefficients
    are non-negative, so that is where a polynomial is largest)."""
    return p.evaluate(ctx.worst)


def check_dense_strides(
    ctx: Context, owner: str, ordered: list[Poly], pad: int | None, pos: ast.Pos
) -> None:
    """The outermost stride of a dense layout (sizes outermost first) is the largest;
    bounded numerically before any polynomial is built, so that a tensor of many
    run-time dims cannot make the strides' polynomials large."""
    stride = 1
    for i in range(len(ordered) - 1, 0, -1):
        size = worst_case(ctx, ordered[i])
        if i == len(ordered) - 1 and pad is not None:
            size = -(-size // pad) * pad
        stride *= size
        if stride > MAX_OFFSET:
            raise ctx.error(
                f"a stride of '{owner}' can exceed 2^63 - 1{_RUNTIME_AT_MOST}: the kernels "
                "compute offsets in 64-bit signed integers",
                pos,
            )


def check_bytes(ctx: Context, owner: str, sizes: list[int], element_bytes: int, pos: ast.Pos) -> None:
    total = element_bytes
    for n in sizes:  # stops as soon as it is too large: sizes may be many and huge
        total *= n
        if total > MAX_OFFSET:
            raise ctx.error(
                f"'{owner}' has more than 2^63 - 1 bytes{_FIXED_PART}: the kernels "
                "compute element and byte offsets in 64-bit signed integers",
                pos,
            )


def check_span(
    ctx: Context,
    owner: str,
    sizes: list[Poly],
    strides: list[Poly] | tuple[Poly, ...],
    element_bytes: int,
    pos: ast.Pos,
) -> None:
    """The farthest element a strided layout reaches must fit a 64-bit byte offset."""
    last = sum((_least(n) - 1) * _least(s) for n, s in zip(sizes, strides))
    if (last + 1) * element_bytes > MAX_OFFSET:
        raise ctx.error(
            f"the layout of '{owner}' reaches past 2^63 - 1 bytes{_FIXED_PART}: the "
            "kernels compute element and byte offsets in 64-bit signed integers",
            pos,
        )


def _least(p: Poly) -> int:
    """`p` with every run-time symbol at 1: its part fixed at compile time (and an upper
    bound on each of its coefficients, all of which are non-negative)."""
    return sum(c for _, c in p.terms)
