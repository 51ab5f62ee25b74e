"""The front half on hostile or extreme input: every spec either lowers and emits, or
fails with a located error. Each test is one way a spec used to escape with a Python
exception, emit code the compiler rejects or miscompiles, or take unbounded time."""

from __future__ import annotations

import re
import signal
from contextlib import contextmanager

import pytest
from test_errors import BASE, FP8, edit, insert

from gemmspec.analyse import analyse, dependency_order
from gemmspec.check import check
from gemmspec.cli import main
from gemmspec.codegen.emit import EmittedProgram, emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.errors import SpecError, source_lines
from gemmspec.lower.lowering import lower
from gemmspec.parse import MAX_EXPR_DEPTH, parse
from gemmspec.runtime.nvrtc import compile_cubin
from gemmspec.spec import (
    MAX_EXTENT,
    MAX_LAUNCHES,
    MAX_LEAVES_PER_LAUNCH,
    MAX_NAME_LENGTH,
    MAX_SCALE_BLOCK,
    MAX_WITHIN_DEPTH,
)


def front(text: str) -> list[EmittedProgram]:
    """parse -> check -> analyse -> lower -> emit, as `gemmspec compile` runs them."""
    programs = []
    for spec in check(parse(text, "spec.gspec")):
        programs.append(emit(spec, lower(spec, analyse(spec))))
    return programs


