"""Flat grouped schedule -> CUDA source, one translation unit per launch.

Each launch becomes a leaf-table builder (evaluating the problem generator's
polynomials on the device from the run-time offsets tensors) plus the grouped
GEMM kernel for its signature. Pre-passes become the FP8 requantize/transpose
kernels and the quantize kernel. The device check of the run-time offsets
(validate.py) runs in launch 0's builder, or as a kernel of its own where a pre-pass
reads the checked offsets first. Python computes every expression; the templates only
lay them out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import GemmspecError
from ..expr import Poly
from ..lower.schedule import (
    Extent,
    KernelSignature,
    Launch,
    OperandMap,
    PostPass,
    PrePass,
    ProblemGenerator,
    Schedule,
    unit_shape,
)
from ..spec import KERNEL_K_BLOCK, Spec, Tensor
from .kernels import (
    ELEMENT_BYTES,
    ENV,
    INLINE_MAX_LEAVES,
    INLINE_STATIC_BYTES,
    SCATTER_STEPS,
    GatherRowsKernelConfig,
    GemmKernelConfig,
    QuantizeKernelConfig,
    RequantKernelConfig,
    RowPassKernelConfig,
    TransposeKernelConfig,
    gemm_kernel_name,
    map_specs,
    render_gather_rows,
    render_gemm,
    render_quantize,
    render_requant,
    render_row_pass,
    render_transpose,
)
from .names import gemm_symbol, postpass_symbol, prepass_symbol, table_symbol
from .validate import THREADS as CHECK_THREADS
from .validate import CheckPlacement, ValidationKernel, check_placement, validation_kernel

TABLE_THREADS = 256  # the leaf-table builder is one block of this many threads
# A builder that runs the offsets check runs it with its own threads: one block of either.
assert TABLE_THREADS == CHECK_THREADS

HEADER = '#include "gemmspec_ptx.cuh"\n'
# The leaf table's records (docs/kernel-abi.md): sizeof(GsLeaf) per leaf and the sentinel;
# after the sentinel, per leaf, sizeof(GsEpilogue), then sizeof(GsGather) (defined in the
# kernels that gather or scatter rows).
LEAF_RECORD_BYTES = 144
EPILOGUE_RECORD_BYTES = 48
GATHER_RECORD_BYTES = 32
# Then sizeof(GsDScale) (defined in the kernels with an FP8 D): where its scales go.
DSCALE_RECORD_BYTES = 32
# Then sizeof(GsCopy) (defined in the kernels that write D's copy): where the copy goes.
COPY_RECORD_BYTES = 32


class EmitError(GemmspecError):
    """The schedule needs something the kernel templates cannot express yet."""


def c_symbol(sym: str) -> str:
    """Per-leaf symbols become locals; run-time dims become `dim_<name>` parameters."""
    if "." in sym:
        kind, name = sym.split(".", 1)
        if kind.startswith(("pstart", "plen")):  # pstart16.k -> pstart16_k
            return f"{kind}_{name}"
        return {"g": "g_", "start": "start_", "len": "len_", "bstart": "bstart_", "cbstart": "cbstart_"}[kind] + name
    return f"dim_{sym}"


def c_expr(p: Poly) -> str:
    if not p.terms:
        return "0LL"
    parts = []
    for mono, coeff in p.terms:
        factors = [f"{coeff}LL"] + [c_symbol(s) for s in mono]
        if coeff == 1 and mono:
            factors = factors[1:]
        parts.append(" * ".join(factors))
    return "(" + " + ".join(parts) + ")"


def tensor_param(name: str) -> str:
    return f"p_{name}"


@dataclass(frozen=True)
class EmittedLaunch:
    launch: Launch
    gemm: GemmKernelConfig
    table_kernel: str
    table_params: tuple[str, ...]  # run-time tensors, in parameter order
    dim_params: tuple[str, ...]  # run-time dims, in parameter order
    leaf_count: int
    source: str
    check: ValidationKernel | None = None  # the offsets check its builder runs first

    @property
    def kernels(self) -> tuple[str, ...]:
        """The kernels of the launch's source: its leaf-table builder and its GEMM, or the
        GEMM alone where it builds the table itself."""
        return (self.gemm.name,) if self.gemm.inline_table else (self.table_kernel, self.gemm.name)


@dataclass(frozen=True)
class EmittedCheck:
    """The device check of a spec's offsets and index tensors, and where it runs."""

    kernel: ValidationKernel
    placement: CheckPlacement

    @property
    def fused(self) -> bool:
        return self.placement.fused


@dataclass(frozen=True)
class EmittedPrePass:
    prepass: PrePass
    # What the source bakes in.
    config: TransposeKernelConfig | QuantizeKernelConfig | RequantKernelConfig | GatherRowsKernelConfig
    source: str

    @property
    def kernel(self) -> str:
        return self.config.name


@dataclass(frozen=True)
class EmittedPostPass:
    postpass: PostPass
    config: RowPassKernelConfig
    source: str

    @property
    def kernel(self) -> str:
        """The kernel that writes the target (scatter_add's index kernels run before it)."""
        return self.config.name

    @property
    def kernels(self) -> tuple[str, ...]:
        """Every kernel of the pass, in launch order."""
        if self.config.kind == "scatter_add":
            return tuple(self.config.name + suffix for _, suffix in SCATTER_STEPS)
        return (self.config.name,)


