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
