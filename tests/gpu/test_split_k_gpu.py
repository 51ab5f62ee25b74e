"""On a Hopper GPU: split K (memory-bound tiles of at most 32 columns whose leaves share one
K, the LoRA shrink's: every block takes an equal run of the launch's K blocks) matches the
float64 reference on nested ragged leaves with 0, 1, 127 and 129 rows, with the table
built in the kernel and by a builder; with K of one block (every tile one step), an f32
+=, a fused epilogue, token counts from a handful of tiles (more blocks than steps) to
hundreds; and repeated calls give the same bits (shared tiles are added in block order;
the arrival counters are back at zero after every launch)."""

from __future__ import annotations

import pytest

import gemmspec
from gemmspec import bench
from gemmspec.runtime.verify import run_random

pytestmark = pytest.mark.gpu

EDGE_COUNTS = [[0, 1, 127, 129, 300], [64, 65, 0, 2, 511]]
EDGE_LENGTHS = {"lora": [sum(c) for c in EDGE_COUNTS], "expert": [c for row in EDGE_COUNTS for c in row]}


def shrink(k: int, loras: int = 2, experts: int = 5, op: str = "=", pre: str = "", out: str = "f32",
           extra: str = "") -> str:
    text = bench.LORA.format(k=k, r=16, l=loras, e=experts).replace(
        "y[t, r] = sum", f"y[t, r] {op} {pre}sum"
    ).replace("tensor y  : f32", f"tensor y  : {out}")
    return text.replace("  tensor y ", extra + "  tensor y ") if extra else text


def report_ok(report) -> None:
    print(report.describe())
    assert report.ok, report.describe()


def build_split(text: str, inline: bool = True):
    from gemmspec.codegen.emit import emit

    exe = gemmspec.build(text)
    if not inline:
        exe.program = emit(exe.spec, exe.schedule, inline_tables=False)
    cfg = exe.program.launches[0].gemm
    assert cfg.split_k and bool(cfg.inline_table) == inline, cfg.name
    return exe


@pytest.mark.parametrize("inline", [True, False], ids=["table in the kernel", "builder"])
@pytest.mark.parametrize("k", [64, 200, 576, 4096])
def test_split_k_ragged_nested_edges(k, inline):
    exe = build_split(shrink(k), inline)
    report_ok(run_random(exe, lengths=EDGE_LENGTHS, seed=k, repeats=0))


@pytest.mark.parametrize("t", [3, 40, 300, 3000, 9000])
def test_split_k_tile_counts(t):
    # A few tiles (more blocks than K blocks: some blocks idle), tens, hundreds.
    report_ok(run_random(build_split(shrink(576, loras=4, experts=8)), dims={"T": t}, seed=t, repeats=0))


@pytest.mark.parametrize("t", [5, 1000, 20000])
def test_split_k_one_k_block_per_tile(t):
    # K of one block: every tile is one step, so no tile is shared.
    report_ok(run_random(build_split(shrink(64, loras=4, experts=8)), dims={"T": t}, seed=t, repeats=0))


def test_split_k_accumulates_f32():
    exe = build_split(shrink(576, op="+="))
    report_ok(run_random(exe, lengths=EDGE_LENGTHS, seed=5, repeats=0))


def test_split_k_fused_epilogue_bf16():
    text = shrink(576, pre="scaling[lora(t)] * route_w[t] * ", out="bf16",
                  extra="  tensor scaling : f32 [L]\n  tensor route_w : f32 [T]\n")
    exe = build_split(text)
    report_ok(run_random(exe, lengths=EDGE_LENGTHS, seed=6, repeats=0))


def test_many_tiles():
    # Over 600 tiles of 64 rows, two K blocks each.
    report_ok(run_random(build_split(shrink(128, loras=2, experts=2)), dims={"T": 40000}, seed=7, repeats=0))


def test_split_k_is_deterministic():
    torch = pytest.importorskip("torch")
    # 2048 tokens in about 50 tiles: each shared by several blocks.
    exe = build_split(shrink(4096, loras=4, experts=8))
    g = torch.Generator(device="cpu").manual_seed(3)
    lo, inner = bench.nested_offsets(bench.random_nested_counts([512] * 4, 8, g))
    x = torch.randn((2048, 4096), device="cuda", dtype=torch.bfloat16)
    wa = torch.randn((4, 8, 16, 4096), device="cuda", dtype=torch.bfloat16)
    y = torch.full((2048, 16), float("nan"), device="cuda")
    run = exe.prepare(torch.cuda.current_stream(), x=x, wa=wa, y=y,
                      lora_offsets=torch.tensor(lo, dtype=torch.int32, device="cuda"),
                      expert_offsets=torch.tensor(inner, dtype=torch.int32, device="cuda"))
    run.enqueue()
    first = y.clone()
    for _ in range(3):
        y.fill_(float("nan"))
        run.enqueue()
        torch.cuda.synchronize()
        assert torch.equal(y.view(torch.int32), first.view(torch.int32))
    ref = x.double() @ wa.reshape(32, 16, 4096)[0].double().t()  # rows of leaf (0, 0)
    rows = slice(inner[0][0], inner[0][1])
    assert torch.allclose(first[rows].double(), ref[rows], rtol=1e-3, atol=1e-2)