def located(text: str, line: int, token: str | None, fragment: str) -> SpecError:
    """The error of `text`: at `line`, caret on the first `token` of that line (the
    line's start when None), echoing that line, and saying `fragment`."""
    with pytest.raises(SpecError) as info:
        front(text)
    err = info.value
    lines = source_lines(text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n"))
    assert fragment in err.message, err.render()
    assert err.location is not None and err.location.line == line, err.render()
    if token is not None:
        assert err.location.column == lines[line - 1].index(token) + 1, err.render()
    assert err.location.source_line == lines[line - 1], err.render()
    head, echoed, caret = err.render().splitlines()[:3]
    assert head.startswith(f"spec.gspec:{line}:{err.location.column}: error: ")
    # The caret sits under the character it points at (a long line is echoed as a
    # window around it; a character that is not printable is echoed as a space).
    under = echoed[caret.index("^")]
    at = lines[line - 1][err.location.column - 1]
    assert under == at or (not at.isprintable() and under == " "), err.render()
    return err


@contextmanager
def deadline(seconds: int):
    """Fail instead of hanging (a generous bound, far above the expected time)."""
    if not hasattr(signal, "SIGALRM"):
        yield
        return

    def expired(signum, frame):
        raise AssertionError(f"took more than {seconds} s")

    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def with_x_layout(layout: str) -> str:
    return edit(BASE, 5, "bf16 [T, K]", f"bf16 [T, K] layout {layout}")


# ---- long chains: no recursion in proportion to the input -------------------------


@pytest.mark.parametrize("terms", [2_000, 20_000])
def test_a_long_sum_folds(terms):
    (prog,) = front(with_x_layout("strides(" + " + ".join(["K"] * terms) + ", 1)"))
    a = prog.launches[0].launch.problems.a
    assert str(a.strides[0]) == str(512 * terms)


def test_a_long_product_folds():
    (prog,) = front(with_x_layout("strides(" + " * ".join(["1"] * 5_000) + " * K, 1)"))
    assert str(prog.launches[0].launch.problems.a.strides[0]) == "512"


def test_a_long_sum_of_split_sizes():
    text = insert(BASE, 4, "  group part[P = 2] = split(N, sizes = [" + " + ".join(["1"] * 200) + ", 56])")
    front(text)


def test_parentheses_nest_to_a_bound():
    ok = "(" * MAX_EXPR_DEPTH + "K" + " + 1)" * MAX_EXPR_DEPTH
    front(with_x_layout(f"strides({ok}, 1)"))
    deep = "(" * (MAX_EXPR_DEPTH + 1) + "K" + " + 1)" * (MAX_EXPR_DEPTH + 1)
    located(with_x_layout(f"strides({deep}, 1)"), 5, "K +", "more than 32 deep")
    huge = "(" * 20_000 + "K" + " + 1)" * 20_000  # far past any recursion limit
    located(with_x_layout(f"strides({huge}, 1)"), 5, "K +", "more than 32 deep")


def test_a_product_of_sums_is_bounded():
    text = edit(BASE, 2, "dim T", "dim T, A, B, C, D")
    factor = "(T + A + B + C + D + 1)"
    located(
        edit(text, 5, "bf16 [T, K]", f"bf16 [T, K] layout strides({' * '.join([factor] * 6)}, 1)"),
        5, None, "expression too complex",
    )


# ---- integer literals ----------------------------------------------------------------


def test_a_literal_of_thousands_of_digits():
    located(edit(BASE, 3, "N = 256", "N = " + "9" * 5000), 3, "999", "integer 999999999999...")


def test_a_literal_of_2_to_the_63():
    text = insert(BASE, 4, f"  group part[P = {2**63}] = uniform(N)")
    located(text, 5, str(2**63), "literals are at most 2^63 - 1")


def test_a_huge_uniform_count_is_refused_before_it_is_built():
    located(insert(BASE, 4, f"  group part[P = {2**40}] = uniform(N)"), 5, "P", "more than 2147483647")
    located(insert(BASE, 4, "  group part[P = 2048] = uniform(N)"), 5, "P", "more than 1024")


# ---- sizes the kernels' integers hold ---------------------------------------------------


@pytest.mark.parametrize("size", [2**31, 10**18])
def test_a_dim_past_int32(size):
    located(edit(BASE, 3, "N = 256", f"N = {size}"), 3, "N", "32-bit signed integers")


def test_the_largest_dims_emit_code_that_compiles_cleanly(tmp_path):
    text = f"""\
gemm edge {{
  dim T
  dim N = {MAX_EXTENT}, K = {MAX_EXTENT}
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}}
"""
    (prog,) = front(text)
    (launch,) = prog.launches
    assert f"{MAX_EXTENT}LL" in launch.source
    log = compile_cubin(
        launch.source, name=launch.gemm.name, include_dirs=[include_dir()], cache_dir=str(tmp_path)
    ).log
    assert not re.search(r"truncation|change of sign", log), log


def test_a_tensor_past_2_to_the_63_bytes():
    text = edit(edit(BASE, 3, "N = 256, K = 512", f"N = {MAX_EXTENT}, K = {MAX_EXTENT}"), 6, "bf16 [E, N, K]", "bf16 [N, K]")
    text = edit(edit(text, 8, "w[expert(t), n, k]", "w[n, k]"), 7, "bf16 [T, N]", "f32 [T, N]")
    front(text)  # [N, K] bf16: just below 2^63 bytes
    located(edit(text, 6, "bf16 [N, K]", "f16 [N, K, E]").replace("w[n, k]", "w[n, k, e]"), 6, "w", "more than 2^63 - 1 bytes")


def test_a_stride_past_2_to_the_63():
    located(with_x_layout("strides(T * T * T, 1)"), 5, "T * T", "can exceed 2^63 - 1")
    located(with_x_layout(f"strides({2**62} * 4, 1)"), 5, str(2**62), "can exceed 2^63 - 1")


@pytest.mark.parametrize("block", [MAX_SCALE_BLOCK + 1, 2**40])
def test_a_scale_block_past_its_limit(block):
    located(edit(FP8, 6, "[1, 128, 128]", f"[1, {block}, 128]"), 6, str(block), "larger than 1048576")


def test_a_scale_block_of_2_to_the_70_is_a_literal_error():
    located(edit(FP8, 6, "[1, 128, 128]", f"[1, {2**70}, 128]"), 6, str(2**70), "literals are at most")


def test_too_many_leaves_in_one_launch():
    text = insert(BASE, 4, "  group sub[S = 32768] = ragged(T within expert, offsets = sub_offs)")
    text = text.replace("tensor w : bf16 [E, N, K]", "tensor w : bf16 [E, S, N, K]")
    text = text.replace("w[expert(t), n, k]", "w[expert(t), sub(t), n, k]")
    located(text, 9, "y[", "131072 leaf GEMMs in one launch")
    (prog,) = front(text.replace("}\n", "  split\n}\n"))  # one launch per expert
    assert [x.leaf_count for x in prog.launches] == [32768] * 4


def test_a_split_of_a_huge_outer_axis_stops_before_planning():
    text = insert(edit(BASE, 4, "expert[E = 4]", "expert[E = 60000]"), 4, "  group sub[S = 1] = ragged(T within expert, offsets = sub_offs)")
    text = text.replace("tensor w : bf16 [E, N, K]", "tensor w : bf16 [E, S, N, K]")
    text = text.replace("w[expert(t), n, k]", "w[expert(t), sub(t), n, k]") + ""
    text = text.replace("}\n", "  split\n}\n")
    with deadline(60):
        err = located(text, 10, "split", f"more than the {MAX_LAUNCHES} one spec may make")
    assert "'expert' index" in err.message


def test_a_group_of_2_to_the_32_segments():
    located(edit(BASE, 4, "expert[E = 4]", f"expert[E = {2**32}]"), 4, "E", "more than 2147483647")
    located(edit(BASE, 4, "expert[E = 4]", f"expert[E = {MAX_LEAVES_PER_LAUNCH + 1}]"), 4, "E", "more than 65536")


def test_output_tiles_past_int32():
    text = edit(BASE, 2, "dim T", f"dim T = {MAX_EXTENT}")
    text = edit(text, 3, "N = 256", f"N = {MAX_EXTENT}")
    located(text, 8, "y[", "output tiles")


# ---- written tensors must not alias ----------------------------------------------------


@pytest.mark.parametrize(
    "layout, fragment",
    [
        ("strides(0, 0)", "its stride along T is 0"),
        ("strides(0, 1)", "its stride along T is 0"),
        ("strides(1, 1)", "T and N have the same stride 1"),
        ("strides(N, N)", "T and N have the same stride 256"),
    ],
)
def test_an_aliasing_output_layout(layout, fragment):
    text = edit(BASE, 7, "bf16 [T, N]", f"bf16 [T, N] layout {layout}")
    located(text, 7, "layout", fragment)


def test_an_aliasing_fixed_layout_names_two_indices():
    text = edit(BASE, 2, "dim T", "dim T = 4").replace("N = 256", "N = 4")
    text = edit(text, 7, "bf16 [T, N]", "bf16 [T, N] layout strides(3, 2)")
    located(text, 7, "layout", "(T=0, N=3) and (T=2, N=0) are both at offset 6")


def test_layouts_that_do_not_alias():
    # Strides that are not nested but still distinct: offsets 2t + 3n are 0, 3, 2, 5, 4, 7.
    text = edit(BASE, 2, "dim T", "dim T = 3").replace("N = 256", "N = 2")
    front(edit(text, 7, "bf16 [T, N]", "bf16 [T, N] layout strides(2, 3)"))
    front(edit(BASE, 5, "bf16 [T, K]", "bf16 [T, K] layout strides(0, 1)"))  # a broadcast read
    one = edit(BASE, 3, "N = 256", "N = 1")  # a stride 0 on a dim of one element
    front(edit(one, 7, "bf16 [T, N]", "bf16 [T, N] layout strides(1, 0)"))


# ---- nesting -------------------------------------------------------------------------


def _within_chain(depth: int) -> str:
    groups = ["  group g0[G0 = 2] = ragged(T, offsets = o0)"]
    groups += [f"  group g{i}[G{i} = 2] = ragged(T within g{i - 1}, offsets = o{i})" for i in range(1, depth + 1)]
    return BASE.replace("  tensor x", "\n".join(groups) + "\n  tensor x")


def test_within_nests_to_a_bound():
    check(parse(_within_chain(MAX_WITHIN_DEPTH)))
    # g0 is on line 5; g9, the first too deep, on line 14, within g8.
    located(_within_chain(300), 6 + MAX_WITHIN_DEPTH, f"g{MAX_WITHIN_DEPTH},", "more than 8")


# ---- several thousand statements check in linear time ----------------------------------


def many_statements(n: int) -> str:
    """n statements: half accumulate into y, half read it, readers written first."""
    head = ["gemm big {", "  dim T", "  dim N = 256, K = 256, M = 256",
            "  tensor x : bf16 [T, K]", "  tensor y : bf16 [T, N]"]
    body = []
    for i in range(n // 2):
        head.append(f"  tensor w{i} : bf16 [N, K]")
        body.append(f"  y[t, n] {'=' if i == n // 2 - 1 else '+='} sum[k] x[t, k] * w{i}[n, k]")
    for i in range(n - n // 2):
        head += [f"  tensor v{i} : bf16 [M, N]", f"  tensor z{i} : bf16 [T, M]"]
        body.append(f"  z{i}[t, m] = sum[n] y[t, n] * v{i}[m, n]")
    return "\n".join(head + body[::-1] + ["}"]) + "\n"


def test_thousands_of_statements_check_in_linear_time():
    text = many_statements(4000)
    assert len(text.splitlines()) > 10_000
    with deadline(60):  # about 3 s; the quadratic ordering took minutes
        (spec,) = check(parse(text, "big.gspec"))
        order = dependency_order(spec)
        schedule = lower(spec, analyse(spec))
    writes_y = [i for i in order if spec.gemms[i].out.tensor == "y"]
    reads_y = [i for i in order if spec.gemms[i].a.tensor == "y"]
    assert len(writes_y) == len(reads_y) == 2000
    assert order.index(writes_y[-1]) < order.index(reads_y[0])
    assert len(schedule.launches) == 4000


@pytest.mark.slow
def test_more_launches_than_a_spec_may_make():
    n = MAX_LAUNCHES + 2
    first_statement = 5 + n // 2 + 2 * (n - n // 2) + 1
    with deadline(60):  # located at the first statement past the limit, in source order
        located(many_statements(n), first_statement + MAX_LAUNCHES, "y[", "launches one spec may make")


# ---- names of internal symbols -------------------------------------------------------------


def test_a_dim_named_like_a_block_count():
    text = """\
gemm g {
  dim T, T_blocks
  dim N = 256, K = 512
  tensor x  : e4m3 [T, K] scale f32 [128, 128]
  tensor z  : e4m3 [T_blocks, K] scale f32 [1, 128] layout major(T_blocks)
  tensor w  : e4m3 [N, K] scale f32 [128, 128]
  tensor w2 : e4m3 [N, K] scale f32 [128, 128]
  tensor y  : bf16 [T, N]
  tensor y2 : bf16 [T_blocks, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
  y2[t, n] = sum[k] z[t, k] * w2[n, k]
}
"""
    front(text)
    # The real rule still holds: T's 128-blocks may not be counted in a stride.
    bad = edit(text, 4, "scale f32 [128, 128]", "scale f32 [128, 128] layout major(T)")
    located(bad, 4, "layout", "the run-time dim T in a stride")


# ---- cycles ---------------------------------------------------------------------------------


DERIVED = """\
gemm g {
  dim T
  dim N = 256, K = 512
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor w  : e4m3 [N, K] scale f32 [128, 128]
  tensor y  : bf16 [T, N]
  tensor w_t : e4m3 [N, K] layout major(N) scale f32 [128, 128] = transpose(w)
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


def test_a_tensor_derived_from_itself():
    err = located(edit(DERIVED, 7, "transpose(w)", "transpose(w_t)"), 7, "w_t)", "derived from itself")
    assert "from its source 'w_t'" not in err.message


def test_derived_tensors_in_a_cycle():
    text = insert(edit(DERIVED, 7, "transpose(w)", "transpose(w_u)"), 7, "  tensor w_u : e4m3 [N, K] scale f32 [128, 128] = transpose(w_t)")
    located(text, 7, "w_u)", "derived tensors form a cycle (w_t <- w_u <- w_t)")


def test_a_chain_of_derived_tensors_names_the_input():
    text = insert(DERIVED, 7, "  tensor w_u : e4m3 [N, K] scale f32 [128, 128] = transpose(w_t)")
    err = located(text, 8, "w_t)", "derive 'w_u' from 'w'")
    assert "transpose(w)" in (err.note or "")


def test_statements_in_a_cycle_are_located():
    text = """\
gemm g {
  dim T
  dim N = 256, K = 512
  tensor a : bf16 [T, N]
  tensor b : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor v : bf16 [K, N]
  a[t, n] = sum[k] b[t, k] * w[n, k]
  b[t, k] = sum[n] a[t, n] * v[k, n]
}
"""
    err = located(text, 8, "a[", "in a cycle: #0 reads 'b', written by #1; #1 reads 'a', written by #0")
    assert err.note


# ---- source text --------------------------------------------------------------------------


def test_a_byte_order_mark_is_skipped():
    front("\ufeff" + BASE)
    located("\ufeff" + edit(BASE, 5, "[T, K]", "[T, Q]"), 5, "Q", "unknown dim 'Q'")


@pytest.mark.parametrize("space", ["\x0b", "\x0c", "\t", "\r", "\r\n"])
def test_every_documented_whitespace_is_accepted(space):
    front(BASE.replace("\n", space + "\n").replace("  dim T", " " + space + "dim T"))


@pytest.mark.parametrize("ending", ["\r\n", "\r"])
def test_lines_end_where_an_editor_ends_them(ending):
    text = edit(BASE, 5, "[T, K]", "[T, Q]").replace("\n", ending)
    located(text, 5, "Q", "unknown dim 'Q'")


@pytest.mark.parametrize("mark", ["\x0c", "\x0b", "\u2028", "\x85"])
def test_the_caret_is_under_the_right_line_after_a_line_like_character(mark):
    text = edit(BASE, 2, "dim T", "dim T " + mark).replace("[T, K]", "[T, Q]")
    if mark in "\x0c\x0b":
        located(text, 5, "Q", "unknown dim 'Q'")
    else:  # not whitespace: an error at that character, echoed on its own line
        err = located(text, 2, mark, "unexpected character")
        assert mark not in err.render()  # shown as a space, so the echo stays one line


def test_the_command_line_prints_the_located_error(tmp_path, capsys):
    path = tmp_path / "bom_crlf.gspec"
    path.write_bytes(("\ufeff" + edit(BASE, 5, "[T, K]", "[T, Q]")).replace("\n", "\r\n").encode("utf-8"))
    assert main(["check", str(path)]) == 1
    err = capsys.readouterr().err
    head, echoed, caret = err.splitlines()[:3]
    assert head == f"{path}:5:23: error: unknown dim 'Q'"
    assert echoed == "   5 |   tensor x : bf16 [T, Q]"
    assert caret.index("^") == echoed.index("Q")
    assert "Traceback" not in err


def test_a_tab_keeps_the_caret_in_place():
    err = located(edit(BASE, 5, "  tensor x : bf16 [T, K]", "\ttensor x :\tbf16 [T, Q]"), 5, "Q", "unknown dim")
    echoed, caret = err.render().splitlines()[1:3]
    pad = caret[: caret.index("^")]
    assert [c == "\t" for c in pad] == [c == "\t" for c in echoed[: len(pad)]]


# ---- derived tensors the pre-passes cannot produce ----------------------------------------


WGRAD = """\
gemm g {
  dim T
  dim N = 256, K = 512
  tensor x    : e4m3 [T, K] scale f32 [1, 128]
  tensor dy   : e4m3 [T, N] scale f32 [1, 128]
  tensor dw   : f32  [N, K]
  tensor x_q  : e4m3 [T, K] layout major(T) scale f32 [128, 1] = requantize(x)
  tensor dy_q : e4m3 [T, N] layout major(T) scale f32 [128, 1] = requantize(dy)
  dw[n, k] += sum[t] dy_q[t, n] * x_q[t, k]
}
"""


def test_requantize_as_the_pass_generates_it():
    (prog,) = front(WGRAD)
    assert [p.prepass.kind for p in prog.prepasses] == ["requantize", "requantize"]


def test_requantize_into_other_blocks():
    text = edit(WGRAD, 7, "scale f32 [128, 1]", "scale f32 [128, 128]")
    located(text, 7, "requantize", "'x_q' has scale blocks [128, 128], not [128, 1]")


def test_requantize_from_a_column_major_source():
    located(edit(WGRAD, 4, "[T, K] scale", "[T, K] layout major(T) scale"), 7, "requantize", "not row-major [T, C]")


MOE_DGRAD = """\
gemm g {
  dim T
  dim N = 256, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dy  : e4m3 [T, N] scale f32 [1, 128]
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor w_t : e4m3 [E, N, K] layout major(N) scale f32 [1, 128, 128] = transpose(w)
  tensor dx  : bf16 [T, K]
  dx[t, k] = sum[n] dy[t, n] * w_t[expert(t), n, k]
}
"""


def test_transpose_of_a_3d_tensor_is_emitted():
    (prog,) = front(MOE_DGRAD)
    assert [p.prepass.kind for p in prog.prepasses] == ["transpose"]


def test_transpose_that_moves_nothing():
    text = edit(MOE_DGRAD, 6, "scale f32 [1, 128, 128]", "layout major(N) scale f32 [1, 128, 128]")
    located(text, 7, "transpose", "nothing moves")


def test_requantize_into_a_padded_layout():
    text = edit(WGRAD, 7, "layout major(T)", "layout strides(1, T + 16)")
    located(text, 7, "requantize", "no padding")


def test_transpose_with_its_own_scale_layout():
    text = edit(DERIVED, 7, "scale f32 [128, 128] =", "scale f32 [128, 128] layout major(N) =")
    text = insert(text, 7, "  tensor dy : e4m3 [T, N] scale f32 [1, 128]\n  tensor dx : bf16 [T, K]")
    text = text.replace("}\n", "  dx[t, k] = sum[n] dy[t, n] * w_t[n, k]\n}\n")
    front(text.replace(" layout major(N) =", " ="))
    located(text, 7, "transpose", "shares the scale tensor of 'w'")


# ---- names ------------------------------------------------------------------------------------


def test_names_have_a_length_limit():
    front(edit(BASE, 1, "gemm g", "gemm " + "g" * MAX_NAME_LENGTH))
    located(edit(BASE, 1, "gemm g", "gemm " + "g" * 245), 1, "ggg", "245 characters long")
    located(edit(BASE, 5, "tensor x ", "tensor " + "x" * 65 + " "), 5, "xxx", "at most 64")
