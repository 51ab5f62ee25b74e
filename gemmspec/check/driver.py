"""The checks of one spec, in order, over one shared context; and of a whole file."""

from __future__ import annotations

from .. import ast
from ..errors import SpecError, locate, source_lines
from ..spec import Spec
from .context import Context
from .copies import check_copies
from .derivations import check_derivation
from .directives import check_directives
from .emittable import check_derived_emittable
from .fp8_output import check_pow2_scales
from .groups import declare_group
from .names import check_spec_name, declare_dim
from .row_passes import check_row_pass_targets
from .statements import check_statement
from .swiglu_grad import check_no_cycle
from .tensors import declare_tensor
from .views import check_view_uses
from .writes import check_outputs_do_not_alias, check_written_once


def check_spec(ctx: Context) -> Spec:
    """One spec: its declarations in source order, each derivation, each statement,
    then the rules across statements and passes, and the directives."""
    check_spec_name(ctx, ctx.ast.name)
    for d in ctx.ast.dims:
        declare_dim(ctx, d.name, d.size)
    for g in ctx.ast.groups:
        declare_group(ctx, g)
    for t in ctx.ast.tensors:
        declare_tensor(ctx, t)
    for t in ctx.ast.tensors:
        check_derivation(ctx, t)
    if not ctx.ast.statements:
        raise ctx.error(
            f"spec '{ctx.ast.name}' has no GEMM statement", ctx.ast.name.pos,
            "add one, e.g. y[t, n] = sum[k] x[t, k] * w[n, k]",
        )
    gemms = tuple(check_statement(ctx, i, s) for i, s in enumerate(ctx.ast.statements))
    gemms = check_copies(ctx, gemms)
    check_view_uses(ctx, gemms)
    check_row_pass_targets(ctx, gemms)
    check_no_cycle(ctx, gemms)
    check_written_once(ctx, gemms)
    check_pow2_scales(ctx, gemms)
    check_outputs_do_not_alias(ctx, gemms)
    check_derived_emittable(ctx, gemms)
    directives = check_directives(ctx, gemms)
    return Spec(
        name=ctx.ast.name.text,
        path=ctx.file.path,
        line=ctx.ast.name.pos.line,
        dims=tuple(ctx.dims.values()),
        groups=tuple(ctx.groups[n] for n in ctx.group_order),
        tensors=tuple(ctx.tensors.values()),
        gemms=gemms,
        directives=directives,
        where=ctx.where(ctx.ast.name.pos),
    )


def check(file: ast.FileAst) -> tuple[Spec, ...]:
    """Check every spec of a parsed file; raise the first `SpecError` found."""
    lines = source_lines(file.text)
    seen: dict[str, ast.Pos] = {}
    specs = []
    for s in file.specs:
        if s.name.text in seen:
            first = seen[s.name.text]
            raise SpecError(
                f"spec '{s.name.text}' is defined twice (first at {first.line}:{first.column})",
                locate(file.path, lines, s.name.pos.line, s.name.pos.column),
            )
        seen[s.name.text] = s.name.pos
        specs.append(check_spec(Context(file, s, lines)))
    if not specs:
        raise SpecError("no `gemm NAME { ... }` spec in this file", locate(file.path, lines, 1, 1))
    return tuple(specs)
