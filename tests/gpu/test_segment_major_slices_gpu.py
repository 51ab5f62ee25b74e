"""A segment_major tensor whose other dim a uniform group splits per leaf too (column
slices of each adapter's block), on the GPU: each leaf starts at its slice inside its
segment's block, output and input alike. The output is read back through the layout's
addresses (language.md: element (t, c) of segment [s, s + n) at s * C + c * n + (t - s))
and judged element by element against float64, with guard bytes around it; the
segments include empty ones and lengths past one 64-row tile."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402

SLICED_OUT = """
gemm sliced_out_gpu {
  dim T
  dim N = 256, K = 128
  group part[P = 2] = uniform(N)
  group lora[L = 4] = ragged(T, offsets = lora_offsets)
  tensor x : bf16 [T, P, K]
  tensor w : bf16 [L, N, K]
  tensor y : f32 [T, N] layout segment_major(lora)
  y[t, n] = sum[k] x[t, part(n), k] * w[lora(t), n, k]
}
"""
SLICED_IN = """
gemm sliced_in_gpu {
  dim T
  dim N = 128, K = 256
  group part[P = 2] = uniform(K)
  group lora[L = 4] = ragged(T, offsets = lora_offsets)
  tensor x : bf16 [T, K] layout segment_major(lora)
  tensor w : bf16 [L, N, K]
  tensor y : f32 [P, T, N]
  y[p, t, n] = sum[k in part(p)] x[t, k] * w[lora(t), n, k]
}
"""
LENGTHS = [[0, 1, 70, 3], [129, 0, 0, 2]]


def _segments(lengths):
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    expert = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return bounds, expert


def _to_segment_major(logical: torch.Tensor, bounds: list[int]) -> torch.Tensor:
    """[T, C] logical values in segment_major storage (a [T, C] buffer): each segment's rows
    transposed into its block."""
    blocks = [logical[a:b].T.reshape(-1) for a, b in zip(bounds, bounds[1:])]
    return torch.cat(blocks).view(logical.shape)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_a_sliced_segment_major_output(lengths):
    op = gt.op(SLICED_OUT)
    bounds, expert = _segments(lengths)
    t = bounds[-1]
    gen = torch.Generator().manual_seed(t)
    x = torch.randn(t, 2, 128, generator=gen).to(torch.bfloat16)
    w = (torch.randn(4, 256, 128, generator=gen) / 16).to(torch.bfloat16)
    guarded = GuardedTensor((t, 256), torch.float32)
    offs = torch.tensor(bounds, dtype=torch.int32)
    op(x=x.cuda(), w=w.cuda(), lora_offsets=offs.cuda(), y=guarded.tensor)
    # Columns 0-127 read x[t, 0, :], 128-255 x[t, 1, :].
    want = torch.einsum("tnk,tnk->tn", x.double().repeat_interleave(128, dim=1), w.double()[expert])
    got = guarded.tensor.cpu().reshape(-1)
    logical = torch.cat([got[a * 256:b * 256].view(256, b - a).T for a, b in zip(bounds, bounds[1:])])
    assert_close_elementwise(logical, want, dtype="f32", operand_dtype="bf16", name="y (segment_major)", guards=guarded)


@pytest.mark.parametrize("lengths", LENGTHS)
def test_a_sliced_segment_major_input(lengths):
    op = gt.op(SLICED_IN)
    bounds, expert = _segments(lengths)
    t = bounds[-1]
    gen = torch.Generator().manual_seed(t + 1)
    x = torch.randn(t, 256, generator=gen).to(torch.bfloat16)
    w = (torch.randn(4, 128, 256, generator=gen) / 16).to(torch.bfloat16)
    guarded = GuardedTensor((2, t, 128), torch.float32)
    offs = torch.tensor(bounds, dtype=torch.int32)
    op(x=_to_segment_major(x, bounds).cuda(), w=w.cuda(), lora_offsets=offs.cuda(), y=guarded.tensor)
    want = torch.stack([torch.einsum("tk,tnk->tn", x.double()[:, h], w.double()[expert][:, :, h])
                        for h in (slice(0, 128), slice(128, 256))])
    assert_close_elementwise(guarded.tensor, want, dtype="f32", operand_dtype="bf16", name="y", guards=guarded)
