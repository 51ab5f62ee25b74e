"""The compiler's front half as one plain function per stage, called in order.

parse -> check -> analyse -> lower. Each stage's output is a frozen value that
can be printed; `dump_dir` writes each one to a numbered file so a user can see
what every stage made of their spec.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from . import ast
from .analyse import NestDecision, analyse
from .check import check
from .errors import OutputError
from .explain import schedule_json
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


def write_if_changed(path: Path, content: str | bytes) -> None:
    """Leave files whose content is already right untouched (keeps build tools quiet).

    A changed file is replaced in one rename, so a failed write never leaves half a
    file behind; any failure comes back as an OutputError naming the path.
    """
    data = content.encode("utf-8") if isinstance(content, str) else content
    try:
        if path.is_dir():
            raise OutputError(f"cannot write {path}: a directory is in the way", str(path))
        if path.is_file() and path.read_bytes() == data:
            return
        _replace(path, data)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {_reason(e)}", str(path)) from e


def _replace(path: Path, data: bytes) -> None:
    # Mode 0o666 lets the umask decide, as for any file a build tool writes.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _reason(e: OSError) -> str:
    return e.strerror or str(e)


def output_dir_problem(path: Path) -> str | None:
    """Why `path` cannot be a folder to write into, judged without creating anything."""
    if path.exists() or path.is_symlink():
        if not path.is_dir():
            return "it exists and is not a directory"
        existing = path
    else:
        existing = next((p for p in path.parents if p.exists()), Path("."))
        if not existing.is_dir():
            return f"{existing} exists and is not a directory"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{existing} is not writable"
    return None


def check_output_dir(path: Path, what: str) -> None:
    """Raise an OutputError now, before any work, if `path` cannot hold output files."""
    problem = output_dir_problem(path)
    if problem is not None:
        raise OutputError(f"cannot write the {what} {path}: {problem}", str(path))


def make_output_dir(path: Path, what: str) -> None:
    """Create `path` and its parents, or raise an OutputError saying what is in the way."""
    check_output_dir(path, what)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise OutputError(f"cannot create the {what} {path}: {_reason(e)}", str(path)) from e


def lower_file(source: str | Path | ast.FileAst, dump_dir: str | Path | None = None) -> list[Lowered]:
    """Check, analyse and lower every spec of a file."""
    file = load(source)
    specs = check(file)
    out = []
    for spec in specs:
        spec = plan_gathers(spec)
        decision = analyse(spec)
        schedule = lower(spec, decision)
        out.append(Lowered(spec, decision, schedule))
    if dump_dir is not None:
        dump_front_half(file, out, Path(dump_dir))
    return out


def dump_front_half(file: ast.FileAst, lowered: list[Lowered], where: Path) -> None:
    make_output_dir(where, "--dump-ir directory")
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