@dataclass(frozen=True)
class EmittedProgram:
    spec: str
    prepasses: tuple[EmittedPrePass, ...]
    launches: tuple[EmittedLaunch, ...]
    check: EmittedCheck | None = None
    postpasses: tuple[EmittedPostPass, ...] = ()
    # The order the steps run in where it is not the default (Schedule.order).
    order: tuple[tuple[str, int], ...] = ()

    def steps(self) -> tuple[tuple[str, int, object], ...]:
        """Every step in the order it runs: (kind, index among its kind, the emitted
        pre-pass, launch or post-pass)."""
        items = {"prepass": self.prepasses, "launch": self.launches, "postpass": self.postpasses}
        order = self.order or tuple((kind, i) for kind, xs in items.items() for i in range(len(xs)))
        return tuple((kind, i, items[kind][i]) for kind, i in order)

    def sources(self) -> dict[str, str]:
        """File name -> CUDA source."""
        out = {}
        if self.check is not None and not self.check.fused:
            out[f"{self.spec}_check.cu"] = self.check.kernel.source
        out.update({f"{self.spec}_prepass{i}.cu": p.source for i, p in enumerate(self.prepasses)})
        out.update({f"{self.spec}_launch{x.launch.index}.cu": x.source for x in self.launches})
        out.update({f"{self.spec}_postpass{i}.cu": p.source for i, p in enumerate(self.postpasses)})
        return out


def _flat_index(axes: tuple[str, ...], counts: dict[str, int], last_extra: int = 0) -> str:
    """Row-major index over leaf axes; the last axis has `last_extra` more entries."""
    expr = ""
    for i, ax in enumerate(axes):
        n = counts[ax] + (last_extra if i == len(axes) - 1 else 0)
        expr = f"g_{ax}" if not expr else f"({expr}) * {n} + g_{ax}"
    return expr or "0"


def _extent_lines(spec: Spec, ext: Extent, counts: dict[str, int]) -> list[str]:
    r = ext.role
    size = c_expr(ext.size)
    if ext.kind == "fixed":
        return [f"const long long start_{r} = 0;", f"const long long len_{r} = {size};"]
    if ext.kind == "masked":
        t = tensor_param(ext.tensor)
        return [
            f"const long long start_{r} = 0;",
            f"long long len_{r} = {t}[g_{ext.group}];",
            f"len_{r} = len_{r} < 0 ? 0 : (len_{r} > {size} ? {size} : len_{r});",
        ]
    if ext.group_kind == "ragged":
        t = tensor_param(ext.tensor)
        outer = ext.index_axes[:-1]
        row = _flat_index(outer, counts) if outer else "0"
        idx = f"({row}) * {counts[ext.group] + 1} + g_{ext.group}"
        # Clamped so that malformed offsets can never address outside the dim.
        return [
            f"long long start_{r} = {t}[{idx}];",
            f"long long end_{r} = {t}[{idx} + 1];",
            f"start_{r} = start_{r} < 0 ? 0 : (start_{r} > {size} ? {size} : start_{r});",
            f"end_{r} = end_{r} < start_{r} ? start_{r} : (end_{r} > {size} ? {size} : end_{r});",
            f"const long long len_{r} = end_{r} - start_{r};",
        ]
    return [
        f"const long long start_{r} = {_select(ext.group, ext.starts)};",
        f"const long long len_{r} = {_select(ext.group, ext.sizes)};",
    ]


def _select(axis: str, values: tuple[int, ...]) -> str:
    """values[g_axis] as a chain of selects: a run-time-indexed local array would
    live in local memory."""
    expr = f"{values[-1]}LL"
    for i in range(len(values) - 2, -1, -1):
        expr = f"(g_{axis} == {i} ? {values[i]}LL : {expr})"
    return expr


@dataclass
class _PrefixLoop:
    """One scan over the segments before a leaf's (flat order) that accumulates prefix
    sums over their clamped lengths `e - s`: anchored scale blocks, padded rows."""

    role: str
    group: str
    inits: list[str]
    adds: list[str]

    def lines(self, spec: Spec, ext: Extent, counts: dict[str, int]) -> list[str]:
        t = tensor_param(spec.group(self.group).tensor)
        c = counts[self.group]
        flat = _flat_index(ext.index_axes, counts)
        size = c_expr(ext.size)
        return [
            *self.inits,
            f"for (long long j = 0; j < {flat}; ++j) {{",
            f"  long long s = {t}[(j / {c}) * {c + 1} + j % {c}];",
            f"  long long e = {t}[(j / {c}) * {c + 1} + j % {c} + 1];",
            f"  s = s < 0 ? 0 : (s > {size} ? {size} : s);",
            f"  e = e < s ? s : (e > {size} ? {size} : e);",
            *(f"  {a}" for a in self.adds),
            "}",
        ]


