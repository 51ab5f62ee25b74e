"""Checked spec + nest decision -> flat grouped schedule.

For each planned launch this module writes the problem generator: leaf extents
from the groups, and every operand's and scale's address as polynomials over the
per-leaf symbols described in `schedule.py`. It also plans the pre-passes that
produce derived (quantized, requantized or transposed) operands.
"""

from __future__ import annotations

import heapq
from dataclasses import replace

from ..analyse import LaunchPlan, NestDecision
from ..errors import GemmspecError
from ..expr import ZERO, Poly
from ..spec import FP8_TYPES, KERNEL_K_BLOCK, Access, Gemm, Spec, Tensor
from .schedule import (
    COPY_BLOCK_START,
    EpilogueMap,
    Extent,
    IndexMap,
    KernelSignature,
    Launch,
    OperandMap,
    PostPass,
    PrePass,
    ProblemGenerator,
    ScaleMap,
    Schedule,
    SegmentPad,
)


def _dim_size(spec: Spec, name: str) -> Poly:
    d = spec.dim(name)
    return Poly.sym(name) if d.size is None else Poly.const(d.size)


def _group_chain(spec: Spec, group: str) -> tuple[str, ...]:
    """The group and its enclosing groups, outermost first."""
    return tuple(g.name for g in reversed(spec.enclosing(group)))


def _extent(spec: Spec, gemm: Gemm, role: str) -> Extent:
    rd = gemm.role(role)
    size = _dim_size(spec, rd.dim)
    if role == "n" and gemm.swiglu_halves:
        # Gate rows, then up rows: the GEMM has twice D's columns (never split by a group).
        return Extent(role, rd.dim, "fixed", size * 2)
    if rd.masked_by is not None:
        g = spec.group(rd.masked_by)
        return Extent(role, rd.dim, "masked", size, g.name, g.kind, g.tensor, (g.name,))
    if rd.group is None:
        return Extent(role, rd.dim, "fixed", size)
    g = spec.group(rd.group)
    if g.kind == "ragged":
        return Extent(role, rd.dim, "segment", size, g.name, g.kind, g.tensor, _group_chain(spec, g.name))
    return Extent(
        role, rd.dim, "segment", size, g.name, g.kind, None, (g.name,), g.starts, g.sizes
    )


def _rows(spec: Spec, gemm: Gemm, acc: Access) -> IndexMap | None:
    """Rows of `acc` read or written through an index tensor: leaf row i is row
    idx[start.m + i] (idx[i] when the rows are not split per leaf) of the tensor's dim."""
    axis = acc.axis_of_role("m")
    if axis is None or acc.uses[axis].index is None:
        return None
    offset = Poly.sym("start.m") if gemm.m.group is not None else ZERO
    bound = _dim_size(spec, spec.tensor(acc.tensor).dims[axis])
    return IndexMap(acc.uses[axis].index, offset, bound)


def _operand(spec: Spec, gemm: Gemm, acc: Access, roles: tuple[str, str]) -> OperandMap:
    t = spec.tensor(acc.tensor)
    lay = t.layout
    offset: Poly = ZERO
    stride: dict[str, Poly] = {}
    pad: SegmentPad | None = None
    segmented = {r for r in roles if gemm.role(r).group is not None}
    if lay.kind == "strided":
        for i, use in enumerate(acc.uses):
            if use.kind == "role":
                stride[use.role] = lay.strides[i]
                # A row read through an index tensor is found by its number, from the base.
                if use.role in segmented and use.index is None:
                    offset = offset + Poly.sym(f"start.{use.role}") * lay.strides[i]
            else:
                offset = offset + Poly.sym(f"g.{use.axis}") * lay.strides[i]
    else:
        # Segment-major: the leaf's segment is one block, its segmented dim contiguous.
        seg_role = acc.uses[lay.seg_axis].role
        others = [i for i in range(t.rank) if i != lay.seg_axis]
        block = _dim_size(spec, t.dims[others[0]]) * lay.other_strides[0] if others else Poly.const(1)
        if lay.padded:
            # Segments in whole multiples of `pad` rows: the leaf's block starts at its
            # padded prefix and its rows are its padded length apart.
            pad = SegmentPad(seg_role, lay.pad, lay.pad_rows)
            seg_start, seg_len = Poly.sym(pad.start), Poly.sym(pad.length)
        else:
            seg_start, seg_len = Poly.sym(f"start.{seg_role}"), Poly.sym(f"len.{seg_role}")
        offset = seg_start * block
        stride[seg_role] = Poly.const(1)
        for j, i in enumerate(others):
            use = acc.uses[i]
            s = lay.other_strides[j] * seg_len
            if use.kind == "role":
                stride[use.role] = s
                # Another dim the leaf splits (a column slice of a segment's block): the leaf
                # starts at its slice, as in a strided layout.
                if use.role in segmented and use.index is None:
                    offset = offset + Poly.sym(f"start.{use.role}") * s
            else:
                offset = offset + Poly.sym(f"g.{use.axis}") * s
    rows = _rows(spec, gemm, acc)
    # A view is read with its own strides from its source's buffer: the schedule names
    # the buffer, so every later stage binds the source's pointer.
    buffer = spec.storage(t.name)
    return OperandMap(
        buffer, t.dtype, roles, offset, (stride[roles[0]], stride[roles[1]]), rows, pad, _elements(spec, buffer)
    )


