"""Directives: flatten or split, target, tile, gather and accumulate."""

from __future__ import annotations

from ..spec import FP8_OUT_BLOCK, FP8_TYPES, KERNEL_K_BLOCK, Directives, Gemm
from ..tiling import MAX_BIAS_WIDTH
from .context import Context

GATHER_MODES = ("auto", "fused", "prepass")  # the gather(...) directive's choices
ACCUMULATION_MODES = ("promoted", "fast")  # the accumulate(...) directive's choices


def check_directives(ctx: Context, gemms: tuple[Gemm, ...]) -> Directives:
    force = None
    force_pos = None
    target = "sm_90a"
    tile = None
    gather_rows = "auto"
    accumulation = None
    scaled = any(t.scale is not None for t in ctx.ast.tensors)
    for d in ctx.ast.directives:
        if d.kind in ("flatten", "split"):
            if force is not None and force != d.kind:
                raise ctx.error(
                    f"'{d.kind}' contradicts the earlier '{force}' directive", d.pos
                )
            if force is None:
                force_pos = d.pos
            force = d.kind
        elif d.kind == "target":
            if d.args[0] != "sm_90a":
                raise ctx.error(
                    f"unsupported target '{d.args[0]}'; gemmspec emits code for sm_90a "
                    "(Hopper with wgmma)",
                    d.pos,
                )
        elif d.kind == "tile":
            tm, tn = int(d.args[0]), int(d.args[1])
            if tile is not None and tile != (tm, tn):
                raise ctx.error(f"tile({tm}, {tn}) contradicts the earlier tile({tile[0]}, {tile[1]})", d.pos)
            if tm not in (64, 128) or tn % 8 or not 8 <= tn <= 256:
                raise ctx.error(
                    f"tile({tm}, {tn}) is not a supported tile: the kernels take 64 or 128 "
                    "rows by a multiple of 8 columns from 8 to 256",
                    d.pos,
                )
            fp8_out = [
                (g, st) for g, st in zip(gemms, ctx.ast.statements)
                if ctx.tensors[g.out.tensor].dtype in FP8_TYPES
            ]
            for g, st in fp8_out:
                cols = tn // 2 if g.swiglu else tn
                if cols % FP8_OUT_BLOCK:
                    what = f"{cols} output columns of a SwiGLU" if g.swiglu else f"{tn} columns"
                    raise ctx.error(
                        f"tile({tm}, {tn}) gives {what}, but the FP8 output "
                        f"'{g.out.tensor}' (line {st.pos.line}) is quantized per row and "
                        f"{FP8_OUT_BLOCK} columns: a tile covers whole blocks of it",
                        d.pos,
                        f"use tile({tm}, {2 * FP8_OUT_BLOCK if g.swiglu else FP8_OUT_BLOCK})",
                    )
            copying = next(((g, st) for g, st in zip(gemms, ctx.ast.statements) if g.copy), None)
            if copying is not None and tm != 128:
                g, st = copying
                raise ctx.error(
                    f"tile({tm}, {tn}) has {tm} rows, but the statement on line {st.pos.line} "
                    f"writes '{g.copy}' = copy({g.out.tensor}), whose [{KERNEL_K_BLOCK}, 1] scale "
                    f"blocks are one 128-row tile each",
                    d.pos,
                    f"use tile(128, {tn})",
                )
            for g, st in zip(gemms, ctx.ast.statements):
                # Gate rows, then up rows: each half whole 8-column wgmma blocks; scaled, one
                # 128-row scale block of each weight per half.
                need = 2 * FP8_OUT_BLOCK if g.swiglu_halves and scaled else 16
                if g.swiglu_halves and (tn % need or (scaled and tn != need)):
                    raise ctx.error(
                        f"tile({tm}, {tn}) splits the SwiGLU on line {st.pos.line} badly: its tiles "
                        f"hold gate rows, then as many up rows, "
                        + ("each half one 128-row scale block" if scaled else "each half whole 8-row blocks"),
                        d.pos,
                        f"use tile({tm}, {need if scaled else 128})",
                    )
            halves = bool(fp8_out) and all(g.swiglu for g, _ in fp8_out) and len(fp8_out) == len(gemms)
            halves = halves or any(g.swiglu_halves for g in gemms)
            if tn > 192 and scaled and not (halves and tn == 2 * FP8_OUT_BLOCK):
                raise ctx.error(
                    f"tile({tm}, {tn}) is too wide for scaled FP8: those kernels keep two "
                    "accumulator tiles in registers, so at most 192 columns",
                    d.pos,
                )
            bias = next((s.bias for s in ctx.ast.statements if s.bias is not None), None)
            if tn > MAX_BIAS_WIDTH and bias is not None:
                raise ctx.error(
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
                raise ctx.error(
                    f"gather({mode}) is not a way to read gathered rows: use "
                    + ", ".join(f"gather({m})" for m in GATHER_MODES),
                    d.pos,
                )
            if not any(g.gather for g in gemms):
                raise ctx.error(
                    f"gather({mode}): no statement reads rows through an index tensor "
                    "(x[idx[t], k])",
                    d.pos,
                )
            if gather_rows != "auto" and mode != gather_rows:
                raise ctx.error(f"gather({mode}) contradicts the earlier gather({gather_rows})", d.pos)
            gather_rows = mode
        elif d.kind == "accumulate":
            mode = d.args[0]
            if mode not in ACCUMULATION_MODES:
                raise ctx.error(
                    f"accumulate({mode}) is not a way to sum FP8 products: use "
                    + " or ".join(f"accumulate({m})" for m in ACCUMULATION_MODES),
                    d.pos,
                )
            if not any(ctx.tensors[g.a.tensor].dtype in FP8_TYPES and ctx.per_channel(g) for g in gemms):
                raise ctx.error(
                    f"accumulate({mode}): no statement multiplies FP8 operands whose scales are "
                    "constant along K (per-channel or per-tensor); blockwise scales are applied, "
                    "and so promoted into f32, every 128 of K, and 16-bit operands accumulate in f32",
                    d.pos,
                )
            if accumulation is not None and mode != accumulation:
                raise ctx.error(f"accumulate({mode}) contradicts the earlier accumulate({accumulation})", d.pos)
            accumulation = mode
    where = ctx.where(force_pos) if force_pos is not None else None
    return Directives(force, target, tile, gather_rows, accumulation or "promoted", force_where=where)
