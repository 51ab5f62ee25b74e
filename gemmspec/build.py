"""`gemmspec.build(spec)`: the whole compiler behind one call."""

from __future__ import annotations

from pathlib import Path

from . import ast
from .backward import derive_backward
from .codegen.emit import emit
from .errors import GemmspecError
from .explain import explain_text
from .pipeline import lower_file
from .spec import Spec


def build(spec: str | Path | ast.FileAst, name: str | None = None):
    """Compile a spec (path, .gspec text or parsed file) to a callable `Executable`.

    With several specs in one file, `name` picks one. The returned object has
    `.sources` (CUDA per file), `.schedule`, `.explain()` and is called with the
    run-time tensors as keyword arguments (see `argument_names()`).
    """
    from .runtime.executor import Executable

    lowered = lower_file(spec)
    if name is not None:
        lowered = [x for x in lowered if x.spec.name == name]
        if not lowered:
            raise GemmspecError(f"no spec named '{name}'")
    if len(lowered) > 1:
        names = ", ".join(x.spec.name for x in lowered)
        raise GemmspecError(f"the file defines several specs ({names}); pass name=...")
    x = lowered[0]
    return Executable(x.spec, x.schedule, emit(x.spec, x.schedule), explain=explain_text)


def build_backward(spec: Spec):
    """The derived backward spec, built (checked, lowered, emitted) as a callable
    Executable, with its `Backward` description; GemmspecError when nothing derives."""
    bw = derive_backward(spec)
    if not bw.statements:
        why = "; ".join(f"#{s.forward}: {s.reason}" for s in bw.skipped) or "no statement"
        raise GemmspecError(f"{spec.name}: no backward statement derived ({why})")
    return build(bw.source), bw
