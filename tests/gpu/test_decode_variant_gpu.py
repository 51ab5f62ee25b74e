"""On a Hopper GPU: the decode variant (64-row tiles of one CTA, picked per call where the
average rows per expert are at most the rule's threshold) computes what the compiled
launch computes, on both sides of the rule's threshold, for FP8 blockwise and BF16
operands, over leaves of 0, 1, 2, 7, 8, 9, 63, 64, 65, 127 and 129 rows; a CUDA graph
captured on it replays with new counts; the wide FP8 variant (two column warpgroups) after
a leaf-table builder of its own. Judged element by element against the float64
reference (gemmspec.runtime.verify), guard bytes included. Skipped elsewhere, with a
reason."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.runtime.verify import check_random

pytestmark = pytest.mark.gpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import assert_close_elementwise  # noqa: E402

E = 8
SPEC = """
gemm decode_{kind} {{
  dim T
  dim N = {n}, K = 512
  group expert[E = 8] = ragged(T, offsets = offs)
  tensor x : {t} [T, K]{xs}
  tensor w : {t} [E, N, K]{ws}
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}}
"""
# N = 384 keeps the compiled width in the variant (192 columns);
# N = 512, a multiple of 256, gives FP8 the wide variant: 64 x 256 whole tiles.
KINDS = {
    "fp8": dict(t="e4m3", xs=" scale f32 [1, 128]", ws=" scale f32 [1, 128, 128]", n=384),
    "fp8_wide": dict(t="e4m3", xs=" scale f32 [1, 128]", ws=" scale f32 [1, 128, 128]", n=512),
    "bf16": dict(t="bf16", xs="", ws="", n=384),
}
# Token counts per expert on each side of the threshold; the threshold (96 rows per expert
# where the compiled FP8 kernel runs CTA pairs, 128 with the wide variant, 32 for BF16's
# single CTAs) adds two more.
COUNTS = {
    "edges_low": [0, 1, 2, 7, 8, 9, 63, 64],  # T = 154: decode for FP8, compiled for BF16
    "edges_high": [65, 127, 129, 0, 0, 1, 2, 7],  # T = 331
    "small": [0, 1, 2, 7, 8, 9, 0, 0],  # T = 27: decode for both
    "prefill_edges": [0, 1, 129, 127, 65, 1000, 9, 8],  # T = 1339: compiled for both
}


def threshold_counts(max_rows: int) -> dict[str, list[int]]:
    """Counts at the threshold (still the decode variant) and one row past it."""
    per = max_rows // E
    return {"at_threshold": [per] * E, "one_past": [per + 1] + [per] * (E - 1)}


def spec_text(kind: str) -> str:
    return SPEC.format(kind=kind, **KINDS[kind])


@pytest.mark.parametrize("counts", sorted([*COUNTS, "at_threshold", "one_past"]))
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_side_of_the_threshold_matches_the_reference(kind, counts):
    exe = gemmspec.build(spec_text(kind))
    assert exe.decode is not None, "a ragged launch over a run-time dim has a decode variant"
    limit = exe.decode.rule.max_rows
    lengths = {**COUNTS, **threshold_counts(limit)}[counts]
    t = sum(lengths)
    picked = exe.program_for({"T": t})
    assert (picked is exe.decode.program) == (t <= limit)
    assert "t64x" in picked.launches[0].gemm.name or t > limit
    if kind == "fp8_wide":
        assert limit == 128 * E and exe.decode.program.launches[0].gemm.tile_n == 256
    for seed in (0, 1):  # two calls with fresh data on one executable (one plan)
        report = check_random(exe, lengths={"expert": lengths}, seed=seed).report
        print(report.describe())
        assert report.ok, report.describe()


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_decode_variant_can_be_turned_off(kind):
    exe = gemmspec.build(spec_text(kind))
    exe.choose_at_call = False
    assert exe.program_for({"T": 8}) is exe.program
    report = check_random(exe, lengths={"expert": COUNTS["small"]}, seed=2).report
    assert report.ok, report.describe()


@pytest.mark.parametrize("kind", ["fp8", "fp8_wide"])
def test_a_graph_captured_on_the_decode_variant_replays_with_new_counts(kind):
    torch = pytest.importorskip("torch")
    exe = gemmspec.build(spec_text(kind))
    n = KINDS[kind]["n"]
    first = [0, 1, 2, 7, 8, 9, 63, 64]
    t = sum(first)
    assert exe.program_for({"T": t}) is exe.decode.program
    g = torch.Generator(device="cpu").manual_seed(5)
    x = (torch.randn((t, 512), generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    xs = (torch.rand((t, 4), generator=g) * 0.01 + 0.001).cuda()
    w = (torch.randn((E, n, 512), generator=g) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).cuda()
    ws = (torch.rand((E, n // 128, 4), generator=g) * 0.01 + 0.001).cuda()
    offs = torch.zeros(E + 1, dtype=torch.int32, device="cuda")
    y = torch.full((t, n), float("nan"), dtype=torch.bfloat16, device="cuda")

    def set_counts(counts):
        offs.copy_(torch.tensor(np.concatenate([[0], np.cumsum(counts)]), dtype=torch.int32))

    set_counts(first)
    exe(x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offs)  # warm-up: the plan exists before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        exe(x=x, x_scale=xs, w=w, w_scale=ws, y=y, offs=offs)
    xa = (x.double().view(t, 4, 128) * xs.double().view(t, 4, 1)).view(t, 512).cpu().numpy()
    blocks = n // 128
    wb = (w.double().view(E, blocks, 128, 4, 128) * ws.double().view(E, blocks, 1, 4, 1)).view(E, n, 512).cpu().numpy()
    for counts in ([64, 0, 1, 2, 7, 8, 9, 63], [0, 0, 0, 154, 0, 0, 0, 0], first):
        set_counts(counts)
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = np.empty((t, n))
        start = 0
        for e, c in enumerate(counts):
            ref[start:start + c] = xa[start:start + c] @ wb[e].T
            start += c
        assert_close_elementwise(y, ref, dtype="bf16")


# Two launches (the shrink and the expand of examples/lora_qkv_one_spec.gspec, BF16 in
# single CTAs over 4 adapters: the threshold is T = 128). The decode variant's builder of
# launch 0 counts 64-row tiles: segments of 65 and 129 rows take one more tile than
# 128-row counting gives, so a builder of the compiled program would leave rows out;
# launch 1 builds its table in its GEMM from the offsets launch 0's builder checked.
LORA = Path(__file__).resolve().parents[2] / "examples" / "lora_qkv_one_spec.gspec"
LORA_LENGTHS = {"decode": [0, 65, 61, 2], "compiled": [129, 65, 0, 200]}


@pytest.mark.parametrize("side", sorted(LORA_LENGTHS))
def test_launches_with_builders_of_their_own_match_the_reference(side):
    from gemmspec.runtime.verify import run_random

    exe = gemmspec.build(LORA)
    variant = exe.decode
    assert variant is not None and variant.rule.max_rows == 32 * 4
    lengths = LORA_LENGTHS[side]
    picked = exe.program_for({"T": sum(lengths)})
    assert (picked is variant.program) == (side == "decode")
    if side == "decode":  # launch 0's builder counts 64-row tiles; launch 1 builds its table in its GEMM
        first, second = picked.launches
        assert not first.gemm.inline_table and first.table_kernel.endswith("_decode")
        assert second.gemm.inline_table
    report = run_random(exe, lengths={"lora": lengths}, seed=sum(lengths), repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
    assert {c.tensor for c in report.checks} == {"a", "y"}


# More experts than the variant's GEMM builds a table for (DECODE_INLINE_MAX_LEAVES): a
# leaf-table builder runs before it, and the wide tile's two column warpgroups store
# through one output map per leaf (with the table in the GEMM, each has its own).
MANY_EXPERTS = 264


def test_the_wide_variant_after_a_builder_matches_the_reference():
    from gemmspec.codegen.variants import DECODE_INLINE_MAX_LEAVES

    text = SPEC.replace("E = 8", f"E = {MANY_EXPERTS}").format(kind="fp8_many", **KINDS["fp8_wide"])
    exe = gemmspec.build(text)
    gemm = exe.decode.program.launches[0].gemm
    assert MANY_EXPERTS > DECODE_INLINE_MAX_LEAVES and not gemm.inline_table and gemm.n_split == 2
    rng = np.random.default_rng(7)
    lengths = [int(c) for c in rng.choice([0, 0, 1, 2, 7, 9, 63, 64, 65], size=MANY_EXPERTS)]
    assert exe.program_for({"T": sum(lengths)}) is exe.decode.program
    report = check_random(exe, lengths={"expert": lengths}, seed=3).report
    print(report.describe())
    assert report.ok, report.describe()
