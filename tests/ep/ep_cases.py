"""The cases of the expert-parallel tests, shared by the CPU tests (gloo, the reference
executor in place of the kernels) and the GPU tests (NCCL, the kernels): each rank's
tokens and routing, the worker every rank runs, and the single-process references the
ranks' results are held to.

A case's routing is explicit (not a router's), so that it can leave experts empty and
ranks with nothing to receive or nothing to send."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
# The training FFN of the examples at small compile-time dims (H, N = 2F, F multiples of 128).
SPEC = (
    (ROOT / "examples" / "moe_ffn_fp8_train.gspec").read_text()
    .replace("H = 7168", "H = 128").replace("N = 4096", "N = 256").replace("F = 2048", "F = 128")
)
DECODE_SPEC = (
    (ROOT / "examples" / "moe_ffn_fp8.gspec").read_text()
    .replace("H = 7168", "H = 128").replace("N = 4096", "N = 256").replace("F = 2048", "F = 128")
)
HIDDEN = 128


@dataclass(frozen=True)
class Case:
    name: str
    world: int
    experts: int
    tokens: tuple[int, ...]  # per rank (0: a rank that sends nothing)
    k: int
    allowed: tuple[int, ...]  # experts any token may pick (the others stay empty)
    chunks: int = 1
    seed: int = 0
    capacity: int | None = None  # a decode case (EPMoEDecode): rows per rank pair, None: tokens * k
    decode: bool = False
    stray: tuple[tuple[int, int, int, int], ...] = ()  # (rank, token, slot, id outside [0, E)) put in the routing
    refuse: tuple[int, ...] = ()  # ranks that pass an x one column too wide (their own arguments refused)

    def spec(self, decode: bool = False) -> str:
        return (DECODE_SPEC if decode else SPEC).replace("E = 8", f"E = {self.experts}")

    def inputs(self, rank: int):
        """Rank `rank`'s tokens x [S, H], routing topk_idx [S, k] (k distinct allowed
        experts per token) and router weights topk_w [S, k]: the same on every process."""
        gen = torch.Generator().manual_seed(1000 * self.seed + rank)
        s = self.tokens[rank]
        x = torch.randn(s, HIDDEN, generator=gen)
        allowed = torch.tensor(self.allowed)
        idx = torch.stack([allowed[torch.randperm(len(allowed), generator=gen)[: self.k]] for _ in range(s)]) \
            if s else torch.zeros((0, self.k), dtype=torch.int64)
        w = torch.rand(s, self.k, generator=gen) + 0.25
        for r, t, c, e in self.stray:
            if r == rank:
                idx[t, c] = e
        return x, idx, w

    def weights(self):
        from gemmspec.ep import EPMoE, plan

        return EPMoE.full_weights(plan(self.spec(), 1).roles, seed=self.seed)  # f32, [E, ...]

    def upstream(self, rank: int) -> torch.Tensor:
        """The gradient of rank `rank`'s output."""
        gen = torch.Generator().manual_seed(7000 + 1000 * self.seed + rank)
        return torch.randn(self.tokens[rank], HIDDEN, generator=gen)


# Experts 1 and 5 of CASE_3 are never picked and rank 2 (experts 4 and 5) receives
# nothing; its rank 1 has no tokens. CASE_2's expert 3 is empty.
CASE_2 = Case("2 ranks", world=2, experts=4, tokens=(12, 9), k=2, allowed=(0, 1, 2))
CASE_2_CHUNKS = Case("2 ranks, 3 chunks", world=2, experts=4, tokens=(12, 9), k=2, allowed=(0, 1, 2), chunks=3, seed=1)
CASE_3 = Case("3 ranks, empty experts and ranks", world=3, experts=6, tokens=(10, 0, 7), k=2, allowed=(0, 2, 3), chunks=2)
# Decode with capacity buffers: the default capacity (nothing dropped) and 2 rows per
# rank pair (rows past it dropped); rank 2 again receives nothing.
DECODE_3 = Case("decode, 3 ranks", world=3, experts=6, tokens=(4, 4, 4), k=2, allowed=(0, 2, 3), decode=True, seed=2)
DECODE_3_DROP = Case("decode, 3 ranks, capacity 2", world=3, experts=6, tokens=(4, 4, 4), k=2, allowed=(0, 2, 3),
                     decode=True, capacity=2, seed=2)
