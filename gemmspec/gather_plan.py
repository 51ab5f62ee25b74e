"""Whether a statement's gathered rows are read by the GEMM itself or copied first.

A statement `y[t, n] = sum[k] x[idx[t], k] * w[...]` reads row idx[t] of x for row t.
The GEMM can gather the rows in its loads (one TMA box per row, see the kernel ABI), but
then every column tile of the output gathers its rows again: with N = 4096 and 192-wide
tiles each row is gathered 22 times, one 128-byte box at a time, and the loads, not the
tensor cores, set the pace. A pre-pass that copies the rows once, row t of a dense
`[T, K]` workspace from row idx[t] of x (its scales beside it, one per row and 128
columns, tokens contiguous), costs one read and one write of T x K elements at memory
speed; the GEMM then loads its A tiles by TMA as for any dense operand.

`plan_gathers` decides per statement (the `gather(...)` directive overrides):

- the pre-pass where the rows are read by at least PREPASS_MIN_TILES column tiles of the
  widest tile (N known at compile time and at least PREPASS_MIN_TILES * 128), and the
  copy is simple: x two-dimensional with its columns contiguous, FP8 with [1, 128]
  scales or unscaled 16-bit;
- the fused gather otherwise (a narrow N reads each row about once anyway; the copy
  would only add its own traffic and its T x K workspace).

The copy is a derived tensor `<x>_<idx>_rows` of the spec (op "gather", its index the
statement's index tensor), lowered as a pre-pass like `requantize`; the statement keeps
A as written (`Gemm.a`: its semantics, the offsets and index checks, the reference),
and `Gemm.loaded_a` is what the kernel loads. Statements gathering the same rows of the
same tensor share one copy. An entry outside x's rows copies a zero row (the GEMM's own
gather reads zeros there too); the index check still runs before any GEMM.
"""

from __future__ import annotations

from dataclasses import replace

from .expr import Poly
from .spec import FP8_TYPES, Derivation, FreshNames, Gemm, Layout, Scale, Spec, Tensor

PREPASS_MIN_TILES = 4  # column tiles (of 128) that read each gathered row
SCALE_BLOCK = 128


def _size(spec: Spec, dim: str) -> Poly:
    d = spec.dim(dim)
    return Poly.const(d.size) if d.size is not None else Poly.sym(d.name)


def copyable(spec: Spec, g: Gemm) -> str | None:
    """Why the pre-pass cannot copy g's gathered rows (None: it can)."""
    x = spec.tensor(g.a.tensor)
    if x.rank != 2 or g.a.axis_of_role("m") != 0 or g.a.axis_of_role("k") != 1:
        return f"'{x.name}' is not a two-dimensional [rows, K] operand"
    if x.layout.kind != "strided" or x.layout.contiguous_axis() != 1:
        return f"the columns of '{x.name}' are not contiguous"
    if g.m.masked_by:
        return "its rows are masked"
    if x.dtype in FP8_TYPES:
        if x.scale is None or tuple(x.scale.block) != (1, SCALE_BLOCK) or x.scale.anchor:
            return f"'{x.name}' is FP8 without [1, {SCALE_BLOCK}] scales"
    elif x.scale is not None or x.dtype not in ("bf16", "f16"):
        return f"'{x.name}' is {x.dtype}"
    return None


def wants_prepass(spec: Spec, g: Gemm) -> tuple[bool, str]:
    """The automatic choice for g's gathered rows, and why."""
    n = spec.dim(g.n.dim).size
    if n is None:
        return False, f"N ('{g.n.dim}') is known only at run time: the GEMM gathers the rows in its loads"
    tiles = n // SCALE_BLOCK
    if tiles < PREPASS_MIN_TILES:
        return False, (
            f"N = {n} is under {PREPASS_MIN_TILES} column tiles of {SCALE_BLOCK}: each row is "
            "gathered about once in the GEMM's loads, a copy would only add its traffic"
        )
    return True, (
        f"N = {n} spans {tiles} column tiles of {SCALE_BLOCK}: gathered in the GEMM's loads, "
        "each row would be gathered again for every column tile; one copy of the rows costs less"
    )


def _copy_tensor(spec: Spec, g: Gemm, name: str) -> Tensor:
    x, idx = spec.tensor(g.a.tensor), spec.tensor(g.gather)
    rows, cols = idx.dims[0], x.dims[1]
    layout = Layout("strided", "row_major", strides=(_size(spec, cols), Poly.const(1)))
    scale = None
    if x.scale is not None:
        # One scale per row and 128 columns, rows contiguous (as the GEMMs read them best).
        grid = Layout("strided", f"major({rows})", strides=(Poly.const(1), _size(spec, rows)))
        scale = Scale(f"{name}_scale", x.scale.dtype, (1, SCALE_BLOCK), grid, None)
    return Tensor(name, x.dtype, (rows, cols), layout, scale, Derivation("gather", x.name, index=g.gather), x.line)


def plan_gathers(spec: Spec) -> Spec:
    """`spec` with a gather pre-pass planned for each statement that should have one."""
    mode = spec.directives.gather_rows
    if mode == "fused" or not any(g.gather for g in spec.gemms):
        return spec
    copies: dict[tuple[str, str], str] = {}
    names = FreshNames(spec)
    tensors = list(spec.tensors)
    gemms = []
    for g in spec.gemms:
        if g.gather and copyable(spec, g) is None and (mode == "prepass" or wants_prepass(spec, g)[0]):
            key = (g.a.tensor, g.gather)
            if key not in copies:
                copies[key] = names.fresh(f"{g.a.tensor}_{g.gather}_rows")
                tensors.append(_copy_tensor(spec, g, copies[key]))
            g = replace(g, a_gathered=copies[key])
        gemms.append(g)
    if not copies:
        return spec
    return replace(spec, tensors=tuple(tensors), gemms=tuple(gemms))


def gather_reason(spec: Spec, g: Gemm) -> str:
    """One line for explain: how g's gathered rows are read, and why."""
    why_not = copyable(spec, g)
    if g.a_gathered:
        how = "copied by a pre-pass into " + f"'{g.a_gathered}'"
        if spec.directives.gather_rows == "prepass":
            return f"{how} (gather(prepass))"
        return f"{how}: {wants_prepass(spec, g)[1]}"
    if spec.directives.gather_rows == "fused":
        return "gathered in the GEMM's loads (gather(fused))"
    if why_not is not None:
        return f"gathered in the GEMM's loads: a pre-pass cannot copy them ({why_not})"
    return f"gathered in the GEMM's loads: {wants_prepass(spec, g)[1]}"
