"""An audit of gemmspec.ep against docs/scaling-out.md: each test holds the code to one
of the doc's claims, with the expected values worked out here from the rules the doc
states (placement blocks, bytes per routed row, the send order, slot-order sums, the
capacity rule), not taken from the code under test.

The outputs are checked against an FFN computed here from the spec's statements, with
gemmspec.torch.quantize for the FP8 rounding the spec declares (the quantize rule of the
language, not part of gemmspec.ep). Everything runs on one process (world 1, or
`gemmspec.ep.SINGLE` inside a faked distributed run) except the `bytes_sent` check,
which needs ranks (gloo, spawned by tests/ep/ep_cases.py) and is marked slow.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from ep_cases import DECODE_SPEC, HIDDEN, SPEC, Case, run_ranks  # noqa: E402

import gemmspec.ep as ep  # noqa: E402
import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError, GemmspecError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DOC = re.sub(r"\s+", " ", (ROOT / "docs" / "scaling-out.md").read_text(encoding="utf-8"))  # whitespace flattened
E = 8  # experts of SPEC and DECODE_SPEC
H = HIDDEN  # 128: hidden (tokens' and outputs' columns)
F = 128  # intermediate
E4M3, F32, BF16 = torch.float8_e4m3fn, torch.float32, torch.bfloat16

# The inference spec with every operand in bf16: tokens without scales.
BF16_DECODE_SPEC = (
    DECODE_SPEC.replace("e4m3 [S, H] scale f32 [1, 128]", "bf16 [S, H]")
    .replace("e4m3 [E, N, H] scale f32 [1, 128, 128]", "bf16 [E, N, H]")
    .replace("e4m3 [T, F] scale f32 [1, 128]", "bf16 [T, F]")
    .replace("e4m3 [E, H, F] scale f32 [1, 128, 128]", "bf16 [E, H, F]")
)


# ---- rules the doc states, worked out here ------------------------------------------------
def row_bytes_fp8(cols: int) -> int:
    """An FP8 row with its 1x128 f32 scales."""
    return cols + 4 * math.ceil(cols / 128)


def doc_bytes(hidden: int) -> dict[str, int]:
    """Bytes per routed row of the cost model's table for FP8 tokens and a bf16 output."""
    return {
        "dispatch": row_bytes_fp8(hidden) + 4,  # x (FP8) + scales + router weight (f32)
        "combine": 2 * hidden,  # y (bf16)
        "backward out": row_bytes_fp8(hidden),  # dy (FP8) + scales
        "backward back": 2 * hidden + 4,  # dx (bf16) + router weight gradient (f32)
    }


def send_order(idx: torch.Tensor) -> list[int]:
    """Routed row ids (i = s*k + c) sorted by expert, stably: token, then slot order."""
    flat = idx.reshape(-1).tolist()
    return sorted(range(len(flat)), key=lambda i: (flat[i], i))


def span(r: range) -> str:
    return str(r.start) if len(r) == 1 else f"{r.start}-{r.stop - 1}"


def _dequantize(q: torch.Tensor, s: torch.Tensor, block) -> torch.Tensor:
    v = q.double()
    for d, b in enumerate(block):
        s = s.repeat_interleave(b, dim=d)
    return v * s.double()[tuple(slice(0, n) for n in v.shape)]


def _fp8(v: torch.Tensor, block) -> torch.Tensor:
    return _dequantize(*gt.quantize(v, "e4m3", block), block)


def reference(x, idx, w, full, skip=frozenset()) -> torch.Tensor:
    """The FP8 expert FFN of the spec's two statements, token by token: x and the weights
    quantized as declared (1x128, 1x128x128), h rounded to bf16 then quantized 1x128, y
    = route_w * (h . w_down) rounded to bf16, and each token's k rows added in slot order
    in f32. Routed rows (s, c) in `skip` contribute nothing."""
    xq = _fp8(x, (1, 128))
    up, down = _fp8(full["w_up"], (1, 128, 128)), _fp8(full["w_down"], (1, 128, 128))
    out = torch.zeros(x.shape[0], down.shape[1], dtype=torch.float32)
    for s in range(x.shape[0]):
        for c in range(idx.shape[1]):
            if (s, c) in skip:
                continue
            e = int(idx[s, c])
            h = torch.nn.functional.silu(up[e, 0::2] @ xq[s]) * (up[e, 1::2] @ xq[s])
            h = _fp8(h.to(BF16).float()[None], (1, 128))[0]
            out[s] += (float(w[s, c]) * (down[e] @ h)).to(BF16).float()
    return out


