"""The torch layer at edges the docs promise, on the CPU (the reference serves the ops):

- a fresh output is strided as its layout declares (`major(T)`, `row_major pad P`,
  `strides(...)`), in the functional form on the CPU and in the fake (meta)
  implementation torch.compile sees, so the op's own allocation passes its checks;
- a padded segment_major buffer with fewer rows than its padding, read for a dim no
  other input gives, is an ArgumentError that says the shape it needs (not a negative
  size);
- per-segment [128, 1] scales with fewer rows than the offsets imply are an
  ArgumentError that gives the shape they make, as on the GPU (not an IndexError);
- `quantize` with a dim's name as the block has one entry along an empty dim;
- an op whose output has a run-time dim no input has (a scattered output's rows) is
  made, and takes that output in place; only the functional form refuses, saying so.
"""

from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402
from gemmspec.torch_reference import register_reference  # noqa: E402

LAYOUTS = """
gemm fresh_layouts {
  dim T
  dim N = 256, K = 96
  tensor x : bf16 [K, T] layout strides(1, K)
  tensor w : bf16 [N, K] layout row_major pad 64
  tensor y : f32 [T, N] layout %s
  y[t, n] = sum[k] x[k, t] * w[n, k]
}
"""


def _op(text: str) -> gt.GemmOp:
    op = gt.op(text)
    register_reference(op)
    return op


def _close(got: torch.Tensor, want: np.ndarray, rtol: float = 2**-7, atol: float = 2**-8) -> None:
    """Element by element: |got - want| <= rtol |want| + atol rms(row), all finite."""
    g = got.double().numpy()
    assert np.isfinite(g).all()
    rms = np.sqrt((want**2).mean(axis=-1, keepdims=True)) if want.size else 0.0
    bad = np.abs(g - want) > rtol * np.abs(want) + atol * rms
    assert not bad.any(), f"{int(bad.sum())} elements over the bound, first at {np.argwhere(bad)[0]}"


@pytest.mark.parametrize(
    ("layout", "strides"),
    [("major(T)", lambda t: (1, t)), ("row_major pad 320", lambda t: (320, 1)), ("strides(1, T)", lambda t: (1, t)),
     ("row_major", lambda t: (256, 1))],
)
@pytest.mark.parametrize("tokens", [0, 1, 3, 130])
def test_a_fresh_output_is_strided_as_its_layout_declares(layout, strides, tokens):
    op = _op(LAYOUTS % layout)
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 96, generator=gen).bfloat16().T  # [K, T], strides (1, K)
    w = torch.randn(256, 128, generator=gen).bfloat16()[:, :96]  # [N, K] in rows of 128
    y = op(x=x, w=w)
    assert y.shape == (tokens, 256) and y.dtype == torch.float32
    if tokens > 1:  # strides of a dim of size 0 or 1 say nothing
        assert y.stride() == strides(tokens)
    _close(y, x.double().T.numpy() @ w.double().T.numpy())
    # The in-place form into such a buffer writes the same values.
    given = torch.empty_strided((tokens, 256), strides(tokens), dtype=torch.float32).fill_(7.0) if tokens else y.clone()
    op(x=x, w=w, y=given)
    assert torch.equal(given, y)
    # What torch.compile sees: the fake implementation allocates as the kernel path does.
    meta = op.functional(x.to("meta"), w.to("meta"))
    assert meta.shape == y.shape and (tokens <= 1 or meta.stride() == strides(tokens))


PADDED = """
gemm padded_rows {
  dim T
  dim K = 128, R = 32
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K] layout segment_major(expert) pad 8
  tensor a : bf16 [E, R, K]
  tensor y : f32 [T, R]
  y[t, r] = sum[k] x[t, k] * a[expert(t), r, k]
}
"""


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_buffer_without_its_padding_rows_says_the_shape_it_needs(device):
    op = _op(PADDED)
    a = torch.randn(3, 32, 128).bfloat16().to(device)
    offs = torch.tensor([0, 1, 3, 3], dtype=torch.int32).to(device)
    message = "tensor 'x' must have shape [T + 21, 128] (segment_major(expert) pad 8: 7 rows of padding for each of its " \
              "3 segments, 21 rows beyond T), got [10, 128]"
    with pytest.raises(ArgumentError, match=re.escape(message)):
        op(x=torch.zeros(10, 128, dtype=torch.bfloat16, device=device), a=a, offs=offs)


