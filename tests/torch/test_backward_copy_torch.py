"""The autograd wrapper's plumbing for a forward copy, on the CPU (the reference standing
in for the kernels): a forward call keeps the copy `h_t` the derived WGRAD reads (not
`h`), the backward op takes it as the forward wrote it (padded segments, spare scale
rows), and its gradients match float64 and the requantize(h) backward, on expert counts
0, 1, 127 and 129. tests/gpu/test_backward_copy_gpu.py runs the same on the kernels."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gemmspec  # noqa: E402
import gemmspec.torch as gt  # noqa: E402
from gemmspec.backward import derive_backward  # noqa: E402

COUNTS = [0, 1, 127, 129]

# The expert FFN of examples/moe_ffn_fp8_train.gspec, small, with a plain down-projection
# (whose backward derives) reading h; the up-projection writes h and its copy h_t.
FFN = """
gemm ffn_copy_{tag} {{
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
}}
"""


def ops(device: str):
    """(forward op, backward op reading h_t, its feed, backward op requantizing h)."""
    exe = gemmspec.build(FFN.format(tag=device))
    bw = derive_backward(exe.spec)
    old = derive_backward(exe.spec, copies=False)
    fop, bop, oop = gt.op(exe), gt.op(bw.source), gt.op(old.source)
    return fop, bop, gt.BackwardFeed(fop, bop, bw), oop


def problem(device: str, counts=COUNTS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = torch.randn(t, 256, generator=gen)
    w_up = torch.randn(4, 512, 256, generator=gen) / 16
    w_down = torch.randn(4, 256, 256, generator=gen) / 16
    dy = torch.randn(t, 256, generator=gen)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)
    inputs = {"offs": offs}
    for name, v, block in (("x", x, (1, 128)), ("w_up", w_up, (1, 128, 128)), ("w_down", w_down, (1, 128, 128))):
        q, s = gt.quantize(v.to(device), "e4m3", block)
        inputs[name], inputs[f"{name}_scale"] = q, s
    inputs["offs"] = offs.to(device)
    return inputs, dy.to(device)


def run_both(fop, bop, feed, oop, inputs, dy):
    """The backward over the copy and over requantize(h), from one forward call."""
    outs = fop(**inputs)
    by_name = dict(zip(fop.outputs, outs))
    kept = feed.kept(inputs, outs)
    dq, ds = gt.quantize(dy, "e4m3", (1, 128))
    new_in = {n: v for n, v in kept.items() if n in bop.inputs} | feed.copies(kept) | {"dy": dq, "dy_scale": ds}
    old_in = {n: v for n, v in (inputs | by_name).items() if n in oop.inputs} | {"dy": dq, "dy_scale": ds}
    new = dict(zip(bop.outputs, bop(**new_in)))
    old = dict(zip(oop.outputs, oop(**old_in)))
    return by_name, kept, new, old


def float64_wgrad(h, h_scale, dy_q, dy_scale, offs):
    """dW_down[e] = dY[e]^T . h[e] in float64 from the FP8 values the forward used."""
    hr = h.double() * h_scale.double().repeat_interleave(128, dim=1)
    dr = dy_q.double() * dy_scale.double().repeat_interleave(128, dim=1)
    o = offs.tolist()
    return torch.stack([dr[a:b].T @ hr[a:b] for a, b in zip(o[:-1], o[1:])])


def check(by_name, kept, new, old, inputs, dy, counts):
    # A forward call keeps the copy as it wrote it, and not h (the backward reads no h).
    assert kept["h_t"] is by_name["h_t"] and kept["h_t_scale"] is by_name["h_t_scale"]
    assert "h" not in kept and "h_scale" not in kept
    assert by_name["h_t"].shape == (sum(counts) + 4 * 15, 256)  # padded segments
    # DGRAD reads neither: the same bits both ways.
    assert torch.equal(new["dh"], old["dh"])
    dq, ds = gt.quantize(dy, "e4m3", (1, 128))
    want = float64_wgrad(by_name["h"], by_name["h_scale"], dq, ds, inputs["offs"])
    for name, got in (("copy", new["dw_down"]), ("requantize", old["dw_down"])):
        err = ((got.double() - want).norm() / want.norm()).item()
        assert err < 0.09, (name, err)  # e4m3 quantization of both factors bounds it
    agree = ((new["dw_down"].double() - old["dw_down"].double()).norm() / want.norm()).item()
    assert agree < 0.09, agree
    assert (new["dw_down"][counts.index(0)] == 0).all()  # an expert with no tokens


@pytest.fixture(scope="module")
def cpu_ops():
    from reference_ops import reference_kernel

    lib = torch.library.Library("gemmspec", "IMPL")
    fop, bop, feed, oop = ops("cpu")
    for o in (fop, bop, oop):
        lib.impl(o.name, reference_kernel(o), "CPU")
    yield fop, bop, feed, oop
    del lib


def test_the_feed_keeps_the_copy_and_the_backward_reads_it(cpu_ops):
    fop, bop, feed, oop = cpu_ops
    assert feed.copy_inputs == {"h_t": "h_t", "h_t_scale": "h_t_scale"}
    assert feed.kept_outputs == ("h_t", "h_t_scale")
    assert "h" not in bop.inputs and {"h_t", "h_t_scale"} <= set(bop.inputs)
    inputs, dy = problem("cpu")
    check(*run_both(fop, bop, feed, oop, inputs, dy), inputs, dy, COUNTS)


def test_fake_backward_outputs_with_a_padded_copy_input(cpu_ops):
    _, bop, _, _ = cpu_ops
    t = sum(COUNTS)
    meta = {n: torch.empty(0, device="meta") for n in bop.inputs}
    meta |= {
        "dy": torch.empty(t, 256, dtype=torch.float8_e4m3fn, device="meta"),
        "dy_scale": torch.empty(t, 2, device="meta"),
        "h_t": torch.empty(t + 60, 256, dtype=torch.float8_e4m3fn, device="meta"),  # padding rows
        "h_t_scale": torch.empty((t + 4 * 127) // 128, 256, device="meta"),
        "w_down": torch.empty(4, 256, 256, dtype=torch.float8_e4m3fn, device="meta"),
        "w_down_scale": torch.empty(4, 2, 2, device="meta"),
        "offs": torch.empty(5, dtype=torch.int32, device="meta"),
    }
    meta |= {
        "x": torch.empty(t, 256, dtype=torch.float8_e4m3fn, device="meta"),
        "x_scale": torch.empty(t, 2, device="meta"),
        "w_up": torch.empty(4, 512, 256, dtype=torch.float8_e4m3fn, device="meta"),
        "w_up_scale": torch.empty(4, 4, 2, device="meta"),
    }
    outs = dict(zip(bop.outputs, bop._fake(*(meta[n] for n in bop.inputs))))
    dh, dw = outs["dh"], outs["dw_down"]
    assert dh.shape == (t, 256) and dh.dtype == torch.bfloat16  # T from dy, not the padded h_t
    assert dw.shape == (4, 256, 256) and dw.dtype == torch.float32
    assert outs["dx"].shape == (t, 256) and outs["dw_up"].shape == (4, 512, 256)


def test_the_function_derives_the_whole_ffn():
    # The up-projection's SwiGLU backward reads the down-projection's DGRAD (dh); the
    # copy's anchored scales are an output's, written by the forward, not quantized.
    fn = gt.function(FFN.format(tag="whole"))
    assert [(d.kind, d.wrt) for d in fn.backward.statements] == [
        ("dgrad", "h"), ("wgrad", "w_down"), ("dgrad", "x"), ("wgrad", "w_up"),
    ]
    assert fn.backward.skipped == () and fn.args == ("x", "w_up", "w_down", "offs")


def test_the_feed_keeps_a_forward_output_the_row_weights_gradient_reads():
    """With the example's route_w on the down-projection, the backward's rowdot reads h as
    the forward wrote it: the feed keeps h and its scales beside the copy, and only the
    copy's outputs are the non-differentiable FP8 forms of another output."""
    text = FFN.format(tag="weighted").replace(
        "  tensor y      : bf16 [T, H]", "  tensor route_w : f32 [T]\n  tensor y      : bf16 [T, H]"
    ).replace("y[t, n] = sum[f]", "y[t, n] = route_w[t] * sum[f]")
    exe = gemmspec.build(text)
    bw = derive_backward(exe.spec)
    assert [(d.kind, d.wrt) for d in bw.statements] == [
        ("dgrad", "h"), ("wgrad", "w_down"), ("rowdot", "route_w"), ("dgrad", "x"), ("wgrad", "w_up"),
    ]
    fop, bop = gt.op(exe), gt.op(bw.source)
    feed = gt.BackwardFeed(fop, bop, bw)
    assert feed.kept_outputs == ("h_t", "h_t_scale", "h", "h_scale")
    assert feed.copy_outputs == frozenset({"h_t", "h_t_scale"})
    assert "route_w" in feed.kept_inputs and {"h", "h_scale", "h_t", "h_t_scale"} <= set(bop.inputs)