def float64_layer(x, idx, w, up, down) -> torch.Tensor:
    """The same FFN in float64 without any rounding (differentiable)."""
    rows = []
    for s in range(x.shape[0]):
        acc = 0
        for c in range(idx.shape[1]):
            e = int(idx[s, c])
            h = torch.nn.functional.silu(up[e, 0::2] @ x[s]) * (up[e, 1::2] @ x[s])
            acc = acc + w[s, c] * (down[e] @ h)
        rows.append(acc)
    return torch.stack(rows)


def close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Within the bf16 output's rounding (the reference's float64 sums may differ in order)."""
    want = want.float()
    return bool(((got.float() - want).abs() <= 2**-7 * want.abs() + 2**-10 * float(want.abs().max())).all())


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def weights(seed: int = 0) -> dict[str, torch.Tensor]:
    """Full expert weights [E, ...] and a router [E, H], made here."""
    gen = torch.Generator().manual_seed(seed)
    return {
        "router": torch.randn(E, H, generator=gen) / H**0.5,
        "w_up": torch.randn(E, 2 * F, H, generator=gen) / H**0.5,
        "w_down": torch.randn(E, H, F, generator=gen) / F**0.5,
    }


def routing(tokens: int, k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, generator=gen) + 0.25
    return x, idx, w


@pytest.fixture(scope="module")
def full():
    return weights(11)


@pytest.fixture(scope="module")
def expert_weights(full):
    return {n: full[n] for n in ("w_up", "w_down")}


# ---- placement ----------------------------------------------------------------------------
@pytest.mark.parametrize("experts, world", [(8, 1), (8, 2), (8, 4), (8, 8), (6, 3), (12, 4)])
def test_contiguous_placement_gives_every_rank_e_over_world_in_rank_order(experts, world):
    p = ep.Placement.contiguous(experts, world)
    block = experts // world
    assert p.sizes == (block,) * world
    assert p == ep.contiguous(experts, world) == ep.Placement((block,) * world)
    for r in range(world):
        assert p.experts_of(r) == range(r * block, (r + 1) * block)
    assert [p.owner(e) for e in range(experts)] == [e // block for e in range(experts)]


@pytest.mark.parametrize("experts, world", [(8, 3), (6, 4), (2, 4), (8, 0), (8, 16)])
def test_contiguous_placement_refuses_a_world_that_does_not_divide_e(experts, world):
    with pytest.raises(GemmspecError, match="placement"):
        ep.Placement.contiguous(experts, world)


def test_placement_sizes_are_contiguous_blocks_in_rank_order_each_at_least_one():
    sizes = (1, 3, 2, 2)
    p = ep.Placement(sizes)
    start = 0
    for r, n in enumerate(sizes):
        assert p.experts_of(r) == range(start, start + n)
        assert all(p.owner(e) == r for e in range(start, start + n))
        start += n
    assert (p.world, p.experts) == (4, 8)
    for bad in ((1, 0, 3), (-1, 9), (2, True)):
        with pytest.raises(GemmspecError, match="at least one expert|sizes"):
            ep.Placement(bad)


# ---- the plan -----------------------------------------------------------------------------
def test_the_default_placement_of_the_plan_is_contiguous():
    for world in (1, 2, 4, 8):
        assert ep.plan(SPEC, world).placement.sizes == (E // world,) * world


def test_plan_prints_what_each_routed_row_moves_and_what_every_rank_owns():
    sizes = (1, 3, 2, 2)
    p = ep.plan(SPEC, 4, ep.Placement(sizes))
    b = doc_bytes(H)
    lines = str(p).splitlines()
    assert lines[0] == "expert parallelism: moe_ffn_fp8_train, 8 experts (expert) over 4 rank(s)"
    blocks, start = [], 0
    for n in sizes:
        blocks.append(range(start, start + n))
        start += n
    assert lines[1] == "  placement: " + ", ".join(f"rank {r}: experts {span(e)}" for r, e in enumerate(blocks))
    assert lines[2].startswith(
        f"  dispatch per routed row: x row (e4m3, scales [1, 128]) + route_w (f32) = {b['dispatch']} B, "
        "sent in expert order; ")
    assert lines[3] == (f"  combine per routed row: y row (bf16) = {b['combine']} B back; "
                        "each token's rows summed in slot order (deterministic)")
    assert lines[4].startswith(f"  backward per routed row: output gradient {b['backward out']} B out, "
                               f"token gradient + router weight gradient {b['backward back']} B back; ")
    for r, e in enumerate(blocks):
        n = len(e)
        assert lines[5 + r] == f"  rank {r}: experts {span(e)} ({n} local): w_up [{n}, {2 * F}, {H}], w_down [{n}, {H}, {F}]"
        assert p.ranks[r].experts == e
        assert p.ranks[r].weight_shapes == (("w_up", (n, 2 * F, H)), ("w_down", (n, H, F)))
    assert len(lines) == 5 + len(sizes)


@pytest.mark.parametrize("hidden", [128, 256, 384])
def test_bytes_per_routed_row_follow_the_cost_models_rules(hidden):
    p = ep.plan(SPEC.replace("H = 128", f"H = {hidden}"), 2)
    b = doc_bytes(hidden)
    assert (p.dispatch_bytes, p.combine_bytes, p.backward_bytes) == \
        (b["dispatch"], b["combine"], (b["backward out"], b["backward back"]))


def test_tokens_travel_in_the_type_the_spec_declares():
    # bf16 tokens: no scales, twice the bytes of an FP8 row; no backward to print (none is derived).
    p = ep.plan(BF16_DECODE_SPEC, 2)
    assert p.dispatch_bytes == 2 * H + 4 and p.combine_bytes == 2 * H
    assert f"x row (bf16) + route_w (f32) = {2 * H + 4} B" in str(p)
    assert "backward" not in str(p) and p.backward_bytes is None
    assert ep.plan(DECODE_SPEC, 2).dispatch_bytes - 4 < (2 * H) * 3 // 4  # FP8: about half of bf16


def test_the_cost_models_arithmetic_is_that_of_the_example_dims():
    p = ep.plan(ROOT / "examples" / "moe_ffn_fp8_train.gspec", 4)
    hidden, inter = p.roles.hidden, p.roles.spec.dim("F").size
    assert (hidden, inter) == (7168, 2048)
    b = doc_bytes(hidden)
    assert (p.dispatch_bytes, p.combine_bytes, p.backward_bytes) == \
        (b["dispatch"], b["combine"], (b["backward out"], b["backward back"]))
    forward = b["dispatch"] + b["combine"]
    assert forward == 21732 and "8 × 21732 ≈ 174 KB" in DOC and round(8 * forward / 1000) == 174
    flop = 2 * hidden * 2 * inter + 2 * inter * hidden
    assert "88 MFLOP" in DOC and round(flop / 1e6) == 88
    assert "about 4,000 FLOP per byte" in DOC and 3500 < flop / forward < 4500
    assert "about 90 ns" in DOC and 85 < flop / 1e15 * 1e9 < 95
    assert "about 50 ns over NVLink" in DOC and 45 < forward / 450e9 * 1e9 < 55
    assert "about 430 ns over a 400 Gb/s NIC" in DOC and 425 < forward / 50e9 * 1e9 < 440
    assert 400e9 / 8 == 50e9


def test_plan_takes_a_path_text_or_parsed_file():
    from gemmspec.parse import parse

    path = ROOT / "examples" / "moe_ffn_fp8.gspec"
    text = path.read_text()
    printed = {str(ep.plan(s, 2)) for s in (path, str(path), text, parse(text, "<string>"))}
    assert len(printed) == 1
    assert printed.pop().startswith("expert parallelism: moe_ffn_fp8, 8 experts (expert) over 2 rank(s)")


def test_plan_name_picks_one_of_several_specs():
    both = SPEC + "\n" + DECODE_SPEC
    assert ep.plan(both, 1, name="moe_ffn_fp8").roles.spec.name == "moe_ffn_fp8"
    assert ep.plan(both, 1, name="moe_ffn_fp8_train").roles.spec.name == "moe_ffn_fp8_train"
    with pytest.raises(GemmspecError, match="name=.*moe_ffn_fp8_train, moe_ffn_fp8"):
        ep.plan(both, 1)


def test_capacity_makes_every_local_group_a_capacity_group():
    from gemmspec.check import check

    for capacity in (False, True):
        p = ep.plan(DECODE_SPEC, 2, capacity=capacity)
        assert p.capacity is capacity
        for r in p.ranks:
            (local,) = check(r.file)
            (group,) = local.groups
            assert (group.kind, bool(group.capacity), group.count) == ("ragged", capacity, E // 2)
        assert ("capacity buffers" in str(p).splitlines()[0]) is capacity
    assert ep.EPMoEDecode(DECODE_SPEC, tokens=2, top_k=1).plan.capacity is True


@pytest.mark.parametrize("what, edit", [
    ("has no router weight per row",
     lambda s: s.replace("y[dst[t], n] = route_w[t] * sum", "y[dst[t], n] = sum")
     .replace("  tensor route_w : f32  [T]                 # router weight of routed row t\n", "")),
    ("exactly one statement must gather the tokens and one scatter the output",
     lambda s: s.replace("y[dst[t], n] =", "y[t, n] =")
     .replace("  tensor dst     : i32 [T]                  # the row of y routed row t writes (distinct)\n", "")),
], ids=["no router weight", "no scatter"])
def test_expert_ffn_names_what_is_missing(what, edit):
    from gemmspec.check import check
    from gemmspec.parse import parse

    text = edit(DECODE_SPEC)
    assert text != DECODE_SPEC
    (spec,) = check(parse(text, "<string>"))
    for call in (lambda: ep.expert_ffn(spec), lambda: ep.plan(text, 1)):
        with pytest.raises(GemmspecError, match=re.escape(what)):
            call()


# ---- the one-process layer: values ------------------------------------------------------------
def test_the_layer_is_the_spec_applied_per_routed_row_and_summed_per_token(expert_weights):
    x, idx, w = routing(6, 3, seed=1)
    layer = ep.ExpertParallel(SPEC, group=ep.SINGLE)
    got = layer(x, idx, w, expert_weights)
    want = reference(x, idx, w, expert_weights)
    assert got.shape == (6, H) and got.dtype == x.dtype
    assert close(got, want)
    assert not close(got, reference(x, idx.roll(1, 1), w, expert_weights))  # the check can tell routings apart


def test_autograd_reaches_x_topk_w_and_the_weights(expert_weights):
    x0, idx, w0 = routing(6, 3, seed=2)
    grad = torch.randn(6, H, generator=torch.Generator().manual_seed(3))

    def run(fn, dtype, idx):
        x = x0.detach().to(dtype).clone().requires_grad_(True)
        w = w0.detach().to(dtype).clone().requires_grad_(True)
        ws = {n: v.detach().to(dtype).clone().requires_grad_(True) for n, v in expert_weights.items()}
        out = fn(x, idx, w, ws)
        out.backward(grad.to(dtype))
        return [x.grad, w.grad, ws["w_up"].grad, ws["w_down"].grad]

    layer = ep.ExpertParallel(SPEC)
    got = run(layer, torch.float32, idx)
    want = run(lambda x, i, w, ws: float64_layer(x, i, w, ws["w_up"], ws["w_down"]), torch.float64, idx)
    other = run(lambda x, i, w, ws: float64_layer(x, i, w, ws["w_up"], ws["w_down"]), torch.float64,
                idx.roll(1, 1))
    # FP8 operands: a few percent off the float64 gradients; another routing is far off
    # (the router weight gradient of slot c belongs to (token, slot c)).
    for name, g, a, b in zip(("x", "topk_w", "w_up", "w_down"), got, want, other):
        assert g is not None and g.shape == a.shape and g.dtype == torch.float32, name
        assert rel(g, a) < 0.15, (name, rel(g, a))
        assert rel(b, a) > 0.4, name


def test_expert_weights_are_quantized_on_each_call(expert_weights):
    x, idx, w = routing(4, 2, seed=4)
    layer = ep.ExpertParallel(SPEC)
    first = layer(x, idx, w, expert_weights)
    doubled = {n: 2 * v for n, v in expert_weights.items()}
    assert close(layer(x, idx, w, doubled), reference(x, idx, w, doubled))
    assert torch.equal(layer(x, idx, w, expert_weights), first)


def test_empty_chunks_are_included_and_change_no_output(expert_weights):
    x, idx, w = routing(3, 2, seed=5)
    one = ep.ExpertParallel(SPEC)(x, idx, w, expert_weights)
    layer = ep.ExpertParallel(SPEC, chunks=5)
    layer.record = []
    assert torch.equal(layer(x, idx, w, expert_weights), one)
    assert len(layer.record) == 5  # 3 tokens in 5 chunks: two of them empty
    assert sum(c["src"].numel() for c in layer.record) == 3 * 2
    assert sum(c["src"].numel() == 0 for c in layer.record) == 2


def test_no_tokens_is_a_step_too(expert_weights):
    x = torch.zeros(0, H, requires_grad=True)
    w = torch.zeros(0, 2, requires_grad=True)
    ws = {n: v.clone().requires_grad_(True) for n, v in expert_weights.items()}
    out = ep.ExpertParallel(SPEC, chunks=2)(x, torch.zeros(0, 2, dtype=torch.int64), w, ws)
    assert out.shape == (0, H)
    out.sum().backward()
    assert x.grad.shape == (0, H) and w.grad.shape == (0, 2)
    assert all(float(v.grad.abs().max()) == 0 for v in ws.values())


# ---- what is exchanged, in which order --------------------------------------------------------
class _Spy:
    """An op that notes each call in `events`."""

    def __init__(self, op, tag, events):
        self._op, self._tag, self._events = op, tag, events

    def __call__(self, **inputs):
        self._events.append((self._tag,))
        return self._op(**inputs)

    def __getattr__(self, name):
        return getattr(self._op, name)


def test_a_step_exchanges_counts_once_then_rows_chunk_by_chunk(expert_weights, monkeypatch):
    S, k, chunks = 4, 2, 2
    x, idx, w = routing(S, k, seed=6)
    grad = torch.randn(S, H, generator=torch.Generator().manual_seed(7))
    layer = ep.ExpertParallel(SPEC, chunks=chunks)
    layer(x, idx, w, expert_weights)  # the CPU reference registered on this first call
    events, sent, counts = [], [], []
    ex, fn = layer.exchange, layer.fn
    rows, count = ex.rows, ex.counts

    def spy_rows(send, send_splits, recv_splits, *, async_op=False):
        events.append(("rows", send.dtype, tuple(send.shape[1:])))
        sent.append(send.clone())
        assert async_op is True  # every row exchange is issued asynchronously
        assert sum(send_splits) == send.shape[0]
        return rows(send, send_splits, recv_splits, async_op=async_op)

    def spy_counts(send, send_splits, recv_splits):
        events.append(("counts",))
        counts.append(send.clone())
        return count(send, send_splits, recv_splits)

    monkeypatch.setattr(ex, "rows", spy_rows)
    monkeypatch.setattr(ex, "counts", spy_counts)
    monkeypatch.setattr(fn, "forward_op", _Spy(fn.forward_op, "FFN", events))
    monkeypatch.setattr(fn, "backward_op", _Spy(fn.backward_op, "backward FFN", events))
    xr = x.clone().requires_grad_(True)
    out = layer(xr, idx, w, expert_weights)
    forward = list(events)
    events.clear()
    out.backward(grad)
    backward = list(events)

    x_row, meta = ("rows", E4M3, (H,)), ("rows", F32, (H // 128 + 1,))  # token rows; scales + router weight
    y_row = ("rows", BF16, (H,))
    # Counts once for every chunk, chunk 1's dispatch before chunk 0's GEMMs, each combine right after its GEMMs.
    assert forward == [("counts",), x_row, meta, x_row, meta, ("FFN",), y_row, ("FFN",), y_row]
    dy, dy_scale = ("rows", E4M3, (H,)), ("rows", F32, (H // 128,))
    dx, d_route = ("rows", BF16, (H,)), ("rows", F32, ())
    assert backward == [dy, dy_scale, dy, dy_scale, ("backward FFN",), dx, d_route, ("backward FFN",), dx, d_route]

    # Bytes per routed row of what was sent: the plan's, and the doc's rules.
    def row_bytes(t):
        return t.element_size() * (t[0].numel() if t.dim() > 1 else 1)

    b = doc_bytes(H)
    assert row_bytes(sent[0]) + row_bytes(sent[1]) == b["dispatch"] == layer.plan.dispatch_bytes
    assert row_bytes(sent[4]) == b["combine"] == layer.plan.combine_bytes
    assert row_bytes(sent[6]) + row_bytes(sent[7]) == b["backward out"]
    assert row_bytes(sent[10]) + row_bytes(sent[11]) == b["backward back"]

    # The counts: one exchange for all chunks, a count per (rank, local expert) and the stray rows, per chunk.
    (c,) = counts
    assert c.numel() == chunks * (E + 1) and int(c.sum()) == S * k

    # What chunk i's dispatch holds: its tokens' routed rows in send order, FP8 rows with
    # their scales, the router weight last in the f32 row; the combine sends as many rows back.
    q, s = gt.quantize(x, "e4m3", (1, 128))
    first = 0
    for i in range(chunks):
        got_x, got_m, got_y = sent[2 * i], sent[2 * i + 1], sent[4 + i]
        tokens = got_x.shape[0] // k
        a, b_ = first, first + tokens
        order = send_order(idx[a:b_])
        token = [a + r // k for r in order]
        assert got_x.shape[0] == len(order) and got_y.shape[0] == len(order)
        assert torch.equal(got_x.view(torch.uint8), q[token].view(torch.uint8))
        assert torch.equal(got_m[:, :-1], s[token].float())
        assert torch.equal(got_m[:, -1], w[a:b_].reshape(-1)[order].float())
        first = b_
    assert first == S


def test_phases_time_each_phase_when_set():
    layer = ep.ExpertParallel(SPEC)
    full = weights(1)
    x, idx, w = routing(3, 2, seed=8)
    layer.phases = {}
    out = layer(x.requires_grad_(True), idx, w, {n: full[n] for n in ("w_up", "w_down")})
    forward = dict(layer.phases)
    assert forward and all(v >= 0 for v in forward.values())
    names = " ".join(forward)
    assert all(word in names for word in ("dispatch", "combine", "FFN")) and "backward" not in names
    out.sum().backward()
    assert set(layer.phases) > set(forward) and any("backward" in n for n in layer.phases)


# ---- the SINGLE group ---------------------------------------------------------------------------
@pytest.fixture
def fake_world(monkeypatch):
    """A default process group of 4 ranks, this process rank 2, that fails any exchange."""
    import torch.distributed as dist

    calls = []

    def no_exchange(*args, **kwargs):
        calls.append("all_to_all_single")
        raise AssertionError("an exchange was issued")

    monkeypatch.setattr(dist, "is_available", lambda: True)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 2)
    monkeypatch.setattr(dist, "all_to_all_single", no_exchange)
    return calls


def test_single_is_the_one_process_layer_inside_a_distributed_run(fake_world, expert_weights):
    default = ep.ExpertParallel(SPEC)  # the default group: 4 ranks, this one rank 2
    assert (default.exchange.world, default.exchange.rank, default.experts) == (4, 2, range(4, 6))
    single = ep.ExpertParallel(SPEC, group=ep.SINGLE)
    assert (single.exchange.world, single.exchange.rank, single.experts) == (1, 0, range(0, E))
    assert single.plan.placement.sizes == (E,)
    x, idx, w = routing(4, 2, seed=9)
    xr = x.clone().requires_grad_(True)
    out = single(xr, idx, w, expert_weights)
    out.sum().backward()
    assert close(out, reference(x, idx, w, expert_weights)) and xr.grad is not None
    with pytest.raises(ArgumentError) as refused:  # its own refusal: nobody else to tell
        single(x[:, :64], idx, w, expert_weights)
    assert "x is [4, 64]" in str(refused.value) and "every rank refuses" not in str(refused.value)
    decode = ep.EPMoEDecode(DECODE_SPEC, tokens=4, top_k=2, group=ep.SINGLE)
    assert decode.exchange.world == 1 and decode.rank_plan.experts == range(0, E)
    assert fake_world == []
    assert single.exchange.bytes_sent == 0


# ---- EPMoE --------------------------------------------------------------------------------------
def test_epmoe_is_softmax_top_k_in_front_of_the_experts(full):
    layer = ep.EPMoE(SPEC, top_k=2, full=full)
    assert torch.equal(layer.router.detach(), full["router"])
    assert all(torch.equal(getattr(layer, n).detach(), full[n]) for n in ("w_up", "w_down"))  # world 1: every expert
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(10))
    out = layer(x)
    probs = torch.softmax(x.double() @ full["router"].double().t(), dim=-1)
    topk_w, topk_idx = probs.topk(2, dim=-1)
    assert close(out, reference(x, topk_idx, topk_w.float(), full))
    # The router's gradient reaches it through the router weights (float64 reference: FP8 tolerance).
    grad = torch.randn(5, H, generator=torch.Generator().manual_seed(11))
    out.backward(grad)
    r = full["router"].double().clone().requires_grad_(True)
    p = torch.softmax(x.double() @ r.t(), dim=-1)
    tw, ti = p.topk(2, dim=-1)
    float64_layer(x.double(), ti, tw, full["w_up"].double(), full["w_down"].double()).backward(grad.double())
    assert layer.router.grad is not None and rel(layer.router.grad, r.grad) < 0.15


def test_epmoe_makes_the_same_full_weights_from_a_seed():
    a, b, c = ep.EPMoE(SPEC, top_k=1, seed=5), ep.EPMoE(SPEC, top_k=1, seed=5), ep.EPMoE(SPEC, top_k=1, seed=6)
    names = ("router", "w_up", "w_down")
    assert all(torch.equal(getattr(a, n), getattr(b, n)) for n in names)
    assert not any(torch.equal(getattr(a, n), getattr(c, n)) for n in names)
    assert [tuple(getattr(a, n).shape) for n in names] == [(E, H), (E, 2 * F, H), (E, H, F)]
    assert ep.EPMoE(SPEC, top_k=E).top_k == E  # 1 <= top_k <= E


def test_epmoe_refuses_an_x_of_the_wrong_width_with_an_argument_error():
    layer = ep.EPMoE(SPEC, top_k=2)
    with pytest.raises(ArgumentError, match=re.escape(f"x is [4, {H + 1}]")):
        layer(torch.randn(4, H + 1))


# ---- EPMoEDecode --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def decode_inputs():
    x, idx, w = routing(4, 2, seed=12)
    return x, idx, w


def _decoder(full, **kwargs):
    layer = ep.EPMoEDecode(DECODE_SPEC, tokens=4, top_k=2, **kwargs)
    layer.load({n: full[n] for n in ("w_up", "w_down")})
    return layer


def test_decode_is_the_spec_applied_per_routed_row_and_repeats_bit_for_bit(full, decode_inputs):
    x, idx, w = decode_inputs
    layer = _decoder(full)
    first = layer.decode(x, idx, w)
    assert close(first, reference(x, idx, w, full))
    assert torch.equal(layer.decode(x, idx, w).view(torch.uint8), first.view(torch.uint8))
    for count in (layer.dropped, layer.stray):
        assert isinstance(count, torch.Tensor) and count.device == x.device and int(count) == 0


def test_decode_default_capacity_is_s_times_k(full, decode_inputs):
    x, idx, w = decode_inputs
    # One rank: all S*k routed rows go to it; S*k rows of capacity drop none, one fewer drops one.
    assert int(_decoder(full).decode(x, idx, w).isfinite().all()) == 1
    layer = _decoder(full)
    layer.decode(x, idx, w)
    assert int(layer.dropped) == 0
    fewer = _decoder(full, capacity=4 * 2 - 1)
    fewer.decode(x, idx, w)
    assert int(fewer.dropped) == 1


@pytest.mark.parametrize("capacity", [0, 3, 5])
def test_decode_drops_the_rows_past_the_capacity_in_send_order(full, decode_inputs, capacity):
    x, idx, w = decode_inputs
    layer = _decoder(full, capacity=capacity)
    got = layer.decode(x, idx, w)
    order = send_order(idx)  # one rank: one destination block, in send order
    dropped = {(i // 2, i % 2) for i in order[capacity:]}
    assert int(layer.dropped) == len(order) - capacity and int(layer.stray) == 0
    assert close(got, reference(x, idx, w, full, skip=dropped))
    if capacity == 0:
        assert torch.equal(got, torch.zeros_like(got))


def test_decode_counts_stray_rows_apart_and_sends_them_nowhere(full, decode_inputs):
    x, idx, w = decode_inputs
    bad = idx.clone()
    bad[1, 0], bad[3, 1] = -1, E
    layer = _decoder(full, capacity=5)
    got = layer.decode(x, bad, w)
    assert int(layer.stray) == 2
    valid = [i for i in send_order(bad) if 0 <= int(bad.reshape(-1)[i]) < E]
    assert int(layer.dropped) == len(valid) - 5
    skip = {(1, 0), (3, 1)} | {(i // 2, i % 2) for i in valid[5:]}
    assert close(got, reference(x, bad.clamp(0, E - 1), w, full, skip=skip))


def test_decode_load_quantizes_the_weights_once(decode_inputs):
    x, idx, w = decode_inputs
    mine = weights(13)
    layer = _decoder(mine)
    first = layer.decode(x, idx, w)
    for n in ("w_up", "w_down"):
        mine[n].mul_(2)  # the caller's tensors change after load: the loaded weights do not
    assert torch.equal(layer.decode(x, idx, w), first)


def test_a_refused_decode_sets_stray_and_dropped_to_none(full, decode_inputs):
    x, idx, w = decode_inputs
    bad = idx.clone()
    bad[0, 0] = -1
    layer = _decoder(full, capacity=3)
    layer.decode(x, bad, w)
    assert (int(layer.stray), int(layer.dropped)) == (1, 4)
    with pytest.raises(ArgumentError, match=re.escape("x is [4, 64]")):
        layer.decode(x[:, :64], idx, w)
    assert layer.stray is None and layer.dropped is None


def test_decode_sends_bf16_tokens_as_the_spec_declares():
    full = weights(14)
    layer = ep.EPMoEDecode(BF16_DECODE_SPEC, tokens=3, top_k=2)
    layer.load({n: full[n] for n in ("w_up", "w_down")})
    x, idx, w = routing(3, 2, seed=15)
    got = layer.decode(x, idx, w)
    xb, up, down = x.to(BF16).double(), full["w_up"].to(BF16).double(), full["w_down"].to(BF16).double()
    want = torch.zeros(3, H)
    for s in range(3):
        for c in range(2):
            e = int(idx[s, c])
            h = (torch.nn.functional.silu(up[e, 0::2] @ xb[s]) * (up[e, 1::2] @ xb[s])).to(BF16).double()
            want[s] += (float(w[s, c]) * (down[e] @ h)).to(BF16).float()
    assert close(got, want)


# ---- several ranks: bytes_sent ------------------------------------------------------------------
BYTES_2 = Case("audit: bytes sent, 2 ranks", world=2, experts=4, tokens=(5, 3), k=2, allowed=(0, 1, 2, 3), seed=21)
BYTES_2_CHUNKS = Case("audit: bytes sent, 2 ranks, 3 chunks", world=2, experts=4, tokens=(4, 6), k=2,
                      allowed=(0, 1, 3), chunks=3, seed=22)


@pytest.mark.slow
def test_bytes_sent_counts_the_rows_sent_to_other_ranks_only(tmp_path):
    cases = [BYTES_2, BYTES_2_CHUNKS]
    results = run_ranks(cases, tmp_path)
    b = doc_bytes(H)
    for case in cases:
        block = case.experts // case.world  # the default placement: contiguous, E/world each
        rows = {(s, d): 0 for s in range(case.world) for d in range(case.world)}  # routed rows from s to d
        for s in range(case.world):
            _, idx, _ = case.inputs(s)
            for e in idx.reshape(-1).tolist():
                rows[s, e // block] += 1
        for r in range(case.world):
            out = sum(rows[r, d] for d in range(case.world) if d != r)  # its rows for others' experts
            back = sum(rows[s, r] for s in range(case.world) if s != r)  # others' rows for its experts
            step = out * (b["dispatch"] + b["backward out"]) + back * (b["combine"] + b["backward back"])
            assert out and back
            # The worker runs the step twice on one layer; bytes_sent counts since the layer was made.
            assert results[r][case.name]["bytes"] == 2 * step, (case.name, r)


# ---- refusals found by this audit, mended ------------------------------------------------
def test_a_name_that_picks_no_spec_says_so():
    with pytest.raises(GemmspecError, match=r"no spec named 'typo': the file holds moe_ffn_fp8_train, moe_ffn_fp8"):
        ep.plan(SPEC + "\n" + DECODE_SPEC, 1, name="typo")


def test_an_expert_outside_the_placement_has_no_owner():
    p = ep.Placement((2, 2))
    assert [p.owner(e) for e in range(4)] == [0, 0, 1, 1]
    for e in (-1, 4):
        with pytest.raises(IndexError, match=f"expert {e} outside"):
            p.owner(e)


def test_epmoe_refuses_full_weights_without_the_router_or_of_other_shapes():
    full = ep.EPMoE.full_weights(ep.plan(SPEC, 1).roles)
    without_router = {k: v for k, v in full.items() if k != "router"}
    with pytest.raises(ArgumentError, match=r"EPMoE: full takes .*; router missing$"):
        ep.EPMoE(SPEC, top_k=2, full=without_router)
    name = next(k for k in full if k != "router")
    short = full | {name: full[name][:-1]}
    with pytest.raises(ArgumentError, match=re.escape(f"{name} is {list(short[name].shape)}")):
        ep.EPMoE(SPEC, top_k=2, full=short)
