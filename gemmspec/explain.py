"""`gemmspec explain`: the nest, the decision and its reasons, the flat problem
formulas, the launches and the pre-passes, as text and as JSON.

The JSON form is a documented contract (docs/explain-json.md): for each spec it
has `name`, `decision`, `reasons`, `launches` (each with `leaf_count`) and
`prepasses` (each with `kind`).
"""

from __future__ import annotations

import re
import textwrap

from .lower.schedule import Launch, Schedule
from .spec import Spec

JSON_VERSION = 1


def _launch_json(launch: Launch) -> dict:
    pg = launch.problems
    sig = launch.signature
    doc = {
        "index": launch.index,
        "statement": launch.statement,
        "statement_text": launch.statement_text,
        "kernel": sig.name,
        "leaf_count": launch.leaf_count,
        "leaf_axes": [{"name": a.name, "count": a.count, "group": a.group} for a in pg.free_axes],
        "pinned_axes": {a: i for a, i in pg.fixed_axes},
        "signature": {
            "a_type": sig.a_type,
            "b_type": sig.b_type,
            "d_type": sig.d_type,
            "accumulate": sig.accumulate,
            "scaled": sig.scaled,
            "a_scale_block": list(sig.sa_block) if sig.scaled else None,
            "b_scale_block": list(sig.sb_block) if sig.scaled else None,
            "a_k_major": sig.a_k_major,
            "b_k_major": sig.b_k_major,
            "tile": [sig.tile_m, sig.tile_n, sig.tile_k],
            "cluster": sig.cluster,
            "multicast_b": sig.multicast_b,
            "swiglu": sig.swiglu,
            "d_scale_pow2": sig.d_scale_pow2,
            "fast_accum": sig.fast_accum,
            "swiglu_halves": sig.swiglu_halves,
            "gather": sig.gather,
            "scatter": sig.scatter,
        },
        "extents": {e.role: str(e) for e in pg.extents},
        "operands": {
            "A": _map_json(pg.a),
            "B": _map_json(pg.b),
            "D": _map_json(pg.d),
        },
        "scales": {
            "A": _map_json(pg.sa) if pg.sa else None,
            "B": _map_json(pg.sb) if pg.sb else None,
            "D": _map_json(pg.sd) if pg.sd else None,
        },
        "epilogue": [_epilogue_json(e) for e in pg.epilogue],
        "runtime_tensors": list(pg.runtime_tensors),
        "runtime_dims": list(pg.runtime_dims),
    }
    if pg.u is not None:
        # A SwiGLU over separate gate and up rows: B's map addresses the gate rows, U's the
        # up rows (only such launches have these keys).
        doc["operands"]["U"] = _map_json(pg.u)
        doc["scales"]["U"] = _map_json(pg.su) if pg.su else None
    if pg.c is not None and pg.sc is not None:
        # `T = copy(D)`: the second FP8 output the epilogue writes (only such launches
        # have these keys).
        doc["signature"]["copy"] = True
        doc["signature"]["copy_scale_pow2"] = sig.copy_scale_pow2
        doc["operands"]["C"] = _map_json(pg.c)
        doc["scales"]["C"] = _map_json(pg.sc)
    if launch.note:
        doc["note"] = launch.note
    return doc


def _epilogue_json(e) -> dict:
    """A fused epilogue operand: the leaf's scalar at `offset` (`alpha`), or one value per
    row (`row`, role m) or column (`bias`, role n) at `offset + i * stride`."""
    return {
        "kind": e.kind,
        "tensor": e.tensor,
        "dtype": e.dtype,
        "role": e.role,
        "offset": str(e.offset),
        "stride": str(e.stride) if e.role is not None else None,
    }


def _map_json(m) -> dict:
    doc = {
        "tensor": m.tensor,
        "offset": str(m.offset),
        "strides": {r: str(s) for r, s in zip(m.roles, m.strides)},
    }
    if hasattr(m, "block"):
        doc["block"] = dict(zip(m.roles, m.block))
        doc["anchored_per"] = {r: a for r, a in zip(m.roles, m.anchors) if a}
    pad = getattr(m, "pad", None)
    if pad is not None:  # a segment_major operand with padded segments
        doc["padded_segments"] = {"role": pad.role, "pad": pad.pad, "extra_rows": pad.extra_rows}
    if m.rows is not None:  # rows read or written through an index tensor
        doc["rows_through"] = {"tensor": m.rows.tensor, "offset": str(m.rows.offset), "bound": str(m.rows.bound)}
    return doc


