"""On a Hopper GPU with torch: the custom op under torch.compile(fullgraph=True), in a
captured CUDA graph (functional and in-place forms) and with outputs returned."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402
from gemmspec.bench import moe_spec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402

MOE = moe_spec("moe_torch_op", n=384, k=512, e=4)
COUNTS = [0, 1, 127, 129]


def inputs(t_counts=COUNTS, seed=0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    t = sum(t_counts)
    x = torch.randn(t, 512, generator=gen).cuda().to(torch.bfloat16)
    w = (torch.randn(4, 384, 512, generator=gen) / 16).cuda().to(torch.bfloat16)
    offs = torch.tensor([0, *torch.tensor(t_counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    return x, w, offs


def reference(x, w, offs):
    o = offs.tolist()
    return torch.cat([x[a:b].double() @ w[e].double().T for e, (a, b) in enumerate(zip(o[:-1], o[1:]))])


def test_returns_its_output():
    op = gt.op(MOE)
    x, w, offs = inputs()
    y = op(x=x, w=w, offs=offs)
    assert y.shape == (257, 384) and y.dtype == torch.bfloat16
    assert_close_elementwise(y, reference(x, w, offs), dtype="bf16", name="y")


def test_under_torch_compile_fullgraph():
    op = gt.op(MOE)
    x, w, offs = inputs()

    @torch.compile(fullgraph=True)
    def layer(x, w, offs):
        return torch.relu(op(x=x, w=w, offs=offs).float()) * 2

    out = layer(x, w, offs)
    # Float32 of bf16 values: bf16's rule.
    assert_close_elementwise(out, torch.relu(reference(x, w, offs)) * 2, dtype="bf16", name="relu(y) * 2")
    # Another token count: a dynamic T recompiles at most once and stays right.
    x2, w2, offs2 = inputs([5, 300, 0, 64], seed=1)
    assert_close_elementwise(layer(x2, w, offs2), torch.relu(reference(x2, w, offs2)) * 2, dtype="bf16",
                             name="relu(y) * 2, another T")


def test_under_torch_compile_reduce_overhead():
    op = gt.op(MOE)
    x, w, offs = inputs()

    @torch.compile(fullgraph=True, mode="reduce-overhead")
    def layer(x, w, offs):
        return op(x=x, w=w, offs=offs).float().sum(dim=1)

    for _ in range(3):  # warm-up, capture, replay
        out = layer(x, w, offs)
    # Each row sum carries 384 bf16 roundings (about 0.05 in all, the sums' rms about 28):
    # 2e-2 of the rms stays under the absolute 1.0 this was held to.
    assert_close_elementwise(out, reference(x, w, offs).sum(dim=1), dtype="f32", name="row sums of y",
                             rtol=2.0**-7, atol=2e-2)


@pytest.mark.parametrize("in_place", [False, True], ids=["returned", "in_place"])
def test_in_a_captured_cuda_graph(in_place):
    op = gt.op(MOE)
    x, w, offs = inputs()
    guarded = GuardedTensor((257, 384), torch.bfloat16, fill=0.0)
    y = guarded.tensor

    def step():
        if in_place:
            op(x=x, w=w, offs=offs, y=y)
            return y
        return op(x=x, w=w, offs=offs)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    x.copy_(torch.randn_like(x, dtype=torch.float32).to(torch.bfloat16))  # new values, same memory
    graph.replay()
    torch.cuda.synchronize()
    assert_close_elementwise(out, reference(x, w, offs), dtype="bf16", name="y replayed", guards=guarded)


@pytest.mark.parametrize(("layout", "strides"), [("major(T)", lambda t: (1, t)), ("row_major pad 320", lambda t: (320, 1))])
@pytest.mark.parametrize("tokens", [0, 1, 130])
def test_a_fresh_output_takes_its_declared_layout(layout, strides, tokens):
    # The op allocates a fresh output as its layout declares, eagerly and under
    # torch.compile; the executable's stride check accepts its own allocation.
    op = gt.op(f"""
gemm fresh_layout_gpu {{
  dim T
  dim N = 256, K = 128
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : f32 [T, N] layout {layout}
  y[t, n] = sum[k] x[t, k] * w[n, k]
}}""")
    gen = torch.Generator(device="cpu").manual_seed(tokens)
    x = torch.randn(tokens, 128, generator=gen).cuda().to(torch.bfloat16)
    w = (torch.randn(256, 128, generator=gen) / 16).cuda().to(torch.bfloat16)
    want = x.double() @ w.double().T
    y = op(x=x, w=w)
    assert y.shape == (tokens, 256) and (tokens <= 1 or y.stride() == strides(tokens))
    assert_close_elementwise(y, want, dtype="f32", operand_dtype="bf16", name=f"y {layout}")
    compiled = torch.compile(lambda x, w: op(x=x, w=w) * 1.0, fullgraph=True)
    assert_close_elementwise(compiled(x, w), want, dtype="f32", operand_dtype="bf16", name=f"y {layout}, compiled")