def _prefix_lines(spec: Spec, pg: ProblemGenerator, counts: dict[str, int]) -> list[str]:
    """The per-leaf prefix sums over earlier segments: each scale's first block along a
    role (bstart), then each padded segment_major operand's first row (pstart<P>) and
    row pitch (plen<P>). Sums over the same ragged group share one scan of its offsets."""
    items: list[list[str] | _PrefixLoop] = []
    loops: dict[tuple[str, str], _PrefixLoop] = {}
    done: set[str] = set()
    for sm in pg.scale_maps:
        for role, block, anchor in zip(sm.roles, sm.block, sm.anchors):
            if role in done or f"bstart.{role}" not in _symbols(pg):
                continue
            done.add(role)
            if anchor is None:
                items.append([f"const long long bstart_{role} = start_{role} / {block};"])
                continue
            g = spec.group(anchor)
            if g.kind != "ragged":
                prefix, acc = [], 0
                for s in g.sizes:
                    prefix.append(acc)
                    acc += -(-s // block)
                items.append([f"const long long bstart_{role} = {_select(anchor, tuple(prefix))};"])
                continue
            # Anchored blocks: ceil(len / block) summed over every earlier segment.
            loop = _PrefixLoop(
                role, anchor, [f"long long bstart_{role} = 0;"],
                [f"bstart_{role} += (e - s + {block - 1}) / {block};"],
            )
            loops[(role, anchor)] = loop
            items.append(loop)
    if pg.sc is not None:
        # A copy's [128, 1] blocks: ceil(len / 128) summed over every earlier segment of
        # its (ragged, unnested) row group, in the scan the other sums over it share.
        anchor, block = pg.sc.anchors[0], pg.sc.block[0]
        loop = loops.get(("m", anchor))
        if loop is None:
            loop = loops[("m", anchor)] = _PrefixLoop("m", anchor, [], [])
            items.append(loop)
        loop.inits.append("long long cbstart_m = 0;")
        loop.adds.append(f"cbstart_m += (e - s + {block - 1}) / {block};")
    clamps: list[str] = []
    for pad in pg.pads:
        ext = pg.extent(pad.role)
        start, length = c_symbol(pad.start), c_symbol(pad.length)
        p = pad.pad
        items.append([f"const long long {length} = (len_{pad.role} + {p - 1}) / {p} * {p};"])
        g = spec.group(ext.group)
        if g.kind != "ragged":
            prefix, acc = [], 0
            for s in g.sizes:
                prefix.append(acc)
                acc += -(-s // p) * p
            items.append([f"const long long {start} = {_select(g.name, tuple(prefix))};"])
            continue
        # Padded rows: round_up(len, P) summed over every earlier segment, then kept so
        # that the leaf's block ends inside the storage even for malformed offsets.
        add = f"{start} += (e - s + {p - 1}) / {p} * {p};"
        loop = loops.get((pad.role, g.name))
        if loop is None:
            loop = loops[(pad.role, g.name)] = _PrefixLoop(pad.role, g.name, [], [])
            items.append(loop)
        loop.inits.append(f"long long {start} = 0;")
        loop.adds.append(add)
        rows = c_expr(ext.size + pad.extra_rows)
        clamps.append(f"{start} = {start} < {rows} - {length} ? {start} : {rows} - {length};")
    lines: list[str] = []
    for item in items:
        lines += item.lines(spec, pg.extent(item.role), counts) if isinstance(item, _PrefixLoop) else item
    return lines + clamps


def _symbols(pg: ProblemGenerator) -> set[str]:
    polys = [pg.a.offset, *pg.a.strides, pg.b.offset, *pg.b.strides, pg.d.offset, *pg.d.strides]
    polys += [p for e in pg.epilogue for p in (e.offset, e.stride)]
    for s in pg.scale_maps:
        polys += [s.offset, *s.strides]
    return {sym for p in polys for sym in p.symbols}


def _k_block(sig: KernelSignature, block: tuple[int, int]) -> int:
    """A scale's K block as the kernel takes it: 128, or 0 for the whole of K (the
    checker allows no other, and per-channel scales do not depend on K's size)."""
    if not sig.scaled:
        return 128
    return block[1] if block[1] == KERNEL_K_BLOCK else 0


def gemm_config(launch: Launch) -> GemmKernelConfig:
    """The kernel configuration a launch's signature implies; where the leaves share one K
    and the kernel can, it splits K (split_k): memory-bound tiles over all blocks (with
    their epilogue from registers), others past the last whole waves. Memory-bound tiles
    on a long K take two 128-byte swizzle rows of K per ring stage (see _k_atoms)."""
    cfg = _signature_config(launch)
    atoms = _k_atoms(cfg, launch.problems)
    if atoms > 1:
        cfg = replace(cfg, **_DERIVED, tile_k=atoms * cfg.atom_k)
    if _one_k(launch.problems) and cfg.split_by_default():
        return replace(cfg, **_DERIVED, split_k=True)
    return cfg


# A memory-bound tile's stages hold two swizzle rows of K where every leaf's K, known when
# the spec is compiled, spans at least this many (a last stage of zeros past K is then at
# most a sixteenth of the tile's loads).
K_ATOMS_MIN_ROWS = 16


def _k_atoms(cfg: GemmKernelConfig, pg: ProblemGenerator) -> int:
    """Swizzle rows of K per ring stage. A memory-bound tile's stream is bound per block by
    its K-block round trip (full barrier, wgmma, release: about 460 cycles per 10 KB stage
    of the LoRA shrink's 64 x 16 tile); two rows per stage (20 KB, half the stages) moved
    the shrink on the H200 from 28.1 to 22.2 us at 4096 tokens and 23.2 to 22.5 at 2048, level
    at 8192 and 16384 (29.8 / 29.9, 51.7 / 51.5). Four rows leave two stages per block
    (33 us at 8192)."""
    if not (cfg.memory_bound and cfg.several_rows_possible):
        return 1
    k = pg.extents[2]
    if k.kind != "fixed" or not k.size.is_const or k.size.value < K_ATOMS_MIN_ROWS * cfg.atom_k:
        return 1
    return 2


def _one_k(pg: ProblemGenerator) -> bool:
    """Every leaf has the same K (split K's walk counts K blocks from the first leaf's)."""
    return pg.extents[2].kind == "fixed"


def _signature_config(launch: Launch) -> GemmKernelConfig:
    sig = launch.signature
    return GemmKernelConfig(
        a_type=sig.a_type,
        b_type=sig.b_type,
        d_type=sig.d_type,
        accumulate=sig.accumulate,
        scaled=sig.scaled,
        sa_bm=sig.sa_block[0],
        sa_bk=_k_block(sig, sig.sa_block),
        sb_bn=sig.sb_block[0],
        sb_bk=_k_block(sig, sig.sb_block),
        tile_m=sig.tile_m,
        tile_n=sig.tile_n,
        cluster=sig.cluster,
        multicast_b=sig.multicast_b,
        epilogue=sig.epilogue,
        swiglu=sig.swiglu,
        swiglu_halves=sig.swiglu_halves,
        swiglu_up_rows=sig.swiglu_up_rows,
        gather=sig.gather,
        # Rows by TMA measured 11 % faster than the producer's copies on the H200 (FP8,
        # top-2 routing); leaves TMA cannot describe are still copied by hand.
        gather_tma=sig.gather,
        scatter=sig.scatter,
        d_scale_pow2=sig.d_scale_pow2,
        copy=sig.copy,
        copy_pow2=sig.copy_scale_pow2,
        fast_accum=sig.fast_accum,
    )


def _mixed_radix(pg: ProblemGenerator) -> list[dict]:
    """Each free leaf axis's index as (leaf / stride) % count, outermost axis first
    (the same decode as ProblemGenerator.leaf_indices)."""
    axes, stride = [], 1
    for a in reversed(pg.free_axes):
        axes.append({"var": f"g_{a.name}", "count": a.count, "stride": stride})
        stride *= a.count
    return axes[::-1]


def _ceil16(n: int) -> int:
    return -(-n // 16) * 16


@dataclass(frozen=True)
class InlineTable:
    """Where a table built in the kernel keeps its parts, in bytes from its records' start
    (INLINE_RECORDS in the GEMM template: after the ring, the staging and the mbarriers):
    the records as the builder lays them out in global memory, then each checked copy of
    the offsets, then the flags of the blocks other than block 0."""

    copies: tuple[int, ...]  # one per checked copy, in the check's tensor order
    ignored_flags: int
    end: int
    # With whole-tensor maps, each leaf's first row of A and of B in them (an int2 per
    # leaf, the region's last bytes: the GEMM finds them from the region's size).
    whole_rows: int = 0


def table_record_bytes(pg: ProblemGenerator) -> int:
    """The bytes of a launch's leaf table (docs/kernel-abi.md): a GsLeaf per leaf and the
    sentinel, then per leaf a GsEpilogue (a fused epilogue's addresses), a GsGather (row
    numbers through index tensors), a GsDScale (an FP8 output's scales) and a GsCopy (its
    copy), each where the launch has it."""
    per_leaf = (
        (EPILOGUE_RECORD_BYTES if pg.epilogue else 0)
        + (GATHER_RECORD_BYTES if pg.index_maps else 0)
        + (DSCALE_RECORD_BYTES if pg.sd is not None else 0)
        + (COPY_RECORD_BYTES if pg.c is not None else 0)
    )
    return (pg.leaf_count + 1) * LEAF_RECORD_BYTES + pg.leaf_count * per_leaf


def inline_table_layout(pg: ProblemGenerator, check: ValidationKernel | None, whole_maps: bool = False) -> InlineTable:
    at, copies = _ceil16(table_record_bytes(pg)), []
    for ints in check.copy_ints if check else ():
        copies.append(at)
        at += _ceil16(4 * ints)
    flags = 4 * max(len(check.checks), 1) if check else 0
    if not whole_maps:
        return InlineTable(tuple(copies), at, at + flags)
    rows = _ceil16(at + flags)
    return InlineTable(tuple(copies), at, rows + 8 * pg.leaf_count, rows)


def inline_fields(pg: ProblemGenerator, check: ValidationKernel | None) -> dict[str, int | bool]:
    """The configuration fields of a GEMM that builds its table: its region's bytes, the
    static shared memory its check takes (a counter, where scale rows are counted), and
    whether A and B load through maps of their whole buffers."""
    whole = whole_maps_possible(pg)
    return {
        "inline_table": inline_table_layout(pg, check, whole).end,
        "inline_static": INLINE_STATIC_BYTES if check is not None and check.anchored else 0,
        "whole_maps": whole,
    }


def _leaf_free(p: Poly, pg: ProblemGenerator) -> bool:
    """`p` is the same for every leaf of the launch: constants and run-time dims only."""
    return p.symbols <= set(pg.runtime_dims)


def whole_maps_possible(pg: ProblemGenerator) -> bool:
    """Whether A and B can each be loaded through one map of its whole buffer (kernels.py,
    ``whole_maps``): every leaf's K is the launch's K, each operand's rows are contiguous
    along K with one row stride for every leaf, every leaf starts at a whole row (its
    offset a multiple of the stride in every term: its first row is a formula, with no
    division on the device), and the buffer is whole rows of the launch's own dims.
    Whether a leaf's rows lie inside the map is the device's to check."""
    k = pg.extents[2]
    if k.kind != "fixed" or not _leaf_free(k.size, pg) or pg.u is not None:
        return False
    return all(
        op.rows is None and op.pad is None
        and op.strides[1].is_const and op.strides[1].value == 1
        and _leaf_free(op.strides[0], pg) and _leaf_free(op.elements, pg)
        and op.offset.exact_quotient(op.strides[0]) is not None
        and op.elements.exact_quotient(op.strides[0]) is not None
        for op in (pg.a, pg.b)
    )


def _whole_buffer(op: OperandMap) -> dict[str, str]:
    """An operand's whole-buffer map as the table builder writes it (C): its row stride,
    its rows, and a leaf's first row there."""
    stride = op.strides[0]
    return {
        "stride": c_expr(stride),
        "rows": c_expr(op.elements.exact_quotient(stride)),
        "first_row": c_expr(op.offset.exact_quotient(stride)),
    }


def inline_possible(cfg: GemmKernelConfig, pg: ProblemGenerator, max_leaves: int = INLINE_MAX_LEAVES) -> bool:
    """Whether a launch's table can be built by each block of its GEMM (given that no other
    kernel of the call reads the table or the checked offsets): few leaves (each block
    builds them all: at most `max_leaves`) and no rows through index tensors."""
    return (
        pg.leaf_count <= max_leaves and not pg.index_maps and not (cfg.gather or cfg.scatter)
        and not cfg.swiglu_halves  # its builder writes no up map
    )


def emit_launch(
    spec: Spec, launch: Launch, config: GemmKernelConfig | None = None, check: ValidationKernel | None = None,
    inline: bool = False, table_tag: str = "",
) -> EmittedLaunch:
    """The launch's GEMM kernel and leaf-table builder; `config` overrides the kernel
    configuration the signature implies (benchmark probes of kernel variants; its
    `inline_table` says whether the GEMM builds the table). With `check` the builder runs
    the spec's offsets check first and builds its table from the checked copies (and the
    index tensors) the check takes. `inline`: no other kernel of the call reads the table
    or the checked copies, so the GEMM builds the table itself where inline_possible.
    `table_tag` names the builder of a variant (names.table_symbol)."""
    pg = launch.problems
    cfg = config or _launch_gemm_config(launch, inline, check)
    if cfg.whole_maps and not whole_maps_possible(pg):
        raise EmitError(f"launch {launch.index}: A and B cannot load through maps of their whole buffers")
    layout = inline_table_layout(pg, check, cfg.whole_maps)
    if cfg.whole_maps and cfg.inline_table != layout.end:  # the GEMM finds the rows from the region's end
        raise EmitError(f"launch {launch.index}: its table's region is {cfg.inline_table} B, its layout {layout.end} B")
    if cfg.split_k and not _one_k(pg):
        raise EmitError(f"launch {launch.index}: split K needs leaves that share one K (its K is {pg.extents[2]})")
    # The symbol names the spec and launch, so that equal configurations in two launches
    # (or two specs) never define one symbol twice.
    cfg = replace(cfg, name=gemm_symbol(spec.name, launch.index, gemm_kernel_name(cfg)))
    counts = {ax.name: ax.count for ax in pg.leaf_axes}
    body: list[str] = []
    for ext in pg.extents:
        body += _extent_lines(spec, ext, counts)
    body += _prefix_lines(spec, pg, counts)
    fields = [
        ("a_off", c_expr(pg.a.offset)), ("a_sm", c_expr(pg.a.strides[0])), ("a_sk", c_expr(pg.a.strides[1])),
        ("b_off", c_expr(pg.b.offset)), ("b_sn", c_expr(pg.b.strides[0])), ("b_sk", c_expr(pg.b.strides[1])),
        ("d_off", c_expr(pg.d.offset)), ("d_sm", c_expr(pg.d.strides[0])), ("d_sn", c_expr(pg.d.strides[1])),
    ]
    for prefix, sm in (("sa", pg.sa), ("sb", pg.sb)):
        r0 = "sm" if prefix == "sa" else "sn"
        if sm is None:
            fields += [(f"{prefix}_off", "0LL"), (f"{prefix}_{r0}", "0LL"), (f"{prefix}_sk", "0LL")]
        else:
            fields += [
                (f"{prefix}_off", c_expr(sm.offset)),
                (f"{prefix}_{r0}", c_expr(sm.strides[0])),
                (f"{prefix}_sk", c_expr(sm.strides[1])),
            ]
    epilogue_fields: list[tuple[str, str]] = []
    if pg.epilogue:
        # Each pointer advanced to the leaf's first element; null when absent.
        by_kind = {e.kind: e for e in pg.epilogue}
        for kind, param, stride in (("alpha", "ALPHA", None), ("row", "ROW", "row_sm"), ("bias", "BIAS", "bias_sn")):
            e = by_kind.get(kind)
            where = (
                f"static_cast<const unsigned char*>({param}) + {c_expr(e.offset)} * {ELEMENT_BYTES[e.dtype]}"
                if e else "nullptr"
            )
            epilogue_fields.append((kind, where))
            if stride:
                epilogue_fields.append((stride, c_expr(e.stride) if e else "0LL"))
    gather_fields: list[tuple[str, str]] = []
    if pg.index_maps:
        # Each leaf's first row number (the index tensor at the leaf's first row), and the
        # rows of the operand it picks from; null and 0 for an operand not gathered.
        for prefix, rows in (("a", pg.a.rows), ("d", pg.d.rows)):
            where = f"{tensor_param(rows.tensor)} + {c_expr(rows.offset)}" if rows else "nullptr"
            gather_fields.append((f"{prefix}_rows", where))
        for prefix, rows in (("a", pg.a.rows), ("d", pg.d.rows)):
            gather_fields.append((f"{prefix}_bound", f"static_cast<int>({c_expr(rows.bound)})" if rows else "0"))
    dscale_fields: list[tuple[str, str]] = []
    if pg.sd is not None:
        # An FP8 D's scales: the leaf's first scale (SD advanced by the leaf's offset) and
        # the strides per row and per 128-column block.
        dscale_fields = [
            ("sd", f"SD + {c_expr(pg.sd.offset)}"),
            ("sd_sm", c_expr(pg.sd.strides[0])),
            ("sd_sn", c_expr(pg.sd.strides[1])),
        ]
    copy_fields: list[tuple[str, str]] = []
    if pg.c is not None and pg.sc is not None:
        # D's copy: the leaf's first element and scale, its column stride (the leaf's padded
        # row count) and the floats per scale row.
        copy_fields = [
            ("c", f"static_cast<unsigned char*>(C) + {c_expr(pg.c.offset)}"),
            ("sc", f"SC + {c_expr(pg.sc.offset)}"),
            ("c_sn", c_expr(pg.c.strides[1])),
            ("sc_sm", c_expr(pg.sc.strides[0])),
        ]
    table_name = table_symbol(spec.name, launch.index, table_tag)
    params = tuple(tensor_param(t) for t in pg.runtime_tensors)
    dims = tuple(c_symbol(d) for d in pg.runtime_dims)
    aliases: list[tuple[str, str]] = []  # a builder that checks: its tensors, from the check's
    if check is not None:
        taken = {(p.kind, p.ref): p.name for p in check.params}
        for t in pg.runtime_tensors:
            name = taken.get(("checked", t)) or taken.get(("index", t))
            if name is None:
                raise EmitError(f"launch {launch.index} reads '{t}', which the offsets check does not take")
            aliases.append((tensor_param(t), name))
    unit_m, unit_n = unit_shape(cfg.tile_m, cfg.tile_n, cfg.cluster, cfg.multicast_b)
    table = ENV.get_template("leaf_table.cu.jinja").render(
        name=table_name,
        inline=bool(cfg.inline_table),
        gemm=cfg.name,
        a_ctype=ENV.filters["ctype"](cfg.a_type),
        b_ctype=ENV.filters["ctype"](cfg.b_type),
        d_ctype=ENV.filters["ctype"](cfg.d_type),
        ctas_per_sm=cfg.ctas_per_sm,
        cluster=cfg.cluster,
        inline_copies=[(f"checked_{t}", at) for t, at in zip(check.tensors, layout.copies)] if check else [],
        ignored_flags_at=layout.ignored_flags,
        check=check is not None,
        check_function=check.function if check else "",
        check_params=(
            check.declarations(check.inline_params if cfg.inline_table else None) if check else ""
        ),
        check_call=check.call() if check else "",
        check_args=", ".join(p.name for p in check.inline_params) if check else "",
        check_aliases=aliases,
        spec_name=spec.name,
        launch_index=launch.index,
        statement=launch.statement_text,
        leaf_count=pg.leaf_count,
        threads=cfg.threads if cfg.inline_table else TABLE_THREADS,
        tensor_params=params,
        dim_params=dims,
        free_axes=_mixed_radix(pg),
        pinned_axes=[{"var": f"g_{a}", "value": i} for a, i in pg.fixed_axes],
        body=body,
        fields=fields,
        # The leaf table counts work units: a pair's neighbouring row or column blocks.
        tile_m=unit_m,
        tile_n=unit_n,
        a_bytes=ELEMENT_BYTES[cfg.a_type],
        b_bytes=ELEMENT_BYTES[cfg.b_type],
        d_bytes=ELEMENT_BYTES[cfg.d_type],
        store_tma=cfg.store_tma,
        swiglu_halves=cfg.swiglu_halves,
        swiglu_up_rows=cfg.swiglu_up_rows,
        maps_per_leaf=len(map_specs(cfg)),
        epilogue_fields=epilogue_fields,
        gather_fields=gather_fields,
        gather_a=pg.a.rows is not None,
        # A gathered by TMA: the map covers all of A's rows (the index picks among them).
        gather_a_rows=f"static_cast<int>({c_expr(pg.a.rows.bound)})" if cfg.gather_tma and pg.a.rows else "",
        gather_at=pg.leaf_count * EPILOGUE_RECORD_BYTES if pg.epilogue else 0,
        dscale_fields=dscale_fields,
        records_first=sum(map(bool, (epilogue_fields, gather_fields, dscale_fields, copy_fields))) >= 2,
        dscale_at=pg.leaf_count * (
            (EPILOGUE_RECORD_BYTES if pg.epilogue else 0) + (GATHER_RECORD_BYTES if pg.index_maps else 0)
        ),
        copy_fields=copy_fields,
        copy_at=pg.leaf_count * (
            (EPILOGUE_RECORD_BYTES if pg.epilogue else 0) + (GATHER_RECORD_BYTES if pg.index_maps else 0)
            + DSCALE_RECORD_BYTES
        ),
        split_k=cfg.split_k,
        memory_bound=cfg.memory_bound,
        whole_maps=cfg.whole_maps,
        whole_rows_at=layout.whole_rows,
        late_d_maps=cfg.late_d_maps,
        prefetch_k_blocks=cfg.prefetch_k_blocks,
        # The whole buffers' maps and the launch's K (kernels.py).
        whole_k=c_expr(pg.extents[2].size),
        whole_a=_whole_buffer(pg.a) if cfg.whole_maps else {},
        whole_b=_whole_buffer(pg.b) if cfg.whole_maps else {},
        # Rows and columns past a leaf's read from a whole map are never stored, but an FP8
        # D's scale takes the amax of a row's 128 columns, and its copy's of a column's 128
        # rows: such a leaf takes a whole map only where its tiles end at its edge.
        whole_ragged_m=not cfg.copy,
        whole_ragged_n=not cfg.fp8_out,
    )
    source = HEADER + "\n" + render_gemm(cfg) + "\n" + table
    return EmittedLaunch(
        launch, cfg, table_name, tuple(pg.runtime_tensors), tuple(pg.runtime_dims), pg.leaf_count, source, check
    )


def quantize_config(src: Tensor, dst: Tensor) -> QuantizeKernelConfig:
    """The quantize kernel for `dst = quantize(src)` (shapes per check_derived_emittable)."""
    ok = (
        src.rank in (2, 3)
        and src.layout.kind == "strided"
        and src.layout.contiguous_axis() == src.rank - 1
        and dst.scale is not None
        and dst.scale.block[-1] == KERNEL_K_BLOCK
        and dst.scale.block[-2] in (1, KERNEL_K_BLOCK)
    )
    if not ok:
        raise EmitError(
            f"quantize {src.name} -> {dst.name}: the emitted pass handles 2-D and 3-D sources "
            "with the last dim contiguous into [1, 128] or [128, 128] scale blocks"
        )
    pow2 = dst.derived is not None and dst.derived.pow2
    return QuantizeKernelConfig(in_type=src.dtype, out_type=dst.dtype, block_r=dst.scale.block[-2], pow2=pow2)


def emit_prepass(spec: Spec, p: PrePass, index: int = 0) -> EmittedPrePass:
    """The checker admits only what these kernels compute (check_derived_emittable);
    the EmitErrors below guard that agreement."""
    src, dst = spec.tensor(p.source), spec.tensor(p.target)
    if p.kind == "transpose":
        axes = (src.layout.contiguous_axis(), dst.layout.contiguous_axis())
        if src.rank not in (2, 3) or None in axes or axes[0] == axes[1]:
            raise EmitError(f"transpose {p.source} -> {p.target}: no transpose kernel for these layouts")
        cfg = TransposeKernelConfig()
        cfg = replace(cfg, name=prepass_symbol(spec.name, index, cfg.name))
        return EmittedPrePass(p, cfg, HEADER + render_transpose(cfg))
    if p.kind == "gather":
        if src.rank != 2 or src.layout.contiguous_axis() != 1 or ELEMENT_BYTES[src.dtype] not in (1, 2):
            raise EmitError(f"gather {p.source} -> {p.target}: the pass copies 2-D rows of 1- or 2-byte elements")
        cfg = GatherRowsKernelConfig(elem_bytes=ELEMENT_BYTES[src.dtype], scaled=src.scale is not None)
        cfg = replace(cfg, name=prepass_symbol(spec.name, index, cfg.name))
        return EmittedPrePass(p, cfg, HEADER + render_gather_rows(cfg))
    if p.kind == "swiglu_grad":
        dh = spec.tensor(p.other)
        if src.rank != 2 or src.layout.contiguous_axis() != 1 or dh.layout.contiguous_axis() != 1:
            raise EmitError(f"swiglu_grad {p.source}, {p.other} -> {p.target}: the pass reads 2-D rows")
        if dst.scale.block == (128, 1):  # the WGRAD's form: the requantize kernel's layout
            req = RequantKernelConfig(in_type=src.dtype, out_type=dst.dtype, pad=dst.layout.pad, swiglu=True, dh_type=dh.dtype)
            req = replace(req, name=prepass_symbol(spec.name, index, req.name))
            return EmittedPrePass(p, req, HEADER + render_requant(req))
        cfg = replace(quantize_config(src, dst), swiglu_grad=True, dh_type=dh.dtype, name="")
        cfg = replace(cfg, name=prepass_symbol(spec.name, index, cfg.name))
        return EmittedPrePass(p, cfg, HEADER + render_quantize(cfg))
    if p.kind == "quantize":
        cfg = quantize_config(src, dst)
        cfg = replace(cfg, name=prepass_symbol(spec.name, index, cfg.name))
        return EmittedPrePass(p, cfg, HEADER + render_quantize(cfg))
    ok = (
        src.rank == 2
        and src.scale.block == (1, 128)
        and dst.scale.block == (128, 1)
        and src.layout.kind == "strided"
        and src.layout.contiguous_axis() == 1
    )
    if not ok:
        raise EmitError(
            f"requantize {p.source} -> {p.target}: the emitted pass handles 2-D row-major "
            "[T, C] FP8 with [1, 128] scales into [128, 1] scales"
        )
    # A padded segment_major target takes a kernel that writes the padded segments.
    cfg = RequantKernelConfig(
        in_type=src.dtype, out_type=dst.dtype, pad=dst.layout.pad,
        gather_rows=p.index is not None, row_weight=p.weight is not None,
    )
    cfg = replace(cfg, name=prepass_symbol(spec.name, index, cfg.name))
    return EmittedPrePass(p, cfg, HEADER + render_requant(cfg))


def emit_postpass(spec: Spec, p: PostPass, index: int = 0) -> EmittedPostPass:
    """A row pass's kernel (the checker admits what it computes: check_row_pass)."""
    src, dst = spec.tensor(p.source), spec.tensor(p.target)
    if src.rank != 2 or src.layout.contiguous_axis() != 1:
        raise EmitError(f"{p.kind} {p.source} -> {p.target}: the pass reads 2-D tensors with contiguous rows")
    if p.kind == "rowdot":
        other = spec.tensor(p.other)
        cfg = RowPassKernelConfig("rowdot", src.dtype, other.dtype, other.scale is not None, "f32")
    else:
        cfg = RowPassKernelConfig(p.kind, src.dtype, src.dtype, False, dst.dtype)
    cfg = replace(cfg, name=postpass_symbol(spec.name, index, cfg.name))
    return EmittedPostPass(p, cfg, HEADER + render_row_pass(cfg))


# Configuration fields that follow from the others unless a variant sets them itself.
_DERIVED = {
    "name": "",
    "stages": 0,
    "store_tma": None,
    "consumer_scales": None,
    "prefetch_scales": None,
    "cache_hints": None,
    "ring_rounds": None,
    "lean_registers": None,
    "scales_before_issue": None,
    "staged_products": None,
}


def with_kernel_config(
    spec: Spec, program: EmittedProgram, index: int = 0, *, table_tag: str = "", inline_leaves: int = 0, **changes
) -> EmittedProgram:
    """`program` with launch `index` re-emitted under its kernel configuration changed by
    `changes` (its leaf-table builder follows; the derived fields, and split K where the
    launch splits by default, and the K per stage, are worked out again unless `changes` sets
    them): kernel variants for probes and tests of kernel options. `table_tag` gives the
    variant's leaf-table builder a symbol of its own (one program that links beside
    `program` must not define the same builder twice). `inline_leaves` lets the variant
    build a table of up to that many leaves itself where `table_in_gemm_allowed`."""
    x = program.launches[index]
    base = gemm_config(x.launch)
    # The table stays in the kernel unless the variant takes what a built-in table cannot.
    inline = {
        "inline_table": x.gemm.inline_table, "inline_static": x.gemm.inline_static, "whole_maps": x.gemm.whole_maps,
    }
    if (inline_leaves and not x.gemm.inline_table and table_in_gemm_allowed(program, index)
            and inline_possible(base, x.launch.problems, inline_leaves)):
        inline = inline_fields(x.launch.problems, x.check)
    if any(changes.get(k) for k in ("gather", "scatter")):
        inline = {"inline_table": 0, "inline_static": 0, "whole_maps": False}
    fields = {**_DERIVED, **inline, **changes}
    if fields["inline_table"]:  # the region holds the whole maps' rows where the variant takes them
        fields["inline_table"] = inline_table_layout(x.launch.problems, x.check, fields["whole_maps"]).end
    if "tile_k" not in changes:
        # The K per stage follows the variant's tile (see _k_atoms).
        one_row = replace(base, **{**fields, "tile_k": 0, "split_k": False})
        fields["tile_k"] = _k_atoms(one_row, x.launch.problems) * one_row.atom_k
    if "split_k" not in changes and base.split_k:
        # Split K is the default only where the variant's kernel can take it.
        unsplit = replace(base, **{**fields, "split_k": False})
        fields["split_k"] = unsplit.split_by_default()
    cfg = replace(base, **fields)
    launches = list(program.launches)
    launches[index] = emit_launch(spec, x.launch, cfg, x.check, table_tag=table_tag)
    return replace(program, launches=tuple(launches))


def emit_check(spec: Spec, schedule: Schedule, fuse: bool = True) -> EmittedCheck | None:
    """The spec's offsets check and where it runs (None: nothing is known only at run
    time); `fuse=False` keeps it a kernel of its own even where a builder could run it."""
    placement = check_placement(spec, schedule)
    if placement is None:
        return None
    if placement.fused and not fuse:
        placement = CheckPlacement(False, "a kernel of its own, first (not fused: asked so)")
    kernel = validation_kernel(spec)
    assert kernel is not None
    return EmittedCheck(kernel, placement)


def _alone(steps: Schedule | EmittedProgram, check: EmittedCheck | None) -> bool:
    """One launch and nothing before it: no other kernel reads its table or the checked
    offsets, so its GEMM may build the table itself (one kernel per call). `steps`: a
    schedule or the program emitted from it (each has launches, pre- and post-passes)."""
    return (
        len(steps.launches) == 1 and not steps.prepasses and not steps.postpasses
        and (check is None or check.fused)
    )


def program_alone(program: EmittedProgram) -> bool:
    """`_alone` for an emitted program."""
    return _alone(program, program.check)


def table_in_gemm_allowed(program: EmittedProgram, index: int) -> bool:
    """Whether launch `index` of `program` may build its leaf table in its GEMM: where the
    program is that one launch (its GEMM then checks the offsets too), or for any launch
    after the first. The offsets check runs in launch 0's builder or a kernel of its own,
    before it, and a later launch reads the checked copies as its builder would (bad
    offsets: it computes nothing); no other kernel reads a launch's table."""
    return index > 0 or program_alone(program)


def _launch_gemm_config(launch: Launch, inline: bool, check: ValidationKernel | None) -> GemmKernelConfig:
    """The signature's configuration, with the table built in the kernel where `inline`
    (nothing else of the call reads the table) and the launch allows it."""
    cfg = gemm_config(launch)
    if inline and inline_possible(cfg, launch.problems):
        cfg = replace(cfg, **_DERIVED, **inline_fields(launch.problems, check))
    return cfg


def launch_config(spec: Spec, schedule: Schedule, launch: Launch) -> GemmKernelConfig:
    """The GEMM configuration `emit` gives `launch` (what `explain` reports)."""
    check = emit_check(spec, schedule)
    return _launch_gemm_config(launch, _alone(schedule, check), check.kernel if check is not None else None)


def emit(spec: Spec, schedule: Schedule, *, fuse_check: bool = True, inline_tables: bool = True) -> EmittedProgram:
    """The CUDA of every kernel of `schedule`. `fuse_check=False` runs the offsets check
    as a kernel of its own before anything else (the launch sequence before the check
    was fused into the first builder: for comparisons). `inline_tables=False` keeps a
    leaf-table builder before every GEMM, also where the GEMM could build its table itself
    (for comparisons)."""
    check = emit_check(spec, schedule, fuse_check)
    fused = check.kernel if check is not None and check.fused else None
    alone = inline_tables and _alone(schedule, check)
    return EmittedProgram(
        schedule.spec,
        tuple(emit_prepass(spec, p, i) for i, p in enumerate(schedule.prepasses)),
        tuple(
            emit_launch(spec, x, check=fused if x.index == 0 else None, inline=alone) for x in schedule.launches
        ),
        check,
        tuple(emit_postpass(spec, p, i) for i, p in enumerate(schedule.postpasses)),
        schedule.order,
    )