def schedule_json(spec: Spec, schedule: Schedule, program=None) -> dict:
    """The JSON form; with the emitted `program` (as `compile` writes it) each launch and
    pre-pass also names the symbols of its kernels, as the header and manifest do."""
    doc = {
        "version": JSON_VERSION,
        "name": spec.name,
        "file": spec.path,
        "decision": schedule.decision,
        "reasons": list(schedule.reasons),
        "nest": [
            {"name": g.name, "kind": g.kind, "dim": g.dim, "count": g.count, "within": g.within}
            for g in spec.groups
        ],
        "launches": [_launch_json(x) for x in schedule.launches],
        "prepasses": [
            {
                "kind": p.kind,
                "source": p.source,
                "target": p.target,
                "source_layout": p.source_layout,
                "target_layout": p.target_layout,
                "source_scale": (
                    {"name": p.source_scale, "block": list(p.source_block)}
                    if p.source_scale is not None else None  # quantize: an unscaled source
                ),
                "target_scale": (
                    {"name": p.target_scale, "block": list(p.target_block)}
                    if p.target_scale is not None else None  # gather: an unscaled source
                ),
                "anchored_per": p.anchor,
                "pow2_scales": p.pow2,
                "index": p.index,
                "weight": p.weight,
                "before_launches": list(p.reads_before),
                "description": p.describe(),
            }
            for p in schedule.prepasses
        ],
    }
    for prepass, p in zip(doc["prepasses"], schedule.prepasses):
        if p.other is not None:  # only swiglu_grad's: other documents stay as they were
            prepass["other"] = p.other
    if schedule.order:
        doc["order"] = [{"kind": kind, "index": i} for kind, i in schedule.order]
    if schedule.postpasses:  # only where there are some: other documents stay as they were
        doc["postpasses"] = [
            {
                "kind": p.kind,
                "source": p.source,
                "target": p.target,
                "other": p.other,
                "other_scale": p.other_scale,
                "weight": p.weight,
                "description": p.describe(),
                # scatter_add's index, the field only on its passes (other documents stay as they were)
                **({"index": p.index} if p.kind == "scatter_add" else {}),
            }
            for p in schedule.postpasses
        ]
    placement = _check_placement(spec, schedule)
    if placement is not None:
        doc["offsets_check"] = {"fused": placement.fused, "where": placement.reason}
    variant = _decode_variant(spec, schedule, program)
    if variant is not None:  # only where a launch has one: other documents stay as they were
        doc["run_time_choice"] = variant.to_json()
    if program is not None:
        for launch, x in zip(doc["launches"], program.launches):
            # A GEMM that builds its leaf table itself has no builder kernel.
            launch["symbols"] = {"leaf_table": None if x.gemm.inline_table else x.table_kernel, "gemm": x.gemm.name}
        for prepass, p in zip(doc["prepasses"], program.prepasses):
            prepass["symbol"] = p.kernel
        for postpass, p in zip(doc.get("postpasses", ()), program.postpasses):
            postpass["symbol"] = p.kernel
            if len(p.kernels) > 1:  # scatter_add: its index kernels, then the one that sums
                postpass["symbols"] = list(p.kernels)
    return doc


def _decode_kernel_line(cfg) -> str:
    """What sets a decode variant's GEMM apart, in words."""
    parts = [f"{cfg.tile_m} x {cfg.tile_n} tiles, one CTA per tile", "split K" if cfg.split_k else "whole tiles"]
    if cfg.inline_table:
        parts.append("the leaf table built in the GEMM")
    if cfg.whole_maps:
        parts.append("A and B through maps of their whole buffers")
    return ", ".join(parts)


def _decode_variant(spec: Spec, schedule: Schedule, program=None):
    """The launches' decode variant and the rule that picks it per call (None: none has one)."""
    from .codegen.emit import emit
    from .codegen.variants import decode_variant

    return decode_variant(spec, schedule, program if program is not None else emit(spec, schedule))


def _check_placement(spec: Spec, schedule: Schedule):
    """Where the device check of the run-time offsets runs (None: the spec has none)."""
    from .codegen.emit import launch_config
    from .codegen.validate import CheckPlacement, check_placement  # the back end places it

    placement = check_placement(spec, schedule)
    if placement is not None and placement.fused and launch_config(spec, schedule, schedule.launches[0]).inline_table:
        return CheckPlacement(True, "in every block of launch 0's GEMM kernel, before it builds its leaf table")
    return placement


