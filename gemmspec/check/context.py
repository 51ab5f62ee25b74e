"""What the checks of one spec share: the declarations so far, where an error points,
the queries several checks make, and the words of the language several of them read."""

from __future__ import annotations

from .. import ast
from ..errors import Fix, SourceLocation, SpecError, locate
from ..expr import ONE, Poly
from ..spec import KERNEL_K_BLOCK, Dim, Gemm, Group, Tensor

# What quantize(...) reads (the row passes and swiglu_grad read the same types).
QUANTIZE_SOURCE_TYPES = frozenset({"bf16", "f16", "f32"})

# `T = copy(S)`: a second FP8 output of the statement writing S, not a pre-pass.
COPY_OP = "copy"
# `= swiglu_grad(GU, DH)`: a pre-pass that may read what statements and row passes write.
SWIGLU_GRAD_OP = "swiglu_grad"
# quantize(SOURCE, pow2): the pass writes power-of-two scales (its only option).
QUANTIZE_POW2 = "pow2"
# requantize(SOURCE, rows = IDX, weight = W): row t of the target is W[t] times row
# IDX[t] of SOURCE (its two keywords, each optional).
REQUANTIZE_ROWS, REQUANTIZE_WEIGHT = "rows", "weight"

# Index variable -> (its dim, where it is first bound).
Binding = dict[str, tuple[str, ast.Pos]]


class Context:
    """The state of checking one spec, shared by every check: what is declared so far
    (filled in declaration order), the source lines that errors point into, and the
    questions about declared tensors that several checks ask."""

    def __init__(self, file: ast.FileAst, spec: ast.SpecAst, lines: list[str]):
        self.file = file
        self.ast = spec
        self.lines = lines  # split once per file, shared by every spec in it
        self.dims: dict[str, Dim] = {}
        self.dim_pos: dict[str, ast.Pos] = {}
        self.groups: dict[str, Group] = {}
        self.group_order: list[str] = []
        self.group_depth: dict[str, int] = {}  # 0 for a group not declared `within`
        self.group_rank: dict[str, int] = {}  # declaration order
        self.masked_by_count_dim: dict[str, str] = {}  # count dim -> first masked group
        self.tensors: dict[str, Tensor] = {}
        self.tensor_ast: dict[str, ast.TensorDecl] = {}
        self.names: dict[str, tuple[str, ast.Pos]] = {}  # every run-time-visible name
        # The largest value of every symbol a size or stride may hold: run-time dims
        # and the block counts of run-time dims cut into scale blocks.
        self.worst: dict[str, int] = {}

    def error(
        self, message: str, pos: ast.Pos, note: str | None = None, fix: Fix | None = None
    ) -> SpecError:
        return SpecError(message, self.where(pos), note, fix)

    def where(self, pos: ast.Pos) -> SourceLocation:
        return locate(self.file.path, self.lines, pos.line, pos.column)

    def size_poly(self, dim: str) -> Poly:
        size = self.dims[dim].size
        return Poly.sym(dim) if size is None else Poly.const(size)

    def scale_grid(self, t: Tensor) -> list[Poly]:
        """Blocks per dim of `t`'s scale grid, spelled as `check_scale` spells them."""
        assert t.scale is not None
        grid = []
        for d, b in zip(t.dims, t.scale.block):
            size = self.dims[d].size
            if isinstance(b, str):
                grid.append(ONE)
            elif size is not None:
                grid.append(Poly.const(-(-size // b)))
            else:
                grid.append(Poly.sym(d if b == 1 else f"ceil({d}/{b})"))
        return grid

    def anchor_along(self, t: Tensor, axis: int) -> str | None:
        """The group whose segments restart `t`'s scale blocks along dim `axis`, if any."""
        anchor = t.scale.anchor if t.scale else None
        if anchor is None or self.groups[anchor].dim != t.dims[axis]:
            return None
        return anchor

    def per_channel(self, gemm: Gemm) -> bool:
        a = self.tensors[gemm.a.tensor]
        k_axis = gemm.a.axis_of_role("k")
        return a.scale is not None and k_axis is not None and a.scale.block[k_axis] != KERNEL_K_BLOCK

    def covers(self, t: Tensor, axis: int) -> bool:
        """Whether one scale block covers the whole of `t`'s dim `axis`: a run-time dim
        named in the block, or a block at least the fixed dim's size."""
        assert t.scale is not None
        size = self.dims[t.dims[axis]].size
        return t.scale.whole(axis) or (size is not None and t.scale.block[axis] >= size)


def row_major(sizes: list[Poly], pad: int | None) -> list[Poly]:
    """Row-major strides for `sizes` (outermost first); `pad` rounds the row length up."""
    strides: list[Poly] = [ONE] * len(sizes)
    acc = ONE
    for i in range(len(sizes) - 1, -1, -1):
        strides[i] = acc
        size = sizes[i]
        if i == len(sizes) - 1 and pad is not None:
            size = Poly.const(-(-size.value // pad) * pad)
        acc = acc * size
    return strides
