"""On a Hopper GPU: operands stored `segment_major(G) pad P` against the float64
reference, on token counts that are not multiples of 16 (nor of 128). Outputs are
poisoned with NaN first and must come back fully written; the padding of every padded
input is NaN too, so a kernel that read it would show. The leaf tables are read back:
with pad 16 every FP8 leaf loads A and B by TMA, which is what the padding is for.
Skipped elsewhere, with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import assert_close_elementwise  # noqa: E402

pytestmark = pytest.mark.gpu

GS_LOAD_A_TMA, GS_LOAD_B_TMA = 1, 2
LEAF_INTS = 36  # sizeof(GsLeaf) / 4; `loads` is int 4, `k` int 2

COUNTS = [0, 1, 15, 16, 17, 127, 129, 1000, 4001]

WGRAD = """
gemm wgrad_pad {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert){pad} scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert){pad} scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}}
"""

REQUANT = """
gemm wgrad_requant_pad {{
  dim T
  dim N = {n}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] = sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}}
"""

NESTED = """
gemm nested_pad {
  dim T
  dim K = 576, R = 64
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R] layout segment_major(expert) pad 4
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""


def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


def wgrad(n: int, k: int, e: int, pad: str = " pad 16") -> str:
    return WGRAD.format(n=n, k=k, e=e, pad=pad)


@pytest.mark.parametrize("k", [576, 7168])
@pytest.mark.parametrize("counts", [COUNTS, COUNTS[::-1]], ids=["up", "down"])
def test_padded_wgrad_matches_reference(k, counts):
    exe = gemmspec.build(wgrad(200, k, len(counts)))
    report_ok(run_random(exe, lengths={"expert": counts}, seed=k + counts[0], repeats=0))


def test_requantize_into_padded_segments_feeds_wgrad():
    counts = [1, 127, 129, 0, 1000, 4001, 15, 17]
    exe = gemmspec.build(REQUANT.format(n=264, k=576, e=len(counts)))
    assert all(p.kernel.endswith("_p16") for p in exe.program.prepasses)
    report_ok(run_random(exe, lengths={"expert": counts}, seed=21, repeats=0))


NESTED_REQUANT = """
gemm nested_requant_pad {
  dim T
  dim N = 264, K = 576
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(x)
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = requantize(dy)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


def test_nested_requantize_into_padded_segments():
    """The pass scans the nested offsets flattened (an empty segment between rows): its
    padded prefixes must be the builder's."""
    counts = [1, 129, 17, 0, 1000, 15]
    exe = gemmspec.build(NESTED_REQUANT)
    report_ok(run_random(exe, lengths={"lora": [147, 1015], "expert": counts}, seed=23, repeats=0))


def test_nested_padded_segments():
    report_ok(run_random(gemmspec.build(NESTED), lengths={"lora": [1000, 1133], "expert": None}, seed=22, repeats=0))