# Expert ids outside [0, 6) on ranks 0 and 2 (rank 1 has no tokens): every rank refuses
# the step. In decode they are sent nowhere and counted.
STRAY_3 = Case("3 ranks, stray ids", world=3, experts=6, tokens=(5, 0, 4), k=2, allowed=(0, 2, 3),
               stray=((0, 1, 0, -1), (2, 0, 1, 6), (2, 3, 0, 40)))
# Rank 1 passes an x one column too wide: it refuses its own arguments and takes part in
# the counts exchange with that refusal, so ranks 0 and 2 refuse the step too (rank 2's
# stray id is not what they report: the refusal comes first). Two chunks: the refusal is
# one count per chunk.
REFUSE_3 = Case("3 ranks, rank 1's arguments refused", world=3, experts=6, tokens=(5, 3, 4), k=2, allowed=(0, 2, 3),
                chunks=2, refuse=(1,), stray=((2, 0, 1, 6),))
# Decode: rank 1's x is one column too wide. A decode call waits for no host check, so
# ranks 0 and 2 cannot learn of it: rank 1 serves their rows for its experts, sending none
# of its own, and raises; their outputs are whole.
DECODE_3_REFUSE = Case("decode, 3 ranks, rank 1's arguments refused", world=3, experts=6, tokens=(4, 4, 4), k=2,
                       allowed=(0, 2, 3), decode=True, seed=4, refuse=(1,))
