"""The inputs of the bench's rows, made by torch on the GPU: random FP8 values and
scales, offsets from segment lengths, the token counts of a LoRA x expert nest, and
the seeded routings and counts of the decode rows (plain Python: the table is built
without torch).

torch is imported when a row runs, not with the package: `gemmspec bench --list` needs
no torch.
"""

from __future__ import annotations

import random


def load_torch():
    import torch

    return torch


def random_fp8(shape):
    torch = load_torch()
    return (torch.randn(shape, device="cuda") * 64).clamp(-448, 448).to(torch.float8_e4m3fn)


def random_fp8_experts(shape):
    """random_fp8 of an [E, ...] weight made an expert at a time (DeepSeek-V3's 256
    experts would need tens of GB of float32 at once)."""
    torch = load_torch()
    out = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
    for e in range(shape[0]):
        out[e] = random_fp8(shape[1:])
    return out


def random_scales(shape):
    torch = load_torch()
    return torch.rand(shape, device="cuda") * 0.01 + 0.001


def offsets_tensor(lengths):
    torch = load_torch()
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32, device="cuda")


def random_nested_counts(lora_lengths: list[int], experts: int, generator) -> list[list[int]]:
    """Each adapter's tokens cut at `experts - 1` random points: per adapter, the token
    count of each expert (0 where two cuts meet, odd sizes as they fall)."""
    torch = load_torch()
    counts = []
    for length in lora_lengths:
        cuts = sorted(torch.randint(0, length + 1, (experts - 1,), generator=generator).tolist())
        bounds = [0, *cuts, length]
        counts.append([b - a for a, b in zip(bounds[:-1], bounds[1:])])
    return counts


def nested_offsets(counts: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    """The offsets of a nest `lora` > `expert ragged(T within lora)` from its L x E token
    counts: `lora_offsets` (L + 1 entries) and `expert_offsets` (L rows of E + 1 absolute
    row numbers, each row from its adapter's first token to its end)."""
    lora_offsets, expert_offsets = [0], []
    for row in counts:
        bounds = [lora_offsets[-1]]
        for c in row:
            bounds.append(bounds[-1] + c)
        expert_offsets.append(bounds)
        lora_offsets.append(bounds[-1])
    return lora_offsets, expert_offsets


def token_leaves(counts: list[list[int]], device):
    """Each token's adapter and expert (int64 [T] each) from the nest's L x E counts: the
    indices a caller has from routing, which torch's element-wise path needs."""
    torch = load_torch()
    experts = len(counts[0])
    flat = torch.tensor([c for row in counts for c in row], device=device)
    leaf = torch.repeat_interleave(torch.arange(flat.numel(), device=device), flat)
    return leaf // experts, leaf % experts


# ------------------------------------------------------------ decode routing (no torch)
def topk_routing(tokens: int, experts: int, top_k: int, seed: int) -> list[list[int]]:
    """Each token's `top_k` distinct experts, drawn uniformly by a generator seeded with
    `seed` (Python's `random`, so the table is the same on every machine and needs no
    torch)."""
    if not 0 < top_k <= experts:
        raise ValueError(f"top-{top_k} routing needs 1 <= top_k <= experts ({experts})")
    rng = random.Random(seed)
    return [rng.sample(range(experts), top_k) for _ in range(tokens)]


def expert_counts(routing: list[list[int]], experts: int) -> list[int]:
    """Rows per expert of a routing: the lengths of its ragged expert segments (tokens
    sorted by expert, each token once per expert it picked)."""
    counts = [0] * experts
    for chosen in routing:
        for e in chosen:
            counts[e] += 1
    return counts


def routed_counts(tokens: int, experts: int, top_k: int, seed: int = 0) -> list[int]:
    """The expert segment lengths of `tokens` tokens routed top-`top_k` over `experts`
    (`topk_routing`): they sum to tokens * top_k."""
    return expert_counts(topk_routing(tokens, experts, top_k, seed), experts)


def masked_counts(experts: int, low: int, high: int, seed: int = 0) -> list[int]:
    """Valid rows per group of a masked decode batch: uniform in [low, high], seeded."""
    rng = random.Random(seed)
    return [rng.randint(low, high) for _ in range(experts)]


def routed_rows(tokens: int, experts: int, top_k: int, seed: int = 0) -> tuple[list[int], list[int]]:
    """The routed rows of a seeded top-k routing (`topk_routing`) as an expert FFN reads
    them: the token of each row, rows sorted by expert and, within an expert, by token
    (`src`, tokens * top_k entries, each token `top_k` times), and the expert segment
    lengths (`expert_counts`)."""
    routing = topk_routing(tokens, experts, top_k, seed)
    by_expert: list[list[int]] = [[] for _ in range(experts)]
    for token, chosen in enumerate(routing):
        for e in chosen:
            by_expert[e].append(token)
    return [s for rows in by_expert for s in rows], [len(rows) for rows in by_expert]


def route_into(tensors: dict, tokens: int, experts: int, top_k: int, seed: int):
    """A seeded top-k routing (`routed_rows`) written in place into the decode FFN's
    `src`, `expert_offsets` and `route_w` (router weights uniform in [0, 1), seeded);
    returns the expert of each routed row (a CPU tensor)."""
    torch = load_torch()
    src, lengths = routed_rows(tokens, experts, top_k, seed)
    tensors["src"].copy_(torch.tensor(src, dtype=torch.int32))
    bounds = [0]
    for n in lengths:
        bounds.append(bounds[-1] + n)
    tensors["expert_offsets"].copy_(torch.tensor(bounds, dtype=torch.int32))
    tensors["route_w"].copy_(torch.rand(len(src), generator=torch.Generator(device="cpu").manual_seed(seed)))
    return torch.repeat_interleave(torch.arange(experts), torch.tensor(lengths))
