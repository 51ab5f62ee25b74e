"""`segment_major(G) pad P`: segments stored in lengths rounded up to multiples of P.

The checker (located errors), the lowering (padded prefixes as per-leaf symbols), the
leaf fields it gives for unaligned counts (row pitches TMA can describe), explain and the
manifest. The padded layout's values are checked against the spec in
tests/reference/test_segment_pad_layout.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.check import check
from gemmspec.codegen.emit import emit
from gemmspec.codegen.host import render_header
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.errors import SpecError
from gemmspec.explain import schedule_json
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import random_runtime
from gemmspec.reference.schedule_exec import leaf_symbols

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

WGRAD = """\
gemm wgrad {
  dim T
  dim N = 40, K = 24
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""

NESTED = """\
gemm nested {
  dim T
  dim K = 200, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""


def error(src: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(src, "spec.gspec"))
    return info.value


def located(src: str, err: SpecError, line: int, token: str) -> None:
    assert err.location.line == line, err.render()
    assert err.location.column == src.splitlines()[line - 1].rindex(token) + 1, err.render()


def spec_of(src: str):
    (s,) = check(parse(src, "spec.gspec"))
    return s


# ---- the checker ------------------------------------------------------------------------------


@pytest.mark.parametrize("pad", [3, 24, 0, 100])
def test_pad_must_be_a_power_of_two(pad):
    src = WGRAD.replace("segment_major(expert) pad 16 scale", f"segment_major(expert) pad {pad} scale", 1)
    err = error(src)
    assert f"the pad of a segment_major layout must be a power of two; got {pad}" in str(err)
    located(src, err, 5, f"{pad} scale")
    assert "pad 16" in err.render()  # the note says what fits FP8


def test_pad_rows_must_fit_32_bit_indices():
    src = WGRAD.replace("group expert[E = 4]", "group expert[E = 65536]").replace(
        "segment_major(expert) pad 16 scale", "segment_major(expert) pad 65536 scale", 1
    )
    err = error(src)
    assert "adds up to 4294901760 rows (65535 for each of 65536 segments)" in str(err)
    located(src, err, 5, "65536")


def test_pad_on_strides_is_located_at_the_pad():
    src = WGRAD.replace("tensor dw : f32 [E, N, K]", "tensor dw : f32 [E, N, K] layout strides(N*K, K, 1) pad 16")
    err = error(src)
    assert "pad applies to row_major, major(...) and segment_major(...) layouts" in str(err)
    located(src, err, 7, "16")


def test_pad_on_a_masked_group_names_the_group():
    src = """\
gemm m {
  dim M = 64, K = 128
  group expert[E = 2] = masked(M, counts = counts)
  tensor x : bf16 [E, M, K] layout segment_major(expert) pad 16
  tensor w : bf16 [E, M, K]
  tensor y : f32 [E, M, M]
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}
"""
    err = error(src)
    assert "segment_major(expert): group 'expert' does not split any dim of 'x'" in str(err)


def test_scales_stay_unsegmented():
    src = WGRAD.replace("scale f32 [128, 1] per expert\n  tensor x", "scale f32 [128, 1] layout segment_major(expert) pad 16\n  tensor x", 1)
    err = error(src)
    assert "scales cannot be segment_major" in str(err)


def test_padded_layout_records_pad_and_rows():
    s = spec_of(WGRAD)
    lay = s.tensor("dy").layout
    assert (lay.kind, lay.pad, lay.pad_rows, lay.padded) == ("segment_major", 16, 60, True)
    assert str(lay) == "segment_major(expert) pad 16"
    assert lay.storage_shape((100, 40)) == (160, 40)
    # Nested: one segment per (lora, expert) pair, 2 x 3 of them.
    lay = spec_of(NESTED).tensor("x").layout
    assert (lay.pad, lay.pad_rows) == (8, 7 * 6)
    # pad 1 is no padding at all.
    lay = spec_of(WGRAD.replace("pad 16", "pad 1")).tensor("x").layout
    assert (lay.pad, lay.pad_rows, lay.padded) == (1, 0, False)
    assert lay.storage_shape((100, 24)) == (100, 24)


def test_pad_1_and_no_pad_lower_alike():
    plain = lower_file(WGRAD.replace(" pad 16", ""))[0].schedule
    one = lower_file(WGRAD.replace(" pad 16", " pad 1"))[0].schedule
    assert one.launches == plain.launches


# ---- lowering and the leaf fields -------------------------------------------------------------


def test_padded_operands_use_the_padded_prefix():
    (low,) = lower_file(WGRAD)
    (launch,) = low.schedule.launches
    pg = launch.problems
    assert str(pg.a.offset) == "40*pstart16.k" and [str(s) for s in pg.a.strides] == ["plen16.k", "1"]
    assert str(pg.b.offset) == "24*pstart16.k" and [str(s) for s in pg.b.strides] == ["plen16.k", "1"]
    assert pg.a.pad == pg.b.pad and len(pg.pads) == 1
    assert (pg.pads[0].role, pg.pads[0].pad, pg.pads[0].extra_rows) == ("k", 16, 60)
    # The scales keep their anchored blocks, unchanged by the padding.
    assert str(pg.sa.offset) == "40*bstart.k"
    # The kernel signature (and so the GEMM kernel) is the unpadded one.
    (plain,) = lower_file(WGRAD.replace(" pad 16", ""))[0].schedule.launches
    assert launch.signature == plain.signature


COUNTS = [0, 1, 15, 16, 17, 127, 129, 1000, 4001]


def leaf_fields(src: str, lengths: list[int]):
    (low,) = lower_file(src.replace("E = 4", f"E = {len(lengths)}"))
    spec, (launch,) = low.spec, low.schedule.launches
    rt = random_runtime(spec, np.random.default_rng(0), lengths={"expert": lengths})
    pg = launch.problems
    out = []
    for leaf in range(pg.leaf_count):
        env = leaf_symbols(spec, rt, pg, leaf)
        for op in (pg.a, pg.b):
            out.append((env["len.k"], op.offset.evaluate(env), op.strides[0].evaluate(env), op.strides[1].evaluate(env)))
    return out


def test_padded_leaves_are_tma_describable_for_unaligned_counts():
    """What the table builder tests per leaf (FP8: 1 byte per element): the base 16-byte
    aligned and rows a multiple of 16 bytes apart, K contiguous, for every count."""
    for k, offset, row_stride, k_stride in leaf_fields(WGRAD, COUNTS):
        assert k_stride == 1
        assert offset % 16 == 0, (k, offset)
        assert row_stride % 16 == 0 and row_stride >= k and row_stride - k < 16, (k, row_stride)


def test_unpadded_leaves_are_not_for_the_same_counts():
    fields = leaf_fields(WGRAD.replace(" pad 16", ""), COUNTS)
    assert any(k > 1 and (row_stride % 16 or offset % 16) for k, offset, row_stride, _ in fields)


# ---- explain, pre-passes, manifest ---------------------------------------------------------------


def test_explain_says_every_leaf_loads_by_tma():
    text = gemmspec.build(WGRAD).explain()
    assert "dy, x are stored with padded segments (segment_major pad 16)" in text
    assert "A dy(m, k) = dy_base[40*pstart16.k + m*(plen16.k) + k*(1)]" in text
    assert "padded segments: pstart16.k = sum of round_up(len.k, 16) over the segments before the leaf's" in text
    # A pad that leaves rows short of 16 bytes says so.
    text = gemmspec.build(WGRAD.replace("pad 16", "pad 4")).explain()
    assert "rounded up to its pad for dy, x" in text


def test_explain_json_names_the_padding():
    (low,) = lower_file(WGRAD)
    doc = schedule_json(low.spec, low.schedule)
    a = doc["launches"][0]["operands"]["A"]
    assert a["padded_segments"] == {"role": "k", "pad": 16, "extra_rows": 60}
    assert "padded_segments" not in doc["launches"][0]["operands"]["D"]


REQUANT = """\
gemm req {
  dim T
  dim N = 136, K = 260
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


def test_requantize_into_a_padded_layout_plans_a_padded_pass():
    (low,) = lower_file(REQUANT)
    prog = emit(low.spec, low.schedule)
    assert [p.prepass.target_layout for p in prog.prepasses] == ["segment_major(expert) pad 16"] * 2
    assert all(p.config.pad == 16 and p.kernel.endswith("_p16") for p in prog.prepasses)
    m = launch_manifest(low.spec, prog)
    sizes = {w.name: w.bytes.evaluate({"T": 1000}) for w in m.workspaces}
    assert sizes["prepass0.x_q"] == (1000 + 60) * 260  # 15 rows of padding per expert
    assert sizes["prepass1.dy_q"] == (1000 + 60) * 136
    # Unpadded, the pass and its workspace are as before.
    (low,) = lower_file(REQUANT.replace(" pad 16", ""))
    prog = emit(low.spec, low.schedule)
    assert all(p.config.pad == 1 and not p.kernel.endswith("_p16") for p in prog.prepasses)
    m = launch_manifest(low.spec, prog)
    assert {w.name: w.bytes.evaluate({"T": 1000}) for w in m.workspaces}["prepass0.x_q"] == 1000 * 260


def test_manifest_names_the_padding_rows_of_an_argument():
    exe = gemmspec.build(EXAMPLES / "moe_fp8_wgrad.gspec")
    args = {a["name"]: a for a in exe.manifest.to_json()["arguments"]}
    assert args["dy"]["pad_rows"] == {"dim": "T", "rows": 120}
    assert args["x"]["pad_rows"] == {"dim": "T", "rows": 120}
    assert "pad_rows" not in args["dw"] and "pad_rows" not in args["dy_scale"]
    header = render_header(exe.manifest)
    assert "dy;  // input: e4m3 [T, N] stored in T + 120 rows (padded segments)\n" in header
