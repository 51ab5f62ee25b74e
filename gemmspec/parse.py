"""Text to syntax tree: lark's LALR parser plus a transformer to `gemmspec.ast`.

Syntax errors become `SpecError`s located at the offending token, with a message
that names what was expected in words rather than terminal names. Nothing here
recurses in proportion to the input: LALR parsing is iterative, the transformer is
lark's non-recursive one, sums and products are flat, and parenthesised nesting and
integer literals are bounded with located errors.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import os
import re
import sys
from functools import lru_cache
from importlib import resources
from pathlib import Path

import lark
from lark import (
    Lark,
    Token,
    UnexpectedCharacters,
    UnexpectedEOF,
    UnexpectedToken,
    v_args,
)
from lark.exceptions import VisitError
from lark.visitors import Transformer_NonRecursive

from . import ast, diskcache
from .errors import Edit, Fix, SourceLocation, SpecError, locate, normalise_source, source_lines

# Integer literals are at most 2^63 - 1: every size, stride and count ends up in a
# signed 64-bit C++ constant or smaller (the checker applies each one's own limit).
MAX_INT_LITERAL = 2**63 - 1
# Sums and products nested inside one another deeper than this are refused: nothing
# real needs it, and every later stage walks expressions by recursion over depth.
MAX_EXPR_DEPTH = 32

# Terminal names as a user would say them.
_TERMINAL_WORDS = {
    "NAME": "a name",
    "INT": "an integer",
    "DTYPE": "an element type (e4m3, e5m2, bf16, f16, f32, i32)",
    "ASSIGN": "'=' or '+='",
    "DERIVE_OP": "'requantize', 'transpose', 'quantize', 'copy', 'rowdot', 'rowscale', 'scatter_add', 'swiglu_grad' or 'view'",
    "LBRACE": "'{'",
    "RBRACE": "'}'",
    "LSQB": "'['",
    "RSQB": "']'",
    "LPAR": "'('",
    "RPAR": "')'",
    "COMMA": "','",
    "COLON": "':'",
    "EQUAL": "'='",
    "STAR": "'*'",
    "PLUS": "'+'",
    "SUM": "'sum'",
    "SILU": "'silu'",
    "IN": "'in'",
    "$END": "end of file",
}


# `group NAME[...] = ragged(DIM` or `ragged(DIM within OUTER`, up to where `, offsets = ...`
# belongs (comments aside): a `)` there means the offsets were left out.
_RAGGED_OPEN = re.compile(
    r"group\s+([A-Za-z_]\w*)\s*\[[^\]]*\]\s*=\s*ragged\s*\(\s*[A-Za-z_]\w*"
    r"(?:\s+within\s+[A-Za-z_]\w*)?\s*\Z"
)

_CAPACITY = object()  # marks `ragged(..., capacity)` among a rule's children


# strict: lark refuses terminals that can collide (checked with interegular) rather than
# let the lexer pick one silently.
_PARSER_OPTIONS = {
    "parser": "lalr",
    "lexer": "contextual",
    "strict": True,
    "propagate_positions": True,
    "maybe_placeholders": False,
}
_PARSER_MAGIC = b"GSLARK01"


def _grammar() -> str:
    return resources.files("gemmspec").joinpath("grammar.lark").read_text(encoding="utf-8")


def build_parser() -> Lark:
    """The spec grammar's LALR parser, built from the grammar (checked strictly)."""
    return Lark(_grammar(), **_PARSER_OPTIONS)


@lru_cache(maxsize=1)
def _parser() -> Lark:
    """`build_parser()`, kept in gemmspec's cache folder: building it (the strict
    collision check above all) takes about 0.25 s, loading it a few ms. The entry is keyed
    by the grammar, the options and the lark and Python versions; one that does not load
    is rebuilt and rewritten."""
    if not diskcache.cache_enabled():
        return build_parser()
    key = hashlib.sha256(
        "\0".join((_grammar(), repr(sorted(_PARSER_OPTIONS.items())), lark.__version__, sys.version)).encode()
    ).hexdigest()
    path = os.path.join(diskcache.default_cache_dir(), f"parser-{key[:16]}.lark")
    saved = diskcache.read_entry(path, key, _PARSER_MAGIC)
    if saved is not None:
        with contextlib.suppress(Exception):  # whatever a stale or damaged entry raises
            return Lark.load(io.BytesIO(saved))
    parser = build_parser()
    out = io.BytesIO()
    parser.save(out)
    diskcache.write_entry(path, out.getvalue(), key, _PARSER_MAGIC, "parser")
    return parser