def _kernel_line(spec: Spec, schedule: Schedule, launch) -> str:
    """The launch's kernel symbol and what its configuration chose."""
    from .codegen.emit import launch_config  # the back end decides stages and epilogue
    from .codegen.kernels import gemm_kernel_name
    from .codegen.names import gemm_symbol

    cfg = launch_config(spec, schedule, launch)
    parts = [f"{cfg.tile_m}x{cfg.tile_n} tiles", f"{cfg.stages} stages"]
    if cfg.cluster > 1:
        parts.append("CTA pairs along M multicasting B" if cfg.multicast_b else "CTA pairs multicasting A")
    if cfg.ctas_per_sm > 1:
        parts.append(f"{cfg.ctas_per_sm} blocks per SM (memory-bound tile)")
    if cfg.k_atoms > 1:
        parts.append(
            f"{cfg.tile_k} of K per stage ({cfg.k_atoms} TMA boxes per operand: the memory-bound stream is paced by "
            "its barrier round trips per stage)"
        )
    if cfg.mma_lag > 1:
        parts.append(f"{cfg.mma_lag} earlier K blocks' wgmma left running")
    if cfg.split_k and cfg.memory_bound:
        parts.append(
            f"split K: K blocks of all tiles (whole ones where they fill the blocks) dealt evenly to the blocks "
            f"(up to {cfg.split_max_blocks}) whatever the run-time tile count; a tile that several blocks share is "
            "added up by the last of them, in block order"
        )
    elif cfg.split_k:
        parts.append(
            "split K where it pays at run time: a short last wave (the last full wave and the tiles after it) or "
            "fewer tiles than blocks cut into 2-8 parts of K, run part by part after the whole tiles, each tile's "
            "parts added in order"
        )
    if cfg.cache_hints:
        parts.append("TMA loads with L2 eviction hints (A evict-first, B evict-last)")
    if cfg.prefetch_k_blocks:
        parts.append(
            f"the first tile's weights, {cfg.prefetch_k_blocks} K blocks of each row, prefetched into L2 once the "
            "table is built"
        )
    if cfg.b_evict_first:
        parts.append("B's TMA loads evict first in L2 (weights read once leave what L2 holds in place)")
    if cfg.exit_on_read:
        parts.append("blocks leave once their last TMA stores have read the staging (the grid waits for the writes)")
    if cfg.inline_table:
        parts.append("leaf table built by each block (no builder kernel: one launch per call)")
    if cfg.whole_maps:
        parts.append(
            "A and B loaded through one map of each whole buffer per block, a leaf's first rows coordinates there "
            "(a leaf those maps do not describe keeps its own; the output keeps a map per leaf)"
        )
    if cfg.late_d_maps:
        parts.append(
            "output maps written by the consumers at their start, ring initialised while the table is built "
            "(the producer waits for neither)"
        )
    if cfg.staged_add:
        parts.append(
            "old output tile loaded into the staging by TMA, added to and stored by TMA where a leaf's rows end "
            "on 16-byte boundaries (else from registers, masked per element)"
        )
    elif cfg.store_tma:
        parts.append(
            "output staged and stored by TMA where a leaf's rows end on 16-byte boundaries (else from registers, "
            "masked per element)"
        )
    else:
        parts.append("output stored from registers")
    pg = launch.problems
    if cfg.gather:
        how = "rows loaded by TMA, a one-row box each" if cfg.gather_tma else "rows copied by the producer"
        parts.append(f"A gathered through {pg.a.rows.tensor}: {how}")
    if cfg.scatter:
        parts.append(f"D scattered through {pg.d.rows.tensor}: rows stored from registers")
    if cfg.fp8_out:
        rule = "power-of-two scales" if cfg.d_scale_pow2 else "scale amax / FP8 max"
        parts.append(f"{cfg.d_type} output quantized in the epilogue (bf16 rounding, {rule} per row and 128 columns)")
    if launch.signature.copy:
        rule = "power-of-two scales" if launch.signature.copy_scale_pow2 else "scale amax / FP8 max"
        parts.append(
            f"and its copy {pg.c.tensor} segment-major per segment, quantized in the same epilogue ({rule} per "
            "column and 128 rows)"
        )
    if cfg.mma_parts > 1:
        parts.append(f"each K block's wgmma in {cfg.mma_parts} batches of {cfg.tile_n // cfg.mma_parts} columns")
    if cfg.per_channel:
        how = "promoted into f32 every 128 of K" if cfg.promotes else "fast accumulation: the whole of K in the tensor cores' accumulator"
        parts.append(f"per-channel scales: the unscaled main loop ({how}), SA(row) * SB(column) in the epilogue")
    elif cfg.scaled:
        count = ("one B scale per tile", "two B scales per tile", "a B scale per column")[cfg.sb_mode]
        where = "staged by the producer" + (" as SA x SB products" if cfg.staged_products else "")
        if cfg.consumer_scales:
            where = "read by the consumers" + (" a K block ahead" if cfg.prefetch_scales else "")
        parts.append(f"{count} and K block, {where}")
        if cfg.ring_rounds:
            parts.append(f"K loop in rounds of {cfg.stages} blocks with their stages fixed at compile time")
    return f"{gemm_symbol(spec.name, launch.index, gemm_kernel_name(cfg))} ({', '.join(parts)})"