DECODE_3_STRAY = Case("decode, 3 ranks, stray ids", world=3, experts=6, tokens=(4, 4, 4), k=2, allowed=(0, 2, 4),
                      decode=True, seed=3, stray=((1, 2, 1, -3), (2, 0, 0, 6)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def step(layer, case: Case, rank: int, device: str):
    """One forward and backward of `layer` (an ExpertParallel) on rank `rank`'s inputs:
    what the test compares, on the CPU."""
    x, idx, w = case.inputs(rank)
    if rank in case.refuse:
        x = torch.cat([x, x[:, :1]], 1)
    full = case.weights()
    e = layer.experts
    x = x.to(device).requires_grad_(True)
    w = w.to(device).requires_grad_(True)
    weights = {n: full[n][e.start:e.stop].to(device).requires_grad_(True) for n in layer.roles.weights}
    out = layer(x, idx.to(device), w, weights)
    out.backward(case.upstream(rank).to(device))
    return {
        "out": out.detach().cpu(), "grad_x": x.grad.cpu(), "grad_w": w.grad.cpu(),
        **{f"grad_{n}": v.grad.cpu() for n, v in weights.items()},
    }


def decode_step(case: Case, group, rank: int, device: str, graph: bool = False) -> dict:
    """EPMoEDecode on rank `rank`'s inputs: its output (twice, for determinism) and the
    rows it dropped; with `graph`, the second call is a CUDA graph's replay."""
    from gemmspec.ep import EPMoEDecode
    from gemmspec.errors import ArgumentError

    x, idx, w = (t.to(device) for t in case.inputs(rank))
    layer = EPMoEDecode(case.spec(decode=True), tokens=case.tokens[rank], top_k=case.k, group=group,
                        capacity=case.capacity)
    full, e = case.weights(), layer.rank_plan.experts
    layer.load({n: full[n][e.start:e.stop].to(device) for n in layer.roles.weights})
    if rank in case.refuse:  # as many calls as the other ranks make, each refused
        assert not graph, "a refusing rank's calls are not captured"
        x = torch.cat([x, x[:, :1]], 1)
        errors = []
        for _ in range(2):
            try:
                layer.decode(x, idx, w)
            except ArgumentError as err:
                errors.append(str(err))
        return {"errors": errors, "stray": layer.stray, "dropped": layer.dropped}
    first = layer.decode(x, idx, w)
    if graph:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            layer.decode(x, idx, w)  # warm: plans made, NCCL communicators up
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            captured = layer.decode(x, idx, w)
        g.replay()
        torch.cuda.synchronize()
        again = captured.clone()
    else:
        again = layer.decode(x, idx, w)
    return {"out": first.cpu(), "again": again.cpu(), "dropped": int(layer.dropped), "stray": int(layer.stray)}


def worker(rank: int, cases: list[Case], port: int, out_dir: str, backend: str, device: str) -> None:
    """Every rank's part: each case's step twice (the second for determinism), and the
    first step's FFN inputs (the dispatched buffers), saved for the parent to check. A
    case of fewer ranks than the processes runs on a group of the first ranks."""
    from gemmspec.ep import ExpertParallel
    from gemmspec.errors import ArgumentError

    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    world = max(c.world for c in cases)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for case in cases:
            # Every process creates every group (collective), members run the case.
            group = dist.new_group(list(range(case.world))) if case.world < world else None
            if rank >= case.world:
                continue
            if case.decode:
                results[case.name] = decode_step(case, group, rank, device, graph=device != "cpu")
                continue
            layer = ExpertParallel(case.spec(), group=group, chunks=case.chunks)
            if case.stray or case.refuse:  # every rank must refuse the step, and the next case must still run
                try:
                    step(layer, case, rank, device)
                except ArgumentError as e:
                    results[case.name] = {"error": str(e)}
                continue
            layer.record = []
            first = step(layer, case, rank, device)
            recorded = [{n: v.cpu() for n, v in chunk.items()} for chunk in layer.record]
            layer.record = None
            again = step(layer, case, rank, device)
            results[case.name] = {"first": first, "again": again, "dispatched": recorded,
                                  "bytes": layer.exchange.bytes_sent}
        torch.save(results, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


# A run of every case takes seconds; a rank left waiting in an exchange would wait for ever.
RANKS_DEADLINE_S = 300


def run_ranks(cases: list[Case], out_dir: Path, backend: str = "gloo", device: str = "cpu") -> list[dict]:
    """Spawn one process per rank of the largest case; every rank's results. Processes
    still running after RANKS_DEADLINE_S are ended, and that is a failure: a hang."""
    import time

    import torch.multiprocessing as mp

    world = max(c.world for c in cases)
    ctx = mp.spawn(worker, args=(cases, free_port(), str(out_dir), backend, device), nprocs=world, join=False)
    deadline = time.monotonic() + RANKS_DEADLINE_S
    while not ctx.join(timeout=1.0):  # raises where a rank failed
        if time.monotonic() > deadline:
            waiting = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
            for p in ctx.processes:
                p.kill()
            raise AssertionError(f"ranks {waiting} still running after {RANKS_DEADLINE_S} s: a rank waits in an exchange")
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]


# ---- single-process references ----------------------------------------------------------
def one_process(case: Case, device: str = "cpu") -> dict:
    """The same layer on one process (every expert, every rank's tokens in rank order):
    the step's results, by rank."""
    from gemmspec.ep import ExpertParallel

    layer = ExpertParallel(case.spec())
    xs, idxs, ws = zip(*(case.inputs(r) for r in range(case.world)))
    x = torch.cat(xs).to(device).requires_grad_(True)
    w = torch.cat(ws).to(device).requires_grad_(True)
    full = case.weights()
    weights = {n: full[n].to(device).requires_grad_(True) for n in layer.roles.weights}
    out = layer(x, torch.cat(idxs).to(device), w, weights)
    out.backward(torch.cat([case.upstream(r) for r in range(case.world)]).to(device))
    bounds = [sum(case.tokens[:r]) for r in range(case.world + 1)]
    per_rank = []
    for r in range(case.world):
        a, b = bounds[r], bounds[r + 1]
        per_rank.append({"out": out.detach()[a:b].cpu(), "grad_x": x.grad[a:b].cpu(), "grad_w": w.grad[a:b].cpu()})
    return {"ranks": per_rank, "weights": {f"grad_{n}": v.grad.cpu() for n, v in weights.items()}}


def expected_dispatch(case: Case, rank: int, chunk: int) -> dict:
    """What rank `rank` must receive for chunk `chunk`, by a loop over the rows: from
    each source rank in rank order, its rows of this rank's experts in expert order (each
    expert's in token, then slot order); the token row quantized per row as the spec
    says, its router weight, the expert order of the received rows and the offsets."""
    import gemmspec.torch as gt
    from gemmspec.ep import plan

    p = plan(case.spec(), case.world)
    mine = p.placement.experts_of(rank)
    rows, scales, weights, blocks = [], [], [], []  # blocks: (local expert, first row, count)
    for src in range(case.world):
        x, idx, w = case.inputs(src)
        a, b = (case.tokens[src] * i // case.chunks for i in (chunk, chunk + 1))
        q, s = gt.quantize(x[a:b], "e4m3", (1, 128))
        for j, e in enumerate(mine):
            first = len(rows)
            for t in range(b - a):
                for c in range(case.k):
                    if int(idx[a + t, c]) == e:
                        rows.append(q[t].view(torch.uint8))
                        scales.append(s[t])
                        weights.append(w[a + t, c])
            blocks.append((j, first, len(rows) - first))
    order = [row for j in range(len(mine)) for (jj, first, count) in blocks if jj == j
             for row in range(first, first + count)]
    per_expert = [sum(count for jj, _, count in blocks if jj == j) for j in range(len(mine))]
    offsets = [0]
    for c in per_expert:
        offsets.append(offsets[-1] + c)
    empty = torch.zeros((0, HIDDEN), dtype=torch.uint8)
    return {
        "x": torch.stack(rows) if rows else empty,
        "x_scale": torch.stack(scales) if scales else torch.zeros((0, 1)),
        "route_w": torch.tensor([float(weights[i]) for i in order], dtype=torch.float32),
        "src": torch.tensor(order, dtype=torch.int32),
        "expert_offsets": torch.tensor(offsets, dtype=torch.int32),
    }


def dropped_rows(case: Case, rank: int) -> list[tuple[int, int]]:
    """The (token, slot) pairs of rank `rank` that EPMoEDecode drops: in its send order
    (by expert, then token, then slot), the rows of each destination past the capacity."""
    from gemmspec.ep import plan

    placement = plan(case.spec(), case.world).placement
    _, idx, _ = case.inputs(rank)
    rows = sorted((int(idx[t, c]), t, c) for t in range(idx.shape[0]) for c in range(case.k))
    seen = [0] * case.world
    out = []
    for e, t, c in rows:
        d = placement.owner(e)
        if seen[d] >= case.capacity:
            out.append((t, c))
        seen[d] += 1
    return out


def one_process_forward(case: Case, dropped: dict[int, list[tuple[int, int]]], device: str = "cpu") -> list[torch.Tensor]:
    """The one-process layer's output per rank, with the router weights of the
    `dropped` rows (by rank) set to zero: what dropping them must give. A row of a stray
    id gives nothing either: it is routed to expert 0 with a router weight of zero."""
    from gemmspec.ep import ExpertParallel

    layer = ExpertParallel(case.spec())
    xs, idxs, ws = zip(*(case.inputs(r) for r in range(case.world)))
    idxs, ws = [i.clone() for i in idxs], [w.clone() for w in ws]
    for r, pairs in dropped.items():
        for t, c in pairs:
            ws[r][t, c] = 0.0
    for r, t, c, _ in case.stray:
        idxs[r][t, c], ws[r][t, c] = 0, 0.0
    full = case.weights()
    out = layer(torch.cat(xs).to(device), torch.cat(idxs).to(device), torch.cat(ws).to(device),
                {n: full[n].to(device) for n in layer.roles.weights})
    return list(out.detach().cpu().split(list(case.tokens)))
