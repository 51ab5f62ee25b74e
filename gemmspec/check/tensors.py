"""Tensor declarations: shape, layout, index tensors, scales, and what `= op(...)`
records (each derivation is checked once every tensor is declared)."""

from __future__ import annotations

from .. import ast
from ..expr import ONE, Poly
from ..spec import (
    ELEMENT_BYTES,
    FP8_TYPES,
    INDEX_TYPE,
    MAX_EXTENT,
    MAX_RANK,
    MAX_SCALE_BLOCK,
    ROW_PASS_OPS,
    Derivation,
    Layout,
    RowPass,
    Scale,
    Tensor,
)
from .context import (
    COPY_OP,
    QUANTIZE_POW2,
    REQUANTIZE_ROWS,
    REQUANTIZE_WEIGHT,
    SWIGLU_GRAD_OP,
    Context,
)
from .fixes import fix, replace_declaration
from .gather import index_decl
from .groups import GROUP_KINDS_THAT_PARTITION
from .layouts import check_layout
from .names import claim, need_dim


def declare_tensor(ctx: Context, t: ast.TensorDecl) -> None:
    if t.name.text in ctx.tensors:
        raise ctx.error(f"tensor '{t.name.text}' is declared twice", t.name.pos)
    claim(ctx, t.name, "tensor")
    if len(t.shape) > MAX_RANK:
        raise ctx.error(
            f"'{t.name.text}' has {len(t.shape)} dims, more than {MAX_RANK}: a statement's "
            "indices and leaf axes grow with its tensors' dims",
            t.shape[MAX_RANK].pos,
        )
    dims = tuple(need_dim(ctx, n).name for n in t.shape)
    seen: set[str] = set()
    for n in t.shape:
        if n.text in seen:
            raise ctx.error(
                f"dim '{n.text}' appears twice in the shape of '{t.name.text}'", n.pos
            )
        seen.add(n.text)
    layout = check_layout(ctx, t.layout, t.shape, t.name.text, ELEMENT_BYTES[t.dtype.text], t.name.pos)
    if t.dtype.text == INDEX_TYPE:
        check_index_tensor(ctx, t, layout)
    scale = check_scale(ctx, t) if t.scale else None
    derived = None
    copy_of = None
    row_pass = None
    if t.derived and t.derived.op.text == COPY_OP:
        copy_of = t.derived.source.text  # a second output of a statement, not a pre-pass
    elif t.derived and t.derived.op.text in ROW_PASS_OPS:
        # An output written after the statements, not a pre-pass (check_row_pass).
        keys = {k.text: v.text for k, v in t.derived.keywords}
        other = t.derived.options[0].text if t.derived.options else None
        row_pass = RowPass(
            t.derived.op.text, t.derived.source.text, other, keys.get(REQUANTIZE_WEIGHT),
            keys.get(REQUANTIZE_ROWS),
        )
    elif t.derived and t.derived.op.text == SWIGLU_GRAD_OP:
        # A pre-pass reading two tensors (check_swiglu_grad).
        other = t.derived.options[0].text if t.derived.options else None
        derived = Derivation(SWIGLU_GRAD_OP, t.derived.source.text, other=other)
    elif t.derived:
        pow2 = any(o.text == QUANTIZE_POW2 for o in t.derived.options)  # checked in check_derivation
        keys = {k.text: v.text for k, v in t.derived.keywords}  # checked in check_derivation
        derived = Derivation(
            t.derived.op.text, t.derived.source.text, pow2,
            index=keys.get(REQUANTIZE_ROWS), weight=keys.get(REQUANTIZE_WEIGHT),
        )
    ctx.tensors[t.name.text] = Tensor(
        t.name.text, t.dtype.text, dims, layout, scale, derived, t.name.pos.line, copy_of,
        row_pass,
    )
    ctx.tensor_ast[t.name.text] = t


def check_index_tensor(ctx: Context, t: ast.TensorDecl, layout: Layout) -> None:
    """An i32 tensor is an index tensor: one row number per row of a statement, read
    through `x[idx[t], k]` or written through `y[idx[t], n] = ...`; contiguous."""
    usage = f"read rows through it as `x[{t.name.text}[t], k]`"
    if len(t.shape) != 1:
        decl, known = index_decl(ctx, t.name.text)
        raise ctx.error(
            f"'{t.name.text}' is {INDEX_TYPE}, an index tensor, but has {len(t.shape)} dims "
            f"[{', '.join(n.text for n in t.shape)}]; an index tensor has one: an entry per row",
            t.shape[min(1, len(t.shape) - 1)].pos,
            f"declare it `{decl}` over the rows it indexes, and {usage}",
            fix(replace_declaration(ctx, t.name.text, decl)) if known else None,
        )
    if layout.kind != "strided" or layout.strides != (ONE,):
        assert t.layout is not None
        raise ctx.error(
            f"index tensor '{t.name.text}' is stored {layout}; index tensors are contiguous",
            t.layout.pos,
            "drop the layout",
        )


