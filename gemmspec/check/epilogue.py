"""Epilogue operands: the per-leaf scalar, per-row weight and per-column bias applied
to a finished accumulator tile."""

from __future__ import annotations

from collections.abc import Callable

from .. import ast
from ..spec import EPILOGUE_KINDS, EPILOGUE_TYPES, Access, EpilogueOperand
from .context import Context


def check_epilogue(
    ctx: Context,
    s: ast.Statement,
    k_var: str,
    role_of: dict[str, str],
    batch_use: dict[str, str],
    k_group_axis: tuple[str, str] | None,
    access: Callable[[ast.Ref], Access],
) -> tuple[EpilogueOperand, ...]:
    """Classify each epilogue operand by the indices it takes: leaf axes only (a
    per-leaf scalar), the row index (a per-row weight) or, for the added term, the
    column index (a per-column bias). Everything else cannot be applied to a finished
    accumulator tile and is refused here."""
    found: dict[str, tuple[EpilogueOperand, ast.Ref]] = {}
    terms = [(f, False) for f in s.factors] + ([(s.bias, True)] if s.bias is not None else [])
    m_var = next(v for v, r in role_of.items() if r == "m")
    n_var = next(v for v, r in role_of.items() if r == "n")
    for ref, added in terms:
        t = ctx.tensors[ref.tensor.text]
        what = "added term" if added else "factor"
        for idx in ref.indices:
            v = idx.var.text
            if v == k_var:
                via = f"{idx.group}({v})" if idx.group else f"'{v}'"
                raise ctx.error(
                    f"epilogue {what} '{t.name}' is indexed by {via}, the contracted index: "
                    "an epilogue applies to the finished sum, which no longer has a "
                    f"'{v}'",
                    idx.pos,
                    f"scale the factor that '{v}' indexes instead (a separate pass), or "
                    f"index '{t.name}' by the output's indices only",
                )
            if idx.group is None and v not in role_of and v not in batch_use and not (
                k_group_axis and v == k_group_axis[1]
            ):
                raise ctx.error(
                    f"index '{v}' of epilogue {what} '{t.name}' indexes neither the output "
                    "nor a factor of the product",
                    idx.var.pos,
                    f"index '{t.name}' by the output's indices ({', '.join(str(i) for i in s.out.indices)})"
                    " or by group references such as expert(t)",
                )
        acc = access(ref)
        has_m = acc.axis_of_role("m") is not None
        has_n = acc.axis_of_role("n") is not None
        if added:
            if has_m or not has_n:
                shape = "per element" if has_m and has_n else "per row" if has_m else "per leaf"
                raise ctx.error(
                    f"the added term '{t.name}' is {shape}; the epilogue adds a per-column "
                    f"bias only, indexed by the column index '{n_var}' (and leaf axes)",
                    ref.tensor.pos,
                    f"declare it over the columns, e.g. {t.name}[{n_var}] or "
                    f"{t.name}[expert({m_var}), {n_var}]; a per-row or per-element term "
                    "needs its own statement or pass",
                )
            kind = "bias"
        elif has_n:
            raise ctx.error(
                f"factor '{t.name}' varies along the column index '{n_var}'; the epilogue "
                "multiplies by a per-leaf scalar and a per-row weight only",
                ref.tensor.pos,
                f"fold a per-column scale into the second factor's rows, or add it as a "
                f"bias (`+ {t.name}[...]`) if it is a term",
            )
        else:
            kind = "row" if has_m else "alpha"
        if kind in found:
            first = found[kind][1].tensor
            label = {"alpha": "per-leaf scalar", "row": "per-row weight", "bias": "bias"}[kind]
            raise ctx.error(
                f"a second {label} ('{t.name}'; the first is '{first}' at "
                f"{first.pos.line}:{first.pos.column}); the epilogue takes one of each kind",
                ref.tensor.pos,
                "multiply them into one tensor before the call",
            )
        if t.dtype not in EPILOGUE_TYPES:
            raise ctx.error(
                f"epilogue {what} '{t.name}' is {t.dtype}; epilogue operands are "
                f"{', '.join(EPILOGUE_TYPES)}",
                ref.tensor.pos,
                f"declare '{t.name}' as f32 (or bf16, f16)",
            )
        if t.layout.kind != "strided":
            raise ctx.error(
                f"epilogue {what} '{t.name}' is stored {t.layout}; epilogue operands take "
                "row_major, major(...) or strides(...) layouts",
                ref.tensor.pos,
                "declare it with a strided layout",
            )
        found[kind] = (EpilogueOperand(kind, acc, t.dtype), ref)
    return tuple(found[k][0] for k in EPILOGUE_KINDS if k in found)
