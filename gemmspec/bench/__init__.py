"""`gemmspec bench`: gemmspec beside the anchors, in one process, on one GPU.

The package, from the bottom up: `inputs` (random operands, offsets), `compare`
(relative error and the check of a result, for the rows and the anchors alike),
`specs` (the .gspec texts the rows build), `timing` (do_bench or the event loop,
the clock under load, `Result`), `card` (the copy rate the memory-bound rows are judged
against, and whether the H200's recorded figures apply), `anchors/` (PyTorch and DeepGEMM, each an adapter
timed on the inputs gemmspec ran on), `measure` (gemmspec's side of each case),
`cases` (the table: shape, types, anchors and target per case), `report` and `plot`
(the table, its JSON, the chart), `sweep` (`--sweep`: one shape over token counts)
and `run` (the command). `run.py` says what the command measures and how.
"""

from .cases import CASES, LORA_EXPAND_COUNTS, MASKED, RAGGED, Case, Target, selected_cases
from .inputs import nested_offsets, offsets_tensor, random_fp8, random_nested_counts, random_scales
from .plot import plot
from .report import report
from .run import main
from .specs import (
    DENSE,
    GATHER,
    LORA,
    LORA_EXPAND,
    MASKED_SPEC,
    ROWWISE,
    WGRAD,
    moe_spec,
    with_directive,
)
from .timing import Result, Timing, sustained_clock, timed_launches

__all__ = [
    "CASES",
    "DENSE",
    "GATHER",
    "LORA",
    "LORA_EXPAND",
    "LORA_EXPAND_COUNTS",
    "MASKED",
    "MASKED_SPEC",
    "RAGGED",
    "ROWWISE",
    "WGRAD",
    "Case",
    "Result",
    "Target",
    "Timing",
    "main",
    "moe_spec",
    "nested_offsets",
    "offsets_tensor",
    "plot",
    "random_fp8",
    "random_nested_counts",
    "random_scales",
    "report",
    "selected_cases",
    "sustained_clock",
    "timed_launches",
    "with_directive",
]
