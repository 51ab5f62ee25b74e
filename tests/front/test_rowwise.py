"""Per-channel ("rowwise") FP8 scales: one scale along the whole (compile-time) K on
both operands is accepted; mixed, run-time K, K-grouped and epilogue combinations are
refused with located errors; the tile and the kernel configuration follow. Per-tensor
scales, the special case with one block over the whole of M or N too, are in
test_per_tensor.py."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.codegen.emit import gemm_config
from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

SPEC = """gemm rowwise {{
  dim T
  dim N = 512, K = {k}
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [{xs}]
  tensor w : e4m3 [E, N, K] scale f32 [{ws}]
  tensor y : bf16 [T, N]
  y[t, n] = {pre}sum[k] x[t, k] * w[expert(t), n, k]
}}
"""


def text(xs="1, K", ws="1, 1, K", k="7168", pre="") -> str:
    return SPEC.format(xs=xs, ws=ws, k=k, pre=pre)


def error(src: str) -> SpecError:
    with pytest.raises(SpecError) as info:
        check(parse(src, "spec.gspec"))
    return info.value


def located(src: str, err: SpecError, line: int, token: str) -> None:
    assert err.location.line == line, err.render()
    assert err.location.column == src.splitlines()[line - 1].rindex(token) + 1, err.render()


@pytest.mark.parametrize(
    "xs, ws",
    [("1, K", "1, 1, K"), ("1, 7168", "1, 1, 7168"), ("1, K", "1, 128, K"), ("1, K", "1, 64, K")],
)
def test_full_k_blocks_on_both_operands_are_per_channel(xs, ws):
    (spec,) = check(parse(text(xs, ws), "spec.gspec"))
    assert spec.tensor("x").scale.block[1] == 7168
    assert spec.per_channel(spec.gemms[0])


def test_blockwise_is_not_per_channel():
    (spec,) = check(parse(text("1, 128", "1, 128, 128"), "spec.gspec"))
    assert not spec.per_channel(spec.gemms[0])


def test_per_channel_kernel_runs_the_unscaled_loop_on_wide_tiles():
    (lowered,) = lower_file(text())
    (launch,) = lowered.schedule.launches
    cfg = gemm_config(launch)
    assert cfg.per_channel and not cfg.blockwise
    assert (cfg.sa_bk, cfg.sb_bk, cfg.sa_bm, cfg.sb_bn) == (0, 0, 1, 1)
    assert "sa1xK_sb1xK" in cfg.name
    assert not cfg.consumer_scales and not cfg.prefetch_scales and cfg.scale_bytes == 0
    (lowered,) = lower_file(text().replace("dim N = 512", "dim N = 4096"))
    assert gemm_config(lowered.schedule.launches[0]).tile_n == 192  # 256 would spill


def test_mixed_blockwise_and_per_channel_is_refused():
    src = text("1, 128", "1, 1, K")
    err = error(src)
    assert "both operands must be per-channel or per-tensor, or both blockwise" in err.message
    located(src, err, 6, "K]")
    src = text("1, K", "1, 128, 128")
    err = error(src)
    assert "'x' has one scale along the whole contracted dim K" in err.message
    located(src, err, 5, "K]")


def test_run_time_k_with_a_named_block_is_refused():
    # A run-time dim's name is one block over the whole of it; along the contracted dim
    # that needs K fixed at compile time.
    src = text(k="7168").replace("dim N = 512, K = 7168", "dim K\n  dim N = 512")
    err = error(src)
    assert "spans the whole contracted dim K, which is known only at run time" in err.message
    assert "(per-channel or per-tensor scales) needs K fixed at compile time" in err.message
    assert "`dim K = SIZE`" in err.note
    located(src, err, 6, "K]")


def test_other_k_blocks_name_both_choices():
    src = text("1, 256", "1, 1, 256")
    err = error(src)
    assert "use 128 (blockwise) or K's whole extent 7168 (per-channel)" in err.message
    located(src, err, 5, "256]")


def test_unknown_block_name_is_refused():
    src = text("1, Q", "1, 1, K")
    err = error(src)
    assert "scale block 'Q' is not a dim" in err.message
    located(src, err, 5, "Q]")


def test_leaf_axis_keeps_block_one():
    src = text("1, K", "4, 1, K")
    err = error(src)
    assert "a group or batch dim takes one scale per entry" in err.message
    located(src, err, 6, "4, 1")


def test_k_grouped_statement_with_full_k_blocks_is_refused():
    src = """gemm wg {
  dim T = 1024
  dim N = 256, K = 256
  group chunk[C = 4] = uniform(T)
  tensor dy : e4m3 [T, N] layout major(T) scale f32 [T, 1]
  tensor x : e4m3 [T, K] layout major(T) scale f32 [T, 1]
  tensor dw : f32 [C, N, K]
  dw[c, n, k] += sum[t in chunk(c)] dy[t, n] * x[t, k]
}
"""
    err = error(src)
    assert "contracts over the segments of 'chunk'" in err.message
    located(src, err, 5, "T, 1]")


def test_epilogue_beside_per_channel_scales_is_refused():
    src = text().replace("tensor y : bf16 [T, N]", "tensor route_w : f32 [T]\n  tensor y : bf16 [T, N]")
    src = src.replace("y[t, n] = sum", "y[t, n] = route_w[t] * sum")
    err = error(src)
    assert "beside per-channel scales is not supported yet" in err.message
    located(src, err, 9, "route_w[t]")


def test_swiglu_beside_per_channel_scales_is_refused():
    src = """gemm sw {
  dim T
  dim N = 256, F = 128, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, 1, K]
  tensor h : bf16 [T, F]
  h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]
}
"""
    err = error(src)
    assert "SwiGLU beside per-channel scales is not supported yet" in str(err)
    assert err.location.line == 8
    assert "128-wide scale blocks" in err.render()
