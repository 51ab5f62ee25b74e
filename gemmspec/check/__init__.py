"""Syntax tree to checked spec: resolve every name, classify every statement.

Each problem raises a `SpecError` that points at the token responsible and, where
the fix is not obvious, says what would make the spec valid (for instance which
requantization or transpose pass to declare).

Besides the language's rules it enforces the limits of `spec.py` (sizes the
kernels' integer types can hold, nesting and name lengths), so that everything it
accepts lowers and emits code that compiles. Every loop here is linear in the
spec, or bounded by one of those limits.

One module a concern, each with the errors of its rules; `driver.check_spec` runs
them in order over one `context.Context`, which they read and fill. They import the
context and one another (never the driver), and of the compiler only the stages
before this one.
"""

from .driver import check

__all__ = ["check"]
