"""The compiler's front half as one plain function per stage, called in order.

parse -> check -> analyse -> lower. Each stage's output is a frozen value that
can be printed; `dump_dir` writes each one to a numbered file so a user can see
what every stage made of their spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from . import ast
from .analyse import NestDecision, analyse
from .check import check
from .explain import schedule_json
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


def write_if_changed(path: Path, text: str) -> None:
    """Leave files whose content is already right untouched (keeps build tools quiet)."""
    if path.exists() and path.read_text(encoding="utf-8") == text:
        return
    path.write_text(text, encoding="utf-8")


def lower_file(source: str | Path | ast.FileAst, dump_dir: str | Path | None = None) -> list[Lowered]:
    """Check, analyse and lower every spec of a file."""
    file = load(source)
    specs = check(file)
    out = []
    for spec in specs:
        decision = analyse(spec)
        schedule = lower(spec, decision)
        out.append(Lowered(spec, decision, schedule))
    if dump_dir is not None:
        dump_front_half(file, out, Path(dump_dir))
    return out


def dump_front_half(file: ast.FileAst, lowered: list[Lowered], where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    write_if_changed(where / "01-ast.txt", "\n\n".join(_ast_text(s) for s in file.specs) + "\n")
    write_if_changed(where / "02-spec.txt", "\n\n".join(str(x.spec) for x in lowered) + "\n")
    write_if_changed(where / "03-decision.txt", "\n\n".join(str(x.decision) for x in lowered) + "\n")
    write_if_changed(where / "04-schedule.txt", "\n\n".join(str(x.schedule) for x in lowered) + "\n")
    doc = [schedule_json(x.spec, x.schedule) for x in lowered]
    write_if_changed(where / "04-schedule.json", json.dumps(doc, indent=2) + "\n")


def _ast_text(s: ast.SpecAst) -> str:
    lines = [f"gemm {s.name} @ {s.name.pos}"]
    lines += [f"  {d}" for d in s.dims]
    lines += [f"  {g}" for g in s.groups]
    lines += [f"  {t}" for t in s.tensors]
    lines += [f"  {st}" for st in s.statements]
    lines += [f"  {d}" for d in s.directives]
    return "\n".join(lines)
