"""The offsets check that runs on the device, so a call never waits for the host.

Before anything reads them, one block of threads reads every run-time offsets and
counts tensor and checks what the host used to check after copying them back: rows
non-decreasing, a top-level ragged group starting at 0 and ending at its dim (at or
below it for a capacity group), nested rows spanning their outer segment exactly,
counts non-negative, and the rows of scales anchored per ragged group. It
writes one flag per check (0 or 1, every run, so no flag is stale) and a copy of each
tensor for the launches to read: the tensor itself when every check passed, zeros
otherwise, which makes every segment empty. A call with bad offsets therefore
computes no leaf, and `check=True` reads the flags back to raise a clear error.

It also reads every index tensor (rows read or written through it, `x[idx[t], k]`, or
read by `requantize(SOURCE, rows = idx)`) over the rows the statements use and flags a
row number outside the rows it picks from. The
launches read index tensors as they are: the kernels skip such a row themselves (read
as zeros, not stored), so a bad index never reaches memory outside its tensor; the
flag, like the others, empties every ragged segment and gives `check=True` its error.
Distinct row numbers (a scattered `=` output) are the caller's to keep; the host checks
them when it reads the index back (`prepare(check=True)`, `check=True`).

The check is a device function. Launch 0's leaf-table builder runs it first and builds
its table from the copies it has just written, which saves the call a launch; where a
pre-pass reads the checked offsets before that builder runs (or there is no builder),
it is a kernel of its own that runs first (`check_placement`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..lower.schedule import PrePass, Schedule
from ..spec import Spec, Tensor
from .names import check_symbol

THREADS = 256  # one block; a leaf-table builder that runs the check has as many threads
FUNCTION = "check_offsets"


@dataclass(frozen=True)
class Check:
    """One flag of the kernel: what it checks, said as the error message says it."""

    tensor: str  # the offsets/counts tensor or the scale it concerns
    message: str


@dataclass(frozen=True)
class AnchoredRows:
    """A scale whose blocks restart at each segment of a ragged group: its row count
    along `axis` follows from the offsets, so the device counts it."""

    scale: str
    axis: int
    group: str
    block: int
    # A copy's scales, written by the epilogue (a fresh output is sized for the most rows
    # the segments can need); the rows past the counted ones are not touched either way.
    written: bool = False


@dataclass(frozen=True)
class IndexRows:
    """Index tensor `tensor` (one entry per row of `rows`) picks rows of `bound`'s dim for
    the tensors `of`; `limit` is the group whose offsets end (a capacity group) or counts
    (a masked group) bound the entries that statements read, None for all of them."""

    tensor: str
    rows: str
    bound: str
    of: tuple[str, ...]
    limit: str | None


@dataclass(frozen=True)
class CheckParam:
    """One parameter of a kernel that runs the check: what its value is, by name."""

    name: str  # the C++ parameter's name
    ctype: str
    kind: str  # "flags", "input" (an offsets/counts tensor), "checked" (its copy), "index",
    #            "size" (a dim's size) or "rows" (an anchored scale's row count)
    ref: str  # the tensor, dim or scale
    axis: int = 0  # "rows": the scale's axis


@dataclass(frozen=True)
class ValidationKernel:
    """The check of a spec: a device function that every thread of one block runs, either
    as a kernel of its own (`source`) or at the start of a leaf-table builder."""

    name: str  # the symbol of the kernel of its own
    function: str  # the device function FUNCTION, for a kernel to call
    tensors: tuple[str, ...]  # offsets/counts tensors: (input, checked copy) pairs in this order
    sizes: tuple[str, ...]  # dims whose size the kernel compares against, in parameter order
    anchored: tuple[AnchoredRows, ...]  # one `long long` row count each, after the sizes
    checks: tuple[Check, ...]  # flags[i] is 1 when checks[i] failed
    indices: tuple[str, ...] = ()  # index tensors, one pointer each after the pairs
    copy_ints: tuple[int, ...] = ()  # the ints of each checked copy, in `tensors` order

    @property
    def params(self) -> tuple[CheckParam, ...]:
        """The parameters of a kernel that runs the check, in the function's order."""
        out = [CheckParam("flags", "int*", "flags", "")]
        for t in self.tensors:
            out += [CheckParam(f"in_{t}", "const int*", "input", t), CheckParam(f"checked_{t}", "int*", "checked", t)]
        out += [CheckParam(f"index_{t}", "const int*", "index", t) for t in self.indices]
        out += [CheckParam(f"size_{d}", "long long", "size", d) for d in self.sizes]
        out += [
            CheckParam(f"rows_{a.scale}_{a.axis}", "long long", "rows", a.scale, a.axis) for a in self.anchored
        ]
        return tuple(out)

    @property
    def inline_params(self) -> tuple[CheckParam, ...]:
        """The parameters of a GEMM that runs the check in each block (its table built in
        the kernel): no checked copies (each block's are in its shared memory) and the
        flags as `check_flags` (block 0 writes them)."""
        return tuple(
            replace(p, name="check_flags") if p.kind == "flags" else p for p in self.params if p.kind != "checked"
        )

    def declarations(self, params: tuple[CheckParam, ...] | None = None) -> str:
        """The parameters as a kernel declares them (the pointers __restrict__: a checked
        copy is read, after the check, only through pointers made from its own)."""
        return ", ".join(
            f"{p.ctype} __restrict__ {p.name}" if p.ctype.endswith("*") else f"{p.ctype} {p.name}"
            for p in (self.params if params is None else params)
        )

    def call(self) -> str:
        return f"{FUNCTION}({', '.join(p.name for p in self.params)});"

    @property
    def source(self) -> str:
        """The check as a kernel of its own (one block of THREADS threads)."""
        return "\n".join(
            [
                '#include "gemmspec_ptx.cuh"',  # the index scan's helper
                "",
                f"namespace {self.name}_impl {{",
                "",
                self.function,
                f"}}  // namespace {self.name}_impl",
                "",
                f'extern "C" __global__ void __launch_bounds__({THREADS})',
                f"{self.name}({self.declarations()}) {{",
                f"  {self.name}_impl::{self.call()}",
                "}",
                "",
            ]
        )


