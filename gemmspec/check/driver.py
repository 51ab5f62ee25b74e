"""Syntax tree to checked spec: resolve every name, classify every statement.

Each problem raises a `SpecError` that points at the token responsible and, where
the fix is not obvious, says what would make the spec valid (for instance which
requantization or transpose pass to declare).

Besides the language's rules it enforces the limits of `spec.py` (sizes the
kernels' integer types can hold, nesting and name lengths), so that everything it
accepts lowers and emits code that compiles. Every loop here is linear in the
spec, or bounded by one of those limits.
"""

from __future__ import annotations

from .. import ast
from ..aliasing import ENUMERATE_LIMIT, UNDECIDED, element_collision
from ..errors import SpecError, locate, source_lines
from ..expr import Poly
from ..spec import FP8_OUT_BLOCK, FP8_TYPES, KERNEL_K_BLOCK, Directives, Gemm, Layout, Spec
from ..tiling import MAX_BIAS_WIDTH
from .context import SWIGLU_GRAD_OP, Context
from .copies import check_copies
from .derivations import check_derivation
from .emittable import check_derived_emittable
from .fp8_output import check_pow2_scales
from .groups import declare_group
from .names import check_identifier, declare_dim
from .row_passes import check_row_pass_targets
from .statements import check_statement
from .swiglu_grad import check_no_cycle
from .tensors import declare_tensor

# Derivations whose pre-pass writes the target's scales.
SCALING_OPS = frozenset({"requantize", "quantize"})

GATHER_MODES = ("auto", "fused", "prepass")  # the gather(...) directive's choices


