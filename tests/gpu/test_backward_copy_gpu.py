"""On a Hopper GPU with torch: the derived backward reading the forward's copy `h_t`
(written in the up-projection's epilogue) in place of requantize(h). One forward call of
the kernels writes h and h_t; the backward op built from the derived spec takes h_t as
the forward wrote it (padded segments, spare scale rows, outputs poisoned first), and
its weight gradient matches float64 and the requantize(h) backward's, its DGRAD the
requantize backward's bit for bit, on expert counts 0, 1, 127, 129 (not multiples of 128)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gemmspec  # noqa: E402
import gemmspec.torch as gt  # noqa: E402
from gemmspec.backward import derive_backward  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402

COUNTS = [0, 1, 127, 129]

# The expert FFN of examples/moe_ffn_fp8_train.gspec, small, with a plain down-projection
# (whose backward derives) reading h; the up-projection writes h and its copy h_t.
FFN = """
gemm ffn_copy_gpu {
  dim T
  dim H = 256, N = 512, F = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x      : e4m3 [T, H] scale f32 [1, 128]
  tensor w_up   : e4m3 [E, N, H] scale f32 [1, 128, 128]
  tensor h      : e4m3 [T, F] scale f32 [1, 128]
  tensor h_t    : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = copy(h)
  tensor w_down : e4m3 [E, H, F] scale f32 [1, 128, 128]
  tensor y      : bf16 [T, H]
  h[t, j] = silu(sum[k] x[t, k] * w_up[expert(t), 2*j, k]) * sum[k] x[t, k] * w_up[expert(t), 2*j + 1, k]
  y[t, n] = sum[f] h[t, f] * w_down[expert(t), n, f]
}
"""


# The WGRAD reads operands requantized into 128x1 blocks (the copy of the bf16 result, or
# requantize(h)); the reference, the FP8 values of h and dy: a few percent of every term,
# whose largest reaches about 0.2 of an expert's whole gradient's rms (on the CPU, the
# reference standing in for the kernels, tests/torch/test_backward_copy_torch.py).
REQUANTIZED = {"rtol": 2.0**-3, "atol": 0.5}


def poisoned(o, inputs) -> dict[str, GuardedTensor]:
    """Fresh outputs of op `o` filled with NaN (an FP8 NaN for the FP8 ones), each between
    guard bytes."""
    return {s.name: GuardedTensor(size, gt.torch_dtype(s.dtype))
            for s, size in zip(o.shapes, o.output_sizes(inputs))}


def per_expert(x):
    """A weight gradient [E, ...] as one row per expert (its tokens' rounding is at the
    scale of the whole matrix)."""
    return x.double().reshape(x.shape[0], -1)


@pytest.mark.parametrize("counts", [COUNTS, [129, 127, 1, 0]], ids=["0-1-127-129", "129-127-1-0"])
def test_the_wgrad_over_the_copy_matches_float64_and_the_requantize_backward(counts):
    exe = gemmspec.build(FFN)
    bw, old = derive_backward(exe.spec), derive_backward(exe.spec, copies=False)
    assert bw.copies == (("h_t", "h_t"),)
    fop, bop, oop = gt.op(exe), gt.op(bw.source), gt.op(old.source)
    feed = gt.BackwardFeed(fop, bop, bw)
    assert not any(p.source == "h" for p in bop.exe.schedule.prepasses)
    assert any(p.source == "h" for p in oop.exe.schedule.prepasses)

    gen = torch.Generator().manual_seed(0)
    t = sum(counts)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    inputs = {"offs": offs}
    for name, shape, block in (("x", (t, 256), (1, 128)), ("w_up", (4, 512, 256), (1, 128, 128)), ("w_down", (4, 256, 256), (1, 128, 128))):
        v = torch.randn(shape, generator=gen) / (1 if name == "x" else 16)
        inputs[name], inputs[f"{name}_scale"] = gt.quantize(v.cuda(), "e4m3", block)
    dy = torch.randn(t, 256, generator=gen).cuda()
    dq, ds = gt.quantize(dy, "e4m3", (1, 128))

    guarded = poisoned(fop, inputs)
    outs = {n: g.tensor for n, g in guarded.items()}
    fop(**inputs, **outs)
    kept = feed.kept(inputs, tuple(outs[n] for n in fop.outputs))
    assert "h" not in kept and kept["h_t"] is outs["h_t"]
    new_in = {n: v for n, v in kept.items() if n in bop.inputs} | feed.copies(kept) | {"dy": dq, "dy_scale": ds}
    old_in = {n: v for n, v in (inputs | outs).items() if n in oop.inputs} | {"dy": dq, "dy_scale": ds}
    new_guarded, old_guarded = poisoned(bop, new_in), poisoned(oop, old_in)
    new, old = ({n: g.tensor for n, g in x.items()} for x in (new_guarded, old_guarded))
    bop(**new_in, **new)
    oop(**old_in, **old)
    torch.cuda.synchronize()
    for name, g in [*guarded.items(), *new_guarded.items(), *old_guarded.items()]:
        assert g.changed_outside().size == 0, f"{name}: a guard byte changed"

    assert torch.equal(new["dh"], old["dh"])  # the DGRAD reads neither
    hr = outs["h"].double() * outs["h_scale"].double().repeat_interleave(128, dim=1)
    dr = dq.double() * ds.double().repeat_interleave(128, dim=1)
    o = offs.tolist()
    want = torch.stack([dr[a:b].T @ hr[a:b] for a, b in zip(o[:-1], o[1:])])
    for name, got in (("copy", new["dw_down"]), ("requantize", old["dw_down"])):
        assert not got.isnan().any(), name
        assert_close_elementwise(per_expert(got), per_expert(want), dtype="f32",
                                 name=f"{counts} dw_down over {name}", **REQUANTIZED, rel_norm_limit=0.09)
    agree = ((new["dw_down"].double() - old["dw_down"].double()).norm() / want.norm()).item()
    assert agree < 0.09, agree
    assert_close_elementwise(per_expert(new["dw_down"]), per_expert(old["dw_down"]), dtype="f32",
                             name=f"{counts} dw_down over the copy vs requantize", **REQUANTIZED)
    assert (new["dw_down"][counts.index(0)] == 0).all()  # an expert with no tokens