def group_chain_count(spec: Spec, group: str) -> int:
    """Rows of a group's tensor: the product of the counts of its enclosing groups."""
    return math.prod(g.count for g in spec.enclosing(group)[1:])


def anchored_rows(spec: Spec, t: Tensor) -> tuple[AnchoredRows, ...]:
    """The axes of `t`'s scale grid whose length depends on run-time offsets."""
    sc = t.scale
    if sc is None or sc.anchor is None:
        return ()
    g = spec.group(sc.anchor)
    if g.kind != "ragged":
        return ()
    return tuple(
        AnchoredRows(sc.name, axis, g.name, sc.block[axis], t.copy_of is not None)
        for axis, d in enumerate(t.dims)
        if d == g.dim
    )


def _rows_limit(spec: Spec, group: str | None, masked: str | None) -> str | None:
    """The group bounding the rows a statement reads: a masked group, or the outermost
    ragged group of its rows when that is a capacity (rows past its end are not read)."""
    if masked is not None:
        return masked
    if group is None:
        return None
    outermost = spec.enclosing(group)[-1]
    return outermost.name if outermost.capacity else None


def index_rows(spec: Spec) -> tuple[IndexRows, ...]:
    """Every (index tensor, dim it picks rows of), with the tensors it picks them of and
    the rows the statements read: all of them if any statement reads all."""
    found: dict[tuple[str, str], IndexRows] = {}
    uses = []
    for g in spec.gemms:
        for acc, name in ((g.a, g.gather), (g.out, g.scatter)):
            if name is not None:
                bound = spec.tensor(acc.tensor).dims[acc.axis_of_role("m")]
                uses.append((name, bound, acc.tensor, _rows_limit(spec, g.m.group, g.m.masked_by)))
    # requantize(SOURCE, rows = IDX) that a statement reads: IDX picks SOURCE's rows for
    # the rows of the target's segments (its pass reads a zero row past SOURCE, as a
    # gathered GEMM row does; the check gives the call its error).
    read = {t for g in spec.gemms for t in (g.a.tensor, g.b.tensor)}
    for t in spec.tensors:
        if t.derived is not None and t.derived.op == "requantize" and t.derived.index and t.name in read:
            group = t.layout.group if t.layout.kind == "segment_major" else None
            source = spec.tensor(t.derived.source)
            uses.append((t.derived.index, source.dims[0], source.name, _rows_limit(spec, group, None)))
    for name, bound, tensor, limit in uses:
        key = (name, bound)
        if key in found:
            old = found[key]
            same = old.limit == limit
            found[key] = IndexRows(
                name, old.rows, bound, tuple(dict.fromkeys((*old.of, tensor))), limit if same else None
            )
        else:
            found[key] = IndexRows(name, spec.tensor(name).dims[0], bound, (tensor,), limit)
    return tuple(found.values())