def _pos(tok: Token) -> ast.Pos:
    return ast.Pos(tok.line or 1, tok.column or 1)


def _name(tok: Token) -> ast.Name:
    return ast.Name(str(tok), _pos(tok))


def _meta_pos(meta) -> ast.Pos:
    return ast.Pos(getattr(meta, "line", 1), getattr(meta, "column", 1))


class _LimitExceeded(Exception):
    """Raised inside the transformer (which knows no file); `parse` locates it."""

    def __init__(self, message: str, pos: ast.Pos):
        super().__init__(message)
        self.message = message
        self.pos = pos


def _int(tok: Token) -> int:
    """An INT token's value; the digit count is checked first, because Python refuses
    to convert strings of more than 4,300 digits and the work grows with length."""
    digits = str(tok).lstrip("0") or "0"
    if len(digits) > len(str(MAX_INT_LITERAL)) or int(digits) > MAX_INT_LITERAL:
        shown = digits if len(digits) <= 24 else f"{digits[:12]}...{digits[-6:]} ({len(digits)} digits)"
        raise _LimitExceeded(
            f"integer {shown} is too large: literals are at most 2^63 - 1 = {MAX_INT_LITERAL}",
            _pos(tok),
        )
    return int(digits)


def _nest(node: ast.Sum | ast.Product) -> ast.Sum | ast.Product:
    # The depth counts sums and products inside one another, with or without
    # parentheses: `(a + b) * c` is 2 deep, `((a))` 0.
    if node.depth > MAX_EXPR_DEPTH:
        raise _LimitExceeded(
            f"expression nests sums and products more than {MAX_EXPR_DEPTH} deep (each sum or "
            "product that is a term or factor of another counts one level; parentheses alone "
            "do not); simplify it",
            node.pos,
        )
    return node