def backward_json(spec: Spec) -> dict:
    """The `backward` key of `explain --json`: the derived backward spec's text, what it
    derives and refuses, and its own explain JSON (null when nothing derives)."""
    from .backward import derive_backward
    from .errors import GemmspecError
    from .pipeline import lower_derived

    bw = derive_backward(spec)
    doc = bw.to_json()
    doc["explain"] = None
    try:
        lowered = lower_derived(bw)
    except GemmspecError as e:  # a derivation the rest of the compiler refuses: say so
        doc["refused"].append({"statement": None, "reason": f"the derived spec does not compile: {e}"})
        return doc
    if lowered is not None:
        doc["explain"] = schedule_json(lowered.spec, lowered.schedule)
    return doc


# A line's indent and item marker: continuation lines hang under the text after it.
_ITEM = re.compile(r"( *)(- |\[\d+\] )?")
# A short bracketed list ("[1, 128, 128]", "[t, k]") is wrapped as one word.
_SHORT_BRACKETS = re.compile(r"\[[^\[\]]{1,24}\]")
_KEEP = "\x00"  # stands for a space no line may break at while wrapping


def wrap(text: str, width: int) -> str:
    """`text` with every line longer than `width` wrapped at spaces. A continuation line
    hangs under the text of a `- ` or `[i] ` item, or 4 columns deeper than its line (so
    it never reads as one of the line's children, which are 2 deeper). A line's first word
    stays with its indent, a short bracketed list stays whole, and words are never split
    (a kernel name longer than `width` keeps its line), so every name stays searchable."""
    out = []
    for line in text.splitlines():
        if len(line) <= width or _KEEP in line:
            out.append(line)
            continue
        indent, item = _ITEM.match(line).groups()
        if item:
            head, hang = indent + item, " " * len(indent + item)
        else:
            first = re.match(r" *\S+ ", line)
            head, hang = (first.group() if first else indent), " " * (len(indent) + 4)
        body = _SHORT_BRACKETS.sub(lambda m: m.group().replace(" ", _KEEP), line[len(head):])
        wrapped = textwrap.wrap(
            body, width, initial_indent=head, subsequent_indent=hang,
            break_long_words=False, break_on_hyphens=False,
        )
        out += [w.replace(_KEEP, " ") for w in wrapped]
    return "\n".join(out)


def explain_text(spec: Spec, schedule: Schedule, backward: bool = True, width: int | None = None) -> str:
    """What `gemmspec explain` prints: one line per item, or wrapped at `width` columns;
    `backward=False` leaves out the derived backward's summary (the explain of a backward
    spec itself)."""
    lines = [f"spec {spec.name} ({spec.path}:{spec.line})"]
    lines.append("nest:")
    if not spec.groups:
        lines.append("  (no groups)")
    for g in spec.groups:
        lines.append(f"  {g}")
    lines.append(f"decision: {schedule.decision}")
    lines += [f"  - {r}" for r in schedule.reasons]
    if schedule.prepasses:
        lines.append("pre-passes:")
        for i, p in enumerate(schedule.prepasses):
            before = ", ".join(map(str, p.reads_before))
            when = f"before launch {before}" if before else "before the pre-passes that read it"
            lines.append(f"  [{i}] {p.describe()} ({when})")
    lines.append(f"launches: {len(schedule.launches)}")
    for launch in schedule.launches:
        body = str(launch).splitlines()
        body[1] = f"  kernel {_kernel_line(spec, schedule, launch)}"
        lines += ["  " + ln for ln in body]
    variant = _decode_variant(spec, schedule)
    if variant is not None:
        lines.append(f"at call time: the decode variant when {variant.rule.describe()}, else as above:")
        for i, _, after in variant.launches:
            lines.append(f"  launch {i}: {after} ({_decode_kernel_line(variant.program.launches[i].gemm)})")
    if schedule.order:
        lines.append("order: " + ", ".join(f"{kind} {i}" for kind, i in schedule.order))
    if schedule.postpasses:
        lines.append("row passes (in the order above):" if schedule.order else "row passes (after the launches):")
        for i, p in enumerate(schedule.postpasses):
            lines.append(f"  [{i}] {p.describe()}")
    placement = _check_placement(spec, schedule)
    if placement is not None:
        lines.append(f"offsets check (on the device): {placement}")
    if backward:
        from .backward import derive_backward  # the gradients a training step would run

        lines += derive_backward(spec).text().splitlines()
    text = "\n".join(lines)
    return text if width is None else wrap(text, width)
