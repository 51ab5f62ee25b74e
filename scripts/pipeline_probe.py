#!/usr/bin/env python3
"""Time variants of the FP8 headline kernel to locate its bound (needs a Hopper GPU + torch).

Same spec, same inputs; only the GEMM kernel's configuration changes (tile width, CTA
pairs, epilogue staged through shared memory and TMA stores or stored from registers,
ring depth, programmatic dependent launch after the builder, and for the LoRA shrink
where the offsets check runs), plus the same tiles *without* FP8 promotion (an unscaled kernel: its output
is not the spec's result, it only shows what the load pipeline and wgmma sustain without
the per-K-block promotion). Every variant that computes the spec's result is checked
against the default configuration's output. Prints one line per variant, with the SM
clock and board power of its kernel kept running for a second after its timing (where
nvidia-smi is on the PATH; as `gemmspec bench` reads them).

    python3 scripts/pipeline_probe.py [--shape E,M,N,K] [--only SUBSTRING[|SUBSTRING...]] [--bf16 | --lora [--tokens T] | --expand | --wgrad | --gather | --decode e32|e8|qwen3|qwen3_t16|qwen3_t512|dsv3|uniform [--bf16] | --masked] [--idle MS] [--list]
"""

from __future__ import annotations

import argparse
import atexit
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402
from gemmspec.bench import (  # noqa: E402
    GATHER,
    LORA,
    LORA_EXPAND_COUNTS,
    MASKED_SPEC,
    WGRAD,
    measure,
    moe_spec,
    nested_offsets,
    offsets_tensor,
    random_fp8,
    random_scales,
    sustained_clock,
    timed_launches,
    with_directive,
)
from gemmspec.bench.cases import (  # noqa: E402
    DECODE_E8,
    DECODE_E32,
    DECODE_MASKED,
    DECODE_TOP_K,
    DSV3_EXPERTS,
    QWEN3_EXPERTS,
)
from gemmspec.bench.inputs import routed_counts  # noqa: E402
from gemmspec.clocks import ClockSampler, gpu_id  # noqa: E402
from gemmspec.codegen.emit import emit, with_kernel_config  # noqa: E402
from gemmspec.codegen.variants import DECODE_INLINE_MAX_LEAVES, decode_changes  # noqa: E402

# label -> GemmKernelConfig fields to change (stages 0: as deep as shared memory allows;
# store_tma None: the default rule).
VARIANTS = {
    "as compiled": {},
    "whole tiles, round robin (no split K)": {"split_k": False},
    "one CTA per tile": {"cluster": 1, "multicast_b": False},
    "one CTA per tile, whole tiles (no split K)": {"cluster": 1, "multicast_b": False, "split_k": False},
    "one-block K loop, stage in a register (no rounds)": {"ring_rounds": False},
    "192 wide, descriptors rebuilt per wgmma": {"tile_n": 192, "lean_registers": True},
    "192 wide, scales loaded in their own K block": {"tile_n": 192, "prefetch_scales": False},
    "192 wide, scales staged by the producer": {"tile_n": 192, "consumer_scales": False},
    "192 wide, scales staged by the producer, no rounds": {"tile_n": 192, "consumer_scales": False, "ring_rounds": False},
    "192 wide, registers epilogue": {"tile_n": 192, "store_tma": False},
    "192 wide, CTA pairs multicasting A": {"tile_n": 192, "cluster": 2},
    "192 wide, CTA pairs along M multicasting B": {"tile_n": 192, "cluster": 2, "multicast_b": True},
    "scales read before the wgmma issue": {"scales_before_issue": True},
    "raw scales staged, products in the consumers (3.13)": {"staged_products": False},
    "192 wide, raster groups of 16 row blocks": {"tile_n": 192, "raster": 16},
    "256 wide (two 128-column wgmma halves per K block)": {"tile_n": 256},
    "160 wide (registers epilogue)": {"tile_n": 160},
    "128 wide, staged epilogue": {"tile_n": 128},
    "192 wide, no promotion (wrong values)": {"tile_n": 192, "scaled": False, "consumer_scales": None},
    "leaf-table builder before the GEMM (PDL)": {"inline_tables": False},
    "builder, no programmatic launch (no wait, ordinary launch)": {"inline_tables": False, "programmatic": False},
    "as compiled (again: drift over the run)": {},
}
# The BF16 kernel: 128 x 256 tiles with a staged epilogue and a 3-stage ring; narrower
# staged tiles keep 4 stages. Split K (the default) splits the tiles past the last whole
# wave (4096 tiles of the headline are 31.03 waves on 132 SMs).
BF16_VARIANTS = {
    "as compiled": {},
    "whole tiles, round robin (no split K)": {"split_k": False},
    "leaf-table builder before the GEMM (PDL)": {"inline_tables": False},
    "256 wide, staged epilogue, 3 stages": {"tile_n": 256, "store_tma": True},
    "192 wide, staged epilogue": {"tile_n": 192, "store_tma": True},
    "192 wide, registers epilogue": {"tile_n": 192, "store_tma": False},
    "128 wide, staged epilogue": {"tile_n": 128, "store_tma": True},
    "256 wide, CTA pairs multicasting A": {"tile_n": 256, "cluster": 2},
    "256 wide, CTA pairs along M multicasting B": {"tile_n": 256, "cluster": 2, "multicast_b": True},
    "as compiled (again: drift over the run)": {},
}


