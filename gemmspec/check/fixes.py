"""Where a note's proposal goes in the source, as `Fix` edits: the spans of
declarations and clauses (from the parse tree, since the syntax tree records only
where things start) and the edits that insert, replace or add a declaration."""

from __future__ import annotations

import difflib
from functools import lru_cache

from lark import Token, Tree

from .. import ast
from ..errors import Edit, Fix
from ..parse import syntax_tree
from .context import Context


@lru_cache(maxsize=4)
def _tree(text: str) -> Tree:
    return syntax_tree(text)


def _spec_tree(ctx: Context) -> Tree:
    name = ctx.ast.name
    for spec in _tree(ctx.file.text).children:
        tok = spec.children[0]
        if tok == name.text and tok.line == name.pos.line:
            return spec
    raise LookupError(name.text)  # the text parsed into this very spec


def _decl_tree(ctx: Context, rule: str, name: str) -> Tree:
    for item in _spec_tree(ctx).children[1:]:
        if isinstance(item, Tree) and item.data == rule and item.children[0] == name:
            return item
    raise LookupError(name)


def _child(tree: Tree, rule: str) -> Tree | None:
    return next((c for c in tree.children if isinstance(c, Tree) and c.data == rule), None)


def _end(node: Tree | Token) -> tuple[int, int]:
    if isinstance(node, Token):
        return node.end_line, node.end_column
    return node.meta.end_line, node.meta.end_column


def _start(node: Tree | Token) -> tuple[int, int]:
    if isinstance(node, Token):
        return node.line, node.column
    return node.meta.line, node.meta.column


def _span(node: Tree | Token, text: str) -> Edit:
    return Edit(*_start(node), *_end(node), text)


def _insert(at: tuple[int, int], text: str) -> Edit:
    return Edit(*at, *at, text)


def rename(name: ast.Name, text: str) -> Edit:
    """Replace a name as written (one token) with `text`."""
    line, col = name.pos.line, name.pos.column
    return Edit(line, col, line, col + len(name.text), text)


def fix(*edits: Edit) -> Fix:
    return Fix(tuple(edits))


def set_scale(ctx: Context, tensor: str, block: list[str], anchor: str = "") -> Edit:
    """Give `tensor` the scale blocks `block` (and `anchor`, ` per GROUP`, on a new
    clause): replace the blocks it declares, or add a scale clause after its shape (or
    layout) when it has none."""
    decl = _decl_tree(ctx, "tensor_decl", tensor)
    shown = f"[{', '.join(block)}]"
    clause = _child(decl, "scale_clause")
    if clause is not None:
        return _span(_child(clause, "block_shape"), shown)
    after = _child(decl, "layout_clause") or _child(decl, "shape")
    return _insert(_end(after), f" scale f32 {shown}{anchor}")


def add_anchor(ctx: Context, tensor: str, group: str) -> Edit:
    """` per GROUP` right after `tensor`'s scale blocks."""
    clause = _child(_decl_tree(ctx, "tensor_decl", tensor), "scale_clause")
    return _insert(_end(_child(clause, "block_shape")), f" per {group}")


def set_layout(ctx: Context, tensor: str, layout: str) -> Edit:
    """Give `tensor` the layout `layout` (the words after `layout`)."""
    decl = _decl_tree(ctx, "tensor_decl", tensor)
    clause = _child(decl, "layout_clause")
    if clause is not None:
        return _span(clause, f"layout {layout}")
    return _insert(_end(_child(decl, "shape")), f" layout {layout}")


def end_of_scale(ctx: Context, tensor: str) -> tuple[int, int] | None:
    """Just after `tensor`'s scale clause, if it has one."""
    clause = _child(_decl_tree(ctx, "tensor_decl", tensor), "scale_clause")
    return None if clause is None else _end(clause)


def add_declaration(ctx: Context, after_tensor: str, text: str) -> Edit:
    """A new line holding `text` after the declaration of `after_tensor`, indented like it."""
    decl = _decl_tree(ctx, "tensor_decl", after_tensor)
    line = ctx.lines[decl.meta.line - 1]
    indent = line[: len(line) - len(line.lstrip())]
    return _insert(_end(decl), f"\n{indent}{text}")


def replace_declaration(ctx: Context, tensor: str, text: str) -> Edit:
    """Replace the whole declaration of `tensor` (clauses and derivation included) with `text`."""
    return _span(_decl_tree(ctx, "tensor_decl", tensor), text)


def group_kind_end_of_dim(ctx: Context, group: str) -> tuple[int, int]:
    """Just after the split dim's name in `group`'s `ragged(DIM ...)`."""
    decl = _decl_tree(ctx, "group_decl", group)
    kind = decl.children[-1]
    return _end(kind.children[0])


def insert_at(at: tuple[int, int], text: str) -> Edit:
    return _insert(at, text)


def did_you_mean(name: ast.Name, known: list[str], what: str) -> tuple[str, Fix | None]:
    """The note and fix for an unknown name: the declared name closest to it, if one is
    close, and the names declared."""
    listed = f"declared {what}: {', '.join(known) or 'none'}"
    same_letters = [k for k in known if k.lower() == name.text.lower()]
    close = same_letters or difflib.get_close_matches(name.text, known, n=1, cutoff=0.6)
    if not close:
        return listed, None
    return f"did you mean '{close[0]}'? ({listed})", fix(rename(name, close[0]))


def add_declaration_last(ctx: Context, text: str) -> Edit:
    """A new line holding `text` after the spec's last tensor declaration."""
    decls = [c for c in _spec_tree(ctx).children[1:] if isinstance(c, Tree) and c.data == "tensor_decl"]
    return add_declaration(ctx, decls[-1].children[0], text)


def drop_layout(ctx: Context, tensor: str) -> Edit:
    """Remove `tensor`'s layout clause and the space before it."""
    clause = _child(_decl_tree(ctx, "tensor_decl", tensor), "layout_clause")
    line, col = _start(clause)
    text = ctx.lines[line - 1]
    while col > 1 and text[col - 2] in " \t":
        col -= 1
    return Edit(line, col, *_end(clause), "")


def drop_scale(ctx: Context, tensor: str) -> Edit:
    """Remove `tensor`'s scale clause and the space before it."""
    clause = _child(_decl_tree(ctx, "tensor_decl", tensor), "scale_clause")
    line, col = _start(clause)
    text = ctx.lines[line - 1]
    while col > 1 and text[col - 2] in " \t":
        col -= 1
    return Edit(line, col, *_end(clause), "")
