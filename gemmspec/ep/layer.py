"""An expert FFN spec run expert-parallel: `ExpertParallel` (the experts of this rank,
with autograd), `EPMoE` (a router and top-k in front of it, an nn.Module that trains)
and `EPMoEDecode` (fixed-size capacity buffers per rank pair, nothing that waits for
the host: capturable in a CUDA graph).

One step of `ExpertParallel`: route (sort each rank's routed rows by expert), exchange
the counts (one small exchange for every chunk, then one wait for the host: the row
exchanges are sized by it), then per chunk of tokens dispatch (token rows in the spec's
type, FP8 with their scales where it says FP8, and the router weights), the local FFN
(the rank's local spec through gemmspec.torch, its forward op), and the combine (output
rows back, each token's k rows summed in slot order). Backward runs the same way in
reverse: the output gradient's rows out (quantized as the derived backward spec
declares them), the derived DGRAD/WGRAD op of each rank's local spec, the token and
router weight gradients back. Expert weight gradients stay where the experts live.

Chunks overlap: every exchange is issued with async_op=True, chunk i+1's dispatch
before chunk i's GEMMs and chunk i's combine right after them, and waited for only
where its rows are needed. With NCCL the exchange runs on the process group's
communication stream and a wait makes the compute stream wait for it (an event, no
host synchronization); with gloo it runs on the backend's threads and a wait blocks the
caller. On the CPU the local FFN is the float64 reference (gemmspec.torch_reference).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from contextlib import contextmanager

import torch

from .. import torch as gt
from ..errors import ArgumentError
from ..torch_reference import register_reference
from .exchange import (
    Exchange,
    exchange_counts,
    local_rows,
    rank_counts,
    refuse_step,
    route,
    sum_slots,
    wait,
)
from .placement import Placement, expert_ffn, plan

__all__ = ["EPMoE", "EPMoEDecode", "ExpertParallel"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows of `t` at `index`, for any element type (FP8 rows are moved as bytes)."""
    return _bytes(t)[index].view(t.dtype) if t.element_size() == 1 else t[index]


_INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _count(what: str, value, least: int) -> None:
    """An int argument's check, before any work: ArgumentError unless an int >= least."""
    if type(value) is not int or value < least:
        raise ArgumentError(f"{what} must be an int >= {least}, got {value!r}")


def _shape_errors(x, topk_idx, topk_w, hidden: int, tokens: int | None = None, k: int | None = None) -> list[str]:
    """What is wrong with the token and routing arguments' shapes (nothing: [])."""
    out = []
    if x.dim() != 2 or x.shape[1] != hidden or (tokens is not None and x.shape[0] != tokens):
        out.append(f"x is {list(x.shape)}")
    rows = tokens if tokens is not None else x.shape[0] if x.dim() else None
    if topk_idx.dim() != 2 or topk_idx.shape[1] < 1 or (k is not None and topk_idx.shape[1] != k) \
            or topk_idx.shape[0] != rows:
        out.append(f"topk_idx is {list(topk_idx.shape)}")
    elif topk_w.shape != topk_idx.shape:
        out.append(f"topk_w is {list(topk_w.shape)}")
    if topk_idx.dtype not in _INDEX_DTYPES:
        out.append(f"topk_idx is {topk_idx.dtype} (expert ids: an integer type)")
    return out


def _weight_errors(weights: Mapping[str, torch.Tensor], shapes) -> list[str]:
    """What is wrong with the local expert weights given (nothing: [])."""
    missing = [w for w, _ in shapes if w not in weights]
    out = [f"{', '.join(missing)} missing"] if missing else []
    out += [f"{w} is {list(weights[w].shape)}, not {list(shape)}" for w, shape in shapes
            if w in weights and tuple(weights[w].shape) != shape]
    return out


