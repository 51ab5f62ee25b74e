"""On a Hopper GPU with torch: gemmspec.torch.quantize through the kernel of the
language's quantize pass against the same function's torch operations, bit for bit
(FP8 values and scales) on ragged shapes (0, 1, 127, 129 rows; 3-D weights whose rows
end in a short block), strided and misaligned inputs and every corner of the rule; that
the kernel ran (one launch, a plan cached per signature) and that the tensors it
refuses fall back; and the call under torch.compile, CUDA-graph capture, a side stream
and the dispatcher, each equal to the eager call."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402

RAGGED = [0, 1, 127, 129]
SOURCES = {"bf16": torch.bfloat16, "f16": torch.float16, "f32": torch.float32}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


def with_corners(value: torch.Tensor) -> torch.Tensor:
    """Random values with the rule's corners in some blocks (where the shape has room)."""
    v = value.clone()
    flat = v.view(-1, v.shape[-1])
    rows, cols = flat.shape
    big = 2.0**100 if v.dtype != torch.float16 else 1.0  # f16 tops out at 65504
    if rows > 6 and cols >= 256:
        flat[0, :128] = 0.0  # an all-zero block: scale 1
        flat[1, 5] = float("nan")  # left out of its block's amax; NaN out
        flat[2, 130] = float("inf")  # scale +inf: finite values 0, the inf NaN
        flat[3, :128] *= big
        flat[4, 128:256] *= 2.0**-30 if v.dtype != torch.float16 else 2.0**-10
        flat[5, :] = -0.0
        if v.dtype == torch.float32:
            flat[6, :128] = 0.0
            flat[6, 7] = 2.0**-149  # amax / 448 underflows to 0: scale 1
    return v


def assert_same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """FP8 bits equal except where both are NaN (a NaN's sign and payload may differ);
    scales equal bit for bit."""
    (q, s), (q2, s2) = got, want
    assert q.dtype == q2.dtype and q.shape == q2.shape and q.is_contiguous()
    assert s.dtype == s2.dtype == torch.float32 and s.shape == s2.shape and s.is_contiguous()
    nan, nan2 = torch.isnan(q.float()), torch.isnan(q2.float())
    assert torch.equal(nan, nan2), f"{int((nan != nan2).sum())} NaN positions differ"
    differ = (q.view(torch.uint8) != q2.view(torch.uint8)) & ~nan
    assert not differ.any(), f"{int(differ.sum())} of {q.numel()} values differ, first at {differ.nonzero()[0].tolist()}"
    assert torch.equal(s.view(torch.int32), s2.view(torch.int32)), "scales differ"


def entry(value: torch.Tensor, dtype: str, block: tuple[int, ...]):
    """The cached plan of a call's signature (None before any call through the op)."""
    return gt._QUANTIZER._entries.get(gt._QUANTIZER._key(value, dtype, block))


def ran_kernel(value: torch.Tensor, dtype: str, block: tuple[int, ...]) -> bool:
    e = entry(value, dtype, block)
    assert e is not None, "no plan was made"
    return e.launch is not None


@pytest.mark.parametrize("rows", RAGGED)
@pytest.mark.parametrize("cols", [128, 384])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)], ids=["1x128", "128x128"])
@pytest.mark.parametrize("source, dst", [("bf16", "e4m3"), ("f16", "e5m2"), ("f32", "e4m3"), ("bf16", "e5m2")])
def test_kernel_equals_torch_operations(rows, cols, block, source, dst):
    gen = torch.Generator(device="cpu").manual_seed(rows * 1000 + cols)
    value = with_corners((torch.randn(rows, cols, generator=gen) * 3).to(SOURCES[source])).cuda()
    got = gt.quantize(value, dst, block)
    want = gt.quantize(value, dst, block, kernel=False)
    assert_same(got, want)
    if rows:
        assert ran_kernel(value, dst, block)
    again = gt.quantize(value, dst, block)  # the direct path, on the cached plan
    assert_same(again, want)


@pytest.mark.parametrize("rows", [1, 129, 264])
@pytest.mark.parametrize("block", [(1, 128, 128), (1, 1, 128)], ids=["1x128x128", "1x1x128"])
@pytest.mark.parametrize("source", ["f32", "bf16"])
def test_expert_weights(rows, block, source):
    gen = torch.Generator(device="cpu").manual_seed(rows)
    value = with_corners((torch.randn(4, rows, 1024, generator=gen) / 16).to(SOURCES[source])).cuda()
    assert_same(gt.quantize(value, "e4m3", block), gt.quantize(value, "e4m3", block, kernel=False))
    assert ran_kernel(value, "e4m3", block)


