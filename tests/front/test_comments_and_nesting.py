"""Comments and the nesting limit of integer expressions, as the parser reports them.

The only comments are `#` to the end of the line (the end of the file ends the last
one); a C-style comment, closed or left open at the end of the file, is an error at its
first character that says how comments are written. The nesting limit counts sums and
products inside one another, and its message says so (it spoke of parentheses, which
alone do not count)."""

from __future__ import annotations

import pytest

from gemmspec.errors import SpecError
from gemmspec.parse import MAX_EXPR_DEPTH, parse

SPEC = """\
gemm commented {
  dim T
  dim N = 64, K = 64
  tensor x : bf16 [T, K] layout strides(STRIDE, 1)
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


def spec_with(stride: str = "K", tail: str = "") -> str:
    return SPEC.replace("STRIDE", stride) + tail


def error_of(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        parse(text, "spec.gspec")
    return info.value


def test_a_comment_may_end_the_file_without_a_line_break() -> None:
    (spec,) = parse(spec_with(tail="# the end, no line break"), "spec.gspec").specs
    assert spec.name.text == "commented"


@pytest.mark.parametrize("tail", ["/* left open", "/* closed */\n", "// a C++ comment\n", "/*"])
def test_a_c_style_comment_is_a_located_error(tail: str) -> None:
    err = error_of(spec_with(tail=tail))
    assert err.message == "unexpected character '/'"
    assert err.location is not None and (err.location.line, err.location.column) == (9, 1)
    assert err.note is not None and "comments start with '#'" in err.note


def test_a_slash_elsewhere_has_no_comment_note() -> None:
    err = error_of(spec_with(stride="K / 2"))
    assert err.message == "unexpected character '/'" and err.note is None


def test_parentheses_alone_do_not_count() -> None:
    parse(spec_with(stride="(" * 100 + "K" + ")" * 100), "spec.gspec")


def nested(levels: int) -> str:
    """`levels` parentheses, each holding a product inside a sum: two levels each."""
    return "(" * levels + "K" + " * 2 + 1)" * levels


def test_the_limit_counts_sums_and_products() -> None:
    parse(spec_with(stride=nested(MAX_EXPR_DEPTH // 2)), "spec.gspec")  # 32 deep
    err = error_of(spec_with(stride=nested(MAX_EXPR_DEPTH // 2 + 1)))  # 17 parentheses, 34 deep
    assert err.message.startswith(f"expression nests sums and products more than {MAX_EXPR_DEPTH} deep")
    assert "parentheses alone do not" in err.message
    assert err.location is not None and err.location.line == 4
