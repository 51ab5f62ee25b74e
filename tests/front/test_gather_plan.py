"""How gathered rows are read: in the GEMM's loads, or copied first by the gather
pre-pass; the automatic choice, the gather(...) directive, and what each lowers to."""

from __future__ import annotations

import pytest

from gemmspec.errors import SpecError
from gemmspec.explain import explain_text, schedule_json
from gemmspec.gather_plan import PREPASS_MIN_TILES, copyable
from gemmspec.pipeline import lower_file

SPEC = """\
gemm g {{
  dim T, S
  dim N = {n}, K = 7168
  group expert[E = 8] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : {x}
  tensor w : {w}
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
  {directive}
}}
"""
FP8_X = "e4m3 [S, K] scale f32 [1, 128]"
FP8_W = "e4m3 [E, N, K] scale f32 [1, 128, 128]"


def lowered(n=4096, directive="", x=FP8_X, w=FP8_W):
    (low,) = lower_file(SPEC.format(n=n, directive=directive, x=x, w=w))
    return low


def test_a_wide_fp8_gather_is_copied_once_by_a_prepass():
    low = lowered()
    spec, g = low.spec, low.spec.gemms[0]
    assert g.gather == "idx" and g.kernel_gather is None and g.a_gathered == "x_idx_rows"
    copy = spec.tensor("x_idx_rows")
    assert copy.dims == ("T", "K") and copy.dtype == "e4m3" and str(copy.layout) == "row_major"
    assert (copy.derived.op, copy.derived.source, copy.derived.index) == ("gather", "x", "idx")
    assert copy.scale.block == (1, 128) and copy.scale.layout.text == "major(T)"
    (p,) = low.schedule.prepasses
    assert (p.kind, p.source, p.target, p.index, p.reads_before) == ("gather", "x", "x_idx_rows", "idx", (0,))
    assert (p.source_scale, p.target_scale) == ("x_scale", "x_idx_rows_scale")
    (launch,) = low.schedule.launches
    pg = launch.problems
    assert pg.a.tensor == "x_idx_rows" and pg.a.rows is None and pg.sa.tensor == "x_idx_rows_scale"
    assert not launch.signature.gather
    # The statement as written is kept: its semantics and the index check read it.
    assert g.a.tensor == "x" and g.a.uses[0].index == "idx"


def test_a_narrow_gather_is_gathered_in_the_gemm():
    low = lowered(n=128 * (PREPASS_MIN_TILES - 1))
    g = low.spec.gemms[0]
    assert g.a_gathered is None and g.kernel_gather == "idx"
    assert not low.schedule.prepasses and low.schedule.launches[0].signature.gather
    assert "under 4 column tiles" in explain_text(low.spec, low.schedule)


@pytest.mark.parametrize(("n", "directive", "prepass"), [
    (4096, "gather(fused)", False), (256, "gather(prepass)", True), (4096, "gather(auto)", True), (256, "", False),
])
def test_the_directive_overrides_the_choice(n, directive, prepass):
    low = lowered(n=n, directive=directive)
    assert bool(low.schedule.prepasses) == prepass
    assert (low.spec.gemms[0].a_gathered is not None) == prepass
    text = explain_text(low.spec, low.schedule)
    line = next(ln for ln in text.splitlines() if "gathered rows of 'x'" in ln)
    assert ("copied by a pre-pass" in line) == prepass
    if directive and directive != "gather(auto)":
        assert directive in line


def test_bf16_rows_are_copied_without_scales():
    low = lowered(x="bf16 [S, K]", w="bf16 [E, N, K]")
    (p,) = low.schedule.prepasses
    assert p.source_scale is None and p.target_scale is None
    assert low.spec.tensor(p.target).scale is None
    doc = schedule_json(low.spec, low.schedule)
    assert doc["prepasses"][0]["kind"] == "gather" and doc["prepasses"][0]["target_scale"] is None
    assert doc["prepasses"][0]["index"] == "idx"


def test_row_blocks_of_scales_stay_gathered_in_the_gemm():
    low = lowered(x="e4m3 [S, K] scale f32 [128, 128]", directive="gather(prepass)")
    assert not low.schedule.prepasses
    assert "[1, 128] scales" in copyable(low.spec, low.spec.gemms[0])
    assert "a pre-pass cannot copy them" in explain_text(low.spec, low.schedule)


def test_statements_gathering_the_same_rows_share_one_copy():
    text = """\
gemm two {
  dim T, S
  dim N = 2048, K = 1024
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor x : bf16 [S, K]
  tensor wg : bf16 [E, N, K]
  tensor wu : bf16 [E, N, K]
  tensor g : bf16 [T, N]
  tensor u : bf16 [T, N]
  g[t, n] = sum[k] x[idx[t], k] * wg[expert(t), n, k]
  u[t, n] = sum[k] x[idx[t], k] * wu[expert(t), n, k]
}
"""
    (low,) = lower_file(text)
    (p,) = low.schedule.prepasses
    assert p.reads_before == (0, 1)
    assert [g.a_gathered for g in low.spec.gemms] == [p.target, p.target]


def test_the_copy_takes_a_name_no_tensor_has():
    x = FP8_X
    text = SPEC.format(n=4096, directive="", x=x, w=FP8_W).replace(
        "  tensor y : bf16 [T, N]", "  tensor y : bf16 [T, N]\n  tensor x_idx_rows : bf16 [T, N]"
    ).replace("  y[t, n] =", "  x_idx_rows[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]\n  y[t, n] =")
    (low,) = lower_file(text)
    assert {p.target for p in low.schedule.prepasses} == {"x_idx_rows2"}


@pytest.mark.parametrize(("directive", "message"), [
    ("gather(sideways)", r"gather\(sideways\) is not a way to read gathered rows"),
    ("gather(fused)\n  gather(prepass)", r"gather\(prepass\) contradicts the earlier gather\(fused\)"),
])
def test_bad_directives_are_located_errors(directive, message):
    with pytest.raises(SpecError, match=message) as info:
        lowered(directive=directive)
    assert info.value.location.line >= 10


def test_the_directive_needs_a_gathered_statement():
    text = SPEC.format(n=4096, directive="gather(prepass)", x=FP8_X, w=FP8_W).replace(
        "x[idx[t], k]", "x[t, k]").replace("[S, K]", "[T, K]")
    with pytest.raises(SpecError, match="no statement reads rows through an index tensor") as info:
        lower_file(text)
    assert info.value.location.line == 10
