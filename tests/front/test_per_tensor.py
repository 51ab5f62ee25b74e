"""Per-tensor FP8 scales: a scale block that names a dim covers the whole of it (a
run-time dim included), so `scale f32 [T, K]` on x [T, K] is one scale for all of x and
`scale f32 [1, N, K]` on w [E, N, K] one per expert. Beside one scale along the whole of
K they run the per-channel kernel, the scale read through a zero stride; per-tensor on
one operand and per-channel on the other mix. Misuse is a located error."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.codegen.emit import emit, gemm_config
from gemmspec.errors import SpecError
from gemmspec.expr import ZERO
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

SPEC = """gemm tensorwise {{
  dim T
  dim N = 512, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [{xs}]
  tensor w : e4m3 [E, N, K] scale f32 [{ws}]
  tensor y : bf16 [T, N]
  y[t, n] = {pre}sum[k] x[t, k] * w[expert(t), n, k]
}}
"""


def text(xs="T, K", ws="1, N, K", k="7168", pre="") -> str:
    return SPEC.format(xs=xs, ws=ws, k=k, pre=pre)


def error(src: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(src, "spec.gspec"))
    return info.value


def located(src: str, err: SpecError, line: int, token: str, nth: int = 0) -> None:
    """The caret sits on the `nth` occurrence of `token` on `line` (counting from the end)."""
    row = src.splitlines()[line - 1]
    col = len(row)
    for _ in range(nth + 1):
        col = row.rindex(token, 0, col)
    assert err.location.line == line, err.render()
    assert err.location.column == col + 1, err.render()


@pytest.mark.parametrize(
    "xs, ws, recipe",
    [
        ("T, K", "1, N, K", "per-tensor x, per-expert w"),
        ("T, K", "1, 512, 7168", "sizes written out"),
        ("T, K", "1, 1, K", "per-tensor x, per-channel w"),
        ("1, K", "1, N, K", "per-token x, per-expert w"),
        ("T, K", "1, 4096, K", "a block past the dim's size covers it too"),
    ],
)
def test_recipes_check_and_run_the_per_channel_kernel(xs, ws, recipe):
    (lowered,) = lower_file(text(xs, ws))
    spec = lowered.spec
    assert spec.per_channel(spec.gemms[0]), recipe
    (launch,) = lowered.schedule.launches
    cfg = gemm_config(launch)
    assert cfg.per_channel and not cfg.blockwise and (cfg.sa_bk, cfg.sb_bk) == (0, 0)


def test_a_run_time_dim_named_in_a_block_is_one_block_over_all_of_it():
    (spec,) = check(parse(text(), "spec.gspec"))
    x, w = spec.tensor("x").scale, spec.tensor("w").scale
    assert x.block == ("T", 7168) and x.whole(0) and not x.whole(1)
    assert w.block == (1, 512, 7168) and not any(w.whole(i) for i in range(3))
    assert x.block_text == "[T, 7168]" and str(x) == "scale f32 [T, 7168] layout row_major as x_scale"
    # The grid is one block along T whatever T is, zero included.
    assert [x.blocks_along(0, n) for n in (0, 1, 10**6)] == [1, 1, 1]
    assert x.blocks_along(1, 7168) == 1 and w.blocks_along(1, 512) == 1


def test_lowered_to_a_zero_stride():
    (lowered,) = lower_file(text())
    (launch,) = lowered.schedule.launches
    sa, sb = launch.problems.sa, launch.problems.sb
    # x: one scale, every row at offset 0 (a zero stride along m, blocks of 1).
    assert sa.block == (1, 7168) and sa.strides[0] == ZERO and sa.offset == ZERO
    assert "bstart.m" not in {s for p in (sa.offset, *sa.strides) for s in p.symbols}
    # w: one scale per expert, its block covering the whole of N.
    assert sb.block == (512, 7168) and str(sb.offset) == "g.expert"
    cfg = gemm_config(launch)
    assert "sa1xK_sb512xK" in cfg.name
    (prog,) = [emit(lowered.spec, lowered.schedule)]
    source = prog.launches[0].source
    assert "L.sa_off = 0LL;" in source and "L.sa_sm = 0LL;" in source  # the leaf table
    assert "L.sb_off = (g_expert);" in source


def test_mixed_per_tensor_and_blockwise_is_refused():
    src = text("T, K", "1, 128, 128")
    err = error(src)
    assert "'x' has one scale along the whole contracted dim K (per-tensor)" in err.message
    assert "both operands must be per-channel or per-tensor, or both blockwise" in err.message
    located(src, err, 5, "K]")
    src = text("1, 128", "1, N, K")
    err = error(src)
    assert "'w' has one scale along the whole contracted dim K (per-tensor)" in err.message
    located(src, err, 6, "K]")


def test_whole_run_time_dim_beside_blockwise_k_is_refused():
    src = text("T, 128", "1, 128, 128")
    err = error(src)
    assert (
        "one scale along the whole of the run-time dim T is supported only beside one scale "
        "along the whole of the contracted dim K (per-tensor or per-channel scales), but the "
        "block along K is 128" in err.message
    )
    assert "declare the block along K as K" in err.note
    located(src, err, 5, "T, 128")


def test_per_tensor_with_k_of_128_is_blockwise_with_one_k_block():
    # With K = 128 a block of K is the blockwise 128; one block over the whole of T still
    # reads one scale for every row (the one K block's promotion).
    (lowered,) = lower_file(text(k="128"))
    spec = lowered.spec
    assert not spec.per_channel(spec.gemms[0])
    (launch,) = lowered.schedule.launches
    assert launch.problems.sa.strides == (ZERO, launch.problems.sa.strides[1])
    assert gemm_config(launch).blockwise


def test_run_time_name_at_another_position_is_refused():
    src = text("1, T", "1, N, K")
    err = error(src)
    assert (
        "scale block 'T' names a dim known only at run time, which stands for one block over "
        "the whole of T only at T's own position; this position of 'x' is K" in err.message
    )
    located(src, err, 5, "T]")


def test_whole_run_time_block_does_not_restart_per_group():
    src = text("T, K", "1, N, K").replace("scale f32 [T, K]", "scale f32 [T, K] per expert")
    err = error(src)
    assert "the block along T is the whole of T (one scale for all of it)" in err.message
    assert err.note == "drop `per expert`"
    located(src, err, 5, "expert")


def test_unknown_name_in_a_block_is_refused():
    src = text("Q, K", "1, N, K")
    err = error(src)
    assert "scale block 'Q' is not a dim" in err.message
    located(src, err, 5, "Q, K")


def test_leaf_axis_keeps_block_one():
    src = text("T, K", "E, N, K")
    err = error(src)
    assert "scale block 4 along E spans several groups" in err.message
    located(src, err, 6, "E, N")


def test_epilogue_beside_per_tensor_scales_is_refused():
    src = text().replace("tensor y : bf16 [T, N]", "tensor route_w : f32 [T]\n  tensor y : bf16 [T, N]")
    src = src.replace("y[t, n] = sum", "y[t, n] = route_w[t] * sum")
    err = error(src)
    assert "beside per-channel scales is not supported yet" in err.message
    located(src, err, 9, "route_w[t]")


def test_fixed_whole_blocks_need_no_tile_grid_or_anchor():
    # T = 1000 fixed: one block of 1000 rows along T, across the experts' segments, is
    # neither a divisor nor a multiple of 128 and needs no `per expert`.
    src = text("T, K", "1, N, K").replace("dim T\n", "dim T = 1000\n")
    (spec,) = check(parse(src, "spec.gspec"))
    assert spec.tensor("x").scale.block == (1000, 7168)
    # Beside 128-wide K blocks the tile grid rule stays: 1000 does not fit it.
    src = text("T, 128", "1, 128, 128").replace("dim T\n", "dim T = 1000\n")
    err = error(src)
    assert "scale block 1000 along T does not divide the 128-wide tile grid" in err.message


def test_explain_shows_the_block_and_the_zero_stride(capsys, tmp_path):
    from gemmspec.cli import main

    path = tmp_path / "t.gspec"
    path.write_text(text())
    assert main(["explain", str(path)]) == 0
    out = capsys.readouterr().out
    assert "with scales [T, 7168] x [1, 512, 7168]" in out
    assert "scale A x_scale[0 + (m/1)*(0) + (k/7168)*(1)]" in out
    assert "scale B w_scale[g.expert + (n/512)*(1) + (k/7168)*(1)]" in out


def test_same_kernel_as_per_channel():
    # Per-tensor x beside per-channel w runs the very kernel of per-channel x and w: only
    # the leaf table's stride of x's scale differs (0 instead of one per row).
    (tensor,) = lower_file(text("T, K", "1, 1, K"))
    (channel,) = lower_file(text("1, K", "1, 1, K"))
    (a,), (b,) = tensor.schedule.launches, channel.schedule.launches
    assert gemm_config(a) == gemm_config(b)
    assert a.problems.sa.strides[0] == ZERO and b.problems.sa.strides[0] != ZERO


def test_no_derived_backward_for_per_tensor_scales():
    from gemmspec.backward import derive_backward

    for k in ("7168", "128"):  # per-channel kernel, and blockwise with one K block
        (lowered,) = lower_file(text(k=k))
        bw = derive_backward(lowered.spec)
        assert not bw.statements and bw.source == ""
        (skipped,) = bw.skipped
        assert "per-tensor" in skipped.reason
