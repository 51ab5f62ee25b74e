"""Views (`tensor v : T [dims] = view(SOURCE)`): SOURCE's bytes under another shape.

No pass writes a view and the caller does not pass it: every read of it binds SOURCE's
buffer, with the view's own strides. So it must name exactly SOURCE's elements in
row-major order (SOURCE's values reshaped, as numpy's reshape does): the same type, no
scales, and strides that address element i of the row-major order where SOURCE keeps
its element i. A statement never writes a view, nor reads a view of what it writes.
"""

from __future__ import annotations

from dataclasses import replace

from .. import ast
from ..expr import ONE, Poly
from ..spec import INDEX_TYPE, Gemm, Tensor
from .context import Context, row_major
from .fixes import drop_layout, drop_scale, fix, rename


def check_view(ctx: Context, t: ast.TensorDecl) -> None:
    """The declaration of a view: its source, type, scales and layout."""
    d = t.derived
    assert d is not None
    name, src = t.name.text, d.source
    if d.options:
        raise ctx.error(f"view(...) takes no options, but '{d.options[0].text}' is given", d.options[0].pos)
    if d.keywords:
        raise ctx.error(f"view(...) takes no `{d.keywords[0][0].text} = ...`", d.keywords[0][0].pos)
    view, source = ctx.tensors[name], ctx.tensors[src.text]
    if src.text == name:
        raise ctx.error(f"'{name}' is a view of itself; view a tensor that is passed in", src.pos)
    if source.view_of is not None:
        root = source.view_of
        raise ctx.error(
            f"'{src.text}' is itself a view of '{root}'; a view names the tensor whose buffer "
            "it reads",
            src.pos,
            f"view '{root}' directly: `= view({root})`",
            fix(rename(src, root)),
        )
    if source.derived is not None or source.copy_of is not None or source.row_pass is not None:
        what = (
            "a copy written by a statement's epilogue" if source.copy_of is not None
            else f"written by {source.row_pass.op}(...) after the statements" if source.row_pass is not None
            else f"derived by {source.derived.op}(...), a pass's workspace"
        )
        raise ctx.error(
            f"'{src.text}' is {what}; a view reads a tensor the caller passes (an input, or an "
            "output a statement writes)",
            src.pos,
        )
    if view.dtype != source.dtype:
        raise ctx.error(
            f"'{name}' is {view.dtype} but views '{src.text}', which is {source.dtype}; a view "
            "reads the same bytes, so it keeps the element type",
            t.dtype.pos,
            f"declare '{name}' {source.dtype}: `{source.dtype}`",
            fix(rename(t.dtype, source.dtype)),
        )
    if view.dtype == INDEX_TYPE:
        raise ctx.error(
            f"'{src.text}' is an index tensor; rows are read through an index tensor itself, "
            "never through a view of one",
            src.pos,
        )
    if t.scale is not None:
        raise ctx.error(
            f"'{name}' is a view and has a scale; a view reads '{src.text}''s bytes as they "
            "are, unscaled",
            t.scale.pos,
            "drop the scale clause",
            fix(drop_scale(ctx, name)),
        )
    if source.scale is not None:
        raise ctx.error(
            f"'{src.text}' has a scale; a view reads unscaled tensors only (its scale blocks "
            "would not follow the new shape)",
            src.pos,
        )
    _check_elements(ctx, t, view, source)
    _check_strides(ctx, t, view, source)


def _count(ctx: Context, dims: tuple[str, ...]) -> Poly:
    total = ONE
    for d in dims:
        total = total * ctx.size_poly(d)
    return total


def _blocks(ctx: Context, vdims: tuple[str, ...], sdims: tuple[str, ...]) -> list[tuple[list[int], list[int]]] | None:
    """The view's dims and the source's cut into consecutive runs of equal element
    counts, outermost first: a dim both name, or fixed dims whose sizes multiply to the
    same count ([3, 16] against [48]). None where no such cut exists (a run-time dim of
    the one not matched by the same dim of the other)."""

    def size(d: str) -> int | None:
        return ctx.dims[d].size

    blocks: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(vdims) and j < len(sdims):
        if vdims[i] == sdims[j]:
            blocks.append(([i], [j]))
            i, j = i + 1, j + 1
            continue
        pv, ps = size(vdims[i]), size(sdims[j])
        if pv is None or ps is None:
            return None
        bi, bj = [i], [j]
        i, j = i + 1, j + 1
        while pv != ps:
            if pv < ps:
                if i == len(vdims) or size(vdims[i]) is None:
                    return None
                pv *= size(vdims[i])
                bi.append(i)
                i += 1
            else:
                if j == len(sdims) or size(sdims[j]) is None:
                    return None
                ps *= size(sdims[j])
                bj.append(j)
                j += 1
        blocks.append((bi, bj))
    # What is left on either side may only be dims of one element.
    if any(size(d) != 1 for d in (*vdims[i:], *sdims[j:])):
        return None
    return blocks