# The memory-bound nested LoRA shrink (64 x 16 tiles, two 128-byte rows of K per stage, two
# blocks per SM): how its time depends on the K per stage, the ring depth and the blocks
# per SM (a latency-bound stream slows with a shallower ring), on split K (the default:
# every block an equal run of K blocks) and on the launch sequence. `fuse_check` False
# runs the check as a kernel of its own.
LORA_VARIANTS = {
    "as compiled": {},
    "whole tiles, round robin (no split K)": {"split_k": False},
    "no L2 eviction hints": {"cache_hints": False},
    "whole tiles, no L2 eviction hints": {"split_k": False, "cache_hints": False},
    "leaf-table builder before the GEMM (PDL)": {"inline_tables": False},
    "one block per SM": {"ctas_per_sm": 1},
    "two blocks per SM, 4 stages": {"stages": 4},
    "two blocks per SM, 6 stages": {"stages": 6},
    "two blocks per SM, 8 stages": {"stages": 8},
    "builder, GEMM launched the ordinary way (no PDL)": {"inline_tables": False, "programmatic": False},
    "check a kernel of its own, PDL": {"fuse_check": False},
    "check a kernel of its own, no PDL (3 launches)": {"fuse_check": False, "programmatic": False},
    "one swizzle row of K per stage (3.21)": {"tile_k": 64},
    "one swizzle row of K per stage, whole tiles (3.21)": {"tile_k": 64, "split_k": False},
    "wgmma of two earlier K blocks left running": {"mma_lag": 2},
    "whole tiles, wgmma lag 2": {"mma_lag": 2, "split_k": False},
    "four swizzle rows of K per stage": {"tile_k": 256},
    "four swizzle rows of K per stage, one block per SM": {"tile_k": 256, "ctas_per_sm": 1},
    "maps per leaf (no whole-buffer maps)": {"whole_maps": False},
    "as compiled (again: drift over the run)": {},
}

# The scaled multi-LoRA expand (examples/lora_moe_scaled.gspec): a BF16 D += with a fused
# epilogue, K = 16: memory-bound on D, whose old tile the staged epilogue loads by TMA.
EXPAND_VARIANTS = {
    "as compiled": {},
    "leaf-table builder before the GEMM (PDL)": {"inline_tables": False},
    "from registers, pair by pair (3.13)": {"store_tma": False},
    "64-row tiles": {"tile_m": 64},
    "64-row tiles, two blocks per SM": {"tile_m": 64, "ctas_per_sm": 2},
    "128 x 256 tiles": {"tile_n": 256},
    "as compiled (again: drift over the run)": {},
}

# FP8 WGRAD (K-grouped, 128 x 1 scales on both sides, f32 +=), its producer staging the
# per-row and per-column scales of each stage.
WGRAD_VARIANTS = {
    "as compiled": {},
    "leaf-table builder before the GEMM (PDL)": {"inline_tables": False},
    "one-block K loop, stage in a register (no rounds)": {"ring_rounds": False},
    "registers epilogue (f32 read-modify-write)": {"store_tma": False},
    "160 wide, 3 stages": {"tile_n": 160, "stages": 3},
    "CTA pairs multicasting A": {"cluster": 2},
    "CTA pairs along M multicasting B": {"cluster": 2, "multicast_b": True},
    "scales read after the wgmma issue": {"scales_before_issue": False},
    "160 wide, 3 stages, CTA pairs": {"tile_n": 160, "stages": 3, "cluster": 2},
    "no promotion (wrong values, timing only)": {"scaled": False, "consumer_scales": None},
    "as compiled (again: drift over the run)": {},
}

