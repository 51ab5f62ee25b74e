"""One exception family for everything gemmspec reports to a user.

`SpecError` carries a source location and renders as
``FILE:LINE:COL: error: message`` followed by the source line and a caret, the
way compilers users already know print their diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass


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


class SpecError(GemmspecError):
    """A problem in a .gspec file, located at a line and column."""

    def __init__(self, message: str, location: SourceLocation | None, note: str | None = None):
        super().__init__(message)
        self.message = message
        self.location = location
        self.note = note

    def render(self) -> str:
        loc = self.location
        if loc is None:
            head = f"error: {self.message}"
            return head if not self.note else f"{head}\n  note: {self.note}"
        lines = [f"{loc}: error: {self.message}"]
        if loc.source_line:
            gutter = f"{loc.line:>4} | "
            lines.append(gutter + loc.source_line.rstrip("\n"))
            caret_pad = " " * (len(gutter) + max(loc.column - 1, 0))
            lines.append(caret_pad + "^")
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