def check_scale(ctx: Context, t: ast.TensorDecl) -> Scale:
    s = t.scale
    assert s is not None
    if t.dtype.text not in FP8_TYPES:
        raise ctx.error(
            f"'{t.name.text}' is {t.dtype.text}: scales apply to FP8 (e4m3, e5m2) tensors only",
            s.pos,
        )
    if s.dtype.text != "f32":
        raise ctx.error(
            f"scale type {s.dtype.text} is not supported yet; use f32", s.dtype.pos
        )
    if len(s.block) != len(t.shape):
        raise ctx.error(
            f"scale block has {len(s.block)} entries but '{t.name.text}' has "
            f"{len(t.shape)} dims",
            s.pos,
        )
    sizes = tuple(block_size(ctx, b) for b in s.block)
    for b, size, dim in zip(s.block, sizes, t.shape):
        if isinstance(size, str):
            # One block over the whole of a run-time dim: only that dim's own position.
            if size != dim.text:
                raise ctx.error(
                    f"scale block '{size}' names a dim known only at run time, which stands "
                    f"for one block over the whole of {size} only at {size}'s own position; "
                    f"this position of '{t.name.text}' is {dim.text}",
                    b.pos,
                    f"write a size here, or {dim.text} for one block over the whole of "
                    f"{dim.text}",
                )
            continue
        if size <= 0:
            raise ctx.error("scale block sizes must be positive", b.pos)
        if size > MAX_SCALE_BLOCK:
            raise ctx.error(
                f"scale block {size} is larger than {MAX_SCALE_BLOCK} (2^20); for one "
                "scale along a whole dim use a block at least as large as the dim, up to "
                "that limit",
                b.pos,
            )
    anchor = None
    if s.anchor is not None:
        if s.anchor.text not in ctx.groups:
            raise ctx.error(f"unknown group '{s.anchor.text}'", s.anchor.pos)
        g = ctx.groups[s.anchor.text]
        if g.kind not in GROUP_KINDS_THAT_PARTITION or g.dim not in [n.text for n in t.shape]:
            raise ctx.error(
                f"scale blocks are anchored per '{g.name}', but '{g.name}' does not split "
                f"any dim of '{t.name.text}'",
                s.anchor.pos,
            )
        anchor = g.name
        axis = [n.text for n in t.shape].index(g.dim)
        if isinstance(sizes[axis], str):
            raise ctx.error(
                f"scale blocks are anchored per '{g.name}', but the block along {g.dim} is "
                f"the whole of {g.dim} (one scale for all of it), which does not restart at "
                "each segment",
                s.anchor.pos,
                f"drop `per {g.name}`",
            )
    name = s.name or ast.Name(f"{t.name.text}_scale", t.name.pos)
    if s.name is None and name.text in ctx.names:
        raise ctx.error(
            f"the scale of '{t.name.text}' is passed as '{name.text}', which collides with "
            f"the {ctx.names[name.text][0]} of that name; name it with `as OTHER`",
            s.pos,
        )
    claim(ctx, name, "scale tensor")
    # The scale grid's own layout is over block indices; its dims are named after
    # the tensor's, so `major(T)` reads naturally. A run-time dim cut into blocks
    # has a run-time block count, which no stride may depend on. Its symbol is
    # spelled `ceil(T/128)`, which no name can be, so it never meets a user's dim.
    grid: list[Poly] = []
    blocked_dim: dict[str, str] = {}  # block-count symbol -> its run-time dim
    for n, b in zip(t.shape, sizes):
        d = ctx.dims[n.text]
        if isinstance(b, str):
            grid.append(ONE)  # one block over the whole run-time dim, whatever its size
        elif d.size is not None:
            grid.append(Poly.const(-(-d.size // b)))
        elif b == 1:
            grid.append(Poly.sym(d.name))
        else:
            sym = f"ceil({d.name}/{b})"
            blocked_dim[sym] = d.name
            ctx.worst[sym] = -(-MAX_EXTENT // b)
            grid.append(Poly.sym(sym))
    if s.layout is not None and s.layout.kind == "segment_major":
        raise ctx.error("scales cannot be segment_major; use row_major or major(...)", s.layout.pos)
    layout = check_layout(ctx, s.layout, t.shape, f"{t.name.text}'s scale", 4, s.pos, grid)
    for stride in layout.strides:
        blocked = sorted(sym for sym in stride.symbols if sym in blocked_dim)
        if blocked:
            dim = blocked_dim[blocked[0]]
            raise ctx.error(
                f"this scale layout needs the number of blocks along the run-time dim "
                f"{dim} in a stride; keep {dim}'s blocks outermost (row_major)",
                (s.layout or ast.LayoutDecl("row_major", s.pos)).pos,
            )
    if len(s.pow2) > 1:
        raise ctx.error(f"`pow2` is written twice in the scale of '{t.name.text}'", s.pow2[1])
    return Scale(name.text, s.dtype.text, sizes, layout, anchor, pow2=bool(s.pow2))


def block_size(ctx: Context, b: ast.IntLit | ast.Name) -> int | str:
    """A scale block entry's size: a literal, or a dim's name standing for the whole
    dim: its size when fixed, else the name itself (one block over all of it)."""
    if isinstance(b, ast.IntLit):
        return b.value
    if b.text not in ctx.dims:
        raise ctx.error(
            f"scale block '{b.text}' is not a dim; a block entry is a size or the name "
            "of a dim (one block over the whole of it)",
            b.pos,
        )
    size = ctx.dims[b.text].size
    return b.text if size is None else size