# FP8 M-grouped on rows gathered through an index (top-2 routing of E * M / 2 tokens): the
# gather pre-pass (the default for a wide N) against the GEMM gathering the rows itself
# ("directive" is added to the spec; the other keys change the GEMM's configuration).
GATHER_VARIANTS = {
    "as compiled": {},
    "gathered in the GEMM (TMA row boxes)": {"directive": "gather(fused)"},
    "gathered in the GEMM (cp.async copies)": {"directive": "gather(fused)", "gather_tma": False},
    "as compiled (again: drift over the run)": {},
}


# Decode-sized FP8 MoE (a few tokens per expert; with --bf16 the BF16 kernel): each active
# expert's weights are read once, so the kernel is bound by HBM and latency. The prefill
# tile (128 x 192, CTA pairs) against 64-row tiles of one CTA, ring depths and widths (one
# consumer warpgroup where the variant's two column warpgroups do not apply: other widths,
# split K), and where the weights go in L2 (evicted first; the first tile's asked ahead).
DECODE_VARIANTS = {
    "as compiled": {},
    "decode variant": {"decode": True},
    "decode variant, a builder before the GEMM past 32 leaves": {"decode": True, "inline_leaves": 32},
    "decode variant, 64 x 192": {"decode": True, "tile_n": 192, "n_split": 1},
    "decode variant, 64 x 192, split K where it pays": {"decode": True, "tile_n": 192, "split_k": True, "n_split": 1},
    "decode variant, 64 x 256, split K where it pays": {"decode": True, "split_k": True, "n_split": 1},
    "decode variant, registers epilogue": {"decode": True, "store_tma": False},
    "decode variant, one consumer warpgroup": {"decode": True, "n_split": 1},
    "decode variant, 64 x 160 whole tiles": {"decode": True, "tile_n": 160, "split_k": False, "n_split": 1},
    "decode variant, 64 x 128 whole tiles": {"decode": True, "tile_n": 128, "split_k": False, "n_split": 1},
    "decode variant, maps per leaf (no whole-buffer maps)": {"decode": True, "whole_maps": False},
    "decode variant, weights evict first in L2": {"decode": True, "b_evict_first": True},
    "decode variant, whole tiles (no split K)": {"decode": True, "split_k": False},
    "decode variant, first tile's weights in L2 ahead (4 K blocks)": {"decode": True, "prefetch_k_blocks": 4},
    "decode variant, first tile's weights in L2 ahead (8 K blocks)": {"decode": True, "prefetch_k_blocks": 8},
    "decode variant, ahead (4 K blocks), weights evict first": {"decode": True, "prefetch_k_blocks": 4,
                                                                 "b_evict_first": True},
    "decode variant, CTAs leave once their last stores have read the staging": {"decode": True, "exit_on_read": True},
    "decode variant, ahead (4 K blocks), weights evict first, leave on read": {
        "decode": True, "prefetch_k_blocks": 4, "b_evict_first": True, "exit_on_read": True},
    "decode variant, 128 x 256 (two row warpgroups)": {"decode": True, "tile_m": 128, "n_split": 1},
    "decode variant, 128 x 256, weights evict first": {"decode": True, "tile_m": 128, "n_split": 1, "b_evict_first": True},
    "decode variant (again: drift over the run)": {"decode": True},
}
# The masked decode (E = 32 groups of M = 64 rows, 38-64 valid each): 64-row tiles as
# compiled, against other widths, whole or split.
MASKED_VARIANTS = {
    "as compiled": {},
    "whole tiles (no split K)": {"split_k": False},
    "64 x 256, split K where it pays": {"tile_n": 256},
    "64 x 256, whole tiles": {"tile_n": 256, "split_k": False},
    "64 x 128, whole tiles": {"tile_n": 128, "split_k": False},
    "64 x 256, two column warpgroups": {"tile_n": 256, "split_k": False, "n_split": 2},
    "maps per leaf (no whole-buffer maps)": {"whole_maps": False},
    "weights evict first in L2": {"b_evict_first": True},
    "64 x 256, two column warpgroups, weights evict first": {"tile_n": 256, "split_k": False, "n_split": 2,
                                                            "b_evict_first": True},
    "weights evict first, ahead (4 K blocks)": {"b_evict_first": True, "prefetch_k_blocks": 4},
    "weights evict first, ahead (4 K blocks), leave on read": {"b_evict_first": True, "prefetch_k_blocks": 4,
                                                                "exit_on_read": True},
    "64 x 256, two column warpgroups, weights evict first, ahead (4 K blocks)": {
        "tile_n": 256, "split_k": False, "n_split": 2, "b_evict_first": True, "prefetch_k_blocks": 4},
    "as compiled (again: drift over the run)": {},
}
VARIANT_TABLES = {
    "FP8 headline (default)": VARIANTS,
    "--bf16": BF16_VARIANTS,
    "--lora": LORA_VARIANTS,
    "--expand": EXPAND_VARIANTS,
    "--wgrad": WGRAD_VARIANTS,
    "--gather": GATHER_VARIANTS,
    "--decode (FP8, or BF16 with --bf16)": DECODE_VARIANTS,
    "--masked": MASKED_VARIANTS,
}
# Token counts per expert of the decode cases (contiguous tokens, offsets): E = 32 with
# T = 1024 (22 experts non-empty, 1-129 tokens each) and E = 8 with T = 128, and the
# bench's routed rows (Qwen3-30B-A3B: 128 tokens top-8 of 128 experts; DeepSeek-V3: 64
# tokens top-8 of 256).
DECODE_LENGTHS = {
    "e32": DECODE_E32,
    "e8": DECODE_E8,
    "qwen3": routed_counts(128, QWEN3_EXPERTS, DECODE_TOP_K, seed=128),
    "qwen3_t16": routed_counts(16, QWEN3_EXPERTS, DECODE_TOP_K, seed=16),
    "qwen3_t512": routed_counts(512, QWEN3_EXPERTS, DECODE_TOP_K, seed=512),
    "dsv3": routed_counts(64, DSV3_EXPERTS, DECODE_TOP_K, seed=64),
}


