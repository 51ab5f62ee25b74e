"""On a Hopper GPU with torch: gemmspec.torch.function's forward and its derived
DGRAD/WGRAD kernels against float64 torch autograd, on small ragged MoE shapes with
expert counts 0, 1, 127 and 129 (not multiples of 128), in BF16 and FP8."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402
from gemmspec.bench import moe_spec  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import assert_close_elementwise  # noqa: E402

COUNTS = [0, 1, 127, 129]

# Against float64 of the unrounded inputs (w is float32), element by element: in BF16
# the kernels read w rounded to bf16 (2^-9 of every term: up to 0.008 of a row's rms on
# these shapes, on the CPU with the reference for the kernels), in FP8 every operand is
# rounded to e4m3 (a few percent of every term: up to 0.25 of a row's rms). Bounds about
# twice those, beside each output's norm. dW in BF16 reads dy and x as given: f32's rule.
AGAINST_FLOAT64 = {
    ("bf16", "y"): {"dtype": "bf16", "atol": 2e-2},
    ("bf16", "dx"): {"dtype": "bf16", "atol": 2e-2},
    ("bf16", "dw"): {"dtype": "f32"},
    **{("fp8", name): {"dtype": dtype, "rtol": 2.0**-3, "atol": 0.5}
       for name, dtype in (("y", "bf16"), ("dx", "bf16"), ("dw", "f32"))},
}


def moe(fp8: bool, n: int = 256, k: int = 384) -> str:
    kind = "fp8" if fp8 else "bf16"
    return moe_spec(f"moe_autograd_{kind}_n{n}_k{k}", n=n, k=k, e=4, fp8=fp8)


def reference(x, w, offs, dy):
    x = x.detach().double().requires_grad_(True)
    w = w.detach().double().requires_grad_(True)
    o = offs.tolist()
    y = torch.cat([x[a:b] @ w[e].T for e, (a, b) in enumerate(zip(o[:-1], o[1:]))])
    y.backward(dy.double())
    return y.detach(), x.grad, w.grad


# n264-k320: x, w and dy are not whole 128-column blocks, so gemmspec.torch.quantize
# takes its torch operations for them; n256-k384 runs its kernel for all three.
@pytest.mark.parametrize("n, k", [(256, 384), (264, 320)], ids=["n256-k384", "n264-k320"])
@pytest.mark.parametrize("counts", [COUNTS, [129, 127, 1, 0]], ids=["0-1-127-129", "129-127-1-0"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gradients_match_float64(fp8, counts, n, k):
    fn = gt.function(moe(fp8, n, k))
    gen = torch.Generator(device="cpu").manual_seed(0)
    t = sum(counts)
    x = torch.randn(t, k, generator=gen).cuda().to(torch.bfloat16).requires_grad_(True)
    w = (torch.randn(4, n, k, generator=gen) / 16).cuda().requires_grad_(True)
    offs = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32).cuda()
    dy = torch.randn(t, n, generator=gen).cuda().to(torch.bfloat16)
    y = fn(x=x, w=w, offs=offs)
    y.backward(dy)
    ry, rdx, rdw = reference(x, w, offs, dy)
    tol = 0.09 if fp8 else 0.01
    kind = "fp8" if fp8 else "bf16"
    for name, got, want in (("y", y, ry), ("dx", x.grad, rdx), ("dw", w.grad, rdw)):
        assert_close_elementwise(got, want, name=f"{kind} {counts} {name}", **AGAINST_FLOAT64[kind, name],
                                 rel_norm_limit=tol)
    empty = counts.index(0)
    assert (w.grad[empty] == 0).all()  # an expert with no tokens gets no gradient
    if fp8:
        # Which quantizations ran the kernel: x and w where K is whole 128-blocks, dy
        # where N is; the others took the torch operations.
        shapes = {"x": (t, k), "w": (4, n, k), "dy": (t, n)}
        for q in fn.quantizations:
            plans = [
                e for key, e in gt._QUANTIZER._entries.items()
                if tuple(key[1]) == shapes[q.tensor] and key[4] == tuple(q.block)
            ]
            assert plans, f"no plan for {q}"
            kernel = shapes[q.tensor][-1] % 128 == 0
            assert all((e.launch is not None) == kernel for e in plans), q


def test_under_torch_compile():
    fn = gt.function(moe(True))
    x = torch.randn(257, 384, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(4, 256, 384, device="cuda") / 16).requires_grad_(True)
    offs = torch.tensor([0, 0, 1, 128, 257], dtype=torch.int32, device="cuda")

    @torch.compile(fullgraph=True)
    def loss(x, w, offs):
        return fn(x=x, w=w, offs=offs).float().square().mean()

    loss(x, w, offs).backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x=x, w=w, offs=offs).float().square().mean().backward()
    # The eager call's gradients as the reference: the same kernels on the same values,
    # but for a last bit of the compiled dy, which may move one FP8 rounding (a few
    # hundredths of a row's rms at most). The gradients here are about 4e-5 (dx) and 4e-4
    # (dw): an absolute atol of 1e-3 passed anything, a bound from each row's rms does not.
    assert_close_elementwise(gx, x.grad, dtype="bf16", name="dx compiled", rtol=1e-2, atol=5e-2)
    assert_close_elementwise(gw, w.grad, dtype="f32", name="dw compiled", rtol=1e-2, atol=5e-2)
