"""The float32 quantize reference against an independent per-block formulation:
zero blocks, short row blocks, saturation, NaN, both block shapes and both FP8 types."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, quantize_values

SPEC = """
gemm g {{
  dim R
  dim C = {c}, N = 128
  tensor x   : {src} [{batch}R, C]
  tensor x_q : {dst} [{batch}R, C] scale f32 [{block}] = quantize(x)
  tensor w   : {dst} [{batch}N, C] scale f32 [{wblock}]
  tensor y   : f32 [{batch}R, N]
  y[{b}r, n] = sum[c] x_q[{b}r, c] * w[{b}n, c]
}}
"""
try:
    import torch
except ImportError:  # the numpy loop below stands in
    torch = None

FP8 = {"e4m3": (ml_dtypes.float8_e4m3fn, 448.0), "e5m2": (ml_dtypes.float8_e5m2, 57344.0)}


def spec_for(c: int, dst: str, rows_per_block: int, batch: bool = False, src: str = "bf16"):
    text = SPEC.format(
        c=c, src=src, dst=dst,
        batch="B, " if batch else "", b="b, " if batch else "",
        block=("1, " if batch else "") + f"{rows_per_block}, 128",
        wblock=("1, " if batch else "") + "128, 128",
    )
    if batch:
        text = text.replace("dim C =", "dim B = 2, C =").replace("dim R\n", "dim R = 131\n")
    (lowered,) = lower_file(text)
    return lowered.spec


def by_blocks(x: np.ndarray, dst: str, br: int, bc: int) -> tuple[np.ndarray, np.ndarray]:
    """quantize by a loop over blocks, in torch where it is installed (else numpy)."""
    dtype, fp8_max = FP8[dst]
    *lead, rows, cols = x.shape
    nr, nc = -(-rows // br), -(-cols // bc)
    q = np.empty(x.shape, dtype=dtype)
    grid = np.empty((*lead, nr, nc), dtype=np.float32)
    for idx in np.ndindex(*lead, nr, nc):
        *b, i, j = idx
        sl = (*b, slice(i * br, (i + 1) * br), slice(j * bc, (j + 1) * bc))
        block = x[sl].astype(np.float32)
        if torch is not None:
            t = torch.from_numpy(block)
            finite = t.abs()[~torch.isnan(t)]
            amax = finite.max() if finite.numel() else torch.tensor(0.0)
            scale = amax / torch.tensor(fp8_max, dtype=torch.float32) if amax > 0 else torch.tensor(1.0)
            ratio = (t / scale).clamp(-fp8_max, fp8_max)
            q_torch = ratio.to(torch.float8_e4m3fn if dst == "e4m3" else torch.float8_e5m2)
            q[sl] = q_torch.view(torch.uint8).numpy().view(dtype)
            grid[idx] = scale.item()
        else:
            a = np.float32(np.nanmax(np.abs(block), initial=0))
            s = a / np.float32(fp8_max) if a > 0 else np.float32(1)
            q[sl] = np.clip(block / s, -fp8_max, fp8_max).astype(dtype)
            grid[idx] = s
    return q.astype(np.float64), grid


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("dst", ["e4m3", "e5m2"])
@pytest.mark.parametrize("br", [1, 128])
@pytest.mark.parametrize("rows, cols", [(1, 128), (3, 256), (129, 384), (130, 128)])
def test_matches_block_loop(dst, br, rows, cols):
    spec = spec_for(cols, dst, br)
    rng = np.random.default_rng(rows * cols + br)
    x = (rng.standard_normal((rows, cols)) * 2.0 ** rng.integers(-20, 20, size=(rows, 1)))
    x = x.astype(ml_dtypes.bfloat16).astype(np.float64)
    x[0, : min(cols, 128)] = 0.0  # a zero block (the whole block when br == 1)
    if rows > 2 and cols > 5:
        x[2, 5] = np.nan
    q, grid = quantize_values(spec, Runtime({"R": rows}), x, spec.tensor("x_q"))
    q_ref, grid_ref = by_blocks(x, dst, br, 128)
    assert grid.dtype == np.float32
    assert same(grid, grid_ref)
    assert same(q, q_ref)
    if br == 1:
        assert grid[0, 0] == 1.0 and (q[0, : min(cols, 128)] == 0).all()


def test_three_d_blocks():
    spec = spec_for(256, "e4m3", 128, batch=True)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 131, 256)).astype(ml_dtypes.bfloat16).astype(np.float64)
    q, grid = quantize_values(spec, Runtime({"R": 131}), x, spec.tensor("x_q"))
    q_ref, grid_ref = by_blocks(x, "e4m3", 128, 128)
    assert grid.shape == (2, 2, 2)
    assert same(grid, grid_ref) and same(q, q_ref)


def test_rule_by_hand():
    spec = spec_for(256, "e4m3", 1, src="f32")
    x = np.zeros((2, 256))
    x[0, :3] = [1.0, -3.0, 2.0]
    x[0, 128:130] = [7.0, -0.5]
    x[1, 0] = np.float32(1e-30)
    q, grid = quantize_values(spec, Runtime({"R": 2}), x, spec.tensor("x_q"))
    s = np.float32(3.0) / np.float32(448.0)
    assert grid[0, 0] == s and grid[0, 1] == np.float32(7.0) / np.float32(448.0)
    assert q[0, 1] == -448.0 and q[0, 128] == 448.0  # the block's amax maps onto the FP8 max
    want = float(np.float32(np.float32(1.0) / s).astype(ml_dtypes.float8_e4m3fn))
    assert q[0, 0] == want
    assert grid[1, 1] == 1.0 and (q[1, 128:] == 0).all()  # an all-zero block
    assert q[1, 0] == 448.0  # a lone tiny value still spans the range


def test_saturation_not_nan():
    # amax / 448 rounds down, so amax / scale may land past 448 by an ulp: it saturates.
    spec = spec_for(128, "e4m3", 1, src="f32")
    rng = np.random.default_rng(0)
    x = rng.uniform(-1e3, 1e3, size=(4096, 128)).astype(np.float32).astype(np.float64)
    q, grid = quantize_values(spec, Runtime({"R": 4096}), x, spec.tensor("x_q"))
    assert not np.isnan(q).any()
    assert np.abs(q).max() == 448.0
    over = np.abs(x.astype(np.float32) / grid.repeat(128, axis=1)) > 448.0
    assert over.any(), "no element exceeded the FP8 max before saturation"
