"""`gemmspec bench --sweep decode`: one decode shape timed over token counts.

The shape is DeepSeek-V3's routed gate/up projection in FP8 (256 experts, top-8, N =
4096, K = 7168, 1x128 / 128x128 scales, BF16 out) at T = 1, 2, 4, ..., 4096 tokens,
each token's 8 experts drawn by a seeded routing (`inputs.routed_counts`). Every point
runs gemmspec (checked as the table's rows are), torch's `_scaled_grouped_mm` and, where
importable, DeepGEMM, on the same inputs; the weights are made once for the whole sweep.
Each point's HBM floor is the bytes it must move (`measure.decode_bytes`) at the copy
rate: from a few tokens, where the call reads a few experts, to the point where all 256
experts' weights are read and the floor stops growing with T.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from . import measure
from .anchors import deepgemm
from .anchors import torch as torch_anchor
from .card import REFERENCE, Card, tbs_text
from .inputs import load_torch, random_fp8, random_scales, routed_counts
from .report import copy_share, hbm_floor_us
from .timing import Result


@dataclass(frozen=True)
class Sweep:
    what: str
    experts: int
    top_k: int
    n: int
    k: int
    tokens: tuple[int, ...]
    seed: int = 0


SWEEPS = {
    "decode": Sweep(
        "DeepSeek-V3 gate/up, FP8 1x128/128x128 -> bf16, 256 experts top-8, N=4096, K=7168",
        experts=256, top_k=8, n=4096, k=7168, tokens=tuple(2**i for i in range(13)),
    ),
}


@dataclass(frozen=True)
class Point:
    """One token count of a sweep: its expert segment lengths and the bytes it must move."""

    tokens: int
    lengths: list[int]
    bytes_read: int

    @property
    def name(self) -> str:
        return f"sweep_T{self.tokens}"

    @property
    def active_experts(self) -> int:
        return sum(1 for c in self.lengths if c)


def points(sweep: Sweep) -> list[Point]:
    """Every token count of `sweep` with its seeded routing's lengths (no GPU)."""
    out = []
    for t in sweep.tokens:
        lengths = routed_counts(t, sweep.experts, sweep.top_k, seed=sweep.seed + t)
        out.append(Point(t, lengths, measure.decode_bytes(lengths, sweep.n, sweep.k, fp8=True)))
    return out


def run_sweep(sweep: Sweep, repeat: int) -> tuple[list[Result], dict[str, str]]:
    """gemmspec, torch and DeepGEMM (where importable) at every point; a point whose check
    or launch fails is reported by name, the rest still run."""
    torch = load_torch()
    torch.manual_seed(0)
    e, n, k = sweep.experts, sweep.n, sweep.k
    weights = random_fp8((e, n, k)), random_scales((e, n // 128, k // 128))
    results: list[Result] = []
    failures: dict[str, str] = {}
    pts = points(sweep)
    for i, p in enumerate(pts, 1):
        print(f"[{i}/{len(pts)}] {p.name} ({sum(p.lengths)} rows, {p.active_experts} experts) ...", file=sys.stderr,
              flush=True)
        try:
            rows, problem = measure.decode_fp8(repeat, name=p.name, lengths=p.lengths, n=n, k=k, weights=weights)
            rows += torch_anchor.scaled_grouped_mm(p.name, repeat, problem)
            rows += deepgemm.m_grouped_fp8(p.name, repeat, problem)
            results += rows
        except Exception as exc:  # noqa: BLE001 - a failing point is reported, the rest still run
            failures[p.name] = f"{type(exc).__name__}: {exc}"
        torch.cuda.empty_cache()
    return results, failures


def system(impl: str) -> str:
    """The system a row's impl names, without how it ran: the sweep's line per system."""
    return impl.split(" (")[0]


def sweep_report(sweep: Sweep, results: list[Result], failures: dict[str, str],
                 card: Card = REFERENCE) -> tuple[str, dict]:
    """The sweep's table (one line per point and system: time, TB/s, share of the copy
    rate, time over the floor, gemmspec's ratio) and its JSON summary; `card`: whose copy
    rate the floor and shares are of."""
    rate = card.copy_rate_tbs
    lines = [
        f"sweep: {sweep.what}; floor = bytes read / {tbs_text(rate)} TB/s",
        f"{'T':>5} {'rows':>6} {'experts':>7} {'MB read':>8} {'floor us':>9}  {'impl':44} {'us':>9} "
        f"{'TB/s':>6} {'copy':>5} {'x floor':>7} {'gemmspec/it':>11}  check",
    ]
    summary = {"sweep": sweep.what, "copy_rate_tbs": rate, "points": []}
    for p in points(sweep):
        floor = hbm_floor_us(p.bytes_read, rate)
        head = f"{p.tokens:5} {sum(p.lengths):6} {p.active_experts:7} {p.bytes_read / 1e6:8.1f} {floor:9.1f}"
        entry = {"tokens": p.tokens, "rows": sum(p.lengths), "active_experts": p.active_experts,
                 "bytes_read": p.bytes_read, "hbm_floor_us": floor}
        if p.name in failures:
            lines.append(f"{head}  FAILED: {failures[p.name]}")
            summary["points"].append(entry | {"error": failures[p.name]})
            continue
        rows = [r for r in results if r.case == p.name]
        if not rows:
            continue
        ours = rows[0]
        for j, r in enumerate(rows):
            us = r.ms * 1e3
            lines.append(
                f"{head if j == 0 else '':{len(head)}}  {r.impl[:44]:44} {us:9.1f} {r.rate:6.2f} {copy_share(r, rate):5.0%} "
                f"{us / floor:7.2f} {r.ms / ours.ms:10.2f}x  {r.check}"
            )
        entry["systems"] = [
            {"system": system(r.impl), "impl": r.impl, "us": r.ms * 1e3, "tbs": r.rate, "copy_share": copy_share(r, rate),
             "check": r.check}
            for r in rows
        ]
        summary["points"].append(entry)
    return "\n".join(lines), summary