def lora_inputs(t=8192, k=4096, r=16, loras=4, experts=8):
    """The benchmark's LoRA shrink: tokens split evenly over adapters, randomly over experts."""
    g = torch.Generator(device="cpu").manual_seed(2)
    per = t // loras
    inner = []
    for i in range(loras):
        cuts = sorted(torch.randint(0, per + 1, (experts - 1,), generator=g).tolist())
        inner.append([i * per + b for b in (0, *cuts, per)])
    return {
        "x": torch.randn((t, k), device="cuda", dtype=torch.bfloat16),
        "wa": torch.randn((loras, experts, r, k), device="cuda", dtype=torch.bfloat16),
        "lora_offsets": torch.tensor([i * per for i in range(loras + 1)], dtype=torch.int32, device="cuda"),
        "expert_offsets": torch.tensor(inner, dtype=torch.int32, device="cuda"),
    }


def variant(exe, fuse_check=True, inline_tables=True, decode=False, inline_leaves=0, **changes):
    """Re-emit the launch with a changed kernel configuration (the leaf table follows);
    `fuse_check` False runs the offsets check as a kernel of its own; `inline_tables` False
    puts a leaf-table builder before a GEMM that would build its table itself; `decode`
    starts from the decode variant's configuration; `inline_leaves` lets the GEMM build
    tables of up to that many leaves itself."""
    exe.choose_at_call = False  # the variant at every size, not the decode variant's pick
    if not fuse_check or not inline_tables:
        exe.program = emit(exe.spec, exe.schedule, fuse_check=fuse_check, inline_tables=inline_tables)
    if decode:  # the decode variant's configuration (its first choice), then the changes
        launch = exe.schedule.launches[0]
        changes = {**decode_changes(launch)[0], **changes}
        inline_leaves = inline_leaves or DECODE_INLINE_MAX_LEAVES
    exe.program = with_kernel_config(exe.spec, exe.program, inline_leaves=inline_leaves, **changes)
    return exe.program.launches[0].gemm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="8,4096,4096,7168", help="E,M,N,K (M rows per expert)")
    ap.add_argument("--only", default="",
                    help="run the variants whose label contains one of these: separated by '|', or by ',' where "
                    "no '|' is given (many labels hold commas: 'decode variant' alone selects every decode variant)")
    ap.add_argument("--list", action="store_true", help="print every variant's label, by table, and exit")
    ap.add_argument("--bf16", action="store_true", help="probe the BF16 kernel instead of the FP8 one")
    ap.add_argument("--lora", action="store_true", help="probe the memory-bound nested LoRA shrink instead")
    ap.add_argument("--tokens", type=int, default=8192, help="the LoRA shrink's tokens (with --lora)")
    ap.add_argument("--expand", action="store_true", help="probe the scaled multi-LoRA expand (BF16 D +=) instead")
    ap.add_argument("--wgrad", action="store_true", help="probe the FP8 WGRAD kernel (E x M tokens, N x K weights)")
    ap.add_argument("--gather", action="store_true", help="probe the FP8 kernel on rows gathered through an index")
    ap.add_argument("--decode", choices=[*sorted(DECODE_LENGTHS), "uniform"],
                    help="probe the FP8 kernel (with --bf16 the BF16 one) at a decode case's token counts, as the "
                    "bench routes them (N and K from --shape; uniform: M tokens for each of the E experts)")
    ap.add_argument("--masked", action="store_true",
                    help="probe the FP8 masked decode (32 groups of 64 rows, the bench's counts; N and K from --shape)")
    ap.add_argument(
        "--idle", type=float, default=0.0, metavar="MS",
        help="time 60 launches each after MS ms of GPU idling (the card's power and thermal state "
        "then does not drift with the variants before) instead of do_bench back to back",
    )
    args = ap.parse_args()
    if args.list:
        for table, labels in VARIANT_TABLES.items():
            print(f"{table}:")
            for label in labels:
                print(f"  {label}")
        return 0
    from triton.testing import do_bench  # imported here: --list needs no GPU stack

    e, m, n, k = map(int, args.shape.split(","))
    t = e * m
    y0 = None
    if args.expand:
        counts = LORA_EXPAND_COUNTS
        lo_off, inner = nested_offsets(counts)
        t, n, k = sum(map(sum, counts)), 4096, 16
        tensors = {
            "lora_offsets": torch.tensor(lo_off, dtype=torch.int32, device="cuda"),
            "expert_offsets": torch.tensor(inner, dtype=torch.int32, device="cuda"),
            "h": torch.randn((t, k), device="cuda", dtype=torch.bfloat16),
            "wb": (torch.randn((len(counts), len(counts[0]), n, k), device="cuda") / 4).to(torch.bfloat16),
            "scaling": torch.rand((len(counts),), device="cuda") + 0.25,
            "route_w": torch.rand((t,), device="cuda"),
            "bias": torch.randn((len(counts[0]), n), device="cuda", dtype=torch.bfloat16),
        }
        y0 = torch.randn((t, n), device="cuda", dtype=torch.bfloat16)
        spec = (Path(__file__).resolve().parents[1] / "examples" / "lora_moe_scaled.gspec").read_text()
        variants = EXPAND_VARIANTS
    elif args.lora:
        t, n, k = args.tokens, 16, 4096
        tensors, variants = lora_inputs(t=t), LORA_VARIANTS
        spec = LORA.format(k=k, r=16, l=4, e=8)
    elif args.gather:
        s = t // 2
        g = torch.Generator(device="cpu").manual_seed(3)
        idx = torch.cat([torch.randperm(s, generator=g), torch.randperm(s, generator=g)]).to(torch.int32).cuda()
        tensors = {
            "idx": idx, "x": random_fp8((s, k)), "x_scale": random_scales((s, k // 128)), "w": random_fp8((e, n, k)),
            "w_scale": random_scales((e, n // 128, k // 128)),
        }
        variants, spec = GATHER_VARIANTS, GATHER.format(n=n, k=k, e=e)
    elif args.wgrad:
        # Segment-major operands (each expert's tokens contiguous per channel), 128 x 1 scales.
        tensors = {
            "dy": random_fp8((t, n)), "dy_scale": random_scales((t // 128, n)), "x": random_fp8((t, k)), "x_scale": random_scales((t // 128, k)),
        }
        variants, spec = WGRAD_VARIANTS, WGRAD.format(n=n, k=k, e=e)
    elif args.masked:
        counts = DECODE_MASKED
        e, m, t = len(counts), 64, sum(counts)
        tensors = {
            "x": random_fp8((e, m, k)), "x_scale": random_scales((e, m, k // 128)), "w": random_fp8((e, n, k)),
            "w_scale": random_scales((e, n // 128, k // 128)),
            "counts": torch.tensor(counts, dtype=torch.int32, device="cuda"),
        }
        variants, spec = MASKED_VARIANTS, MASKED_SPEC.format(m=m, n=n, k=k, e=e)
    elif args.bf16:
        lengths = DECODE_LENGTHS.get(args.decode, [m] * e) if args.decode else [m] * e
        e, t = len(lengths), sum(lengths)
        x = torch.randn((t, k), device="cuda", dtype=torch.bfloat16)
        w = torch.randn((e, n, k), device="cuda", dtype=torch.bfloat16)
        tensors, variants = {"x": x, "w": w}, DECODE_VARIANTS if args.decode else BF16_VARIANTS
        spec = moe_spec("moe_bf16", n=n, k=k, e=e)
    else:
        lengths = DECODE_LENGTHS.get(args.decode, [m] * e) if args.decode else [m] * e
        e, t = len(lengths), sum(lengths)
        x, w = random_fp8((t, k)), random_fp8((e, n, k))
        xs, ws = random_scales((k // 128, t)).t(), random_scales((e, n // 128, k // 128))
        tensors = {"x": x, "x_scale": xs, "w": w, "w_scale": ws}
        variants = DECODE_VARIANTS if args.decode else VARIANTS
        spec = moe_spec("moe_fp8", n=n, k=k, e=e, fp8=True, scales_major_t=True)
    offs = offsets_tensor(lengths if args.decode else [m] * e)
    if args.masked:
        lengths = DECODE_MASKED
    flops = 2.0 * t * n * k
    # Bytes a decode call must move: the weights of every expert with a token (and their
    # scales), the tokens and the output (as the bench counts them).
    moved = measure.decode_bytes(lengths, n, k, fp8=not args.bf16) if args.decode or args.masked else 0
    reference = None
    sampler = ClockSampler(gpu_id(torch.cuda.get_device_properties(torch.cuda.current_device()))).__enter__()  # each variant's clock and power under sustained load
    atexit.register(sampler.__exit__)
    parts = args.only.split("|" if "|" in args.only else ",")
    selected = {label: changes for label, changes in variants.items() if any(part in label for part in parts)}
    if not selected:
        print(f"--only {args.only!r} selects none of the {len(variants)} variants (--list names them)", file=sys.stderr)
        return 2
    # Said before any compilation: a part that is in every label selects the whole table.
    print(f"# {len(selected)} of {len(variants)} variants: {'; '.join(selected)}", flush=True)
    for label, changes in selected.items():
        changes = dict(changes)
        directive = changes.pop("directive", None)
        exe = gemmspec.build(spec if directive is None else with_directive(spec, directive))
        try:
            cfg = variant(exe, **changes)
        except ValueError as err:
            print(f"{label:40} skipped: {err}", flush=True)
            continue
        out_dtype = torch.float32 if args.lora else torch.bfloat16
        if args.expand:  # y += ...: the check compares one launch's update of y0
            y = y0.clone()
            outputs = {"y": y}
        elif args.wgrad:  # dw += ...: every launch adds, so the check compares the first launch's sum
            y = torch.zeros((e, n, k), dtype=torch.float32, device="cuda")
            outputs = {"dw": y}
        else:
            # A masked group's rows past its count are never written: zeros, so that they compare.
            y = (torch.zeros((e, m, n), dtype=out_dtype, device="cuda") if args.masked
                 else torch.full((t, n), float("nan"), dtype=out_dtype, device="cuda"))
            outputs = {"y": y}
        extra = {} if args.lora or args.expand or args.masked else {"offs": offs}
        run = exe.prepare(torch.cuda.current_stream(), **outputs, **extra, **tensors)
        run.enqueue()
        torch.cuda.synchronize()
        check = ""
        if cfg.scaled or args.bf16 or args.lora or args.wgrad or args.expand:
            if reference is None:
                reference = y.float().clone()
            diff = (y.float() - reference).norm() / reference.norm()
            check = f"rel diff {diff:.1e}" if torch.isfinite(diff) else "NOT WRITTEN"
        if args.idle:
            ms = timed_launches(run.enqueue, 60, args.idle)
        else:
            ms = do_bench(run.enqueue, warmup=50, rep=300, return_mode="median")
        clock = sustained_clock(sampler, run.enqueue)
        if args.decode or args.masked:
            rate = f"{ms * 1e3:8.1f} us {moved / ms / 1e9:6.2f} TB/s"
        elif args.lora or args.expand:
            rate = f"{ms * 1e3:8.1f} us"
        else:
            rate = f"{flops / ms / 1e9:8.1f} TFLOPS"
        print(f"{label:40} {cfg.name:78} {ms:8.3f} ms {rate} {check}{'  ' + clock.describe() if clock else ''}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
