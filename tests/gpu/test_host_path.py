"""On a Hopper GPU: the default call path. Bad offsets are found by the device (the
launches then compute nothing and `check=True` raises), a call of the same shapes
reuses its plan, a call runs on torch's current stream (a side stream included,
ordered with the work around it), on any GPU of the machine, and is capturable in a
CUDA graph after one warm-up call. Skipped elsewhere."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.bench import moe_spec
from gemmspec.errors import ArgumentError
from gemmspec.runtime.arrays import DeviceBuffer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402

pytestmark = pytest.mark.gpu

BF16_MOE = moe_spec(n=256, k=256, e=4, out="f32")


def _bf16(values: np.ndarray) -> np.ndarray:
    import ml_dtypes

    return values.astype(ml_dtypes.bfloat16)


def _buffers(t=200, offsets=(0, 50, 50, 129, 200)):
    rng = np.random.default_rng(0)
    x = DeviceBuffer.from_numpy(_bf16(rng.standard_normal((t, 256))))
    w = DeviceBuffer.from_numpy(_bf16(rng.standard_normal((4, 256, 256))))
    y = DeviceBuffer.from_numpy(np.full((t, 256), 7.0, np.float32))
    offs = DeviceBuffer.from_numpy(np.array(offsets, np.int32))
    return {
        "x": x.view((t, 256), "bf16"),
        "w": w.view((4, 256, 256), "bf16"),
        "y": y.view((t, 256), "f32"),
        "offs": offs.view((5,), "i32"),
    }, y


def test_bad_offsets_compute_nothing_and_check_raises():
    exe = gemmspec.build(BF16_MOE)
    args, y = _buffers(offsets=(0, 80, 40, 129, 200))  # not non-decreasing
    exe(**args)  # no wait, no error: the device saw it
    assert (y.to_numpy((200, 256), np.float32) == 7.0).all()  # nothing written
    with pytest.raises(ArgumentError, match="non-decreasing"):
        exe(check=True, **args)


def test_same_shapes_reuse_the_plan_and_match():
    exe = gemmspec.build(BF16_MOE)
    args, y = _buffers()
    exe(check=True, **args)
    first = y.to_numpy((200, 256), np.float32).copy()
    args2, y2 = _buffers()
    exe(check=True, **args2)
    assert len(exe._plans) == 1
    assert np.array_equal(first, y2.to_numpy((200, 256), np.float32))
    assert not (first == 7.0).all()


def reference(x, w, ends: list[int]):
    """y in float64 (a torch tensor beside x): each expert's rows of x times its weights."""
    import torch

    return torch.cat([x[a:b].double() @ w[e].double().T for e, (a, b) in enumerate(zip(ends[:-1], ends[1:]))])


def test_torch_side_stream_is_used_and_ordered():
    torch = pytest.importorskip("torch")
    exe = gemmspec.build(BF16_MOE)
    dev = torch.device("cuda:0")
    t = 4096
    x = torch.randn(t, 256, device=dev).to(torch.bfloat16)
    w = torch.randn(4, 256, 256, device=dev).to(torch.bfloat16)
    offs = torch.tensor([0, 1000, 1000, 3000, t], dtype=torch.int32, device=dev)
    guarded = GuardedTensor((t, 256), torch.float32)
    y = guarded.tensor
    side = torch.cuda.Stream(dev)
    exe(x=x, w=w, y=y, offs=offs)  # warm-up: compile and plan on the default stream
    torch.cuda.synchronize()
    expected = reference(x, w, offs.tolist())
    with torch.cuda.stream(side):
        # Work queued before the call on the same stream must finish first: a long
        # matmul writes x, then the call reads it, then a copy reads y. If the call
        # ran on another stream it would read the old x or be read too early.
        y.zero_()
        big = torch.randn(8192, 8192, device=dev)
        for _ in range(4):
            big = big @ big / 8192
        x2 = (x.float() * 2).to(torch.bfloat16)
        exe(x=x2, w=w, y=y, offs=offs)
        out = y.clone()
    side.synchronize()
    assert_close_elementwise(out, 2 * expected, dtype="f32", name="y on the side stream", guards=guarded)
    # The plan for the side stream is its own.
    assert len(exe._plans) == 2


def test_captured_in_a_cuda_graph_after_a_warm_up():
    torch = pytest.importorskip("torch")
    exe = gemmspec.build(BF16_MOE)
    dev = torch.device("cuda:0")
    t = 512
    x = torch.randn(t, 256, device=dev).to(torch.bfloat16)
    w = torch.randn(4, 256, 256, device=dev).to(torch.bfloat16)
    offs = torch.tensor([0, 100, 100, 300, t], dtype=torch.int32, device=dev)
    guarded = GuardedTensor((t, 256), torch.float32, fill=0.0)
    y = guarded.tensor
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        exe(x=x, w=w, y=y, offs=offs)  # warm-up
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exe(x=x, w=w, y=y, offs=offs)
    # New offsets in place: the replay reads them on the device.
    offs.copy_(torch.tensor([0, 0, 256, 256, t], dtype=torch.int32))
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close_elementwise(y, reference(x, w, [0, 0, 256, 256, t]), dtype="f32", name="y replayed", guards=guarded)