def _chunk_bounds(tokens: int, chunks: int) -> list[tuple[int, int]]:
    # Every rank makes the same number of chunks (each is a collective), empty ones included.
    edges = [tokens * i // chunks for i in range(chunks + 1)]
    return list(zip(edges[:-1], edges[1:]))


class ExpertParallel:
    """The experts this rank owns of an expert FFN spec, and the exchanges that bring
    them their routed rows: `ep(x, topk_idx, topk_w, weights)` is the layer's output for
    this rank's tokens, with autograd into x, topk_w and the local expert weights.

    `spec` is the global spec (all E experts); `placement` (default: contiguous blocks of
    E/world) says which this rank owns; `weights` maps each expert weight's name to this
    rank's block of it ([local experts, ...], high precision: the spec's FP8 ones are
    quantized on each call). `chunks` splits the tokens so that exchanges overlap GEMMs.
    """

    def __init__(self, spec, *, group=None, placement: Placement | None = None, chunks: int = 1,
                 name: str | None = None):
        _count("ExpertParallel: chunks", chunks, 1)
        self.exchange = Exchange(group)
        self.plan = plan(spec, self.exchange.world, placement, name=name)
        self.placement = self.plan.placement
        self.rank_plan = self.plan.ranks[self.exchange.rank]
        self.fn = gt.function(self.rank_plan.file)
        self.roles = expert_ffn(self.fn.spec)  # the local spec's roles: E = local experts
        self.chunks = chunks
        bw = self.fn.backward
        grad_of = {d.wrt: d.grad for d in bw.statements}
        self.dy = dict(bw.output_grads)[self.roles.output]
        self.token_grad = grad_of[self.roles.tokens]
        self.route_grad = grad_of.get(self.roles.route_weight)
        self.weight_grads = tuple(grad_of[w] for w in self.roles.weights)
        self.phases: dict[str, float] | None = None  # set to {} to time each phase (synchronized)
        self.record: list[dict[str, torch.Tensor]] | None = None  # set to [] to keep each chunk's FFN inputs
        self._cpu_ready = False

    @property
    def experts(self) -> range:
        return self.rank_plan.experts

    def __call__(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor,
                 weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
        wrong = _shape_errors(x, topk_idx, topk_w, self.roles.hidden)
        wrong += _weight_errors(weights, self.rank_plan.weight_shapes)
        if wrong:
            shapes = ", ".join(f"{w} {list(s)}" for w, s in self.rank_plan.weight_shapes)
            others = ""
            if self.exchange.world > 1:
                # The other ranks are on their way into this step's counts exchange: take
                # part in it with a refusal, so that they refuse the step too, not wait.
                refuse_step(self.exchange, self.chunks, self.placement, topk_idx.device)
                others = "; every rank refuses this step"
            raise ArgumentError(
                f"{self.roles.spec.name}: takes x [tokens, {self.roles.hidden}], topk_idx (integer) and topk_w "
                f"[tokens, k >= 1] and this rank's expert weights ({shapes}); {'; '.join(wrong)}{others}"
            )
        if x.device.type == "cpu" and not self._cpu_ready:
            register_reference(self.fn.forward_op, self.fn.backward_op)
            self._cpu_ready = True
        return _EPFunction.apply(self, topk_idx, x, topk_w, *(weights[w] for w in self.roles.weights))

    # ---- timing -------------------------------------------------------------------------
    @contextmanager
    def _phase(self, name: str, device: torch.device):
        if self.phases is None:
            yield
            return
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        began = time.perf_counter()
        yield
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.phases[name] = self.phases.get(name, 0.0) + time.perf_counter() - began

    # ---- forward ------------------------------------------------------------------------
    def _layout(self, topk_idx: torch.Tensor, bounds):
        """Routes of every chunk, and each chunk's row counts to and from every rank (the
        one host synchronization of a step)."""
        ex, placement = self.exchange, self.placement
        routes = [route(topk_idx[a:b], placement.experts) for a, b in bounds]
        counts = torch.stack([r.expert_counts for r in routes])  # [chunks, E]
        stray = torch.stack([r.stray for r in routes])  # [chunks]
        recv, strays = exchange_counts(ex, counts, stray, placement)  # [world, chunks, local], [world]
        host = torch.cat([rank_counts(counts, placement).reshape(-1), recv.sum(-1).reshape(-1), strays]).tolist()
        n, w = len(bounds), ex.world
        refused = [s for s, c in enumerate(host[2 * n * w:]) if c < 0]  # see refuse_step
        if refused:
            who = (f"rank {refused[0]} refused its own arguments (its error says why)" if len(refused) == 1 else
                   f"ranks {', '.join(map(str, refused))} refused their own arguments (their errors say why)")
            raise ArgumentError(f"{self.roles.spec.name}: {who}; no rows were exchanged")
        bad = {s: c for s, c in enumerate(host[2 * n * w:]) if c}
        if bad:  # every rank saw the same counts: all refuse the step, none waits on another
            where = ", ".join(f"{c} on rank {s}" for s, c in bad.items())
            raise ArgumentError(
                f"{self.roles.spec.name}: topk_idx holds expert ids outside [0, {placement.experts}): {where}; "
                "no rows were exchanged"
            )
        send_splits = [host[i * w:(i + 1) * w] for i in range(n)]
        recv_splits = [[host[n * w + s * n + i] for s in range(w)] for i in range(n)]
        return routes, recv, send_splits, recv_splits

    def _weights(self, weights) -> dict[str, torch.Tensor]:
        out = {}
        for name, value in zip(self.roles.weights, weights):
            out.update(self.fn._quantized(self.fn.spec.tensor(name), value.detach(), {}))
        return out

    def _send_rows(self, value: torch.Tensor, tensor_name: str, spec, token: torch.Tensor):
        """`value`'s rows ([tokens, C], high precision) as `tensor_name` of `spec` declares
        them (quantized per row with its scales, or cast), gathered in send order."""
        t = spec.tensor(tensor_name)
        if t.scale is None:
            return _rows(value.to(gt.torch_dtype(t.dtype)), token), None
        q, s = gt.quantize(value, t.dtype, t.scale.block)
        return _rows(q, token), s[token]

    def _forward(self, x, topk_idx, topk_w, weights):
        ex, roles, fn = self.exchange, self.roles, self.fn
        spec, k = fn.spec, topk_idx.shape[1]
        bounds = _chunk_bounds(x.shape[0], self.chunks)
        with self._phase("route + counts", x.device):
            routes, recv_counts, send_splits, recv_splits = self._layout(topk_idx, bounds)
            wq = self._weights(weights)
        tok = spec.tensor(roles.tokens)

        def dispatch(i):
            (a, b), r = bounds[i], routes[i]
            rows, scales = self._send_rows(x[a:b].detach(), roles.tokens, spec, r.token)
            w = topk_w[a:b].detach().reshape(-1)[r.order].float()[:, None]
            meta = w if scales is None else torch.cat([scales.float(), w], 1)
            got_x, wx = ex.rows(rows, send_splits[i], recv_splits[i], async_op=True)
            got_m, wm = ex.rows(meta, send_splits[i], recv_splits[i], async_op=True)
            return got_x, got_m, (wx, wm)

        state, combines = [], []
        with self._phase("dispatch", x.device):
            pending = dispatch(0)
        for i in range(len(bounds)):
            with self._phase("dispatch", x.device):
                following = dispatch(i + 1) if i + 1 < len(bounds) else None
                got_x, got_m, works = pending
                wait(*works)
            with self._phase("expert FFN", x.device):
                rows = got_x.shape[0]
                perm, offsets = local_rows(recv_counts[:, i, :], rows)
                dims = {d: rows for d in spec.runtime_dims}
                inputs = {
                    roles.tokens: gt._strided(got_x, tok.layout, dims),
                    roles.gather: perm, roles.scatter: perm, roles.offsets: offsets,
                    roles.route_weight: got_m[:, -1][perm.long()].to(gt.torch_dtype(spec.tensor(roles.route_weight).dtype)),
                    **wq,
                }
                if tok.scale is not None:
                    inputs[tok.scale.name] = gt._strided(got_m[:, :-1].contiguous(), tok.scale.layout, dims)
                if self.record is not None:  # what the exchange delivered, as the GEMMs read it
                    self.record.append({n: v.detach().clone() for n, v in inputs.items() if n not in wq})
                outs = fn.forward_op(**inputs)
                outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
                y = outs[fn.forward_op.outputs.index(roles.output)]
                state.append((fn.feed.kept(inputs, outs), perm, dims))
            with self._phase("combine", x.device):
                combines.append(ex.rows(y, recv_splits[i], send_splits[i], async_op=True))
            pending = following
        out = []
        with self._phase("combine", x.device):
            for (back, work), r in zip(combines, routes):
                wait(work)
                out.append(sum_slots(back, r.pos, k))
        result = torch.cat(out).to(x.dtype) if out else x.new_zeros((0, roles.out_columns))
        return result, (bounds, routes, send_splits, recv_splits, state, k, x.dtype, topk_w.dtype,
                        [w.dtype for w in weights])

    # ---- backward -----------------------------------------------------------------------
    def _backward(self, saved, grad_out: torch.Tensor):
        bounds, routes, send_splits, recv_splits, state, k, x_dtype, w_dtype, weight_dtypes = saved
        ex, fn = self.exchange, self.fn
        bop, bspec = fn.backward_op, fn.backward_op.exe.spec
        device = grad_out.device

        def send_grad(i):
            (a, b), r = bounds[i], routes[i]
            rows, scales = self._send_rows(grad_out[a:b], self.dy, bspec, r.token)
            got, w1 = ex.rows(rows, send_splits[i], recv_splits[i], async_op=True)
            got_s, w2 = (None, None) if scales is None else ex.rows(scales, send_splits[i], recv_splits[i], async_op=True)
            return got, got_s, (w1, w2)

        dy_t = bspec.tensor(self.dy)
        grads_w: list[torch.Tensor | None] = [None] * len(self.weight_grads)
        returns = []
        with self._phase("backward: gradient out", device):
            pending = send_grad(0)
        for i in range(len(bounds)):
            with self._phase("backward: gradient out", device):
                following = send_grad(i + 1) if i + 1 < len(bounds) else None
                got, got_s, works = pending
                wait(*works)
            with self._phase("backward: expert FFN", device):
                kept, perm, dims = state[i]
                inputs = {n: v for n, v in kept.items() if n in bop.inputs}
                inputs.update(fn.feed.copies(kept))
                for src, copy in fn.backward.transposed:
                    inputs[copy] = gt._strided(kept[src], bspec.tensor(copy).layout, dims)
                inputs[self.dy] = gt._strided(got, dy_t.layout, dims)
                if got_s is not None:
                    inputs[dy_t.scale.name] = gt._strided(got_s, dy_t.scale.layout, dims)
                outs = bop(**inputs)
                by_name = dict(zip(bop.outputs, (outs,) if isinstance(outs, torch.Tensor) else outs))
                for j, g in enumerate(self.weight_grads):
                    # Chunk by chunk in chunk order: the same sum on every run.
                    grads_w[j] = by_name[g].float() if grads_w[j] is None else grads_w[j] + by_name[g].float()
                dx = by_name[self.token_grad]
                d_route = torch.zeros(perm.numel(), dtype=torch.float32, device=device)
                if self.route_grad is not None:
                    d_route.index_copy_(0, perm.long(), by_name[self.route_grad].float())
            with self._phase("backward: gradient back", device):
                returns.append((ex.rows(dx, recv_splits[i], send_splits[i], async_op=True),
                                ex.rows(d_route, recv_splits[i], send_splits[i], async_op=True)))
            pending = following
        gx, gw = [], []
        with self._phase("backward: gradient back", device):
            for ((dx_back, w1), (dr_back, w2)), r in zip(returns, routes):
                wait(w1, w2)
                gx.append(sum_slots(dx_back, r.pos, k))
                gw.append(dr_back[r.pos].view(-1, k))
        grad_x = torch.cat(gx).to(x_dtype)
        grad_topk = torch.cat(gw).to(w_dtype)
        return grad_x, grad_topk, [g.to(d) for g, d in zip(grads_w, weight_dtypes)]


class _EPFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ep: ExpertParallel, topk_idx, x, topk_w, *weights):
        out, ctx.saved = ep._forward(x, topk_idx, topk_w, weights)
        ctx.ep = ep
        return out

    @staticmethod
    def backward(ctx, grad_out):
        grad_x, grad_topk, grad_weights = ctx.ep._backward(ctx.saved, grad_out.contiguous())
        ctx.saved = None
        return (None, None, grad_x, grad_topk, *grad_weights)


class EPMoE(torch.nn.Module):
    """A MoE layer: a router (a linear map to E logits, replicated on every rank),
    softmax and top-k, and the expert FFN spec's experts over the group's ranks. Its
    parameters are the router's and this rank's block of each expert weight (f32; the
    spec's FP8 ones are quantized on each call). The router's gradient is this rank's
    tokens' only: all-reduce it as for any replicated parameter."""

    def __init__(self, spec, *, top_k: int, group=None, placement: Placement | None = None, chunks: int = 1,
                 name: str | None = None, full: Mapping[str, torch.Tensor] | None = None, seed: int = 0):
        super().__init__()
        _count("EPMoE: top_k", top_k, 1)
        self.ep = ExpertParallel(spec, group=group, placement=placement, chunks=chunks, name=name)
        if top_k > self.ep.placement.experts:
            raise ArgumentError(f"EPMoE: top_k = {top_k} is more than the spec's {self.ep.placement.experts} experts")
        self.top_k = top_k
        if full is not None:
            self._check_full(full)
        full = full if full is not None else self.full_weights(self.ep.plan.roles, seed)
        self.router = torch.nn.Parameter(full["router"].clone())
        e = self.ep.experts
        for w in self.ep.roles.weights:
            self.register_parameter(w, torch.nn.Parameter(full[w][e.start:e.stop].clone()))

    def _check_full(self, full: Mapping[str, torch.Tensor]) -> None:
        """`full` holds the router's [E, H] and every expert weight's [E, ...]."""
        e = self.ep.placement.experts
        want = {"router": (e, self.ep.roles.hidden)}
        want |= {w: (e, *shape[1:]) for w, shape in self.ep.rank_plan.weight_shapes}
        wrong = _weight_errors(full, want.items())
        if wrong:
            shapes = ", ".join(f"{k} {list(shape)}" for k, shape in want.items())
            raise ArgumentError(f"EPMoE: full takes every expert's weights and the router's ({shapes}); "
                                f"{'; '.join(wrong)}")

    @staticmethod
    def full_weights(roles, seed: int = 0) -> dict[str, torch.Tensor]:
        """Every expert's weights and the router's, the same on every rank for one seed:
        {'router': [E, H], weight: [E, ...]} (float32, scaled by 1/sqrt(fan-in))."""
        gen = torch.Generator().manual_seed(seed)
        spec = roles.spec
        out = {"router": torch.randn(roles.experts, roles.hidden, generator=gen) / roles.hidden**0.5}
        for w in roles.weights:
            shape = [spec.dim(d).size if spec.dim(d).size is not None else roles.experts for d in spec.tensor(w).dims]
            shape[0] = roles.experts
            out[w] = torch.randn(*shape, generator=gen) / shape[-1] ** 0.5
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.ep.roles.hidden:
            # The router cannot run on it: ExpertParallel refuses it, and the step with the
            # other ranks (it takes part in their counts exchange).
            no_route = torch.zeros((x.shape[0] if x.dim() else 0, self.top_k), dtype=torch.int64, device=x.device)
            return self.ep(x, no_route, no_route.float(), {w: getattr(self, w) for w in self.ep.roles.weights})
        probs = torch.softmax(x.float() @ self.router.t(), dim=-1)
        topk_w, topk_idx = probs.topk(self.top_k, dim=-1)
        return self.ep(x, topk_idx, topk_w, {w: getattr(self, w) for w in self.ep.roles.weights})


class EPMoEDecode:
    """The expert FFN for decode with fixed-size buffers: every rank sends `capacity`
    rows to every rank (default tokens * k, so that no row is ever dropped), counts and
    rows exchanged with fixed splits, the local spec's group a capacity group (rows past
    its offsets untouched). Nothing in a call waits for the host, so on GPUs a call is
    capturable in a CUDA graph. Forward only; call `load(weights)` once (it quantizes
    this rank's expert weights), then `decode(x, topk_idx, topk_w)` per step. With a
    smaller capacity the rows past it in each rank's buffer are dropped (their
    contribution is zero); `dropped` counts them on the device. A routed row whose
    expert id lies outside [0, E) is not sent either (its contribution is zero; checking
    on the host would make the call wait for it): `stray` counts those on the device.
    A call whose own arguments are refused still serves the other ranks (`_serve_only`)
    before it raises."""

    def __init__(self, spec, *, tokens: int, top_k: int, group=None, placement: Placement | None = None,
                 capacity: int | None = None, name: str | None = None):
        _count("EPMoEDecode: tokens", tokens, 0)
        _count("EPMoEDecode: top_k", top_k, 1)
        if capacity is not None:
            _count("EPMoEDecode: capacity", capacity, 0)
        self.exchange = Exchange(group)
        self.plan = plan(spec, self.exchange.world, placement, capacity=True, name=name)
        self.placement = self.plan.placement
        self.rank_plan = self.plan.ranks[self.exchange.rank]
        self.op = gt.op(self.rank_plan.file)
        self.roles = expert_ffn(self.op.exe.spec)
        self.tokens, self.top_k = tokens, top_k
        self.capacity = capacity if capacity is not None else tokens * top_k
        self.weights: dict[str, torch.Tensor] | None = None
        self.dropped: torch.Tensor | None = None
        self.stray: torch.Tensor | None = None

    def load(self, weights: Mapping[str, torch.Tensor]) -> None:
        """This rank's expert weights ([local experts, ...]), quantized once as the spec says."""
        spec = self.op.exe.spec
        wrong = _weight_errors(weights, self.rank_plan.weight_shapes)
        if wrong:
            shapes = ", ".join(f"{w} {list(s)}" for w, s in self.rank_plan.weight_shapes)
            raise ArgumentError(f"EPMoEDecode: load takes this rank's expert weights ({shapes}); {'; '.join(wrong)}")
        out = {}
        for w in self.roles.weights:
            t, value = spec.tensor(w), weights[w].detach()
            if t.scale is None:
                out[w] = value.to(gt.torch_dtype(t.dtype)).contiguous()
            else:
                out[w], out[t.scale.name] = gt.quantize(value, t.dtype, t.scale.block)
        self.weights = out
        device = next(iter(out.values())).device
        # The rank owning each expert, made here: a copy from the host has no place in a
        # call that a CUDA graph captures.
        sizes = torch.tensor(self.placement.sizes)
        self._owner = torch.repeat_interleave(torch.arange(self.placement.world), sizes).to(device)
        if device.type == "cpu":
            register_reference(self.op)

    def decode(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        if self.weights is None:
            raise ArgumentError("EPMoEDecode: call load(weights) before decode")
        wrong = _shape_errors(x, topk_idx, topk_w, self.roles.hidden, self.tokens, self.top_k)
        if wrong:
            served = ""
            if self.exchange.world > 1:
                self._serve_only()
                served = "; this rank's experts still served the other ranks' rows"
            self.stray = self.dropped = None  # no counts of the caller's arguments
            raise ArgumentError(
                f"EPMoEDecode: made for {self.tokens} tokens and k = {self.top_k}: x [{self.tokens}, "
                f"{self.roles.hidden}], topk_idx (integer) and topk_w [{self.tokens}, {self.top_k}]; "
                f"{'; '.join(wrong)}{served}"
            )
        return self._decode(x, topk_idx, topk_w)

    def _serve_only(self) -> None:
        """A call that sends none of this rank's rows, for a rank whose own arguments are
        refused: the other ranks are in this call's exchanges (a decode call waits for no
        host check, so they cannot learn of the refusal) and their rows for this rank's
        experts still come back computed, so their outputs are whole and no rank waits."""
        device = self._owner.device
        nowhere = torch.full((self.tokens, self.top_k), self.placement.experts, dtype=torch.int64, device=device)
        zeros = torch.zeros((self.tokens, self.top_k), device=device)
        self._decode(torch.zeros((self.tokens, self.roles.hidden), device=device), nowhere, zeros)

    def _decode(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_w: torch.Tensor) -> torch.Tensor:
        ex, roles, placement, cap = self.exchange, self.roles, self.placement, self.capacity
        spec, world, device = self.op.exe.spec, ex.world, x.device
        r = route(topk_idx, placement.experts)
        owner = self._owner
        ids = topk_idx.reshape(-1).long()[r.order]
        routed = (ids >= 0) & (ids < placement.experts)  # a stray id's row goes nowhere
        dest = owner[ids.clamp(0, placement.experts - 1)]
        per_rank = rank_counts(r.expert_counts, placement)
        start = torch.cumsum(per_rank, 0) - per_rank
        slot = torch.arange(r.rows, device=device) - start[dest]
        kept = routed & (slot < cap)
        trash = world * cap  # dropped and stray rows land on a spare row no one reads
        at = torch.where(kept, dest * cap + slot, torch.full_like(slot, trash))
        # Rows each expert keeps: its rows below the capacity of its destination's block.
        in_block = torch.cumsum(r.expert_counts, 0) - start[owner]
        kept_counts = in_block.clamp(max=cap) - (in_block - r.expert_counts).clamp(max=cap)
        self.stray = r.stray
        self.dropped = r.rows - r.stray - kept_counts.sum()

        tok = spec.tensor(roles.tokens)
        if tok.scale is None:
            q, s = x.to(gt.torch_dtype(tok.dtype)), None
        else:
            q, s = gt.quantize(x, tok.dtype, tok.scale.block)
        row_bytes = _bytes(q)  # [S, H * element size]: rows of any type travel as bytes
        send_x = torch.zeros((trash + 1, row_bytes.shape[1]), dtype=torch.uint8, device=device)
        send_x.index_copy_(0, at, row_bytes[r.token])
        w = topk_w.reshape(-1)[r.order].float()[:, None]
        meta_cols = [w] if s is None else [s[r.token].float(), w]
        meta = torch.cat(meta_cols, 1)
        send_m = torch.zeros((trash + 1, meta.shape[1]), dtype=torch.float32, device=device)
        send_m.index_copy_(0, at, meta)

        fixed = [cap] * world
        recv_counts = ex.counts(kept_counts, list(placement.sizes), [placement.sizes[ex.rank]] * world)
        recv_counts = recv_counts.view(world, -1)
        got_x, _ = ex.rows(send_x[:trash], fixed, fixed)
        got_m, _ = ex.rows(send_m[:trash], fixed, fixed)
        got_x = got_x.view(q.dtype)

        # Expert order of the received rows: block s holds rows of local expert j at
        # positions below the running count; the rest (padding) sort last.
        position = torch.arange(cap, device=device)
        j = torch.searchsorted(torch.cumsum(recv_counts, 1), position.expand(world, cap).contiguous(), right=True)
        keys = (j * world + torch.arange(world, device=device)[:, None]).reshape(-1)
        perm = torch.argsort(keys, stable=True).to(torch.int32)
        offsets = torch.zeros(recv_counts.shape[1] + 1, dtype=torch.int32, device=device)
        offsets[1:] = torch.cumsum(recv_counts.sum(0), 0)
        rw_dtype = gt.torch_dtype(spec.tensor(roles.route_weight).dtype)
        inputs = {
            roles.tokens: got_x, roles.gather: perm, roles.scatter: perm, roles.offsets: offsets,
            roles.route_weight: got_m[:, -1][perm.long()].to(rw_dtype), **self.weights,
        }
        if tok.scale is not None:
            inputs[tok.scale.name] = got_m[:, :-1].contiguous()
        outs = self.op(**inputs)
        outs = (outs,) if isinstance(outs, torch.Tensor) else tuple(outs)
        y = outs[self.op.outputs.index(roles.output)]
        back, _ = ex.rows(y, fixed, fixed)
        back = torch.cat([back, back.new_zeros((1, back.shape[1]))])  # the spare row: zeros
        return sum_slots(back[at], r.pos, self.top_k).to(x.dtype)
