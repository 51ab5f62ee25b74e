"""One exception family for everything gemmspec reports to a user.

`SpecError` carries a source location and renders as
``FILE:LINE:COL: error: message`` followed by the source line and a caret, the
way compilers users already know print their diagnostics.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass


def normalise_source(text: str) -> str:
    """The text every stage sees: no byte-order mark, and every line ending (CRLF or a
    lone CR) a single LF, so that the parser's line numbers and the caret printer agree."""
    if text.startswith("\ufeff"):
        text = text[1:]
    return text.replace("\r\n", "\n").replace("\r", "\n")


def source_lines(text: str) -> list[str]:
    """Lines as the parser counts them: only LF ends a line (a form feed, vertical tab,
    NEL or U+2028 does not, unlike `str.splitlines`). A final LF ends the last line
    rather than starting an empty one."""
    lines = text.split("\n")
    if len(lines) > 1 and lines[-1] == "":
        lines.pop()
    return lines


def source_line(text: str, line: int) -> str:
    """The 1-based `line` of `text` ("" past the end)."""
    lines = source_lines(text)
    return lines[line - 1] if 0 < line <= len(lines) else ""


def locate(file: str, text_lines: list[str], line: int, column: int) -> SourceLocation:
    """A location with its source line, from lines split by `source_lines`."""
    src = text_lines[line - 1] if 0 < line <= len(text_lines) else ""
    return SourceLocation(file, line, column, src)


# Source lines longer than this are echoed as a window around the caret.
_WINDOW = 160


def _printable(ch: str) -> str:
    # A control or separator character would break the echoed line or shift the caret:
    # show it as one space (a tab stays a tab so the caret pad can copy it).
    if ch == "\t":
        return ch
    return " " if unicodedata.category(ch) in ("Cc", "Cf", "Zl", "Zp") else ch


class GemmspecError(Exception):
    """Base of every error gemmspec raises on purpose."""


@dataclass(frozen=True)
class SourceLocation:
    file: str
    line: int  # 1-based
    column: int  # 1-based
    source_line: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.column}"


@dataclass(frozen=True)
class Edit:
    """Replace the source from (line, column) up to (end_line, end_column), exclusive,
    1-based, with `text`; an insertion where the two positions are equal."""

    line: int
    column: int
    end_line: int
    end_column: int
    text: str


@dataclass(frozen=True)
class Fix:
    """The change a note proposes, as edits of the source an editor or a test can apply:
    the note says it in words, this says it exactly. The edits do not overlap."""

    edits: tuple[Edit, ...]

    def apply(self, text: str) -> str:
        """`text` (the normalised source the error was found in) with the edits made."""
        lines = source_lines(text)
        starts = [0]
        for line in lines:
            starts.append(starts[-1] + len(line) + 1)

        def offset(line: int, column: int) -> int:
            return min(starts[min(line, len(starts)) - 1] + column - 1, len(text))

        out = text
        spans = sorted(
            ((offset(e.line, e.column), offset(e.end_line, e.end_column), e.text) for e in self.edits),
            reverse=True,
        )
        for start, end, new in spans:  # last first, so earlier offsets stay valid
            out = out[:start] + new + out[end:]
        return out


class SpecError(GemmspecError):
    """A problem in a .gspec file, located at a line and column; `fix`, where there is
    one, is the note's proposal as edits of the source."""

    def __init__(
        self,
        message: str,
        location: SourceLocation | None,
        note: str | None = None,
        fix: Fix | None = None,
    ):
        super().__init__(message)
        self.message = message
        self.location = location
        self.note = note
        self.fix = fix

    def render(self) -> str:
        loc = self.location
        if loc is None:
            head = f"error: {self.message}"
            return head if not self.note else f"{head}\n  note: {self.note}"
        lines = [f"{loc}: error: {self.message}"]
        if loc.source_line:
            gutter = f"{loc.line:>4} | "
            shown = "".join(_printable(c) for c in loc.source_line.rstrip("\n"))
            col = max(loc.column - 1, 0)
            if len(shown) > _WINDOW:  # a very long line: show the part around the caret
                start = max(0, min(col - _WINDOW // 2, len(shown) - _WINDOW))
                head = "..." if start else ""
                tail = "..." if start + _WINDOW < len(shown) else ""
                shown = head + shown[start : start + _WINDOW] + tail
                col += len(head) - start
            lines.append(gutter + shown)
            # Copy tabs into the pad so the caret lines up however wide a tab is shown.
            pad = "".join("\t" if c == "\t" else " " for c in shown[:col])
            lines.append(" " * len(gutter) + pad + "^")
        if self.note:
            lines.append(f"  note: {self.note}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.render()


class SpecErrors(GemmspecError):
    """Several located errors found in one pass; rendered one after another."""

    def __init__(self, errors: list[SpecError]):
        super().__init__(f"{len(errors)} error(s)")
        self.errors = errors

    def __str__(self) -> str:
        return "\n".join(e.render() for e in self.errors)


class CompileError(GemmspecError):
    """NVRTC (or nvcc) rejected emitted CUDA; carries the compiler log."""

    def __init__(self, message: str, log: str = ""):
        super().__init__(message if not log else f"{message}\n{log}")
        self.log = log


class ArgumentError(GemmspecError, ValueError):
    """A run-time argument (tensor, offsets, dims) does not fit the compiled spec."""


class DeviceUnavailableError(GemmspecError):
    """No usable CUDA device (or driver) where one is needed."""


class OutputError(GemmspecError):
    """An output file or folder cannot be written where the user asked for it."""

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path
