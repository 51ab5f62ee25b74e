"""On a Hopper GPU with torch: swiglu_grad between launches. The shared spec
(tests/reference/swiglu_grad_spec.py) recomputes gate/up columns (gu, FP8 GEMM), makes
the gradient of the SwiGLU's output (dh: a bf16 GEMM, then rowscale), quantizes the
gate/up gradient with swiglu_grad, and runs the DGRAD that reads it (dx), on 0, 1, 127
and 129 rows, outputs poisoned with NaN: every output against float64 (dgu made from
the device's own gu and dh by the reference rule), and a second call bit for bit the
first. The WGRAD's form (128x1 blocks per expert segment, padded segments) feeds a
K-grouped WGRAD on expert counts 0, 1, 127 and 129, checked the same way."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402
from gemmspec.pipeline import lower_file  # noqa: E402
from gemmspec.reference.data import Runtime, expand_scales, random_runtime, swiglu_grad_values  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402
from swiglu_grad_spec import SWIGLU_GRAD_SPEC, SWIGLU_GRAD_WGRAD_SPEC  # noqa: E402

DEVICE = "cuda"


def _deq(q, s):
    return q.double() * s.double().repeat_interleave(128, dim=-1)


def test_the_spec_orders_the_pass_between_the_launches():
    (low,) = lower_file(SWIGLU_GRAD_SPEC)
    assert [k for k, _, _ in low.schedule.steps()] == ["launch", "launch", "postpass", "prepass", "launch"]


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [0, 1, 127, 129])
def test_swiglu_grad_between_launches_matches_float64_and_repeats(rows):
    o = gt.op(SWIGLU_GRAD_SPEC)
    gen = torch.Generator().manual_seed(rows + 3)
    x, xs = gt.quantize(torch.randn(rows, 256, generator=gen).to(DEVICE), "e4m3", (1, 128))
    w, ws = gt.quantize((torch.randn(512, 256, generator=gen) / 8).to(DEVICE), "e4m3", (128, 128))
    wt, wts = gt.quantize((torch.randn(256, 512, generator=gen) / 8).to(DEVICE), "e4m3", (128, 128))
    inputs = {
        "x": x, "x_scale": xs, "w": w, "w_scale": ws, "w_t": wt, "w_t_scale": wts,
        "dy": torch.randn(rows, 256, generator=gen).to(torch.bfloat16).to(DEVICE),
        "wd": (torch.randn(256, 256, generator=gen) / 16).to(torch.bfloat16).to(DEVICE),
        "rw": (torch.rand(rows, generator=gen) + 0.5).to(DEVICE),
    }

    def call():
        """Fresh outputs poisoned with NaN, each between guard bytes."""
        outs = {
            s.name: GuardedTensor(size, gt.torch_dtype(s.dtype), device=DEVICE)
            for s, size in zip(o.shapes, o.output_sizes(inputs))
        }
        o(**inputs, **{n: g.tensor for n, g in outs.items()})
        return outs

    guarded, again = call(), call()
    torch.cuda.synchronize()
    first = {n: g.tensor for n, g in guarded.items()}
    for name in ("gu", "dh_pre", "dh", "dx"):
        assert not first[name].isnan().any(), name
        assert torch.equal(first[name], again[name].tensor), name  # deterministic
        assert guarded[name].changed_outside().size == 0, name
    assert first["dx"].shape == (rows, 256)
    if rows == 0:
        return
    xr, wr, wtr = _deq(x, xs), _deq(w, ws.repeat_interleave(128, dim=0)), _deq(wt, wts.repeat_interleave(128, dim=0))
    # The FP8 values the kernels read: each output within its own rounding.
    assert_close_elementwise(first["gu"], xr @ wr.T, dtype="bf16", name="gu", rel_norm_limit=1e-2)
    g = first["dh_pre"].double()
    assert_close_elementwise(g, inputs["dy"].double() @ inputs["wd"].double().T, dtype="bf16", name="dh_pre",
                             rel_norm_limit=1e-2)
    assert_close_elementwise(first["dh"], inputs["rw"].double()[:, None] * g, dtype="bf16", name="dh",
                             rel_norm_limit=4e-3)
    # dgu by the reference rule from the device's gu and dh, then the DGRAD in float64.
    (low,) = lower_file(SWIGLU_GRAD_SPEC)
    rt = random_runtime(low.spec, np.random.default_rng(0), dims={"T": rows})
    q, grid = swiglu_grad_values(
        low.spec, rt, low.spec.tensor("dgu"),
        first["gu"].double().cpu().numpy(), "bf16", first["dh"].double().cpu().numpy(), "bf16",
    )
    dgu = torch.from_numpy(q * np.repeat(grid, 128, axis=1)).to(DEVICE)
    assert_close_elementwise(first["dx"], dgu @ wtr.T, dtype="bf16", name=f"rows {rows}: dx", rel_norm_limit=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("counts", [[0, 1, 127, 129], [129, 127, 1, 0]], ids=["up", "down"])
def test_the_wgrad_form_feeds_a_k_grouped_wgrad(counts):
    o = gt.op(SWIGLU_GRAD_WGRAD_SPEC)
    gen = torch.Generator().manual_seed(sum(counts) + 11)
    t = sum(counts)
    x, xs = gt.quantize(torch.randn(t, 256, generator=gen).to(DEVICE), "e4m3", (1, 128))
    inputs = {
        "gu": (torch.randn(t, 512, generator=gen) * 2).to(torch.bfloat16).to(DEVICE),
        "dh": torch.randn(t, 256, generator=gen).to(torch.bfloat16).to(DEVICE),
        "x": x, "x_scale": xs,
        "offs": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).to(DEVICE),
    }

    def call():
        dw = GuardedTensor((4, 512, 256), torch.float32, device=DEVICE)
        o(**inputs, dw=dw.tensor)
        return dw

    guarded, again = call(), call()
    torch.cuda.synchronize()
    first = guarded.tensor
    assert not first.isnan().any() and torch.equal(first, again.tensor)
    assert guarded.changed_outside().size == 0
    # The 128x1 gradients by the reference rule, dequantized; x as the kernel reads it
    # (its 1x128 FP8 values: the WGRAD's requantized xq is within FP8 rounding of them).
    (low,) = lower_file(SWIGLU_GRAD_WGRAD_SPEC)
    spec = low.spec
    offs = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    rt = Runtime({"T": t}, {"offs": offs})
    target = spec.tensor("dgu_t")
    q, grid = swiglu_grad_values(
        spec, rt, target, inputs["gu"].double().cpu().numpy(), "bf16", inputs["dh"].double().cpu().numpy(), "bf16",
    )
    dgu = torch.from_numpy(q * expand_scales(spec, rt, target, grid)).to(DEVICE)
    xr = _deq(x, xs)
    for e, (a, b) in enumerate(zip(offs[:-1], offs[1:])):
        if a == b:
            assert (first[e] == 0).all()
            continue
        want = dgu[a:b].T @ xr[a:b]
        # xq's 128x1 requantization of x bounds it: a few percent of each term, up to 0.12
        # of a row's rms (the spec's reference for the kernels, on the CPU); twice that.
        assert_close_elementwise(first[e], want, dtype="f32", name=f"dw[{e}]", rtol=2.0**-3, atol=0.25,
                                 rel_norm_limit=0.05)
