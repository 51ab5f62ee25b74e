"""On a Hopper GPU: examples/moe_ffn_fp8_decode.gspec, the decode expert FFN with its top-k
combine into token order, matches the float64 reference (random data through
gemmspec.runtime.verify, at smaller sizes; then seeded top-8 routings at DeepSeek-V3's
decode sizes), gives the same bits on every call, and a CUDA graph captured on it
replays with a new routing of the same token count (the same bits as an eager call on
that routing). On the routings each step is judged on what the step before it wrote: h
of the sampled tokens' routed rows against float64, their y_rows against float64 on that
h, element by element, and y bit for bit the combine of the y_rows written. The bench's
procedure runs and checks at Qwen3's sizes. Skipped elsewhere, with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.bench import measure, specs
from gemmspec.bench.inputs import route_into, routed_counts
from gemmspec.runtime.verify import run_random

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import assert_close_elementwise  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_ffn_fp8_decode.gspec"
TOKENS, EXPERTS, TOP_K, H, F = 64, 256, 8, 7168, 2048


def test_example_matches_the_reference_on_random_data():
    # The float64 reference holds every operand as float64 on the host: the example at 16
    # experts, hidden 1024 and intermediate 512 (the full sizes are judged below on tokens).
    exe = gemmspec.build(specs.ffn_decode_text(hidden=1024, f=512, e=16, name="ffn_decode_small"))
    report = run_random(exe, dims={"S": TOKENS}, lengths={"expert": routed_counts(TOKENS, 16, TOP_K, seed=2)},
                        seed=2, repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
    assert {"h", "y"} <= {c.tensor for c in report.checks}


@pytest.fixture(scope="module")
def layer():
    torch = pytest.importorskip("torch")
    from gemmspec.bench.inputs import random_fp8, random_fp8_experts, random_scales

    make = random_fp8_experts
    w = dict(wg=make((EXPERTS, F, H)), wu=make((EXPERTS, F, H)), w_down=make((EXPERTS, H, F)),
             wg_scale=random_scales((EXPERTS, F // 128, H // 128)), wu_scale=random_scales((EXPERTS, F // 128, H // 128)),
             w_down_scale=random_scales((EXPERTS, H // 128, F // 128)))
    x, xs = random_fp8((TOKENS, H)), random_scales((TOKENS, H // 128))
    t = TOKENS * TOP_K
    args = dict(
        x=x, x_scale=xs, src=torch.zeros(t, dtype=torch.int32, device="cuda"),
        expert_offsets=torch.zeros(EXPERTS + 1, dtype=torch.int32, device="cuda"),
        route_w=torch.zeros(t, device="cuda"),
        h=torch.full((t, F), float("nan"), device="cuda").to(torch.float8_e4m3fn),
        h_scale=torch.full((t, F // 128), float("nan"), device="cuda"),
        y_rows=torch.full((t, H), float("nan"), dtype=torch.bfloat16, device="cuda"),
        y=torch.full((TOKENS, H), float("nan"), dtype=torch.bfloat16, device="cuda"),
        **w,
    )
    return gemmspec.build(EXAMPLE), args


def route(args, seed: int):
    """A seeded top-8 routing written in place into src, expert_offsets and route_w; the
    expert of each routed row."""
    return route_into(args, TOKENS, EXPERTS, TOP_K, seed)


def judge(args, expert_of, tokens):
    """Each step on what the step before it wrote: h of the sampled tokens' routed rows
    against float64, their y_rows against float64 on that h (one row's bound each), and y
    bit for bit the combine of the y_rows written (a sum of k rows carries k rows'
    accumulation errors: judged against the float64 chain, it may exceed one row's bound
    on some data though every step is right)."""
    import torch

    a = args
    rows, h_got, h_ref, y_rows_ref = measure.ffn_decode_reference(
        a["x"], a["x_scale"], a["wg"], a["wg_scale"], a["wu"], a["wu_scale"], a["w_down"], a["w_down_scale"], a["h"],
        a["h_scale"], a["route_w"], a["src"], expert_of, tokens)
    assert_close_elementwise(h_got, h_ref, dtype="e4m3", name="h (routed rows of the sampled tokens)")
    assert_close_elementwise(a["y_rows"][rows], y_rows_ref, dtype="bf16", name="y_rows (routed rows of the sampled tokens)")
    want = measure.combined(a["y_rows"], a["src"], TOKENS)
    wrong = (a["y"].view(torch.int16) != want.view(torch.int16)).nonzero()
    assert wrong.numel() == 0, (
        f"y is not the combine of the y_rows written at {wrong.shape[0]} elements, first {wrong[0].tolist()}: "
        f"{float(a['y'][tuple(wrong[0].tolist())])} against {float(want[tuple(wrong[0].tolist())])}")


def test_top8_routing_matches_the_reference_and_repeats_bit_for_bit(layer):
    import torch

    exe, args = layer
    expert_of = route(args, seed=1)
    exe(**args)
    torch.cuda.synchronize()
    judge(args, expert_of, list(range(0, TOKENS, 4)))
    first = {n: args[n].clone() for n in ("h", "h_scale", "y_rows", "y")}
    for _ in range(3):
        args["y"].fill_(float("nan"))
        exe(**args)
        torch.cuda.synchronize()
        for n, v in first.items():
            assert torch.equal(args[n].view(torch.uint8), v.view(torch.uint8)), f"{n} differs between calls"


def test_a_captured_graph_replays_with_a_new_routing(layer):
    import torch

    exe, args = layer
    route(args, seed=3)
    exe(**args)  # warm-up: the plan and its workspaces exist before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exe(**args)
    for seed in (4, 5):
        expert_of = route(args, seed)
        args["y"].fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        judge(args, expert_of, list(range(1, TOKENS, 5)))
        replayed = args["y"].clone()
        args["y"].fill_(float("nan"))
        exe(**args)  # eager, same routing: the same bits
        torch.cuda.synchronize()
        assert torch.equal(args["y"].view(torch.int16), replayed.view(torch.int16))


def test_the_bench_procedure_runs_and_checks_at_qwen3_sizes(monkeypatch):
    pytest.importorskip("torch")
    from gemmspec import bench

    monkeypatch.setattr(measure, "timed", lambda fn, repeat, before=None: (fn(), bench.Timing([1.0] * repeat, None))[1])
    rows, _ = measure.ffn_decode(1, name="q", tokens=16, experts=128, top_k=8, hidden=2048, f=768, seed=16)
    print("\n".join(f"{r.impl}: {r.check}" for r in rows))
    assert rows[0].impl.startswith("gemmspec one spec") and "same bits" in rows[0].check
    assert specs.ffn_decode_text(hidden=2048, f=768, e=128) != specs.example_text(specs.FFN_DECODE_EXAMPLE)


@pytest.mark.parametrize("program", ["decode", "compiled"])
def test_bad_offsets_compute_nothing_in_either_launch(layer, program):
    # expert_offsets ending one row short of T: the check (in launch 0's builder) flags
    # it, and neither GEMM writes a row, whichever program the call takes; check=True
    # raises it; the next good call writes everything.
    import torch

    from gemmspec.errors import ArgumentError

    exe, args = layer
    exe.choose_at_call = program == "decode"
    try:
        route(args, seed=6)
        good = args["expert_offsets"].clone()
        args["expert_offsets"][-1] -= 1
        for n in ("h", "y_rows"):
            args[n].view(torch.uint8).fill_(0xFF)  # NaN
        exe(**args)
        torch.cuda.synchronize()
        for n in ("h", "y_rows"):
            assert torch.isnan(args[n].float()).all(), f"{n} written with bad offsets"
        with pytest.raises(ArgumentError, match="expert_offsets"):
            exe(check=True, **args)
        args["expert_offsets"].copy_(good)
        exe(check=True, **args)
        torch.cuda.synchronize()
        assert not torch.isnan(args["y_rows"].float()).any() and not torch.isnan(args["y"].float()).any()
    finally:
        exe.choose_at_call = True