def test_strided_and_misaligned_inputs():
    gen = torch.Generator(device="cpu").manual_seed(3)
    wide = torch.randn(131, 1024 + 8, generator=gen).to(torch.bfloat16).cuda()
    flat = torch.randn(4 * 130 * 256 + 3, generator=gen).cuda()
    views = {
        "column slice (row stride 1032)": wide[:, 256:640],
        "every other row": wide[::2, :512],
        "one element past 16-byte alignment": wide.view(-1)[1 : 1 + 127 * 256].view(127, 256),
        "batch with padding": flat.as_strided((4, 129, 256), (130 * 256, 256, 1), storage_offset=3),
    }
    for name, value in views.items():
        block = (1, 128) if value.dim() == 2 else (1, 128, 128)
        got, want = gt.quantize(value, "e4m3", block), gt.quantize(value, "e4m3", block, kernel=False)
        assert_same(got, want)
        assert ran_kernel(value, "e4m3", block), name


@pytest.mark.parametrize(
    "shape, block",
    [((130, 300), (1, 128)), ((129, 320), (128, 128)), ((64, 256), (1, 64)), ((3, 4, 256), (2, 1, 128))],
    ids=str,
)
def test_refused_tensors_fall_back(shape, block):
    value = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    got = gt.quantize(value, "e4m3", block)
    assert_same(got, gt.quantize(value, "e4m3", block, kernel=False))
    assert not ran_kernel(value, "e4m3", block)
    torch.testing.assert_close(got[1].cpu(), gt.quantize(value.cpu(), "e4m3", block)[1], rtol=0, atol=0)


def test_both_paths_follow_the_documented_rule():
    """The kernel and the torch operations on the GPU against numpy, float32 throughout:
    amax / 448 is a true division (torch's CUDA division by a number multiplies by its
    reciprocal, which differs in the last bit for some of these amax)."""
    amax = np.float32(1.0) + np.arange(1, 2049, dtype=np.float32) * np.float32(2.0**-23)
    assert ((amax / np.float32(448)) != (amax * (np.float32(1) / np.float32(448)))).any()
    value = torch.zeros(len(amax), 128, device="cuda")
    value[:, 0] = torch.from_numpy(amax).cuda()
    for kernel in (True, False):
        _, scale = gt.quantize(value, "e4m3", (1, 128), kernel=kernel)
        assert np.array_equal(scale[:, 0].cpu().numpy(), amax / np.float32(448)), kernel


def test_empty_tensors_launch_nothing():
    for shape, block, scales in (((0, 256), (1, 128), (0, 2)), ((2, 0, 128), (1, 128, 128), (2, 0, 1))):
        value = torch.empty(shape, device="cuda", dtype=torch.bfloat16)
        q, s = gt.quantize(value, "e4m3", block)
        assert q.shape == shape and tuple(s.shape) == scales and q.device.type == "cuda"
        e = entry(value, "e4m3", block)
        assert e is not None and e.empty and e.launch is None


def test_dispatcher_path_equals_direct_path(monkeypatch):
    value = torch.randn(257, 512, device="cuda", dtype=torch.bfloat16)
    direct = gt.quantize(value, "e4m3", (1, 128))
    monkeypatch.setattr(gt, "_unwatched", lambda: False)  # as under a profiler or a mode
    assert_same(gt.quantize(value, "e4m3", (1, 128)), direct)


def test_under_torch_compile():
    value = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)

    def dequantized(v):
        q, s = gt.quantize(v, "e4m3", (1, 128))
        return q.float() * s.repeat_interleave(128, dim=1)

    compiled = torch.compile(dequantized, fullgraph=True)
    torch.testing.assert_close(compiled(value), dequantized(value), rtol=0, atol=0)


def test_in_a_cuda_graph():
    value = torch.randn(129, 512, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        gt.quantize(value, "e4m3", (1, 128))  # warm-up: compiles and loads the kernel
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q, s = gt.quantize(value, "e4m3", (1, 128))
    value.copy_(torch.randn_like(value) * 5)
    graph.replay()
    torch.cuda.synchronize()
    assert_same((q, s), gt.quantize(value, "e4m3", (1, 128), kernel=False))


def test_on_a_side_stream_and_current_device_kept():
    before = torch.cuda.current_device()
    value = torch.randn(1000, 1024, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = gt.quantize(value, "e4m3", (128, 128))
    torch.cuda.current_stream().wait_stream(side)
    assert_same(got, gt.quantize(value, "e4m3", (128, 128), kernel=False))
    assert torch.cuda.current_device() == before


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_on_the_second_gpu():
    torch.cuda.set_device(0)
    value = torch.randn(129, 256, device="cuda:1", dtype=torch.bfloat16)
    got = gt.quantize(value, "e4m3", (1, 128))
    assert got[0].device == value.device and torch.cuda.current_device() == 0
    assert_same(got, gt.quantize(value, "e4m3", (1, 128), kernel=False))


def test_plan_cache_stays_bounded(monkeypatch):
    monkeypatch.setattr(gt, "QUANTIZE_PLANS", 3)
    for rows in range(1, 7):
        value = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16)
        assert_same(gt.quantize(value, "e4m3", (1, 128)), gt.quantize(value, "e4m3", (1, 128), kernel=False))
        assert len(gt._QUANTIZER._entries) <= 3