def validation_kernel(spec: Spec) -> ValidationKernel | None:
    """The check kernel of a spec, or None when it reads no group known only at run time
    and no index tensor picks rows."""
    groups = list(spec.read_groups)
    indexed = index_rows(spec)
    if not groups and not indexed:
        return None
    index = {g.name: i for i, g in enumerate(groups)}
    sizes: list[str] = []
    for g in groups:
        if g.kind == "ragged" and g.within is None and g.dim not in sizes:
            sizes.append(g.dim)
    anchored = tuple(a for t in spec.tensors if t.derived is None for a in anchored_rows(spec, t))
    checks: list[Check] = []
    body: list[str] = []

    def flag(cond: str, check: Check) -> None:
        # Every thread takes part in the vote, so the flag is the block's verdict.
        body.append(f"  {{ const int f = __syncthreads_or({cond}); bad |= f;")
        body.append(f"    if (threadIdx.x == 0) flags[{len(checks)}] = f ? 1 : 0; }}")
        checks.append(check)

    for g in groups:
        i = index[g.name]
        rows = group_chain_count(spec, g.name)
        if g.kind == "masked":
            body.append(f"  {{ int neg = 0; for (int s = threadIdx.x; s < {g.count}; s += blockDim.x) neg |= in{i}[s] < 0;")
            flag("neg", Check(g.tensor, f"'{g.tensor}' holds a negative count"))
            body.append("  }")
            continue
        c = g.count
        body.append(f"  {{ int down = 0, ends = 0;  // {g.name}: {rows} row(s) of {c + 1}")
        body.append(f"    for (int s = threadIdx.x; s < {rows * c}; s += blockDim.x) {{")
        body.append(f"      const int r = s / {c}, e = s % {c};")
        body.append(f"      down |= in{i}[r * {c + 1} + e] > in{i}[r * {c + 1} + e + 1];")
        body.append("    }")
        if g.within is None:
            size = f"size{sizes.index(g.dim)}"
            last = f"in{i}[{c}]"
            if g.capacity:
                body.append(f"    ends = in{i}[0] != 0 || {last} < 0 || {last} > {size};")
                what = f"end at or below {g.dim}"
            else:
                body.append(f"    ends = in{i}[0] != 0 || {last} != {size};")
                what = f"end at {g.dim}"
            flag("down", Check(g.tensor, f"'{g.tensor}' must be non-decreasing along each row"))
            flag("ends", Check(g.tensor, f"'{g.tensor}' must start at 0 and {what}"))
        else:
            outer = spec.group(g.within)
            body.append(f"    for (int r = threadIdx.x; r < {rows}; r += blockDim.x) {{")
            if outer.kind == "ragged":
                o, oc = index[outer.name], outer.count
                body.append(f"      const int at = (r / {oc}) * {oc + 1} + r % {oc};")
                body.append(f"      const long long lo = in{o}[at], hi = in{o}[at + 1];")
            else:
                starts = ", ".join(str(s) for s in outer.starts)
                ends = ", ".join(str(s + n) for s, n in zip(outer.starts, outer.sizes))
                body.append(f"      const long long starts[] = {{{starts}}}, stops[] = {{{ends}}};")
                body.append("      const long long lo = starts[r], hi = stops[r];")
            body.append(f"      ends |= in{i}[r * {c + 1}] != lo || in{i}[r * {c + 1} + {c}] != hi;")
            body.append("    }")
            flag("down", Check(g.tensor, f"'{g.tensor}' must be non-decreasing along each row"))
            flag("ends", Check(g.tensor, f"'{g.tensor}': each row must span its '{g.within}' segment exactly"))
        body.append("  }")

    indices = tuple(dict.fromkeys(x.tensor for x in indexed))
    for x in indexed:
        j = indices.index(x.tensor)
        for d in (x.rows, x.bound):
            if d not in sizes:
                sizes.append(d)
        n, bound = f"size{sizes.index(x.rows)}", f"size{sizes.index(x.bound)}"
        body.append(f"  {{ // '{x.tensor}': row numbers of {x.bound}, for {', '.join(x.of)}")
        body.append(f"    long long n = {n};")
        if x.limit is not None:
            lg = spec.group(x.limit)
            i = index[lg.name]
            if lg.kind == "masked":  # rows [0, count) of each batch entry
                body.append("    long long most = 0;")
                body.append(f"    for (int e = 0; e < {lg.count}; ++e) most = max(most, (long long)in{i}[e]);")
                body.append("    n = most < n ? (most < 0 ? 0 : most) : n;")
            else:  # a capacity group: rows past its last offset are not read
                body.append(f"    const long long end = in{i}[{lg.count}];")
                body.append("    n = end < n ? (end < 0 ? 0 : end) : n;")
        body.append(f"    const int outside = gs_rows_outside(ix{j}, n, {bound});")
        flag("outside", Check(
            x.tensor,
            f"'{x.tensor}' holds a row number outside the {x.bound} rows of "
            + " and ".join(f"'{t}'" for t in x.of),
        ))
        body.append("  }")

    for j, a in enumerate(anchored):
        g = spec.group(a.group)
        i, c = index[g.name], g.count
        rows = group_chain_count(spec, g.name)
        body.append(f"  {{ // rows of '{a.scale}' along axis {a.axis}: ceil(length / {a.block}) per segment")
        body.append("    if (threadIdx.x == 0) counted = 0;")
        body.append("    __syncthreads();")
        body.append("    unsigned long long mine = 0;")
        body.append(f"    for (int s = threadIdx.x; s < {rows * c}; s += blockDim.x) {{")
        body.append(f"      const int r = s / {c}, e = s % {c};")
        body.append(f"      const long long n = (long long)in{i}[r * {c + 1} + e + 1] - in{i}[r * {c + 1} + e];")
        body.append(f"      if (n > 0) mine += (unsigned long long)((n + {a.block - 1}) / {a.block});")
        body.append("    }")
        body.append("    atomicAdd(&counted, mine);")
        body.append("    __syncthreads();")
        # A negative count is one the caller does not know (the C++ launcher is given
        # pointers, not shapes): not compared.
        # At least the counted rows: rows past them are neither read nor written (a copy's
        # scales are allocated for the most rows any counts need, and a backward reads them
        # as the forward wrote them).
        body.append(f"    const int wrong = rows{j} >= 0 && counted > (unsigned long long)rows{j};")
        flag("wrong", Check(a.scale, f"scale '{a.scale}' must have at least one row per {a.block} positions of each '{a.group}' segment along axis {a.axis}"))
        body.append("  }")

    params = ["int* __restrict__ flags"]
    for g in groups:
        i = index[g.name]
        params += [f"const int* __restrict__ in{i}", f"int* __restrict__ out{i}"]
    params += [f"const int* __restrict__ ix{j}" for j in range(len(indices))]
    params += [f"long long size{k}" for k in range(len(sizes))]
    params += [f"long long rows{j}" for j in range(len(anchored))]
    copies, copy_ints = [], []
    for g in groups:
        i = index[g.name]
        n = group_chain_count(spec, g.name) * (g.count + (1 if g.kind == "ragged" else 0))
        copy_ints.append(n)
        copies.append(f"  for (int s = threadIdx.x; s < {n}; s += blockDim.x) out{i}[s] = bad ? 0 : in{i}[s];")
    function = "\n".join(
        [
            f"// Run-time offsets and counts of spec {spec.name}, checked on the device (see",
            "// gemmspec/codegen/validate.py): one flag per check, and a checked copy of each",
            "// tensor that is all zeros (every segment empty) when any check failed. Every",
            f"// thread of a block of {THREADS} takes part.",
            *(
                ["// Index tensors are read, not copied: the kernels skip a row number outside its rows."]
                if indices else []
            ),
            f"__device__ __forceinline__ void {FUNCTION}({', '.join(params)}) {{",
            *(["  __shared__ unsigned long long counted;"] if anchored else []),
            "  int bad = 0;",
            *body,
            *copies,
            "}",
            "",
        ]
    )
    v = ValidationKernel(
        check_symbol(spec.name), function, tuple(g.tensor for g in groups), tuple(sizes), anchored,
        tuple(checks), indices, tuple(copy_ints),
    )
    return v