def _check_elements(ctx: Context, t: ast.TensorDecl, view: Tensor, source: Tensor) -> None:
    shown_v, shown_s = f"[{', '.join(view.dims)}]", f"[{', '.join(source.dims)}]"
    nv, ns = _count(ctx, view.dims), _count(ctx, source.dims)
    if nv != ns:
        raise ctx.error(
            f"'{view.name}' {shown_v} holds {nv} elements, but '{source.name}' {shown_s} holds "
            f"{ns}; a view reshapes the same elements",
            t.shape[0].pos,
        )
    if _blocks(ctx, view.dims, source.dims) is None:
        raise ctx.error(
            f"'{view.name}' {shown_v} does not cut the dims of '{source.name}' {shown_s} in "
            "order: a view splits or merges neighbouring fixed dims, and keeps each run-time "
            "dim where the source has it",
            t.shape[0].pos,
        )


def _linear(parts: list[tuple[Poly, Poly]]) -> bool:
    """Whether dims of (size, stride), outermost first, step through their elements as one
    dim: each stride the next one's times its size (dims of one element aside)."""
    parts = [p for p in parts if p[0] != ONE]
    return all(parts[k][1] == parts[k + 1][1] * parts[k + 1][0] for k in range(len(parts) - 1))


def _maps(ctx: Context, view: Tensor, vstrides: tuple[Poly, ...], source: Tensor) -> bool:
    """Whether the view's strides put each element where the source keeps the element
    of its row-major order (the source strided)."""
    blocks = _blocks(ctx, view.dims, source.dims)
    assert blocks is not None
    for bi, bj in blocks:
        vp = [(ctx.size_poly(view.dims[i]), vstrides[i]) for i in bi]
        sp = [(ctx.size_poly(source.dims[j]), source.layout.strides[j]) for j in bj]
        if not (_linear(vp) and _linear(sp)):
            return False
        vp = [p for p in vp if p[0] != ONE]
        sp = [p for p in sp if p[0] != ONE]
        if vp and sp and vp[-1][1] != sp[-1][1]:
            return False
    return True


def _check_strides(ctx: Context, t: ast.TensorDecl, view: Tensor, source: Tensor) -> None:
    src_decl = ctx.tensor_ast[source.name]
    if source.layout.kind != "strided":
        raise ctx.error(
            f"'{source.name}' is stored {source.layout}, in segments; a view reads a tensor "
            "stored with strides (row_major, major(...) or strides(...)), whose elements it "
            "can address in its own order",
            t.derived.source.pos,
            f"store '{source.name}' row_major: drop `layout {source.layout}` from its declaration",
            fix(drop_layout(ctx, source.name)),
        )
    if view.layout.kind == "strided" and _maps(ctx, view, view.layout.strides, source):
        return
    at = t.layout.pos if t.layout is not None else t.derived.source.pos
    shown = ", ".join(str(s) for s in view.layout.strides) if view.layout.kind == "strided" else str(view.layout)
    message = (
        f"'{view.name}' (strides {shown}) does not address the elements of '{source.name}' "
        f"(stored {source.layout}, strides {', '.join(str(s) for s in source.layout.strides)}) in "
        "row-major order; a view reads the source's values reshaped, element for element"
    )
    plain = tuple(row_major([ctx.size_poly(d) for d in view.dims], None))
    if t.layout is not None and _maps(ctx, view, plain, source):
        raise ctx.error(message, at, f"drop the layout of '{view.name}': row-major addresses them",
                        fix(drop_layout(ctx, view.name)))
    src_plain = tuple(row_major([ctx.size_poly(d) for d in source.dims], None))
    if src_decl.layout is not None and view.layout.kind == "strided" and _maps_with(ctx, view, source, src_plain):
        raise ctx.error(
            message, at,
            f"store '{source.name}' row_major: drop `layout {source.layout}` from its declaration",
            fix(drop_layout(ctx, source.name)),
        )
    raise ctx.error(message, at)


def _maps_with(ctx: Context, view: Tensor, source: Tensor, strides: tuple[Poly, ...]) -> bool:
    """`_maps`, were the source stored with `strides`."""
    layout = replace(source.layout, strides=strides)
    return _maps(ctx, view, view.layout.strides, replace(source, layout=layout))


def check_view_uses(ctx: Context, gemms: tuple[Gemm, ...]) -> None:
    """A statement reads a view as it reads any tensor, except its rows through an index
    (the gather would copy from the view's name, which has no buffer) and a view of what
    it writes itself."""
    for g in gemms:
        s = ctx.ast.statements[g.index]
        refs = [s.lhs, s.rhs, *s.factors, *((s.bias,) if s.bias else ())]
        if s.up is not None:
            refs += [s.up.lhs, s.up.rhs]
        for ref in refs:
            v = ctx.tensors[ref.tensor.text]
            if v.view_of is None:
                continue
            if v.view_of in g.writes:
                raise ctx.error(
                    f"the statement reads '{v.name}', a view of '{v.view_of}', which it writes; "
                    "a statement never reads what it writes",
                    ref.tensor.pos,
                )
            if any(isinstance(i, ast.Index) and i.via is not None for i in ref.indices):
                raise ctx.error(
                    f"rows of the view '{v.name}' are read through an index tensor; read them "
                    f"through the index from '{v.view_of}' itself",
                    ref.tensor.pos,
                )