class _ToAst(Transformer_NonRecursive):
    """Builds frozen `ast` nodes bottom-up; `meta` gives each rule's position."""

    __visit_tokens__ = False  # tokens reach the rules as they are

    # -- expressions
    def int_lit(self, items):
        (tok,) = items
        return ast.IntLit(_int(tok), _pos(tok))

    def name_ref(self, items):
        return ast.NameRef(_name(items[0]))

    def add(self, items):
        depth = 1 + max(e.depth for e in items)
        return _nest(ast.Sum(tuple(items), items[0].pos, depth))

    def mul(self, items):
        depth = 1 + max(e.depth for e in items)
        return _nest(ast.Product(tuple(items), items[0].pos, depth))

    # -- dims and groups
    def dim_def(self, items):
        size = _int(items[1]) if len(items) > 1 else None
        return ast.DimDecl(_name(items[0]), size)

    def dim_decl(self, items):
        return ("dims", tuple(items))

    def within(self, items):
        return _name(items[0])

    def capacity(self, items):
        return _CAPACITY

    def ragged(self, items):
        capacity = items[-1] is _CAPACITY
        items = [i for i in items if i is not _CAPACITY]
        dim = _name(items[0])
        within = items[1] if len(items) == 3 else None
        return ast.GroupKind(
            "ragged", dim, dim.pos, within=within, tensor=_name(items[-1]), capacity=capacity
        )

    def size_list(self, items):
        return tuple(items)

    def split_sizes(self, items):
        dim = _name(items[0])
        return ast.GroupKind("split", dim, dim.pos, sizes=items[1])

    def uniform(self, items):
        dim = _name(items[0])
        return ast.GroupKind("uniform", dim, dim.pos)

    def masked(self, items):
        dim = _name(items[0])
        return ast.GroupKind("masked", dim, dim.pos, tensor=_name(items[1]))

    def group_decl(self, items):
        name, count_dim = _name(items[0]), _name(items[1])
        count = _int(items[2]) if len(items) == 4 else None
        return ("group", ast.GroupDecl(name, count_dim, count, items[-1]))

    # -- tensors
    def shape(self, items):
        return tuple(_name(t) for t in items)

    def row_major(self, items):
        return ("row_major", {})

    def major(self, items):
        return ("major", {"dim": _name(items[0])})

    def strides(self, items):
        return ("strides", {"strides": tuple(items)})

    def segment_major(self, items):
        return ("segment_major", {"group": _name(items[0])})

    def pad(self, items):
        return _int(items[0]), _pos(items[0])

    def block_shape(self, items):
        return tuple(_name(t) if t.type == "NAME" else ast.IntLit(_int(t), _pos(t)) for t in items)

    def scale_anchor(self, items):
        return ("anchor", _name(items[0]))

    def scale_name(self, items):
        return ("name", _name(items[0]))

    def scale_pow2(self, items):
        return ("pow2", _pos(items[0]))

    def derive_option(self, items):
        return (_name(items[0]), _name(items[1])) if len(items) == 2 else _name(items[0])

    def derived(self, items):
        options = tuple(o for o in items[2:] if isinstance(o, ast.Name))
        keywords = tuple(o for o in items[2:] if isinstance(o, tuple))
        return ast.Derivation(_name(items[0]), _name(items[1]), options, keywords)

    def tensor_decl(self, items):
        name, dtype, shape = _name(items[0]), _name(items[1]), items[2]
        layout = scale = derived = None
        for it in items[3:]:
            if isinstance(it, ast.LayoutDecl):
                layout = it
            elif isinstance(it, ast.ScaleDecl):
                scale = it
            elif isinstance(it, ast.Derivation):
                derived = it
        return ("tensor", ast.TensorDecl(name, dtype, shape, layout, scale, derived))

    # -- statements
    def gather(self, items):
        return ast.Index(_name(items[1]), via=_name(items[0]))

    def index(self, items):
        if len(items) == 1 and isinstance(items[0], ast.Index):  # `idx[t]`
            return items[0]
        if len(items) == 2:
            return ast.Index(_name(items[1]), group=_name(items[0]))
        (item,) = items
        if isinstance(item, ast.NameRef):  # `(j)`: a plain index in parentheses
            return ast.Index(item.name)
        if isinstance(item, Token):
            return ast.Index(_name(item))
        return ast.IndexExpr(item)

    def ref(self, items):
        return ast.Ref(_name(items[0]), tuple(items[1:]))

    def sum_index(self, items):
        if len(items) == 1:
            return ast.SumIndex(_name(items[0]))
        return ast.SumIndex(_name(items[0]), group=_name(items[2]), group_var=_name(items[3]))

    def epi_factor(self, items):
        return ("factor", items[0])

    def epi_bias(self, items):
        return ("bias", items[0])

    def product(self, items):
        *sums, lhs, rhs = items
        return ("product", tuple(sums), lhs, rhs)

    def swiglu(self, items):
        silu, gate, up = items
        return ("swiglu", gate, ast.UpProduct(up[1], up[2], up[3], _pos(silu)))

    def statement(self, items):
        out, assign, *rest = items
        factors = tuple(r[1] for r in rest if r[0] == "factor")
        bias = next((r[1] for r in rest if r[0] == "bias"), None)
        body = next(r for r in rest if r[0] in ("product", "swiglu"))
        up = None
        if body[0] == "swiglu":
            _, body, up = body
        _, sums, lhs, rhs = body
        pos = ast.Pos(out.tensor.pos.line, out.tensor.pos.column)
        return (
            "statement",
            ast.Statement(
                out, str(assign) == "+=", sums, lhs, rhs, pos, factors, bias, up, _pos(assign)
            ),
        )

    # -- rules that need their own source position
    @v_args(meta=True)
    def layout_clause(self, meta, items):
        (kind, fields), *rest = items
        pad, pad_pos = rest[0] if rest else (None, None)
        return ast.LayoutDecl(kind, _meta_pos(meta), pad=pad, pad_pos=pad_pos, **fields)

    @v_args(meta=True)
    def scale_clause(self, meta, items):
        dtype, block, *opts = items
        layout = anchor = name = None
        pow2: list[ast.Pos] = []
        for opt in opts:
            if isinstance(opt, ast.LayoutDecl):
                layout = opt
            elif opt[0] == "anchor":
                anchor = opt[1]
            elif opt[0] == "pow2":
                pow2.append(opt[1])
            else:
                name = opt[1]
        return ast.ScaleDecl(_name(dtype), block, _meta_pos(meta), layout, anchor, name, tuple(pow2))

    @v_args(meta=True)
    def flatten(self, meta, items):
        return ("directive", ast.Directive("flatten", _meta_pos(meta)))

    @v_args(meta=True)
    def split(self, meta, items):
        return ("directive", ast.Directive("split", _meta_pos(meta)))

    @v_args(meta=True)
    def target(self, meta, items):
        return ("directive", ast.Directive("target", _meta_pos(meta), (str(items[0]),)))

    @v_args(meta=True)
    def tile(self, meta, items):
        return ("directive", ast.Directive("tile", _meta_pos(meta), tuple(str(_int(t)) for t in items)))

    @v_args(meta=True)
    def gather_rows(self, meta, items):
        return ("directive", ast.Directive("gather", _meta_pos(meta), (str(items[0]),)))

    @v_args(meta=True)
    def accumulation(self, meta, items):
        return ("directive", ast.Directive("accumulate", _meta_pos(meta), (str(items[0]),)))

    def spec(self, items):
        name = _name(items[0])
        dims, groups, tensors, statements, directives = [], [], [], [], []
        for it in items[1:]:
            tag = it[0]
            if tag == "dims":
                dims.extend(it[1])
            elif tag == "group":
                groups.append(it[1])
            elif tag == "tensor":
                tensors.append(it[1])
            elif tag == "statement":
                statements.append(it[1])
            else:
                directives.append(it[1])
        return ast.SpecAst(
            name, tuple(dims), tuple(groups), tuple(tensors), tuple(statements), tuple(directives)
        )

    def start(self, items):
        return tuple(items)