def _elements(spec: Spec, name: str) -> Poly:
    """The elements of tensor `name`'s storage (a padded segment_major layout's extra rows
    included)."""
    t = spec.tensor(name)
    count = Poly.const(1)
    for size in t.layout.storage_shape(tuple(_dim_size(spec, d) for d in t.dims)):
        count = count * size
    return count


def _scale(spec: Spec, gemm: Gemm, acc: Access, roles: tuple[str, str], block_start: str = "bstart") -> ScaleMap | None:
    """`block_start`: the per-leaf symbol of the leaf's first block along a split role
    (a copy's anchored blocks take their own, beside D's)."""
    t = spec.tensor(acc.tensor)
    sc = t.scale
    if sc is None:
        return None
    offset: Poly = ZERO
    stride: dict[str, Poly] = {}
    block: dict[str, int] = {}
    anchor: dict[str, str | None] = {}
    for i, use in enumerate(acc.uses):
        s = sc.layout.strides[i]
        if use.kind == "leaf":
            offset = offset + Poly.sym(f"g.{use.axis}") * s
            continue
        r = use.role
        if use.index is not None:
            # Gathered rows: the scale of row idx[t] is at block idx[t] / b, from the origin
            # (the checker refuses blocks anchored per segment along it, and per-channel or
            # per-tensor scales of a gathered operand).
            stride[r], block[r] = s, sc.block[i]
            anchor[r] = None
            continue
        group = gemm.role(r).group
        anchor[r] = sc.anchor if (sc.anchor is not None and sc.anchor == group) else None
        if sc.whole(i):
            # One block over the whole of a run-time dim: every element of every leaf reads
            # the grid's one entry along it, a zero stride (blocks of 1, never anchored).
            stride[r], block[r] = ZERO, 1
            continue
        stride[r], block[r] = s, sc.block[i]
        if group is not None:
            offset = offset + Poly.sym(f"{block_start}.{r}") * s
    return ScaleMap(
        sc.name,
        roles,
        (block[roles[0]], block[roles[1]]),
        offset,
        (stride[roles[0]], stride[roles[1]]),
        (anchor[roles[0]], anchor[roles[1]]),
        _rows(spec, gemm, acc),
    )


def _epilogue(spec: Spec, gemm: Gemm) -> tuple[EpilogueMap, ...]:
    """Each epilogue operand's per-leaf offset (its leaf axes, and the leaf's first row or
    column when that role is split per leaf) and its stride along the role it varies on."""
    out = []
    for e in gemm.epilogue:
        t = spec.tensor(e.access.tensor)
        offset: Poly = ZERO
        stride: Poly = ZERO
        for i, use in enumerate(e.access.uses):
            s = t.layout.strides[i]
            if use.kind == "leaf":
                offset = offset + Poly.sym(f"g.{use.axis}") * s
                continue
            stride = s
            if gemm.role(use.role).group is not None:
                offset = offset + Poly.sym(f"start.{use.role}") * s
        out.append(EpilogueMap(e.kind, spec.storage(t.name), t.dtype, offset, stride))
    return tuple(out)


