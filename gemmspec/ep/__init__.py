"""Expert parallelism: an expert FFN spec's experts placed over the ranks of a
torch.distributed process group, tokens dispatched to the ranks owning their experts
and combined back (see docs/scaling-out.md)."""

from .placement import EPPlan, ExpertFFN, Placement, RankPlan, contiguous, expert_ffn, plan

__all__ = ["EPPlan", "ExpertFFN", "Placement", "RankPlan", "contiguous", "expert_ffn", "plan"]
