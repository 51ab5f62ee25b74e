"""Same inputs, same bits: the decode expert FFN (examples/moe_ffn_fp8_decode.gspec at
DeepSeek-V3's or Qwen3's sizes) called many times over new routings, each routing run
through a captured CUDA graph and eagerly, every output compared bit for bit, and y
compared with the combine of the y_rows the GPU wrote (each token's rows added in
ascending row order in float32 and rounded once, which is what the spec's scatter_add
promises). A kernel whose result depends on timing (a race in a ring, a table or a
map read before it is written) shows as an iteration that differs; start several of
these processes together on one GPU so that their kernels interleave.

    python scripts/determinism_probe.py --iterations 200 [--sizes qwen3] [--seed S]

Exits 1 on the first difference, with where it was."""

from __future__ import annotations

import argparse
import sys
import time

SIZES = {"dsv3": dict(tokens=64, experts=256, hidden=7168, f=2048),
         "qwen3": dict(tokens=128, experts=128, hidden=2048, f=768)}
TOP_K = 8


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--sizes", choices=sorted(SIZES), default="dsv3")
    ap.add_argument("--seed", type=int, default=0, help="the first routing's seed")
    args = ap.parse_args(argv)
    import torch

    import gemmspec
    from gemmspec.bench import measure, specs
    from gemmspec.bench.inputs import random_fp8, random_fp8_experts, random_scales, route_into

    z = SIZES[args.sizes]
    s, e, hd, f = z["tokens"], z["experts"], z["hidden"], z["f"]
    t = s * TOP_K
    exe = gemmspec.build(specs.ffn_decode_text(hidden=hd, f=f, e=e, name=f"ffn_probe_{hd}_{f}_{e}"))
    picked = exe.program_for({"S": s, "T": t})
    print("kernels:", ", ".join(step.gemm.name for step in picked.launches), flush=True)
    make = random_fp8_experts
    a = dict(wg=make((e, f, hd)), wu=make((e, f, hd)), w_down=make((e, hd, f)),
             wg_scale=random_scales((e, f // 128, hd // 128)), wu_scale=random_scales((e, f // 128, hd // 128)),
             w_down_scale=random_scales((e, hd // 128, f // 128)),
             x=random_fp8((s, hd)), x_scale=random_scales((s, hd // 128)),
             src=torch.zeros(t, dtype=torch.int32, device="cuda"),
             expert_offsets=torch.zeros(e + 1, dtype=torch.int32, device="cuda"),
             route_w=torch.zeros(t, device="cuda"),
             h=torch.empty((t, f), dtype=torch.float8_e4m3fn, device="cuda"),
             h_scale=torch.empty((t, f // 128), device="cuda"),
             y_rows=torch.empty((t, hd), dtype=torch.bfloat16, device="cuda"),
             y=torch.empty((s, hd), dtype=torch.bfloat16, device="cuda"))
    outputs = ("h", "h_scale", "y_rows", "y")

    def poison() -> None:
        for n in outputs:
            a[n].view(torch.uint8).fill_(0xFF)  # NaN in each of these types

    route_into(a, s, e, TOP_K, args.seed)
    exe(**a)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exe(**a)
    start = time.time()
    for i in range(args.iterations):
        seed = args.seed + 1 + i
        route_into(a, s, e, TOP_K, seed)
        poison()
        graph.replay()
        torch.cuda.synchronize()
        replayed = {n: a[n].clone() for n in outputs}
        poison()
        exe(**a)
        torch.cuda.synchronize()
        for n in outputs:
            if not torch.equal(a[n].view(torch.uint8), replayed[n].view(torch.uint8)):
                bad = (a[n].view(torch.uint8) != replayed[n].view(torch.uint8)).nonzero()
                print(f"iteration {i} (routing seed {seed}): {n} differs between the graph replay and the eager "
                      f"call at {bad.shape[0]} bytes, first at {bad[:4].tolist()}", flush=True)
                return 1
        for label, got in (("eager", a), ("replay", replayed)):
            want = measure.combined(got["y_rows"], a["src"], s)
            if not torch.equal(got["y"].view(torch.int16), want.view(torch.int16)):
                bad = (got["y"].view(torch.int16) != want.view(torch.int16)).nonzero()
                r, c = bad[0].tolist()
                print(f"iteration {i} (routing seed {seed}), {label}: y is not the combine of the y_rows written at "
                      f"{bad.shape[0]} elements; first y[{r}, {c}] = {float(got['y'][r, c])} against "
                      f"{float(want[r, c])}", flush=True)
                return 1
    print(f"{args.iterations} routings, replay and eager bit-identical, y the combine of y_rows "
          f"({time.time() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
