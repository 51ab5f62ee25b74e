"""Expert ids outside [0, E) in the routing, on one process (the CPU reference in place
of the kernels): the route counts them and sorts them last without indexing by them;
ExpertParallel refuses the step with an ArgumentError that names the rank and the
count, before any row is exchanged or any FFN runs; EPMoEDecode sends them nowhere
(their contribution is zero) and counts them in `stray`, apart from `dropped`. The
ranks of a process group refusing together is tested with three processes in
test_ep_exchange.py."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")

from ep_cases import DECODE_SPEC, SPEC  # noqa: E402

import gemmspec.ep as ep  # noqa: E402
from gemmspec.ep.exchange import route  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.int8])
def test_route_counts_stray_ids_and_sorts_them_last(dtype):
    idx = torch.tensor([[2, -1], [0, 4], [9, 2], [1, 0]], dtype=dtype)  # E = 4: -1, 4 and 9 stray
    r = route(idx, 4)
    flat = idx.reshape(-1).tolist()
    valid = [i for i in range(8) if 0 <= flat[i] < 4]
    stray = [i for i in range(8) if not 0 <= flat[i] < 4]
    # The routed rows first, by expert then routed row id; the stray ones after them, in id order.
    assert r.order.tolist() == sorted(valid, key=lambda i: (flat[i], i)) + stray
    assert r.expert_counts.tolist() == [2, 1, 2, 0]
    assert int(r.stray) == 3 and r.stray.dim() == 0
    assert r.pos[r.order].tolist() == list(range(8))
    assert r.token.tolist() == [i // 2 for i in r.order.tolist()]


def test_route_of_uint8_ids_past_e():
    r = route(torch.tensor([[255, 3], [0, 8]], dtype=torch.uint8), 8)
    assert int(r.stray) == 2 and r.expert_counts.sum().item() == 2


def test_route_without_strays_is_unchanged():
    idx = torch.tensor([[2, 0], [0, 2], [1, 0], [2, 2]])
    r = route(idx, 4)
    assert int(r.stray) == 0 and r.expert_counts.tolist() == [3, 1, 4, 0]


@pytest.fixture(scope="module")
def training():
    layer = ep.ExpertParallel(SPEC)
    full = ep.EPMoE.full_weights(layer.plan.roles)
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(5, 128, generator=gen)
    idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(5)])
    w = torch.rand(5, 2, generator=gen)
    return layer, {n: full[n] for n in layer.roles.weights}, x, idx, w


@pytest.mark.parametrize("bad", [[(1, 0, -1)], [(0, 1, 8), (4, 0, 100)]], ids=["negative", "past E, twice"])
def test_expert_parallel_refuses_stray_ids_before_any_rows_move(training, monkeypatch, bad):
    layer, weights, x, idx, w = training
    idx = idx.clone()
    for t, c, e in bad:
        idx[t, c] = e
    import gemmspec.ep.layer as layer_module

    calls = []
    monkeypatch.setattr(layer.exchange, "rows", lambda *a, **k: calls.append("rows"))
    monkeypatch.setattr(layer_module, "local_rows", lambda *a, **k: calls.append("local_rows"))
    message = f"{layer.roles.spec.name}: topk_idx holds expert ids outside [0, 8): {len(bad)} on rank 0; " \
              "no rows were exchanged"
    with pytest.raises(ArgumentError, match=re.escape(message)):
        layer(x, idx, w, weights)
    assert calls == []


def test_expert_parallel_runs_again_after_a_refused_step(training):
    layer, weights, x, idx, w = training
    want = layer(x, idx, w, weights)
    bad = idx.clone()
    bad[2, 1] = 8
    with pytest.raises(ArgumentError):
        layer(x, bad, w, weights)
    assert torch.equal(layer(x, idx, w, weights), want)


def _untouched_rows_hold_nan(layer):
    """Wrap the layer's op so that the output rows its capacity group does not write
    (the rows of the buffer past the received ones) hold NaN, as a GPU's may hold any
    bytes: the reference's zeros there would hide a row read from them."""
    op, roles = layer.op, layer.roles

    class Op:
        exe, outputs = op.exe, op.outputs

        def __call__(self, **inputs):
            outs = list(op(**inputs))
            y = outs[at]
            written = inputs[roles.scatter][: int(inputs[roles.offsets][-1])].long()
            untouched = torch.ones(y.shape[0], dtype=torch.bool)
            untouched[written] = False
            outs[at] = torch.where(untouched[:, None], torch.nan, y).to(y.dtype)
            return tuple(outs)

    at = op.outputs.index(roles.output)
    layer.op = Op()


def test_decode_sends_stray_rows_nowhere_and_counts_them():
    layer = ep.EPMoEDecode(DECODE_SPEC, tokens=4, top_k=2)
    full = ep.EPMoE.full_weights(layer.plan.roles, seed=1)
    layer.load({n: full[n] for n in layer.roles.weights})
    _untouched_rows_hold_nan(layer)
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(4, 128, generator=gen)
    idx = torch.tensor([[0, 3], [5, -2], [8, 1], [7, 6]])
    w = torch.rand(4, 2, generator=gen) + 0.25
    got = layer.decode(x, idx, w)
    assert int(layer.stray) == 2 and int(layer.dropped) == 0
    # What the stray rows must give: nothing. The same routing with each stray id
    # replaced by a real expert and its router weight zeroed.
    stray = (idx < 0) | (idx >= 8)
    want = layer.decode(x, torch.where(stray, torch.zeros_like(idx), idx), torch.where(stray, 0.0, w))
    assert int(layer.stray) == 0
    assert torch.isfinite(got).all()
    assert torch.equal(got, want)
    # A token whose every row strays gets zeros.
    every = layer.decode(x, torch.tensor([[0, 3], [5, 2], [-1, 8], [7, 6]]), w)
    assert int(layer.stray) == 2 and torch.equal(every[2], torch.zeros(128, dtype=every.dtype))


def test_decode_counts_stray_and_dropped_rows_apart():
    # Capacity 3: the one rank's block holds 3 of the 6 routed rows; 2 more stray.
    layer = ep.EPMoEDecode(DECODE_SPEC, tokens=4, top_k=2, capacity=3)
    full = ep.EPMoE.full_weights(layer.plan.roles, seed=1)
    layer.load({n: full[n] for n in layer.roles.weights})
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(7))
    layer.decode(x, torch.tensor([[0, 3], [5, -2], [8, 1], [7, 6]]), torch.rand(4, 2))
    assert (int(layer.stray), int(layer.dropped)) == (2, 3)