def _swiglu_up(spec: Spec, gemm: Gemm, b: OperandMap, sb: ScaleMap | None) -> tuple[OperandMap | None, ScaleMap | None]:
    """A SwiGLU's up rows where they are not interleaved with the gate's: the second
    weight read with B's indices, `swiglu_up_rows` rows on (stacked halves of B). The
    kernel finds them from B's per-leaf offsets (a second tensor is declared as B is,
    the checker saw to it), so the maps must be B's shifted by those rows."""
    if not gemm.swiglu_halves:
        return None, None
    assert gemm.swiglu_up is not None
    acc = Access(gemm.swiglu_up, gemm.b.uses)
    u = _operand(spec, gemm, acc, ("n", "k"))
    rows = gemm.swiglu_up_rows
    u = replace(u, offset=u.offset + u.strides[0] * rows)
    su = _scale(spec, gemm, acc, ("n", "k"))
    if su is not None:
        assert rows % su.block[0] == 0, "the checker keeps the up half on whole scale blocks"
        su = replace(su, offset=su.offset + su.strides[0] * (rows // su.block[0]))
    if (u.offset, u.strides) != (b.offset + b.strides[0] * rows, b.strides) or (
        su is not None and sb is not None and (su.offset, su.strides, su.block)
        != (sb.offset + sb.strides[0] * (rows // sb.block[0]), sb.strides, sb.block)
    ):
        raise GemmspecError(f"{spec.name}: the up rows of '{gemm.swiglu_up}' do not lie where the gate's do")
    return u, su


def _is_k_major(op: OperandMap) -> bool:
    s = op.strides[1]
    return s.is_const and s.value == 1


def _launch(spec: Spec, plan: LaunchPlan, index: int, dim_order: dict[str, int]) -> Launch:
    """Launch `index` of `plan`; `dim_order` numbers the spec's run-time dims in order."""
    gemm = spec.gemms[plan.statement]
    extents = tuple(_extent(spec, gemm, r) for r in ("m", "n", "k"))
    # A as the kernel loads it: a gather pre-pass's copy, row for row, where one is planned.
    a = _operand(spec, gemm, gemm.loaded_a, ("m", "k"))
    b = _operand(spec, gemm, gemm.b, ("n", "k"))
    d = _operand(spec, gemm, gemm.out, ("m", "n"))
    sa = _scale(spec, gemm, gemm.loaded_a, ("m", "k"))
    sb = _scale(spec, gemm, gemm.b, ("n", "k"))
    # An FP8 output's scales, written by the epilogue (one per row and 128 columns).
    sd = _scale(spec, gemm, gemm.out, ("m", "n"))
    u, su = _swiglu_up(spec, gemm, b, sb)
    epilogue = _epilogue(spec, gemm)
    # `T = copy(D)`: T is indexed as D is; its anchored scale blocks start at `cbstart.m`.
    c = sc = None
    if gemm.copy is not None:
        copy_access = replace(gemm.out, tensor=gemm.copy)
        c = _operand(spec, gemm, copy_access, ("m", "n"))
        sc = _scale(spec, gemm, copy_access, ("m", "n"), COPY_BLOCK_START)
    # The offsets and counts the extents read, then the index tensors rows go through.
    index_maps = [op.rows for op in (a, d) if op.rows is not None]
    runtime_tensors = tuple(dict.fromkeys([*(e.tensor for e in extents if e.tensor), *(r.tensor for r in index_maps)]))
    polys = [a.offset, *a.strides, b.offset, *b.strides, d.offset, *d.strides]
    polys += [p for r in index_maps for p in (r.offset, r.bound)]
    polys += [p for e in epilogue for p in (e.offset, e.stride)]
    polys += [e.size for e in extents]
    for s in (sa, sb, sd, sc):
        if s is not None:
            polys += [s.offset, *s.strides]
    if c is not None:
        polys += [c.offset, *c.strides]
    # The run-time dims this launch's formulas name, in the spec's order. Looked up from
    # the formulas' symbols, not by scanning the spec's dims: a launch costs the size of
    # its own formulas, however many dims the spec declares.
    named = set().union(*(p.symbols for p in polys))
    runtime_dims = tuple(sorted((n for n in named if n in dim_order), key=dim_order.__getitem__))
    problems = ProblemGenerator(
        leaf_axes=gemm.leaf_axes,
        fixed_axes=plan.pinned,
        extents=extents,
        a=a,
        b=b,
        d=d,
        sa=sa,
        sb=sb,
        runtime_tensors=runtime_tensors,
        runtime_dims=runtime_dims,
        epilogue=epilogue,
        sd=sd,
        c=c,
        sc=sc,
        u=u,
        su=su,
    )
    fp8 = a.dtype in FP8_TYPES
    sig = KernelSignature(
        a_type=a.dtype,
        b_type=b.dtype,
        d_type=d.dtype,
        accumulate=gemm.accumulate,
        scaled=sa is not None,
        sa_block=sa.block if sa else (1, 1),
        sb_block=sb.block if sb else (1, 1),
        a_k_major=_is_k_major(a),
        b_k_major=_is_k_major(b),
        tile_m=plan.tile_m,
        tile_n=plan.tile_n,
        tile_k=128 if fp8 else 64,
        cluster=2 if plan.pair_rows else 1,
        multicast_b=plan.pair_rows,
        epilogue=tuple((e.kind, e.dtype) for e in epilogue),
        swiglu=gemm.swiglu,
        swiglu_halves=gemm.swiglu_halves,
        swiglu_up_rows=gemm.swiglu_up_rows,
        gather=a.rows is not None,
        scatter=d.rows is not None,
        d_scale_pow2=sd is not None and spec.tensor(d.tensor).scale.pow2,
        copy=c is not None,
        copy_scale_pow2=c is not None and spec.tensor(c.tensor).scale.pow2,
        fast_accum=fp8 and spec.directives.accumulation == "fast" and sa is not None and sa.block[1] != KERNEL_K_BLOCK,
    )
    return Launch(index, gemm.index, gemm.text, sig, problems, plan.why)


def _prepass(spec: Spec, t: Tensor, readers: tuple[int, ...]) -> PrePass:
    assert t.derived is not None
    src = spec.tensor(t.derived.source)
    if t.derived.op == "gather":  # rows through an index, scales (if any) with them
        return PrePass(
            kind="gather",
            source=src.name,
            target=t.name,
            source_layout=str(src.layout),
            target_layout=str(t.layout),
            source_scale=src.scale.name if src.scale else None,
            target_scale=t.scale.name if t.scale else None,
            source_block=src.scale.block if src.scale else (),
            target_block=t.scale.block if t.scale else (),
            anchor=None,
            reads_before=readers,
            index=t.derived.index,
        )
    assert t.scale is not None
    if t.derived.op == "swiglu_grad":  # quantized like quantize(...), from two sources
        return PrePass(
            kind="swiglu_grad",
            source=src.name,
            target=t.name,
            source_layout=str(src.layout),
            target_layout=str(t.layout),
            source_scale=None,
            target_scale=t.scale.name,
            source_block=(),
            target_block=t.scale.block,
            anchor=t.scale.anchor,
            reads_before=readers,
            other=t.derived.other,
        )
    assert src.scale is not None or t.derived.op == "quantize"
    return PrePass(
        kind=t.derived.op,
        source=src.name,
        target=t.name,
        source_layout=str(src.layout),
        target_layout=str(t.layout),
        source_scale=src.scale.name if src.scale else None,
        target_scale=t.scale.name,
        source_block=src.scale.block if src.scale else (),
        target_block=t.scale.block,
        anchor=t.scale.anchor,
        reads_before=readers,
        pow2=t.derived.pow2,
        index=t.derived.index,
        weight=t.derived.weight,
    )


def _needed_derived(spec: Spec, launches: tuple[Launch, ...]) -> set[str]:
    """The derived tensors a launch reads, and the derived tensors their passes read."""
    need = {
        t.name for t in spec.tensors if t.derived is not None
        and any(t.name in (x.problems.a.tensor, x.problems.b.tensor) for x in launches)
    }
    todo = list(need)
    while todo:
        d = spec.tensor(todo.pop()).derived
        for name in (d.source, d.other):
            if name is not None and spec.tensor(name).derived is not None and name not in need:
                need.add(name)
                todo.append(name)
    return need


def _step_io(spec: Spec, kind: str, x) -> tuple[set[str], set[str]]:
    """What a step reads and writes, by tensor name (a scale goes with its tensor)."""
    if kind == "launch":
        g = spec.gemms[x.statement]
        reads = {*g.reads, x.problems.a.tensor, x.problems.b.tensor}
        return reads | ({g.out.tensor} if g.accumulate else set()), set(g.writes)
    return set(x.reads), {x.target}


def step_order(spec: Spec, schedule: Schedule) -> tuple[tuple[str, int], ...]:
    """The order the steps run in: the default order (pre-passes, launches, post-passes),
    except that a pass waits for every step that writes what it reads, and a launch for
    the passes that write what it reads. Each step is taken as soon as it may run, the
    earliest in the default order first; launches keep their relative order (the analysis
    orders them writers first, passes between included, and `+=` launches into one tensor
    stay in it). A pass writes its target alone, so nothing else orders them. () when
    that is the default order (no pre-pass reads what a launch or a post-pass writes)."""
    steps = schedule.steps()
    io = [_step_io(spec, kind, x) for kind, _, x in steps]
    writers: dict[str, list[int]] = {}
    for i, (_, writes) in enumerate(io):
        for w in writes:
            writers.setdefault(w, []).append(i)
    if not any(kind == "prepass" and any(r in writers for r in io[i][0]) for i, (kind, _, _) in enumerate(steps)):
        return ()  # the pre-passes read only what the caller passes
    after: list[set[int]] = []
    last_launch = None
    for i, (reads, _) in enumerate(io):
        launch = steps[i][0] == "launch"
        deps = {j for r in reads for j in writers.get(r, ()) if j != i and not (launch and steps[j][0] == "launch")}
        if launch:
            if last_launch is not None:
                deps.add(last_launch)
            last_launch = i
        after.append(deps)
    waiting = [len(d) for d in after]
    unblocks: list[list[int]] = [[] for _ in steps]
    for i, deps in enumerate(after):
        for j in deps:
            unblocks[j].append(i)
    ready = [i for i, n in enumerate(waiting) if n == 0]
    heapq.heapify(ready)
    placed: list[int] = []
    while ready:
        i = heapq.heappop(ready)
        placed.append(i)
        for k in unblocks[i]:
            waiting[k] -= 1
            if waiting[k] == 0:
                heapq.heappush(ready, k)
    if len(placed) < len(steps):
        stuck = [f"{steps[i][0]} {steps[i][1]}" for i in range(len(steps)) if waiting[i]]
        raise GemmspecError(f"{spec.name}: the steps {', '.join(stuck)} wait for each other")
    default = schedule.default_order()
    order = tuple(default[i] for i in placed)
    return () if order == default else order


def lower(spec: Spec, decision: NestDecision) -> Schedule:
    dim_order = {name: i for i, name in enumerate(spec.runtime_dims)}
    launches = tuple(_launch(spec, p, i, dim_order) for i, p in enumerate(decision.plans))
    reasons = list(decision.reasons)
    prepasses = []
    needed = _needed_derived(spec, launches)
    for t in spec.tensors:
        if t.name not in needed:
            continue
        readers = tuple(
            launch.index
            for launch in launches
            if t.name in (launch.problems.a.tensor, launch.problems.b.tensor)
        )
        prepasses.append(_prepass(spec, t, readers))
        if readers:
            reasons.append(
                f"pre-pass: {t.name} = {t.derived} before launch"
                f"{'es' if len(readers) > 1 else ''} {', '.join(map(str, readers))}"
            )
        else:
            reasons.append(f"pre-pass: {t.name} = {t.derived}, read by another pre-pass")
    postpasses = []
    for t in spec.row_passes:
        rp = t.row_pass
        other = spec.tensor(rp.other) if rp.other else None
        postpasses.append(PostPass(
            rp.op, rp.source, t.name, rp.other,
            other.scale.name if other is not None and other.scale else None, rp.weight, rp.index,
        ))
    schedule = Schedule(spec.name, decision.decision, (), tuple(prepasses), launches, tuple(postpasses))
    order = step_order(spec, schedule)
    # A row pass runs after every launch unless a pre-pass waits for it: then where the
    # order puts it.
    where = "once the steps that write what it reads have run (see the order)" if order else "after every launch"
    reasons += [f"row pass: {t.name} = {t.row_pass} {where}" for t in spec.row_passes]
    if not order:
        return replace(schedule, reasons=tuple(reasons))
    reasons.append(
        "order: " + ", ".join(f"{kind} {i}" for kind, i in order)
        + " (a pre-pass reads what a launch or a post-pass writes)"
    )
    return replace(schedule, reasons=tuple(reasons), order=order)