class _Checker(Context):
    def check_spec(self) -> Spec:
        check_identifier(self, self.ast.name, "spec")
        for d in self.ast.dims:
            declare_dim(self, d.name, d.size)
        for g in self.ast.groups:
            declare_group(self, g)
        for t in self.ast.tensors:
            declare_tensor(self, t)
        for t in self.ast.tensors:
            check_derivation(self, t)
        if not self.ast.statements:
            raise self.error(
                f"spec '{self.ast.name}' has no GEMM statement", self.ast.name.pos,
                "add one, e.g. y[t, n] = sum[k] x[t, k] * w[n, k]",
            )
        gemms = tuple(check_statement(self, i, s) for i, s in enumerate(self.ast.statements))
        gemms = check_copies(self, gemms)
        check_row_pass_targets(self, gemms)
        check_no_cycle(self, gemms)
        self.check_written_once(gemms)
        check_pow2_scales(self, gemms)
        self.check_outputs_do_not_alias(gemms)
        check_derived_emittable(self, gemms)
        directives = self.check_directives(gemms)
        return Spec(
            name=self.ast.name.text,
            path=self.file.path,
            line=self.ast.name.pos.line,
            dims=tuple(self.dims.values()),
            groups=tuple(self.groups[n] for n in self.group_order),
            tensors=tuple(self.tensors.values()),
            gemms=gemms,
            directives=directives,
            where=self.where(self.ast.name.pos),
        )

    def check_written_once(self, gemms: tuple[Gemm, ...]) -> None:
        written: dict[str, int] = {}
        for g, s in zip(gemms, self.ast.statements):
            if g.out.tensor in written and not g.accumulate:
                raise self.error(
                    f"'{g.out.tensor}' is already written by the statement on line "
                    f"{written[g.out.tensor]}; use += to accumulate",
                    s.out.tensor.pos,
                )
            written.setdefault(g.out.tensor, g.line)
            for operand in g.reads:
                if operand == g.out.tensor:
                    raise self.error(
                        f"'{operand}' is both read and written by one statement", s.out.tensor.pos
                    )

    def check_outputs_do_not_alias(self, gemms: tuple[Gemm, ...]) -> None:
        """Two elements of a written tensor at one address would be a write race (and a
        wrong sum with +=). Decided exactly where it can be: a zero stride or two equal
        strides on dims of more than one element always alias; all-constant strides are
        checked in full."""
        written: dict[str, None] = {}
        for g in gemms:
            written.setdefault(g.out.tensor)
        read = {t for g in gemms for t in (g.a.tensor, g.b.tensor)}
        for t in self.tensors.values():
            if t.derived is not None and t.name in read:  # written by its pre-pass
                written.setdefault(t.name)
        for name in written:
            t, decl = self.tensors[name], self.tensor_ast[name]
            pos = decl.layout.pos if decl.layout else decl.name.pos
            self._check_injective(t.name, t.dims, t.layout, pos)
            if t.derived is not None and (t.derived.op in SCALING_OPS or t.derived.op == SWIGLU_GRAD_OP) and t.scale is not None:
                # A requantize or quantize pass writes the target's scales too.
                assert decl.scale is not None
                spos = decl.scale.layout.pos if decl.scale.layout else decl.scale.pos
                self._check_injective(f"{t.name}'s scale", t.dims, t.scale.layout, spos, t.scale.block)

    def _check_injective(
        self, owner: str, dims: tuple[str, ...], layout: Layout, pos: ast.Pos,
        block: tuple[int | str, ...] | None = None,
    ) -> None:
        if layout.kind != "strided":
            return  # segment_major stores every segment as its own dense block
        sizes: list[int | None] = []
        for i, name in enumerate(dims):
            size = self.dims[name].size
            if block is not None and isinstance(block[i], str):
                size = 1  # one block over the whole run-time dim
            elif size is not None and block is not None:
                size = -(-size // block[i])
            sizes.append(size)
        # Dims that can hold more than one element (a run-time dim may).
        wide = [i for i, n in enumerate(sizes) if n is None or n > 1]
        by_stride: dict[Poly, int] = {}
        for i in wide:
            stride = layout.strides[i]
            if not stride.terms:
                raise self.error(
                    f"'{owner}' is written, but its stride along {dims[i]} is 0: every "
                    f"element along {dims[i]} lands on one address (a write race)",
                    pos,
                    "give every dim of a written tensor its own non-zero stride",
                )
            if stride in by_stride:
                j = by_stride[stride]
                raise self.error(
                    f"'{owner}' is written, but {dims[j]} and {dims[i]} have the same stride "
                    f"{stride}: ({dims[j]}=1, {dims[i]}=0) and ({dims[j]}=0, {dims[i]}=1) land "
                    "on one address (a write race)",
                    pos,
                )
            by_stride[stride] = i
        if any(sizes[i] is None or not layout.strides[i].is_const for i in wide):
            return  # depends on run-time sizes: not decidable here
        clash = element_collision([(sizes[i], layout.strides[i].value) for i in wide])
        if clash is UNDECIDED:
            raise self.error(
                f"'{owner}' is written, and its strides interleave in a way that cannot be "
                f"checked for two elements at one address (more than {ENUMERATE_LIMIT} "
                "elements, three or more interleaved dims)",
                pos,
                "use strides where each one passes the farthest offset the smaller ones reach",
            )
        if clash is not None:
            first, second, offset = clash
            names = [dims[i] for i in wide]
            a = ", ".join(f"{n}={v}" for n, v in zip(names, first))
            b = ", ".join(f"{n}={v}" for n, v in zip(names, second))
            raise self.error(
                f"'{owner}' is written, but its layout puts two elements at one address: "
                f"({a}) and ({b}) are both at offset {offset} (a write race)",
                pos,
            )

    def check_directives(self, gemms: tuple[Gemm, ...]) -> Directives:
        force = None
        force_pos = None
        target = "sm_90a"
        tile = None
        gather_rows = "auto"
        scaled = any(t.scale is not None for t in self.ast.tensors)
        for d in self.ast.directives:
            if d.kind in ("flatten", "split"):
                if force is not None and force != d.kind:
                    raise self.error(
                        f"'{d.kind}' contradicts the earlier '{force}' directive", d.pos
                    )
                if force is None:
                    force_pos = d.pos
                force = d.kind
            elif d.kind == "target":
                if d.args[0] != "sm_90a":
                    raise self.error(
                        f"unsupported target '{d.args[0]}'; gemmspec emits code for sm_90a "
                        "(Hopper with wgmma)",
                        d.pos,
                    )
            elif d.kind == "tile":
                tm, tn = int(d.args[0]), int(d.args[1])
                if tm not in (64, 128) or tn % 8 or not 8 <= tn <= 256:
                    raise self.error(
                        f"tile({tm}, {tn}) is not a supported tile: the kernels take 64 or 128 "
                        "rows by a multiple of 8 columns from 8 to 256",
                        d.pos,
                    )
                fp8_out = [
                    (g, st) for g, st in zip(gemms, self.ast.statements)
                    if self.tensors[g.out.tensor].dtype in FP8_TYPES
                ]
                for g, st in fp8_out:
                    cols = tn // 2 if g.swiglu else tn
                    if cols % FP8_OUT_BLOCK:
                        what = f"{cols} output columns of a SwiGLU" if g.swiglu else f"{tn} columns"
                        raise self.error(
                            f"tile({tm}, {tn}) gives {what}, but the FP8 output "
                            f"'{g.out.tensor}' (line {st.pos.line}) is quantized per row and "
                            f"{FP8_OUT_BLOCK} columns: a tile covers whole blocks of it",
                            d.pos,
                            f"use tile({tm}, {2 * FP8_OUT_BLOCK if g.swiglu else FP8_OUT_BLOCK})",
                        )
                copying = next(((g, st) for g, st in zip(gemms, self.ast.statements) if g.copy), None)
                if copying is not None and tm != 128:
                    g, st = copying
                    raise self.error(
                        f"tile({tm}, {tn}) has {tm} rows, but the statement on line {st.pos.line} "
                        f"writes '{g.copy}' = copy({g.out.tensor}), whose [{KERNEL_K_BLOCK}, 1] scale "
                        f"blocks are one 128-row tile each",
                        d.pos,
                        f"use tile(128, {tn})",
                    )
                halves = bool(fp8_out) and all(g.swiglu for g, _ in fp8_out) and len(fp8_out) == len(gemms)
                if tn > 192 and scaled and not (halves and tn == 2 * FP8_OUT_BLOCK):
                    raise self.error(
                        f"tile({tm}, {tn}) is too wide for scaled FP8: those kernels keep two "
                        "accumulator tiles in registers, so at most 192 columns",
                        d.pos,
                    )
                bias = next((s.bias for s in self.ast.statements if s.bias is not None), None)
                if tn > MAX_BIAS_WIDTH and bias is not None:
                    raise self.error(
                        f"tile({tm}, {tn}) is too wide for a statement with a bias (+ "
                        f"{bias.tensor.text}[...] on line {bias.tensor.pos.line}): the bias loads "
                        f"and the accumulators fit the registers up to {MAX_BIAS_WIDTH} columns",
                        d.pos,
                        f"use tile({tm}, {MAX_BIAS_WIDTH}) or narrower",
                    )
                tile = (tm, tn)
            elif d.kind == "gather":
                mode = d.args[0]
                if mode not in GATHER_MODES:
                    raise self.error(
                        f"gather({mode}) is not a way to read gathered rows: use "
                        + ", ".join(f"gather({m})" for m in GATHER_MODES),
                        d.pos,
                    )
                if not any(g.gather for g in gemms):
                    raise self.error(
                        f"gather({mode}): no statement reads rows through an index tensor "
                        "(x[idx[t], k])",
                        d.pos,
                    )
                if gather_rows != "auto" and mode != gather_rows:
                    raise self.error(f"gather({mode}) contradicts the earlier gather({gather_rows})", d.pos)
                gather_rows = mode
        where = self.where(force_pos) if force_pos is not None else None
        return Directives(force, target, tile, gather_rows, force_where=where)


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
        specs.append(_Checker(file, s, lines).check_spec())
    if not specs:
        raise SpecError("no `gemm NAME { ... }` spec in this file", locate(file.path, lines, 1, 1))
    return tuple(specs)