def test_a_padded_buffer_with_its_padding_rows_gives_the_dim():
    op = _op(PADDED)
    gen = torch.Generator().manual_seed(1)
    a = torch.randn(3, 32, 128, generator=gen).bfloat16()
    offs = torch.tensor([0, 1, 3, 3], dtype=torch.int32)
    x = torch.randn(3 + 21, 128, generator=gen).bfloat16()  # T = 3 in segments of 1, 2 and 0 rows
    y = op(x=x, a=a, offs=offs)
    assert y.shape == (3, 32)
    _close(y, np.stack([_segment_row(x, t, [0, 1, 3, 3], 8) @ a[e].double().numpy().T for t, e in enumerate([0, 1, 1])]))


def _segment_row(buffer: torch.Tensor, t: int, offsets: list[int], pad: int) -> np.ndarray:
    """Logical row t of a [T, C] tensor stored segment_major pad `pad` in `buffer`
    (language.md's addresses): segment g, of n rows from s, holds its rows transposed
    at p_g * C, p_g the padded lengths of the segments before it; element (t, c) at
    p_g * C + c * round_up(n, pad) + (t - s)."""
    flat, columns = buffer.double().reshape(-1).numpy(), buffer.shape[1]
    p = 0
    for s, e in zip(offsets, offsets[1:]):
        n = -(-(e - s) // pad) * pad
        if s <= t < e:
            return flat[p * columns + np.arange(columns) * n + (t - s)]
        p += n
    raise IndexError(t)


def test_per_segment_scales_with_too_few_rows_give_the_shape_they_make():
    op = _op("""
gemm scale_rows {
  dim T
  dim N = 384, K = 128
  group expert[E = 3] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
""")
    offs = torch.tensor([0, 0, 129, 130], dtype=torch.int32)  # segments of 0, 129 and 1 rows: 3 block rows
    dy = torch.randn(130, 384).to(torch.float8_e4m3fn)
    x = torch.randn(130, 128).to(torch.float8_e4m3fn)
    ins = {"dy": dy, "x": x, "x_scale": torch.ones(3, 128), "offs": offs}
    # Two rows lie inside the host's range ([2..3, 384]); the offsets imply three.
    with pytest.raises(ArgumentError, match=re.escape("scale 'dy_scale' must have shape [3, 384], got [2, 384]")):
        op(dy_scale=torch.ones(2, 384), **ins)
    dw = op(dy_scale=torch.ones(3, 384), **ins)  # enough rows: computed
    want = np.zeros((3, 384, 128))
    for e, (s, end) in enumerate([(0, 0), (0, 129), (129, 130)]):
        for t in range(s, end):  # unit scales: the FP8 values themselves
            want[e] += np.outer(_segment_row(dy, t, [0, 0, 129, 130], 1), _segment_row(x, t, [0, 0, 129, 130], 1))
    _close(dw, want)


@pytest.mark.parametrize("tokens", [0, 1, 200])
def test_quantize_over_a_whole_dim_has_one_entry_along_it(tokens):
    value = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(tokens))
    q, scale = gt.quantize(value, "e4m3", ("T", 128))
    assert q.shape == (tokens, 256) and scale.shape == (1, 2)
    if tokens == 0:
        assert torch.equal(scale, torch.ones(1, 2))  # an empty block: scale 1
    else:
        amax = value.abs().reshape(tokens, 2, 128).amax(dim=(0, 2))
        assert torch.equal(scale[0], amax / torch.full_like(amax, 448.0))


SCATTERED = """
gemm scattered_rows {
  dim T, S
  dim N = 16, K = 64
  tensor dst : i32 [T]
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [S, N]
  y[dst[t], n] = sum[k] x[t, k] * w[n, k]
}
"""


def test_an_output_no_input_sizes_is_taken_in_place():
    op = _op(SCATTERED)
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(3, 64, generator=gen).bfloat16(), torch.randn(16, 64, generator=gen).bfloat16()
    dst = torch.tensor([4, 0, 2], dtype=torch.int32)
    y = torch.full((5, 16), float("nan"), dtype=torch.bfloat16)
    op(dst=dst, x=x, w=w, y=y)
    want = x.double().numpy() @ w.double().numpy().T
    _close(y[[4, 0, 2]], want)
    assert y[[1, 3]].isnan().all()  # rows no entry names keep their bytes
    message = "scattered_rows: output 'y' has run-time dim S, which no input tensor has, so a fresh output " \
              "cannot be sized; pass it in"
    for call in (lambda: op(dst=dst, x=x, w=w), lambda: op.functional(dst.to("meta"), x.to("meta"), w.to("meta"))):
        with pytest.raises(ArgumentError, match=re.escape(message)):
            call()
