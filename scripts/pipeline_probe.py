#!/usr/bin/env python3
"""Time variants of the FP8 headline kernel to locate its bound (needs a Hopper GPU + torch).

Same leaf table, same inputs, only the GEMM kernel's configuration changes:
scaled as compiled, scaled without CTA pairs, scaled with a shallower ring, and the
same tile *without* FP8 promotion (an unscaled kernel: its output is not the spec's
result, it only shows what the load pipeline and wgmma sustain without the per-K-block
promotion). Prints one line per variant.

    python3 scripts/pipeline_probe.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import torch
from triton.testing import do_bench

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import gemmspec  # noqa: E402
from gemmspec.bench import MOE_FP8, _fp8, _offsets, _scales  # noqa: E402
from gemmspec.codegen.emit import HEADER, emit_launch  # noqa: E402
from gemmspec.codegen.kernels import render_gemm  # noqa: E402


def variant(exe, tile_m=None, tile_n=None, cluster=None, **config):
    """Re-emit the launch with another tile (the leaf table follows it); `config` changes
    only the GEMM kernel (stages, scaled), keeping the leaf table."""
    x = exe.program.launches[0]
    tile = {k: v for k, v in dict(tile_m=tile_m, tile_n=tile_n, cluster=cluster).items() if v is not None}
    launch = emit_launch(exe.spec, dataclasses.replace(x.launch, signature=dataclasses.replace(x.launch.signature, **tile)))
    if config:
        cfg = dataclasses.replace(launch.gemm, name="", stages=config.pop("stages", 0), **config)
        table = launch.source[launch.source.index("// Leaf table builder"):]
        launch = dataclasses.replace(launch, gemm=cfg, source=HEADER + "\n" + render_gemm(cfg) + "\n" + table)
    exe.program = dataclasses.replace(exe.program, launches=(launch,))
    return launch.gemm


def main() -> int:
    e, m, n, k = 8, 4096, 4096, 7168
    t = e * m
    x, w = _fp8((t, k)), _fp8((e, n, k))
    xs, ws = _scales((k // 128, t)).t(), _scales((e, n // 128, k // 128))
    y = torch.empty((t, n), dtype=torch.bfloat16, device="cuda")
    offs = _offsets([m] * e)
    flops = 2.0 * t * n * k
    variants = {
        "as compiled": {},
        "no CTA pairs": {"cluster": 1},
        "no CTA pairs, 3 stages": {"cluster": 1, "stages": 3},
        "no CTA pairs, 64-row tiles": {"cluster": 1, "tile_m": 64},
        "no promotion (unscaled FP8, wrong values)": {"cluster": 1, "scaled": False},
        "no promotion, CTA pairs": {"cluster": 2, "scaled": False},
    }
    for label, changes in variants.items():
        exe = gemmspec.build(MOE_FP8.format(n=n, k=k, e=e))
        cfg = variant(exe, **dict(changes))
        run = exe.prepare(torch.cuda.current_stream(), x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offs)
        ms = do_bench(run.enqueue, warmup=50, rep=300, return_mode="median")
        print(f"{label:44} {cfg.name:70} {ms:8.3f} ms {flops / ms / 1e9:8.1f} TFLOPS", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
