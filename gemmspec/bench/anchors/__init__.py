"""The anchors: other implementations of a case's function, timed beside gemmspec on
the inputs gemmspec ran on.

An anchor is an adapter `anchor(case_name, repeat, problem) -> list[Result]`: it lays
the row's inputs out as its library wants them (untimed), checks what it must, and
times its call. The case table names each row's anchors in order; the row's procedure
(gemmspec's side, in `measure.py`) hands them a `Problem` once gemmspec's rows are timed.
"""

from __future__ import annotations

from types import SimpleNamespace


class Problem(SimpleNamespace):
    """What a row gives its anchors: `work` (useful FLOPs, or bytes with `unit` "TB/s")
    and the tensors gemmspec read and wrote, as attributes named as the anchors read them
    (`x`, `xs`, `w`, `ws`, `y`, `lengths`, `offs`, ...)."""

    unit = "TFLOPS"
