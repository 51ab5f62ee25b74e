#!/usr/bin/env python3
"""Time the decode expert FFN in one spec (the bench's `ffn_decode_*` rows) with its decode
variant's kernels under the L2 options (needs a Hopper GPU + torch).

Each configuration re-emits every launch of the decode variant with the options its kernel
takes (kernels.py: ``b_evict_first``, B's loads evicting first; ``prefetch_k_blocks``,
the first unit's weights asked of L2 ahead, where the kernel has whole-buffer maps;
``exit_on_read``, CTAs leaving once their last TMA stores have read the staging),
captures the call in a CUDA graph and times its replay, one launch per idle gap with L2
flushed before each (as `gemmspec bench --idle`), rated in TB/s of the bytes the layer
must move. The options move no value: every configuration's `y` must equal the first's
bit for bit (the first is checked against float64 by the bench's own row).

    python3 scripts/ffn_decode_probe.py [--case dsv3_T64|dsv3_T512|qwen3_T128] [--idle MS] [--rounds N]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gemmspec.bench import offsets_tensor, random_fp8, random_scales, timed_launches  # noqa: E402
from gemmspec.bench.cases import DECODE_TOP_K, FFN_DECODE_SHAPES  # noqa: E402
from gemmspec.bench.inputs import random_fp8_experts, routed_rows  # noqa: E402
from gemmspec.bench.measure import ffn_decode_bytes, graphed  # noqa: E402
from gemmspec.bench.specs import build_spec, ffn_decode_text  # noqa: E402
from gemmspec.codegen.emit import emit_launch  # noqa: E402
from gemmspec.codegen.variants import DECODE_TABLE_TAG  # noqa: E402

CASES = {f"{model}_T{t}": (t, e, hidden, f) for model, t, e, hidden, f in FFN_DECODE_SHAPES}
# label -> the options every launch of the decode variant takes where its kernel allows.
CONFIGS = {
    "decode variant as compiled": {},
    "weights evict first": {"b_evict_first": True},
    "first unit ahead (4 K blocks)": {"prefetch_k_blocks": 4},
    "both": {"b_evict_first": True, "prefetch_k_blocks": 4},
    "both, leave on read": {"b_evict_first": True, "prefetch_k_blocks": 4, "exit_on_read": True},
}
# Options a kernel may not take, dropped in this order until it does: the first unit's
# prefetch needs whole maps, leaving on read a TMA-stored epilogue (the SwiGLU's FP8 h
# is stored from registers).
OPTIONAL = ("prefetch_k_blocks", "exit_on_read")


def with_options(exe, options: dict) -> list[str]:
    """`exe`'s decode variant with each changed launch re-emitted under `options` (those
    its kernel takes); returns its kernels' names."""
    variant = exe.decode
    launches = list(variant.program.launches)
    for index, _, _ in variant.launches:
        x = launches[index]
        taken = dict(options)
        while True:
            try:
                cfg = replace(x.gemm, **taken, name="")
                break
            except ValueError:
                dropped = next((key for key in OPTIONAL if key in taken), None)
                if dropped is None:
                    raise
                taken.pop(dropped)
        launches[index] = emit_launch(exe.spec, x.launch, cfg, x.check, table_tag=DECODE_TABLE_TAG)
    exe.decode = replace(variant, program=replace(variant.program, launches=tuple(launches)))
    return [x.gemm.name for x in launches]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", choices=sorted(CASES), default="dsv3_T64")
    ap.add_argument("--idle", type=float, default=150.0, metavar="MS", help="GPU idle before each timed launch")
    ap.add_argument("--rounds", type=int, default=2, help="times through the configurations (drift shows)")
    args = ap.parse_args()
    tokens, experts, hidden, f = CASES[args.case]
    src_list, lengths = routed_rows(tokens, experts, DECODE_TOP_K, seed=tokens)  # the bench's routing
    rows = len(src_list)
    src = torch.tensor(src_list, dtype=torch.int32, device="cuda")
    tensors = dict(
        src=src, x=random_fp8((tokens, hidden)), x_scale=random_scales((tokens, hidden // 128)),
        wg=random_fp8_experts((experts, f, hidden)), wg_scale=random_scales((experts, f // 128, hidden // 128)),
        wu=random_fp8_experts((experts, f, hidden)), wu_scale=random_scales((experts, f // 128, hidden // 128)),
        w_down=random_fp8_experts((experts, hidden, f)), w_down_scale=random_scales((experts, hidden // 128, f // 128)),
        route_w=torch.rand((rows,), device="cuda"), expert_offsets=offsets_tensor(lengths),
        h=torch.empty((rows, f), dtype=torch.float8_e4m3fn, device="cuda"),
        h_scale=torch.empty((rows, f // 128), device="cuda"),
        y_rows=torch.empty((rows, hidden), dtype=torch.bfloat16, device="cuda"),
    )
    moved = ffn_decode_bytes(lengths, tokens, hidden, f)
    text = ffn_decode_text(hidden=hidden, f=f, e=experts, name=f"ffn_decode_{hidden}_{f}")
    stream = torch.cuda.Stream()
    first = None
    for round_ in range(args.rounds):
        for label, options in CONFIGS.items():
            exe = build_spec(text)
            names = with_options(exe, options)
            y = torch.full((tokens, hidden), float("nan"), dtype=torch.bfloat16, device="cuda")
            run = exe.prepare(stream, y=y, **tensors)
            assert exe.program_for({"T": rows}) is exe.decode.program, "the call does not take the decode variant"
            replay = graphed(run.enqueue, stream)
            replay()
            torch.cuda.synchronize()
            if first is None:
                first = y.clone()
            same = torch.equal(y.view(torch.int16), first.view(torch.int16))
            ms = timed_launches(replay, 60, args.idle)
            print(f"round {round_} {label:32} {ms * 1e3:8.1f} us {moved / ms / 1e9:6.2f} TB/s "
                  f"{'same bits' if same else 'DIFFERENT BITS'}  {' '.join(n.split('_sm90a_')[1] for n in names)}",
                  flush=True)
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