def test_capture_survives_a_collection_of_dropped_executables():
    # A dropped executable's plans and workspaces go by reference counting; left to the
    # cyclic collector they could be freed inside a capture, which invalidates it.
    import gc

    torch = pytest.importorskip("torch")
    t = 300
    x = torch.randn(t, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(4, 256, 256, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 7, 150, 150, t], dtype=torch.int32, device="cuda")
    guarded = GuardedTensor((t, 256), torch.float32, fill=0.0)
    y = guarded.tensor
    for _ in range(3):
        gemmspec.build(BF16_MOE)(x=x, w=w, y=y, offs=offs)
    exe = gemmspec.build(BF16_MOE)
    exe(x=x, w=w, y=y, offs=offs)  # warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    # capture_begin itself collects nothing (torch.cuda.graph may, by version): the
    # collection here is the only one, and it runs inside the (global-mode) capture.
    gc.disable()
    try:
        with torch.cuda.stream(side):
            graph.capture_begin()
            gc.collect()
            exe(x=x, w=w, y=y, offs=offs)
            graph.capture_end()
    finally:
        gc.enable()
    y.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert_close_elementwise(y, reference(x, w, [0, 7, 150, 150, t]), dtype="f32", name="y replayed", guards=guarded)


def test_runs_on_the_device_of_its_arrays():
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    exe = gemmspec.build(BF16_MOE)
    results = []
    for index in (1, 0):
        dev = torch.device(f"cuda:{index}")
        gen = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(300, 256, generator=gen).to(dev, torch.bfloat16)
        w = torch.randn(4, 256, 256, generator=gen).to(dev, torch.bfloat16)
        offs = torch.tensor([0, 7, 150, 150, 300], dtype=torch.int32, device=dev)
        y = torch.zeros(300, 256, device=dev)
        before = torch.cuda.current_device()
        exe(x=x, w=w, y=y, offs=offs, check=True)
        assert torch.cuda.current_device() == before  # the caller's device is left alone
        results.append(y.cpu())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=0)
    x1 = torch.zeros(300, 256, device="cuda:1", dtype=torch.bfloat16)  # the rest on device 0
    with pytest.raises(ArgumentError, match="different devices"):
        exe(x=x1, w=w, y=y, offs=offs)


def test_captured_in_a_graph_on_another_device():
    # Torch's current device is 1 for the whole capture; the caller's device 0 before and
    # after stays current.
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    exe = gemmspec.build(BF16_MOE)
    before = torch.cuda.current_device()
    with torch.cuda.device(1):
        x = torch.randn(300, 256, device="cuda").to(torch.bfloat16)
        w = torch.randn(4, 256, 256, device="cuda").to(torch.bfloat16)
        offs = torch.tensor([0, 7, 150, 150, 300], dtype=torch.int32, device="cuda")
        guarded = GuardedTensor((300, 256), torch.float32, fill=0.0)
        y = guarded.tensor
        assert x.device.index == 1
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            exe(x=x, w=w, y=y, offs=offs)  # warm-up: the plan for this stream
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # A capture stream of this device's own: torch's default capture stream is made
        # once per process, on the device current then, and would carry later captures
        # on device 0 over to device 1.
        with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
            exe(x=x, w=w, y=y, offs=offs)
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert_close_elementwise(y, reference(x, w, [0, 7, 150, 150, 300]), dtype="f32", name="y replayed on device 1",
                                 guards=guarded)
    assert torch.cuda.current_device() == before


CAPACITY_MOE = moe_spec("moe_capacity", n=256, k=256, e=4, out="f32", capacity=True)


def test_capacity_buffer_one_graph_for_every_batch():
    torch = pytest.importorskip("torch")
    exe = gemmspec.build(CAPACITY_MOE)
    cap = 600
    x = torch.randn(cap, 256, device="cuda").to(torch.bfloat16)
    w = torch.randn(4, 256, 256, device="cuda").to(torch.bfloat16)
    offs = torch.tensor([0, 0, 1, 128, 257], dtype=torch.int32, device="cuda")
    guarded = GuardedTensor((cap, 256), torch.float32)
    y = guarded.tensor
    exe(x=x, w=w, y=y, offs=offs, check=True)  # warm-up, rows past 257 untouched
    assert torch.isnan(y[257:]).all() and not torch.isnan(y[:257]).any()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exe(x=x, w=w, y=y, offs=offs)
    for ends in ([0, 129, 129, 300, 430], [0, 0, 0, 0, 0], [0, 1, 2, 3, cap]):
        offs.copy_(torch.tensor(ends, dtype=torch.int32))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        used = ends[-1]
        assert torch.isnan(y[used:]).all()
        # The rows past the offsets' end are the reference's NaN: left as they were.
        ref = torch.full((cap, 256), float("nan"), dtype=torch.float64, device="cuda")
        ref[:used] = reference(x, w, ends)
        assert_close_elementwise(y, ref, dtype="f32", name=f"y for offsets {ends}", guards=guarded)
    offs.copy_(torch.tensor([0, 1, 2, 3, cap + 1], dtype=torch.int32))
    with pytest.raises(ArgumentError, match="end at or below T"):
        exe(x=x, w=w, y=y, offs=offs, check=True)
