"""Every diagnostic is located at the token responsible: exact line and column."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse

BASE = """\
gemm g {
  dim T
  dim N = 256, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

FP8 = """\
gemm g {
  dim T
  dim N = 256, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""


def edit(text: str, line: int, old: str, new: str) -> str:
    lines = text.splitlines()
    assert old in lines[line - 1], (old, lines[line - 1])
    lines[line - 1] = lines[line - 1].replace(old, new, 1)
    return "\n".join(lines) + "\n"


def insert(text: str, after_line: int, new_line: str) -> str:
    lines = text.splitlines()
    lines.insert(after_line, new_line)
    return "\n".join(lines) + "\n"


# (id, spec text, line of the error, token the caret must sit on, message fragment)
CASES = [
    ("missing-brace", BASE.replace("gemm g {", "gemm g"), 2, "dim", "expected '{'"),
    ("bad-character", edit(BASE, 7, "bf16 [T, N]", "bf16 [T, N] @"), 7, "@", "unexpected character"),
    ("unknown-dtype", edit(BASE, 7, "bf16", "fp8"), 7, "fp8", "element type"),
    ("unexpected-eof", BASE.rstrip().rstrip("}"), 8, None, "end of file"),
    # Without `sum`, `x[t, k] *` reads as an epilogue factor: the parser stops at the end
    # of the statement, where another '*' was due (the note asks about `sum`).
    ("missing-sum", edit(BASE, 8, "sum[k] ", ""), 9, "}", "expected '*'"),
    ("unknown-dim", edit(BASE, 5, "[T, K]", "[T, Q]"), 5, "Q", "unknown dim 'Q'"),
    ("dim-two-sizes", insert(BASE, 3, "  dim K = 7168"), 4, "K", "two sizes: 7168 here, 512 at 3:"),
    ("group-count-conflict", insert(BASE, 3, "  dim E = 16"), 5, "E", "dim 'E' is given two sizes: 4 here, 16"),
    ("unknown-tensor", edit(BASE, 8, "x[t, k]", "z[t, k]"), 8, "z", "unknown tensor 'z'"),
    ("wrong-rank", edit(BASE, 8, "x[t, k]", "x[t, k, n]"), 8, "x", "has 2 dims [T, K] but is indexed with 3"),
    ("unknown-group", edit(BASE, 8, "expert(t)", "adapter(t)"), 8, "adapter", "unknown group 'adapter'"),
    ("index-two-dims", edit(BASE, 8, "x[t, k]", "x[k, k]"), 8, "k] *", "index 'k' is used twice"),
    ("index-ranges-differ", edit(BASE, 8, "w[expert(t), n, k]", "w[expert(t), k, n]"), 8, "k, n]", "ranges over N"),
    ("group-wrong-position", insert(edit(BASE, 8, "w[expert(t)", "w[lora(t)"), 4, "  group lora[L = 2] = ragged(T, offsets = loffs)"), 9, "lora(t)", "this position of 'w' is dim E"),
    ("group-wrong-dim", edit(edit(BASE, 6, "[E, N, K]", "[E, N, K, K2]"), 3, "K = 512", "K = 512, K2 = 4"), None, None, None),
    ("not-a-gemm-free-index", edit(edit(BASE, 7, "[T, N]", "[T, N, K]"), 8, "y[t, n]", "y[t, n, k]"), 8, "k] x", "is summed but also indexes the output"),
    ("not-a-gemm-dangling", edit(edit(BASE, 5, "[T, K]", "[T, K, N]"), 8, "x[t, k]", "x[t, k, q]"), 8, "q]", "neither summed nor in the output"),
    ("not-a-gemm-no-column", edit(edit(BASE, 5, "[T, K]", "[T, K, N]"), 8, "x[t, k]", "x[t, k, n]"), 8, "y[", "exactly one column index"),
    ("summed-nowhere", edit(BASE, 8, "sum[k]", "sum[j]"), 8, "j]", "indexes neither factor"),
    ("summed-missing", edit(BASE, 8, "x[t, k]", "x[t, q]"), 8, "x[", "does not index the first factor"),
    ("two-sums", edit(BASE, 8, "sum[k]", "sum[k, n]"), 8, "n] x", "exactly one index"),
    ("fp8-needs-requant", edit(FP8, 8, "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]"), None, None, None),
    ("k-scale-finer", edit(FP8, 5, "scale f32 [1, 128]", "scale f32 [1, 32]"), 5, "32]", "finer than the 128-wide K block"),
    ("fp8-not-k-major", edit(FP8, 6, "[E, N, K] scale", "[E, N, K] layout major(N) scale"), 8, "w[", "needs a transpose pass"),
    ("fp8-no-scale", edit(FP8, 5, " scale f32 [1, 128]", ""), 8, "x[", "has no scale"),
    ("mixed-types", edit(FP8, 6, "e4m3 [E, N, K] scale f32 [1, 128, 128]", "bf16 [E, N, K]"), 8, "w[", "must both be FP8"),
    ("scale-on-bf16", edit(BASE, 5, "bf16 [T, K]", "bf16 [T, K] scale f32 [1, 128]"), 5, "scale", "scales apply to FP8"),
    ("scale-rank", edit(FP8, 5, "[1, 128]", "[128]"), 5, "scale", "scale block has 1 entries"),
    ("scale-not-tile-divisor", edit(FP8, 6, "[1, 128, 128]", "[1, 96, 128]"), 6, "96", "does not divide the 128-wide tile grid"),
    ("scale-straddles-ragged", edit(FP8, 5, "[1, 128]", "[128, 128]"), 5, "128, 128", "straddle the segments of 'expert'"),
    ("cxx-keyword", edit(BASE, 5, "tensor x ", "tensor class "), 5, "class", "reserved in C++"),
    ("reserved-prefix", edit(BASE, 5, "tensor x ", "tensor gs_x "), 5, "gs_x", "reserved for generated code"),
    ("name-collision", edit(BASE, 5, "tensor x ", "tensor offs "), 5, "offs", "collides with the offsets tensor"),
    ("scale-name-collision", insert(edit(FP8, 7, "tensor y", "tensor x_scale"), 8, ""), None, None, None),
    ("output-fp8-block", edit(FP8, 7, "bf16 [T, N]", "e4m3 [T, N] scale f32 [1, 1]"), 7, "1]", "writes one scale per row and 128 columns"),
    ("f32-operand", edit(BASE, 5, "bf16 [T, K]", "f32 [T, K]"), 8, "x[", "tensor cores take FP8, BF16 or F16"),
    ("split-sizes-sum", insert(BASE, 4, "  group part[P = 2] = split(N, sizes = [100, 100])"), 5, "100, 100", "add up to 200 but dim 'N' is 256"),
    ("uniform-not-divisible", insert(BASE, 4, "  group part[P = 3] = uniform(N)"), 5, "N", "compile-time multiple of 3"),
    ("within-masked", insert(insert(BASE, 4, "  group part[P = 2] = masked(N, counts = cnt)"), 5, "  group sub[S = 2] = ragged(N within part, offsets = o2)"), 6, "part,", "can nest only within a ragged, split or uniform group"),
    ("within-unrelated", insert(BASE, 4, "  group sub[S = 2] = ragged(N within expert, offsets = o2)"), 5, "expert", "does not split N"),
    ("major-unknown-dim", edit(BASE, 5, "bf16 [T, K]", "bf16 [T, K] layout major(N)"), 5, "N)", "is not a dim of 'x'"),
    ("strides-count", edit(BASE, 5, "bf16 [T, K]", "bf16 [T, K] layout strides(K)"), 5, "layout", "gives 1 strides for the 2 dims"),
    ("segment-major-unrelated", edit(BASE, 6, "bf16 [E, N, K]", "bf16 [E, N, K] layout segment_major(expert)"), 6, "expert)", "does not split any dim of 'w'"),
    ("flatten-and-split", insert(insert(BASE, 8, "  flatten"), 9, "  split"), 10, "split", "contradicts the earlier 'flatten'"),
    ("bad-target", insert(BASE, 8, "  target sm_80"), 9, "target", "unsupported target 'sm_80'"),
    ("bad-tile", insert(BASE, 8, "  tile(96, 128)"), 9, "tile", "is not a supported tile"),
    ("write-derived", None, None, None, None),
    ("no-statement", "gemm g {\n  dim T\n}\n", 1, "g {", "has no GEMM statement"),
    ("duplicate-spec", BASE + BASE.replace("gemm g {", "gemm g {"), 10, "g {", "defined twice"),
    ("batch-runtime", None, None, None, None),
    ("index-is-dim-name", edit(BASE, 8, "sum[k] x[t, k] * w[expert(t), n, k]", "sum[K] x[t, K] * w[expert(t), n, K]"), 8, "K] *", "has the name of a declared dim"),
]

WRITE_DERIVED = """\
gemm g {
  dim T
  dim N = 256, K = 512
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor w  : e4m3 [N, K] scale f32 [128, 128]
  tensor xq : e4m3 [T, K] layout major(T) scale f32 [128, 1] = requantize(x)
  tensor y  : bf16 [T, N]
  xq[t, k] = sum[n] y[t, n] * w[n, k]
}
"""

BATCH_RUNTIME = """\
gemm g {
  dim B
  dim M = 64, N = 64, K = 64
  tensor x : bf16 [B, M, K]
  tensor w : bf16 [B, N, K]
  tensor y : bf16 [B, M, N]
  y[b, m, n] = sum[k] x[b, m, k] * w[b, n, k]
}
"""

GROUP_WRONG_DIM = edit(BASE, 8, "w[expert(t), n, k]", "w[expert(k), n, k]")


def _first_error(text: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(text, "spec.gspec"))
    return info.value


def _column(text: str, line: int, token: str) -> int:
    return text.splitlines()[line - 1].index(token) + 1


def _concrete_cases():
    out = []
    for cid, text, line, token, fragment in CASES:
        if cid == "write-derived":
            text, line, token, fragment = WRITE_DERIVED, 8, "xq", "cannot be written by a statement"
        elif cid == "batch-runtime":
            text, line, token, fragment = BATCH_RUNTIME, 7, "b,", "known only at run time"
        elif cid == "group-wrong-dim":
            text, line, token, fragment = GROUP_WRONG_DIM, 8, "k), n", "group 'expert' splits T, but 'k' ranges over K"
        elif cid == "fp8-needs-requant":
            text = FP8.replace("y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]",
                               "w2[n, k] += sum[t] x[t, k] * y2[t, n]").replace(
                "tensor y : bf16 [T, N]",
                "tensor y2 : e4m3 [T, N] layout major(T) scale f32 [128, 1]\n  tensor w2 : f32 [K, N]")
            text = text.replace("w2[n, k]", "w2[k, n]")
            line, token, fragment = 5, "1, 128", "changes every 1 element along the contracted dim T"
        elif cid == "scale-name-collision":
            text = FP8.replace("tensor y : bf16", "tensor x_scale : bf16").replace("y[t, n] =", "x_scale[t, n] =")
            line, token, fragment = 7, "x_scale", "collides with the scale tensor"
        if line is None:
            raise AssertionError(cid)
        out.append(pytest.param(text, line, token, fragment, id=cid))
    return out


@pytest.mark.parametrize("text, line, token, fragment", _concrete_cases())
def test_error_is_located(text, line, token, fragment):
    err = _first_error(text)
    assert fragment in err.message, err.render()
    assert err.location.line == line, err.render()
    if token is None:  # end of file: caret after the last character
        assert err.location.column == len(text.rstrip("\n").splitlines()[-1]) + 1
    else:
        assert err.location.column == _column(text, line, token), err.render()
    rendered = err.render().splitlines()
    assert rendered[0].startswith(f"spec.gspec:{line}:{err.location.column}: error: ")
    # The source line follows, then a caret under the offending column.
    assert rendered[1].endswith(text.splitlines()[line - 1] if line <= len(text.splitlines()) else "")
    caret = rendered[2]
    gutter = rendered[1].index("|") + 2
    assert caret.index("^") == gutter + err.location.column - 1


def test_at_least_25_distinct_mistakes_are_covered():
    assert len({c[0] for c in CASES}) >= 25


def test_finer_k_scales_of_an_input_are_declared_128_wide():
    # An input's producer can write 128-wide blocks; requantize(x) is generated only from
    # [1, 128] scales, so proposing it from [1, 32] would lead nowhere.
    text = _concrete_cases()[[c[0] for c in CASES].index("k-scale-finer")].values[0]
    err = _first_error(text)
    assert "`scale f32 [1, 128]`" in (err.note or "") and "requantize" not in err.note
    assert check(parse(err.fix.apply(text), "spec.gspec"))


def test_requant_error_names_the_pass():
    # Contracted over tokens with the forward's 1 x 128 blocks: a requantize pass.
    text = edit(FP8, 8, "y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]", "d[e, k, n] = sum[t in expert(e)] x[t, k] * y[t, n]")
    text = edit(text, 7, "bf16 [T, N]", "e4m3 [T, N] scale f32 [1, 128]")
    text = insert(text, 7, "  tensor d : f32 [E, K, N]")
    err = _first_error(text)
    assert "requantize(x)" in (err.note or "")


def test_transpose_error_names_the_pass():
    text = _concrete_cases()[[c[0] for c in CASES].index("fp8-not-k-major")].values[0]
    err = _first_error(text)
    assert "transpose(w)" in (err.note or "")