def leaf_loads(exe, counts: list[int], n: int, k: int) -> np.ndarray:
    """Run a WGRAD spec on arbitrary bytes with these counts and read back each leaf's
    `loads` and `k` from its leaf table (built by a builder, in global memory)."""
    from gemmspec.codegen.emit import emit

    exe.program = emit(exe.spec, exe.schedule, inline_tables=False)
    spec, e, t = exe.spec, len(counts), sum(counts)
    extra = spec.tensor("dy").layout.pad_rows
    blocks = sum(-(-c // 128) for c in counts)
    rng = np.random.default_rng(0)
    keep = []

    def buf(shape, dtype, fill=None):
        nbytes = int(np.prod(shape)) * {"e4m3": 1, "f32": 4, "i32": 4}[dtype]
        if fill is None:
            b = DeviceBuffer.from_numpy(rng.integers(0, 64, size=max(nbytes, 16), dtype=np.uint8))
        else:
            b = DeviceBuffer.from_numpy(fill)
        keep.append(b)
        return b.view(shape, dtype)

    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    args = {
        "dy": buf((t + extra, n), "e4m3"),
        "dy_scale": buf((blocks, n), "f32", np.full((blocks, n), 0.01, np.float32)),
        "x": buf((t + extra, k), "e4m3"),
        "x_scale": buf((blocks, k), "f32", np.full((blocks, k), 0.01, np.float32)),
        "dw": buf((e, n, k), "f32", np.zeros((e, n, k), np.float32)),
        "offs": buf((e + 1,), "i32", offs),
    }
    run = exe.prepare(**args)
    run.enqueue()
    run.check()
    (launch,) = exe.program.launches
    table = next(p.args for p in run.launches if p.kernel.name == launch.table_kernel)[0]
    leaves = table.to_numpy((e + 1) * LEAF_INTS, "i32").reshape(e + 1, LEAF_INTS)[:e]
    return leaves[:, [2, 4]]


def test_with_pad_16_every_leaf_loads_by_tma():
    counts = [1, 15, 17, 127, 129, 1000, 4001, 33]
    loads = leaf_loads(gemmspec.build(wgrad(256, 384, len(counts))), counts, 256, 384)
    assert (loads[:, 0] == counts).all()
    both = GS_LOAD_A_TMA | GS_LOAD_B_TMA
    assert ((loads[:, 1] & both) == both).all(), loads
    # Unpadded, the counts that are not multiples of 16 (rows that many bytes apart) are
    # copied by hand.
    plain = leaf_loads(gemmspec.build(wgrad(256, 384, len(counts), pad="")), counts, 256, 384)
    by_hand = [c % 16 != 0 for c in counts]
    assert [(f & both) != both for f in plain[:, 1]] == by_hand, plain


def test_derived_backward_with_unaligned_counts():
    """gemmspec.torch.function's derived WGRAD requantizes into segment_major pad 16: its
    gradients match float64 autograd on counts that are not multiples of 16, and every
    leaf of the WGRAD launch loaded by TMA."""
    torch = pytest.importorskip("torch")
    import gemmspec.torch as gt
    from gemmspec.bench import moe_spec

    counts = [1, 15, 17, 129, 0, 333]
    e, n, k = len(counts), 256, 384
    fn = gt.function(moe_spec("moe_pad_autograd", n=n, k=k, e=e, fp8=True))
    gen = torch.Generator(device="cpu").manual_seed(3)
    t = sum(counts)
    x = torch.randn(t, k, generator=gen).cuda().to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(e, n, k, generator=gen) / 16).cuda().requires_grad_(True)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    dy = torch.randn(t, n, generator=gen).cuda().to(torch.bfloat16)
    y = fn(x=x, w=w, offs=offs)
    y.backward(dy)
    torch.cuda.synchronize()
    xd, wd = x.detach().double().requires_grad_(True), w.detach().double().requires_grad_(True)
    o = offs.tolist()
    yd = torch.cat([xd[a:b] @ wd[g].T for g, (a, b) in enumerate(zip(o[:-1], o[1:]))])
    yd.backward(dy.double())
    # Against float64 of the unrounded inputs: every operand rounded to e4m3 on the way (a
    # few percent of every term: up to 0.25 of a row's rms on the CPU, the reference for
    # the kernels). A bound twice that, element by element, beside the norm.
    for name, got, want in (("y", y, yd.detach()), ("dx", x.grad, xd.grad), ("dw", w.grad, wd.grad)):
        assert_close_elementwise(got, want, dtype="f32" if name == "dw" else "bf16", name=name,
                                 rtol=2.0**-3, atol=0.5, rel_norm_limit=0.09)
    assert (w.grad[counts.index(0)] == 0).all()
    # The WGRAD launch of the backward spec: every leaf with tokens loaded A and B by TMA.
    bexe = fn.backward_op.exe
    (x_wgrad,) = [x for x in bexe.program.launches if x.launch.problems.pads]
    run = next(reversed(bexe._plans.values()))
    table = next(p.args for p in run.launches if p.kernel.name == x_wgrad.table_kernel)[0]
    leaves = table.to_numpy((e + 1) * LEAF_INTS, "i32").reshape(e + 1, LEAF_INTS)[:e]
    both = GS_LOAD_A_TMA | GS_LOAD_B_TMA
    assert all((f & both) == both for f, c in zip(leaves[:, 4], counts) if c), leaves[:, [2, 4]]
