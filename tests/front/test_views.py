"""Views (`= view(SOURCE)`): what the checker accepts and refuses, with located errors;
a view is no argument and binds its source's buffer; and a statement that reads a view
runs after the statements that write its source, whatever the source order."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gemmspec.analyse import dependency_order
from gemmspec.check import check
from gemmspec.codegen.emit import emit
from gemmspec.codegen.host import render_host
from gemmspec.codegen.manifest import KernelLaunch, launch_manifest, spec_arguments
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from located import assert_located, check_error, edited  # noqa: E402
from view_spec import EXPAND, SHRINK, qkv_view  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora_qkv_one_spec.gspec"
TEXT = qkv_view()


def spec_of(text: str):
    (spec,) = check(parse(text, "spec.gspec"))
    return spec


def test_the_example_checks_with_a3_a_view_of_a():
    (lowered,) = lower_file(EXAMPLE)
    spec = lowered.spec
    assert spec.tensor("a3").view_of == "a" and spec.tensor("a").view_of is None
    assert spec.storage("a3") == "a" and spec.storage("y") == "y"
    assert str(spec.tensor("a3")).endswith("= view(a)")


def test_a_view_is_no_argument_and_its_reads_bind_the_source():
    (lowered,) = lower_file(TEXT)
    spec, schedule = lowered.spec, lowered.schedule
    args = {a.name: a.role for a in spec_arguments(spec)}
    assert "a3" not in args and args["a"] == "output"
    expand = next(x for x in schedule.launches if spec.gemms[x.statement].text == EXPAND)
    assert expand.problems.a.tensor == "a"  # the buffer, with the view's strides
    assert [str(s) for s in expand.problems.a.strides] == ["48", "1"]
    assert "g.slice" in str(expand.problems.a.offset)  # slice s starts 16*s columns on
    manifest = launch_manifest(spec, emit(spec, schedule))
    refs = {p.source.ref for s in manifest.steps if isinstance(s, KernelLaunch) for p in s.params}
    assert "a" in refs and "a3" not in refs
    # The C++ launcher reads the pointer from the source's field: the view has none.
    host = render_host(manifest)
    assert "args->a)" in host and "args->a3" not in host


@pytest.mark.parametrize("expand_first", [False, True])
def test_the_reader_of_a_view_runs_after_the_writer_of_its_source(expand_first):
    (lowered,) = lower_file(qkv_view(expand_first=expand_first))
    spec, schedule = lowered.spec, lowered.schedule
    shrink = next(g.index for g in spec.gemms if g.text == SHRINK)
    expand = next(g.index for g in spec.gemms if g.text == EXPAND)
    assert shrink == (1 if expand_first else 0)
    assert dependency_order(spec) == [shrink, expand]
    assert [x.statement for x in schedule.launches] == [shrink, expand]
    if expand_first:
        assert any("launch order follows data dependencies" in r for r in schedule.reasons)


def test_views_of_other_shapes_that_address_the_same_elements():
    # Split the 48 columns as [3, 16] or [6, 8], or merge them back: any cut of
    # neighbouring fixed dims in row-major order.
    for dims in ("T, S, R", "T, S2, R8", "T, R3"):
        text = edited("tensor wb", f"tensor v : bf16 [{dims}] = view(a)\n  tensor wb", TEXT)
        text = edited("dim T", "dim T\n  dim S2 = 6, R8 = 8", text)
        assert spec_of(text).tensor("v").view_of == "a"
    # A source stored with strides that are row-major's, written out.
    text = edited("tensor a  : bf16 [T, R3]", "tensor a  : bf16 [T, R3] layout strides(48, 1)", TEXT)
    spec_of(text)
    # A column-major view of a column-major source: both step through T first.
    text = edited("tensor a  : bf16 [T, R3]", "tensor a  : bf16 [T, R3] layout major(T)", TEXT)
    spec = spec_of(edited("[T, S, R] = view(a)", "[T, S, R] layout major(T) = view(a)", text))
    assert [str(s) for s in spec.tensor("a3").layout.strides] == ["1", "16*T", "T"]
    # A view with its row-major strides written out.
    text = edited("[T, S, R] = view(a)", "[T, S, R] layout strides(48, 16, 1) = view(a)", TEXT)
    spec_of(text)


def test_a_view_keeps_the_element_type():
    text = edited("tensor a3 : bf16", "tensor a3 : f16", TEXT)
    assert_located(text, "f16 [T, S, R]", "'a3' is f16 but views 'a', which is bf16")
    assert check_error(text).fix is not None


def test_a_view_holds_the_same_elements():
    text = edited("tensor a3 : bf16 [T, S, R]", "tensor a3 : bf16 [T, S, K]", TEXT)
    assert_located(text, "T, S, K]", "holds 600*T elements, but 'a' [T, R3] holds 48*T")


def test_a_view_keeps_each_run_time_dim_in_place():
    text = edited("tensor a3 : bf16 [T, S, R]", "tensor a3 : bf16 [S, T, R]", TEXT)
    assert_located(text, "S, T, R]", "does not cut the dims of 'a' [T, R3] in order")


def test_a_view_and_its_source_have_no_scale():
    # (Only FP8 tensors take scales: an unscaled FP8 source no statement reads.)
    text = edited("tensor wb", "tensor xs : e4m3 [T, K]\n"
                  "  tensor xv : e4m3 [T, K] scale f32 [1, 128] = view(xs)\n  tensor wb", TEXT)
    assert_located(text, "scale f32 [1, 128] = view", "'xv' is a view and has a scale")
    assert check_error(text).fix is not None
    fp8 = edited("tensor x  : bf16 [T, K]", "tensor x  : e4m3 [T, K] scale f32 [1, 128]", TEXT)
    fp8 = edited("tensor a3 : bf16 [T, S, R] = view(a)", "tensor x3 : e4m3 [T, S, R] = view(x)", fp8)
    fp8 = edited("dim K = 200,", "dim K = 48,", fp8)
    assert_located(fp8, "x)", "'x' has a scale; a view reads unscaled tensors only")


def test_a_view_reads_a_strided_source_in_row_major_order():
    major = edited("tensor a  : bf16 [T, R3]", "tensor a  : bf16 [T, R3] layout major(T)", TEXT)
    assert_located(major, "a)", "does not address the elements of 'a' (stored major(T)")
    assert check_error(major).fix is not None  # store a row-major
    seg = edited("tensor a  : bf16 [T, R3]", "tensor a  : bf16 [T, R3] layout segment_major(lora)", TEXT)
    assert_located(seg, "a)", "'a' is stored segment_major(lora), in segments")
    wrong = edited("[T, S, R] = view(a)", "[T, S, R] layout strides(48, 1, 3) = view(a)", TEXT)
    assert_located(wrong, "layout strides(48, 1, 3)", "'a3' (strides 48, 1, 3) does not address")
    padded = edited("tensor a  : bf16 [T, R3]", "tensor a  : bf16 [T, R3] layout row_major pad 64", TEXT)
    assert_located(padded, "a)", "does not address the elements of 'a'")


def test_a_view_names_a_tensor_the_caller_passes():
    text = edited("tensor a3 : bf16 [T, S, R] = view(a)", "tensor a3 : bf16 [T, S, R] = view(a3)", TEXT)
    assert_located(text, "a3)", "'a3' is a view of itself")
    vv = edited("tensor wb", "tensor a4 : bf16 [T, R3] = view(a3)\n  tensor wb", TEXT)
    assert_located(vv, "a3)", "'a3' is itself a view of 'a'")
    q = edited("tensor wb", "tensor xq : e4m3 [T, K] scale f32 [1, 128] = quantize(x)\n"
               "  tensor xv : e4m3 [T, K] = view(xq)\n  tensor wb", TEXT)
    assert_located(q, "xq)", "'xq' is derived by quantize(...)")
    idx = edited("tensor wb", "tensor idx : i32 [T]\n  tensor iv : i32 [T] = view(idx)\n  tensor wb", TEXT)
    assert_located(idx, "idx)", "'idx' is an index tensor")
    opt = edited("= view(a)", "= view(a, pow2)", TEXT)
    assert_located(opt, "pow2)", "view(...) takes no options")


def test_a_statement_never_writes_a_view_nor_reads_a_view_of_its_output():
    text = edited(SHRINK, "a3[t, s, r] = sum[k] x[t, k] * w3[s, r, k]", TEXT)
    text = edited("tensor wb", "tensor w3 : bf16 [S, R, K]\n  tensor wb", text)
    err = check_error(text)
    assert "'a3' is a view of 'a' and cannot be written by a statement" in err.message, err.render()
    assert "write 'a' itself" in err.note
    own = """
gemm own {
  dim T
  dim N = 48, K = 48
  tensor a  : bf16 [T, N]
  tensor a2 : bf16 [T, K] = view(a)
  tensor w  : bf16 [N, K]
  a[t, n] = sum[k] a2[t, k] * w[n, k]
}
"""
    assert_located(own, "a2[t, k] * w", "reads 'a2', a view of 'a', which it writes")


def test_rows_of_a_view_are_not_read_through_an_index():
    text = edited(EXPAND, "y[t, n] = sum[r] a3[idx[t], slice(n), r] * wb[lora(t), n, r]", TEXT)
    text = edited("tensor wb", "tensor idx : i32 [T]\n  tensor wb", text)
    assert_located(text, "a3[idx[t]", "rows of the view 'a3' are read through an index tensor")
