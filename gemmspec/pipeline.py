"""The compiler's front half as one plain function per stage, called in order.

parse -> check -> analyse -> lower. Each stage's output is a frozen value that
can be printed; `gemmspec.output.lower_and_dump` writes each one to a numbered file
(`--dump-ir`) so a user can see what every stage made of their spec.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from . import ast
from .analyse import NestDecision, analyse
from .backward import Backward, derive_backward
from .check import check
from .gather_plan import plan_gathers
from .lower.lowering import lower
from .lower.schedule import Schedule
from .parse import parse, parse_file
from .spec import Spec


@dataclass(frozen=True)
class Lowered:
    """One spec carried through the front half."""

    spec: Spec
    decision: NestDecision
    schedule: Schedule


def load(source: str | Path | ast.FileAst) -> ast.FileAst:
    """A parsed file from a path, from .gspec text, or as given."""
    if isinstance(source, ast.FileAst):
        return source
    if isinstance(source, Path) or (isinstance(source, str) and "{" not in source):
        return parse_file(source)
    return parse(source, "<string>")


def lower_file(source: str | Path | ast.FileAst) -> list[Lowered]:
    """Check, analyse and lower every spec of a file."""
    file = load(source)
    specs = check(file)
    out = []
    for spec in specs:
        spec = plan_gathers(spec)
        decision = analyse(spec)
        schedule = lower(spec, decision)
        out.append(Lowered(spec, decision, schedule))
    return out


def backward_path(bw: Backward) -> str:
    """The file name the derived backward's text goes by (what `compile --backward`
    writes), so its explain and any error name it."""
    return f"{bw.spec_name}.gspec"


def lower_backward(spec: Spec, copies: bool = True) -> tuple[Backward, Lowered | None]:
    """The derived backward of `spec` (gemmspec.backward) and, where anything was derived,
    its text carried through the front half like any written spec (None otherwise)."""
    bw = derive_backward(spec, copies)
    return bw, lower_derived(bw)


def lower_derived(bw: Backward) -> Lowered | None:
    """A derived backward's text through the front half (None when nothing derived)."""
    if not bw.source:
        return None
    (lowered,) = lower_file(parse(bw.source, backward_path(bw)))
    return lowered
