"""On a Hopper GPU with torch: the gradient of the expert FFN's router weight.

1. The row passes on their own (a bf16 GEMM G, then rowdot(G, h) with h FP8 in 1x128
   blocks and rowscale(G, weight = rw)), on 0, 1, 127 and 129 rows, outputs poisoned with
   NaN: G, d rw and dh against float64, and a second call bit for bit the first (the
   row sums are deterministic).
2. One autograd step through gemmspec.torch.function of examples/moe_ffn_fp8_train.gspec's
   down-projection (`y[dst[t], n] = route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]`,
   the example's sizes) on expert counts 0, 1, 127 and 129: y, dh, dw_down and
   d route_w against float64 autograd of the same formula.

The example's own derived backward (its DGRAD before route_w, WGRAD, row passes) runs in
tests/gpu/test_scatter_backward_gpu.py. The GPU tests are skipped elsewhere, with a
reason; the same bookkeeping runs on the CPU in tests/torch/test_ffn_backward_gpu_cases.py,
and one test here (not marked gpu) checks what the GPU tests build, so that selecting
`-m "not gpu"` still runs something in this file."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gemmspec  # noqa: E402
import gemmspec.torch as gt  # noqa: E402
from gemmspec.backward import derive_backward  # noqa: E402

DEVICE = "cuda"
COUNTS = [0, 1, 127, 129]

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402
from row_pass_spec import ROW_PASS_SPEC  # noqa: E402

ROWS = ROW_PASS_SPEC

DOWN = """
gemm ffn_down {
  dim T
  dim H = 7168, F = 2048
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor dst     : i32 [T]
  tensor route_w : f32 [T]
  tensor h       : e4m3 [T, F] scale f32 [1, 128]
  tensor w_down  : e4m3 [E, H, F] scale f32 [1, 128, 128]
  tensor y       : bf16 [T, H]
  y[dst[t], n] = route_w[t] * sum[f] h[t, f] * w_down[expert(t), n, f]
}
"""


def run_op(o, inputs: dict) -> dict[str, GuardedTensor]:
    """One call of op `o` into fresh outputs poisoned with NaN, each between guard bytes."""
    outs = {
        s.name: GuardedTensor(size, gt.torch_dtype(s.dtype), device=DEVICE)
        for s, size in zip(o.shapes, o.output_sizes(inputs))
    }
    o(**inputs, **{n: g.tensor for n, g in outs.items()})
    return outs


# Against float64 from the unquantized inputs, the kernels' FP8 operands (1x128 and
# 128x128 blocks, the backward's own requantizations, FP8 intermediates) are part of the
# difference: a few percent of every term, whose largest among millions of elements
# reaches a good part of the row's rms (on the CPU, with the reference for the kernels,
# at smaller dims: up to 0.16 of it, and 0.6 of an expert's weight gradient, whose terms
# are products of two quantized values; slowly more at larger dims). Bounds about twice
# that, beside each output's norm.
FP8_VS_UNQUANTIZED = {"rtol": 2.0**-3, "atol": 0.4}
WGRAD_FP8_VS_UNQUANTIZED = {"rtol": 2.0**-3, "atol": 1.5}


def per_expert(x):
    """A weight gradient [E, ...] as one row per expert: its error comes from the
    quantization of the expert's tokens, at the scale of the whole matrix (the row of an
    expert of one token is one gradient element times x, and that element can be near
    zero by cancellation, far below its quantization error)."""
    return x.reshape(x.shape[0], -1)


def test_the_specs_build_with_the_row_passes_and_derive_the_weight_gradient():
    rows = gemmspec.build(ROWS)
    assert [(p.kind, p.target) for p in rows.schedule.postpasses] == [("rowdot", "drw"), ("rowscale", "dh")]
    bw = derive_backward(gemmspec.build(DOWN).spec)
    assert [(d.kind, d.wrt, d.grad) for d in bw.statements] == [
        ("dgrad", "h", "dh"), ("wgrad", "w_down", "dw_down"), ("rowdot", "route_w", "droute_w"),
    ]
    assert bw.not_derived == () and bw.skipped == ()


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 1, 127, 129])
def test_the_row_passes_match_float64_and_repeat_bit_for_bit(rows):
    o = gt.op(ROWS)
    gen = torch.Generator().manual_seed(rows)
    h, hs = gt.quantize(torch.randn(rows, 384, generator=gen).to(DEVICE), "e4m3", (1, 128))
    inputs = {
        "dy": torch.randn(rows, 256, generator=gen).to(torch.bfloat16).to(DEVICE),
        "w": (torch.randn(384, 256, generator=gen) / 16).to(torch.bfloat16).to(DEVICE),
        "h": h, "h_scale": hs,
        "rw": (torch.rand(rows, generator=gen) + 0.5).to(DEVICE),
    }
    guarded, again = run_op(o, inputs), run_op(o, inputs)
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    first = {n: x.tensor for n, x in guarded.items()}
    assert first["drw"].shape == (rows,) and first["dh"].shape == (rows, 384)
    for name in ("g", "drw", "dh"):
        assert not first[name].isnan().any(), name
        assert torch.equal(first[name], again[name].tensor), name  # deterministic
        assert guarded[name].changed_outside().size == 0, name
    if rows == 0:
        return
    g = first["g"].double()  # the bf16 G the row passes read
    hr = h.double() * hs.double().repeat_interleave(128, dim=1)
    assert_close_elementwise(first["g"], inputs["dy"].double() @ inputs["w"].double().T, dtype="bf16", name="g",
                             guards=guarded["g"], rel_norm_limit=1e-2)
    # float32 sums of exact products: far tighter than an f32 GEMM's rule.
    assert_close_elementwise(first["drw"], (g * hr).sum(dim=1), dtype="f32", name="drw", rtol=1e-5, atol=1e-5,
                             guards=guarded["drw"], rel_norm_limit=1e-5)
    # Rounded once to bf16.
    assert_close_elementwise(first["dh"], inputs["rw"].double()[:, None] * g, dtype="bf16", name="dh",
                             guards=guarded["dh"], rel_norm_limit=4e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [COUNTS * 2, [129, 127, 1, 0, 0, 1, 127, 129]], ids=["up", "down"])
def test_an_autograd_step_of_the_down_projection_matches_float64(counts):
    fn = gt.function(DOWN)
    assert fn.backward.not_derived == () and not fn.backward.skipped
    gen = torch.Generator().manual_seed(sum(counts[:2]))
    t = sum(counts)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE)
    dst = torch.randperm(t, generator=gen).to(torch.int32).to(DEVICE)
    h = torch.randn(t, 2048, generator=gen).to(torch.bfloat16).to(DEVICE).requires_grad_(True)
    w = (torch.randn(8, 7168, 2048, generator=gen) / 16).to(DEVICE).requires_grad_(True)
    rw = (torch.rand(t, generator=gen) + 0.5).to(DEVICE).requires_grad_(True)
    y = fn(h=h, w_down=w, route_w=rw, dst=dst, expert_offsets=offs)
    dy = torch.randn(y.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    y.backward(dy)
    # float64 autograd of the forward formula, from the same high-precision inputs.
    hd, wd, rwd = (x.detach().double().requires_grad_(True) for x in (h, w, rw))
    o = offs.tolist()
    rows = torch.cat([hd[a:b] @ wd[e].T for e, (a, b) in enumerate(zip(o[:-1], o[1:]))]) * rwd[:, None]
    yd = torch.zeros_like(rows).index_copy(0, dst.long(), rows)
    yd.backward(dy.double())
    for name, got, want in (("y", y, yd.detach()), ("dh", h.grad, hd.grad), ("dw_down", w.grad, wd.grad), ("droute_w", rw.grad, rwd.grad)):
        assert got is not None and not got.isnan().any(), name
        dtype = {torch.bfloat16: "bf16", torch.float32: "f32"}[got.dtype]
        tolerances = FP8_VS_UNQUANTIZED
        if name == "dw_down":
            got, want, tolerances = per_expert(got), per_expert(want), WGRAD_FP8_VS_UNQUANTIZED
        assert_close_elementwise(got, want, dtype=dtype, name=f"{counts} {name}", **tolerances,
                                 rel_norm_limit=0.09)
    assert rw.grad.dtype == torch.float32
    for e, c in enumerate(counts):
        if c == 0:
            assert (w.grad[e] == 0).all()


FFN = (Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_train.gspec").read_text()


def _deq(q, s, block) -> torch.Tensor:
    """FP8 values times their scales, the scale grid expanded by `block` per dim."""
    for axis, b in enumerate(block):
        if b > 1:
            s = s.repeat_interleave(b, dim=axis)
    return q.double() * s.double()[tuple(slice(0, n) for n in q.shape)]


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [COUNTS * 2, [129, 127, 1, 0, 0, 1, 127, 129]], ids=["up", "down"])
def test_an_autograd_step_of_the_whole_ffn_matches_float64(counts):
    """The example as written: x's rows gathered through src (tokens repeated), the SwiGLU
    up-projection, the weighted down-projection scattered through dst. Every gradient
    (x through scatter_add, w_up, w_down, route_w) against float64 autograd of the same
    formula from the FP8 values the kernels read."""
    fn = gt.function(FFN)
    assert fn.backward.skipped == () and fn.backward.not_derived == ()
    dims = {d.name: d.size for d in fn.spec.dims}
    h_dim, n_dim, f_dim = dims["H"], dims["N"], dims["F"]
    e, t = len(counts), sum(counts)
    assert e == dims["E"]
    s_rows = max(t // 2, 1)  # fewer tokens than routed rows: src repeats them
    gen = torch.Generator().manual_seed(sum(counts[:2]) + 7)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE)
    src = torch.randint(0, s_rows, (t,), generator=gen).to(torch.int32).to(DEVICE)
    dst = torch.randperm(t, generator=gen).to(torch.int32).to(DEVICE)
    x = torch.randn(s_rows, h_dim, generator=gen).to(DEVICE).requires_grad_(True)
    w_up = (torch.randn(e, n_dim, h_dim, generator=gen) / 16).to(DEVICE).requires_grad_(True)
    w_down = (torch.randn(e, h_dim, f_dim, generator=gen) / 16).to(DEVICE).requires_grad_(True)
    rw = (torch.rand(t, generator=gen) + 0.5).to(DEVICE).requires_grad_(True)
    outs = fn(x=x, w_up=w_up, w_down=w_down, route_w=rw, src=src, dst=dst, expert_offsets=offs)
    y = dict(zip(fn.forward_op.outputs, outs))["y"]
    dy = torch.randn(y.shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    y.backward(dy)

    # float64 autograd from the FP8 values the kernels read (the gradients pass the
    # quantization straight through).
    leaves = {}
    for name, v, block in (("x", x, (1, 128)), ("w_up", w_up, (1, 128, 128)), ("w_down", w_down, (1, 128, 128))):
        q, s = gt.quantize(v.detach(), "e4m3", block)
        leaves[name] = _deq(q, s, block).requires_grad_(True)
    rwd = rw.detach().double().requires_grad_(True)
    o = offs.tolist()
    xs = leaves["x"][src.long()]
    h = []
    for g, (a, b) in enumerate(zip(o[:-1], o[1:])):
        gu = xs[a:b] @ leaves["w_up"][g].T
        gate, up = gu[:, 0::2], gu[:, 1::2]
        h.append(gate * torch.sigmoid(gate) * up)
    h = torch.cat(h)
    rows = torch.cat([h[a:b] @ leaves["w_down"][g].T for g, (a, b) in enumerate(zip(o[:-1], o[1:]))]) * rwd[:, None]
    yd = torch.zeros_like(rows).index_copy(0, dst.long(), rows)
    yd.backward(dy.double())
    # h and the gradients are quantized inside (FP8 h, requantized operands of the
    # backward): against float64 through the same formula, as for unquantized inputs.
    assert_close_elementwise(y, yd.detach(), dtype="bf16", name=f"{counts} y", **FP8_VS_UNQUANTIZED,
                             rel_norm_limit=0.05)
    for name, got, want in (
        ("dx", x.grad, leaves["x"].grad), ("dw_up", w_up.grad, leaves["w_up"].grad),
        ("dw_down", w_down.grad, leaves["w_down"].grad), ("droute_w", rw.grad, rwd.grad),
    ):
        assert got is not None and not got.isnan().any(), name
        dtype = {torch.bfloat16: "bf16", torch.float32: "f32"}[got.dtype]
        tolerances = FP8_VS_UNQUANTIZED
        if name.startswith("dw_"):
            got, want, tolerances = per_expert(got), per_expert(want), WGRAD_FP8_VS_UNQUANTIZED
        assert_close_elementwise(got, want, dtype=dtype, name=f"{counts} {name}", **tolerances,
                                 rel_norm_limit=0.1)
    for g, c in enumerate(counts):
        if c == 0:
            assert (w_up.grad[g] == 0).all() and (w_down.grad[g] == 0).all()
