"""The exchanges of expert parallelism over a torch.distributed process group: where
each routed row goes, the counts exchange, and the row exchanges of dispatch and
combine, all with `all_to_all_single` (NCCL on GPUs, gloo on CPUs; no transport of
our own).

Routed row i of a rank is slot c of token s (i = s * k + c). The sender sorts its routed
rows by expert, stably: with contiguous expert blocks per rank that is also the order of
destination ranks, so the sorted rows are the send buffer as `all_to_all_single` wants
it, each destination's rows contiguous and in its experts' order. A receiver gets, from
each source rank in rank order, that source's rows of its first local expert, then of
its second, ...; `local_rows` gives the expert order of those rows as an index (the
GEMM reads and writes the received rows through it, so nothing is permuted), and the
offsets of the local ragged group. The combine sends the output rows back in the order
they came and the sender sums each token's k rows in slot order, so the result has the
same bits on every run (no atomics, no order that depends on timing).

Row payloads travel as bytes (FP8, BF16 and F32 rows alike), which every backend
carries.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .placement import Placement

__all__ = ["SINGLE", "Exchange", "Route", "exchange_counts", "local_rows", "refuse_step", "route", "sum_slots"]


class _Single:
    def __repr__(self) -> str:
        return "gemmspec.ep.SINGLE"


# As a group: this process alone, even where a default process group is initialized
# (the one-process layer a distributed run compares itself with).
SINGLE = _Single()


class Exchange:
    """`all_to_all_single` over `group` (the default group when None and one is
    initialized; `SINGLE`: this process alone); with one rank every exchange hands back
    what it was given. Counts the bytes it sends to other ranks."""

    def __init__(self, group=None):
        self.distributed = group is not SINGLE and dist.is_available() and dist.is_initialized()
        self.group = None if group is SINGLE else group
        self.world = dist.get_world_size(group) if self.distributed else 1
        self.rank = dist.get_rank(group) if self.distributed else 0
        self.bytes_sent = 0  # to other ranks, since the last reset

    def rows(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int], *, async_op: bool = False):
        """Rows of `send` (dim 0) to each rank, `send_splits[d]` to rank d in rank order,
        `recv_splits[s]` from rank s: (received rows, work to wait on or None)."""
        if self.world == 1:
            return send, None
        send = send.contiguous()
        row_bytes = send.element_size() * (send.shape[1:].numel() if send.dim() > 1 else 1)
        self.bytes_sent += row_bytes * (sum(send_splits) - send_splits[self.rank])
        if send.numel() == 0:  # an empty tensor may have any strides: its bytes are no view
            raw = torch.empty((0, row_bytes), dtype=torch.uint8, device=send.device)
        else:
            raw = send.view(torch.uint8) if send.dim() > 1 else send.view(torch.uint8).view(-1, send.element_size())
        out = raw.new_empty((sum(recv_splits), *raw.shape[1:]))
        work = dist.all_to_all_single(out, raw, recv_splits, send_splits, group=self.group, async_op=async_op)
        out = out.view(send.dtype)
        return (out if send.dim() > 1 else out.view(-1)), work

    def counts(self, send: torch.Tensor, send_splits: list[int], recv_splits: list[int]) -> torch.Tensor:
        """A small int64 exchange, waited for (its results size the row exchanges)."""
        if self.world == 1:
            return send
        out = send.new_empty(sum(recv_splits))
        dist.all_to_all_single(out, send.contiguous(), recv_splits, send_splits, group=self.group)
        return out


def wait(*works) -> None:
    """Make the current stream (or, on the CPU, the caller) wait for the exchanges."""
    for w in works:
        if w is not None:
            w.wait()


@dataclass(frozen=True)
class Route:
    """Where a rank's routed rows go: the send order (routed row ids, expert-sorted),
    each routed row's position in it, the token of each sent row, the rows per expert,
    and the rows whose expert id lies outside [0, E) (all tensors on the tokens' device)."""

    order: torch.Tensor  # [R] int64: routed row id at each send position
    pos: torch.Tensor  # [R] int64: send position of routed row i
    token: torch.Tensor  # [R] int64: token of the row at each send position
    expert_counts: torch.Tensor  # [E] int64
    stray: torch.Tensor  # [] int64: rows with an id outside [0, E), sorted after every other

    @property
    def rows(self) -> int:
        return self.order.numel()


def route(topk_idx: torch.Tensor, experts: int) -> Route:
    """The send order of `topk_idx`'s routed rows ([tokens, k] expert ids): sorted by
    expert, stably (ties in token, then slot order). Rows of an id outside [0, experts)
    are counted, not routed: they sort last, under the key `experts`, so nothing indexes
    by their id (an index out of range on a GPU is a device-side assert, which takes the
    process down with no message the caller can catch)."""
    flat = topk_idx.reshape(-1).long()
    k = topk_idx.shape[1] if topk_idx.dim() == 2 else 1
    key = torch.where((flat >= 0) & (flat < experts), flat, experts)
    order = torch.argsort(key, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel(), device=order.device)
    # scatter_add rather than bincount: no host synchronization (bincount sizes its output on the host).
    counts = torch.zeros(experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(0, key, torch.ones_like(key))
    return Route(order, pos, torch.div(order, k, rounding_mode="floor"), counts[:experts], counts[experts])


def rank_counts(expert_counts: torch.Tensor, placement: Placement) -> torch.Tensor:
    """Rows per destination rank from rows per expert ([..., E] -> [..., world])."""
    return torch.stack([b.sum(-1) for b in expert_counts.split(list(placement.sizes), dim=-1)], dim=-1)


def exchange_counts(ex: Exchange, expert_counts: torch.Tensor, stray: torch.Tensor,
                    placement: Placement) -> tuple[torch.Tensor, torch.Tensor]:
    """Each rank's rows per local expert from every rank: [chunks, E] counts and [chunks]
    stray rows (ids outside [0, E)) in; [world, chunks, local experts] (from rank s, chunk
    i, local expert j) and the stray rows of every rank, [world], out. One exchange for
    all chunks, so the row exchanges after it need no further wait; every rank learns
    every rank's stray rows in it, so all can refuse a step together."""
    chunks = expert_counts.shape[0]
    mine = placement.sizes[ex.rank]
    blocks = expert_counts.split(list(placement.sizes), dim=-1)
    send = torch.cat([torch.cat([b, stray[:, None]], 1).reshape(-1) for b in blocks])
    got = ex.counts(send, [chunks * (e + 1) for e in placement.sizes], [chunks * (mine + 1)] * ex.world)
    got = got.view(ex.world, chunks, mine + 1)
    return got[..., :mine], got[..., mine].sum(-1)


def refuse_step(ex: Exchange, chunks: int, placement: Placement, device: torch.device) -> None:
    """This rank's part of a step it refuses (its own arguments are wrong): the counts
    exchange the other ranks are waiting in, with no rows and a stray count of -1 per
    chunk. A negative stray count is no count of rows: `exchange_counts`' callers read it
    as that rank's refusal and refuse the step with it, so no rank waits for rows that
    never come."""
    counts = torch.zeros((chunks, placement.experts), dtype=torch.int64, device=device)
    exchange_counts(ex, counts, torch.full((chunks,), -1, dtype=torch.int64, device=device), placement)


def local_rows(recv_counts: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For the received rows (from rank s, local expert j, in (s, j) order; `recv_counts`
    [world, local experts]): the received row of each row in local expert order, int32
    (the spec's gather and scatter index), and the local group's offsets, int32."""
    world, local = recv_counts.shape
    device = recv_counts.device
    # Row of block (s, j) sorts by key j * world + s: expert-major, then source rank.
    keys = (torch.arange(local, device=device)[None, :] * world + torch.arange(world, device=device)[:, None]).reshape(-1)
    row_keys = torch.repeat_interleave(keys, recv_counts.reshape(-1), output_size=total)
    perm = torch.argsort(row_keys, stable=True).to(torch.int32)
    offsets = torch.zeros(local + 1, dtype=torch.int32, device=device)
    offsets[1:] = torch.cumsum(recv_counts.sum(0), 0)
    return perm, offsets


def sum_slots(rows: torch.Tensor, pos: torch.Tensor, k: int) -> torch.Tensor:
    """Per token, the sum of its k routed rows (`rows` in send order, `pos` the send
    position of each routed row), in float32, added in slot order: c = 0, 1, ..., k-1."""
    tokens = pos.numel() // k
    at = pos.view(tokens, k)
    out = torch.zeros((tokens, *rows.shape[1:]), dtype=torch.float32, device=rows.device)
    for c in range(k):
        out += rows[at[:, c]].float()
    return out