@dataclass(frozen=True)
class CheckPlacement:
    """Where the check runs: in launch 0's leaf-table builder (`fused`), which then builds
    its table from the copies it has just checked, or as a kernel of its own, first."""

    fused: bool
    reason: str

    def __str__(self) -> str:
        return self.reason


def prepass_offsets(spec: Spec, p: PrePass) -> str | None:
    """The run-time offsets tensor a pre-pass reads (it then reads the checked copy): a
    requantize (or a swiglu_grad into 128x1 blocks) into a segment_major layout restarts its
    scale blocks at each segment."""
    if p.kind not in ("requantize", "swiglu_grad"):
        return None
    dst = spec.tensor(p.target)
    if dst.layout.kind != "segment_major":
        return None
    return spec.group(dst.layout.group).tensor or None


def needs_check(spec: Spec) -> bool:
    """Whether the spec reads a group known only at run time or any index tensor picks rows."""
    return bool(spec.read_groups) or bool(index_rows(spec))


def check_placement(spec: Spec, schedule: Schedule) -> CheckPlacement | None:
    """Where the check of `spec` runs (None: it has none). Fused into the first builder
    unless something that reads the checked copies runs before it."""
    if not needs_check(spec):
        return None
    for i, p in enumerate(schedule.prepasses):
        t = prepass_offsets(spec, p)
        if t is not None:
            return CheckPlacement(
                False,
                f"a kernel of its own, first: pre-pass {i} ({p.kind} {p.source} -> {p.target}) "
                f"reads the checked '{t}' before any leaf-table builder runs",
            )
    if not schedule.launches:
        return CheckPlacement(False, "a kernel of its own: there is no leaf-table builder to run it")
    return CheckPlacement(True, "in launch 0's leaf-table builder, before it builds its table")
