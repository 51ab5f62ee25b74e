"""Expert parallelism: an expert FFN spec's experts placed over the ranks of a
torch.distributed process group, tokens dispatched to the ranks owning their experts
and combined back (see docs/scaling-out.md)."""

from .placement import EPPlan, ExpertFFN, Placement, RankPlan, contiguous, expert_ffn, plan

__all__ = [
    "SINGLE", "EPMoE", "EPMoEDecode", "EPPlan", "ExpertFFN", "ExpertParallel", "Placement", "RankPlan",
    "contiguous", "expert_ffn", "plan",
]


def __getattr__(name: str):
    # The layers import torch; the plan does not need it (gemmspec.ep.plan works without).
    if name == "SINGLE":
        from .exchange import SINGLE

        return SINGLE
    if name in ("EPMoE", "EPMoEDecode", "ExpertParallel"):
        from . import layer

        return getattr(layer, name)
    raise AttributeError(name)
