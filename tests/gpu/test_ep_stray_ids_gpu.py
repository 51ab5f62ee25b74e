"""Expert ids outside [0, E) on one GPU (this process alone): no index by them reaches a
kernel, so there is no device-side assert. ExpertParallel refuses the step with an
ArgumentError and runs the next one; EPMoEDecode sends the rows nowhere, counts them in
`stray`, gives what zero-weighted rows give, and does so in a captured CUDA graph too."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ep"))
from ep_cases import DECODE_SPEC, SPEC  # noqa: E402

import gemmspec.ep as ep  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402


def test_expert_parallel_refuses_stray_ids_on_the_gpu_and_runs_on():
    layer = ep.ExpertParallel(SPEC, group=ep.SINGLE)
    full = ep.EPMoE.full_weights(layer.plan.roles)
    weights = {n: full[n].cuda() for n in layer.roles.weights}
    gen = torch.Generator().manual_seed(11)
    x, w = torch.randn(6, 128, generator=gen).cuda(), torch.rand(6, 2, generator=gen).cuda()
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)]).cuda()
    want = layer(x, idx, w, weights)
    bad = idx.clone()
    bad[1, 0], bad[4, 1] = -1, 8
    with pytest.raises(ArgumentError, match=re.escape("outside [0, 8): 2 on rank 0; no rows were exchanged")):
        layer(x, bad, w, weights)
    torch.cuda.synchronize()  # no device-side assert is pending
    again = layer(x, idx, w, weights)
    assert torch.equal(again.view(torch.uint8), want.view(torch.uint8))


def test_decode_sends_stray_rows_nowhere_on_the_gpu_in_a_graph():
    layer = ep.EPMoEDecode(DECODE_SPEC, tokens=4, top_k=2, group=ep.SINGLE)
    full = ep.EPMoE.full_weights(layer.plan.roles, seed=1)
    layer.load({n: full[n].cuda() for n in layer.roles.weights})
    gen = torch.Generator().manual_seed(12)
    x, w = torch.randn(4, 128, generator=gen).cuda(), (torch.rand(4, 2, generator=gen) + 0.25).cuda()
    idx = torch.tensor([[0, 3], [5, -2], [8, 1], [7, 6]]).cuda()
    stray = (idx < 0) | (idx >= 8)
    want = layer.decode(x, torch.where(stray, torch.zeros_like(idx), idx), torch.where(stray, 0.0, w))
    got = layer.decode(x, idx, w)
    assert int(layer.stray) == 2 and int(layer.dropped) == 0
    assert torch.isfinite(got).all() and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        layer.decode(x, idx, w)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = layer.decode(x, idx, w)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.uint8), want.view(torch.uint8)) and int(layer.stray) == 2