def _describe_expected(expected: set[str]) -> str:
    words = sorted({_TERMINAL_WORDS.get(t, f"'{t.lower()}'") for t in expected})
    if len(words) > 6:
        words = words[:6] + ["..."]
    return ", ".join(words)


def _shown(tok: Token) -> str:
    text = str(tok)
    return text if len(text) <= 40 else f"{text[:30]}... ({len(text)} characters)"


def parse(text: str, path: str = "<string>") -> ast.FileAst:
    """Parse .gspec text; raise `SpecError` located at the first syntax error.

    The text is normalised first (no byte-order mark, LF line endings), and the
    `FileAst` keeps the normalised text, so every later caret lines up with it.
    """
    text = normalise_source(text)
    lines = source_lines(text)

    def at_end() -> SourceLocation:
        last = lines or [""]
        return locate(path, last, len(last), len(last[-1]) + 1)

    try:
        tree = _parser().parse(text)
    except UnexpectedEOF as e:
        raise SpecError(
            f"unexpected end of file; expected {_describe_expected(set(e.expected))}", at_end()
        ) from None
    except UnexpectedToken as e:
        tok = e.token
        expected = _describe_expected(set(e.expected))
        if tok.type == "$END":
            where, found = at_end(), "end of file"
        else:
            where, found = locate(path, lines, tok.line, tok.column), f"'{_shown(tok)}'"
        note, fix = None, None
        end = tok.start_pos or 0
        opened = _RAGGED_OPEN.search(text, max(0, end - 400), end) if tok.type == "RPAR" else None
        if opened:
            # `ragged(T)`: the offsets tensor is not optional; name one after the group.
            name = f"{opened.group(1)}_offsets"
            note = f"a ragged group reads its segment boundaries from an int32 tensor: `offsets = {name}`"
            fix = Fix((Edit(tok.line, tok.column, tok.line, tok.column, f", offsets = {name}"),))
        elif set(e.expected) == {"STAR"}:
            # Only a statement's epilogue factors are followed by nothing but '*': a
            # product without `sum[...]` reads as a chain of factors.
            note = "a statement is `OUT[...] = [factor * ...] sum[k] A[...] * B[...] [+ bias[...]]`; is `sum[...]` missing?"
        raise SpecError(f"unexpected {found}; expected {expected}", where, note, fix) from None
    except UnexpectedCharacters as e:
        ch = text[e.pos_in_stream] if e.pos_in_stream < len(text) else "?"
        note, fix = None, None
        if text.startswith(("/*", "//"), e.pos_in_stream):
            # The only comments are `#` to the end of the line: a C-style one, closed or
            # not (at the end of the file too), is refused at its first character.
            note = "comments start with '#' and run to the end of the line; '/*' and '//' are not comments"
            if text.startswith("//", e.pos_in_stream):
                fix = Fix((Edit(e.line, e.column, e.line, e.column + 2, "#"),))
        raise SpecError(
            f"unexpected character {ch!r}", locate(path, lines, e.line, e.column), note, fix
        ) from None
    try:
        specs = _ToAst().transform(tree)
    except VisitError as e:
        if isinstance(e.orig_exc, _LimitExceeded):
            pos = e.orig_exc.pos
            raise SpecError(e.orig_exc.message, locate(path, lines, pos.line, pos.column)) from None
        raise e.orig_exc from None  # a bug in the transformer, not the user's input
    return ast.FileAst(path, text, specs)


def parse_file(path: str | Path) -> ast.FileAst:
    p = Path(path)
    return parse(p.read_text(encoding="utf-8"), str(path))


def syntax_tree(text: str) -> lark.Tree:
    """The parse tree of normalised .gspec text that parses, with each rule's start and
    end: the syntax tree keeps only where things start, and a fix that replaces a whole
    clause needs where it ends too."""
    return _parser().parse(text)
