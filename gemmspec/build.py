"""`gemmspec.build(spec)`: the whole compiler behind one call."""

from __future__ import annotations

from pathlib import Path

from . import ast
from .backward import Backward
from .backward import derive_backward as _derive
from .codegen.emit import emit
from .errors import GemmspecError
from .explain import explain_text
from .pipeline import Lowered, lower_backward, lower_file
from .spec import Spec


def build(spec: str | Path | ast.FileAst, name: str | None = None):
    """Compile a spec (path, .gspec text or parsed file) to a callable `Executable`.

    With several specs in one file, `name` picks one. The returned object has
    `.sources` (CUDA per file), `.schedule`, `.explain()` and is called with the
    run-time tensors as keyword arguments (see `argument_names()`).
    """
    return _executable(_one(lower_file(spec), name))


def _one(lowered: list[Lowered], name: str | None) -> Lowered:
    """The spec named `name`, or the file's only spec."""
    if name is not None:
        lowered = [x for x in lowered if x.spec.name == name]
        if not lowered:
            raise GemmspecError(f"no spec named '{name}'")
    if len(lowered) > 1:
        names = ", ".join(x.spec.name for x in lowered)
        raise GemmspecError(f"the file defines several specs ({names}); pass name=...")
    return lowered[0]


def _executable(x: Lowered):
    from .runtime.executor import Executable

    return Executable(x.spec, x.schedule, emit(x.spec, x.schedule), explain=explain_text)


def _forward(spec, name: str | None) -> Spec:
    """A checked forward spec from what `build` takes, a `Spec`, or an `Executable`."""
    if isinstance(spec, Spec):
        return spec
    if isinstance(getattr(spec, "spec", None), Spec):  # an Executable (or a Lowered)
        return spec.spec
    return _one(lower_file(spec), name).spec


def derive_backward(spec, name: str | None = None) -> Backward:
    """The backward of a forward spec, derived as one more spec, `<name>_backward`.

    `spec` is what `build` takes (a path, .gspec text, a parsed file; `name` picks one
    of several specs), a checked `Spec` or an `Executable`. The result's `.source` is the
    backward spec's .gspec text ('' when no statement derives), `.text()` says what was
    derived and, statement by statement or gradient by gradient, what was not and why
    (`.skipped`, `.not_derived`); `.statements` lists the gradients, `.output_grads` the
    backward's inputs that are the forward outputs' gradients. docs/language.md
    ("Derived backward") has the rules.
    """
    return _derive(_forward(spec, name))


def build_backward(spec, name: str | None = None):
    """The derived backward spec, built (checked, lowered, emitted) as a callable
    `Executable`, with its `Backward` description: `(executable, backward)`.
    `spec` as for `derive_backward`; GemmspecError, with every reason, when nothing
    derives."""
    fwd = _forward(spec, name)
    bw, lowered = lower_backward(fwd)
    if lowered is None:
        why = "; ".join(f"#{s.forward}: {s.reason}" for s in bw.skipped) or "no statement"
        raise GemmspecError(f"{fwd.name}: no backward statement derived ({why})")
    return _executable(lowered), bw
