"""The bench's decode rows and `--sweep decode` without a GPU: the seeded routing and
counts, the bytes a decode call must move, the case table's decode rows, the report of a
row judged against the HBM copy rate, the sweep's points, table and plot series, the
DeepGEMM padding of ragged BF16 groups, and the decode procedures run on the CPU with the
schedule reference executor standing in for the kernels (their checks pass, and fail on
a wrong result)."""

from __future__ import annotations

import math

import numpy as np
import pytest

import gemmspec
from gemmspec import bench
from gemmspec.bench import cases, measure, specs, sweep
from gemmspec.bench.anchors import deepgemm
from gemmspec.bench.cases import STREAM_FLOOR_US
from gemmspec.bench.inputs import expert_counts, masked_counts, routed_counts, topk_routing
from gemmspec.bench.plot import sweep_series
from gemmspec.bench.report import verdict

E32 = [0, 55, 57, 2, 0, 18, 9, 0, 61, 46, 40, 56, 2, 25, 0, 106, 0, 86, 0, 61, 14, 0, 91, 0, 0, 108, 33, 1, 0, 129, 1, 23]
E8 = [0, 49, 53, 2, 0, 16, 8, 0]


# ------------------------------------------------------------------ routing and counts
@pytest.mark.parametrize("tokens,experts", [(1, 256), (64, 256), (512, 256), (4096, 256), (16, 128), (512, 128)])
def test_topk_routing_picks_distinct_experts_and_counts_sum_to_rows(tokens, experts):
    routing = topk_routing(tokens, experts, 8, seed=tokens)
    assert len(routing) == tokens
    for chosen in routing:
        assert len(chosen) == len(set(chosen)) == 8
        assert all(0 <= e < experts for e in chosen)
    counts = expert_counts(routing, experts)
    assert len(counts) == experts and sum(counts) == tokens * 8
    assert counts == routed_counts(tokens, experts, 8, seed=tokens)


def test_routing_repeats_with_its_seed_and_changes_with_another():
    assert topk_routing(64, 256, 8, seed=3) == topk_routing(64, 256, 8, seed=3)
    assert topk_routing(64, 256, 8, seed=3) != topk_routing(64, 256, 8, seed=4)
    assert expert_counts([[2, 0], [0, 1]], 3) == [2, 1, 1]


def test_routing_refuses_more_picks_than_experts():
    with pytest.raises(ValueError, match="1 <= top_k <= experts"):
        topk_routing(4, 4, 8, seed=0)


def test_masked_counts_stay_in_range_and_repeat():
    counts = masked_counts(32, 38, 64, seed=0)
    assert len(counts) == 32 and all(38 <= c <= 64 for c in counts)
    assert counts == masked_counts(32, 38, 64, seed=0) == cases.DECODE_MASKED
    assert len(set(counts)) > 1


# ------------------------------------------------------------------ bytes read
def test_decode_bytes_counts_active_weights_rows_scales_and_output():
    counts, n, k = [0, 3, 1, 0], 256, 384
    # FP8: 2 active experts x (256 x 384 bytes + 2 x 3 f32 scales), 4 rows x (384 bytes +
    # 3 f32 scales), 4 x 256 BF16 outputs.
    assert measure.decode_bytes(counts, n, k, fp8=True) == 2 * (256 * 384 + 6 * 4) + 4 * (384 + 3 * 4) + 4 * 256 * 2
    assert measure.decode_bytes(counts, n, k, fp8=False) == 2 * 256 * 384 * 2 + 4 * 384 * 2 + 4 * 256 * 2
    assert measure.decode_bytes([0, 0], n, k, fp8=True) == 0


def test_decode_bytes_of_the_e32_row():
    n, k, active, t = 4096, 7168, 22, 1024
    assert sum(1 for c in E32 if c) == active and sum(E32) == t
    expected = active * n * k * (1 + 4 / 128 / 128) + t * k * (1 + 4 / 128) + 2 * t * n
    assert measure.decode_bytes(E32, n, k, fp8=True) == pytest.approx(expected, rel=1e-12)


# ------------------------------------------------------------------ the case table
def _decode_cases():
    return {c.name: c for c in bench.selected_cases(["decode"])}


def test_only_decode_selects_every_decode_row_and_nothing_else():
    chosen = _decode_cases()
    assert set(chosen) == {c.name for c in bench.CASES if c.name.startswith("decode_")}
    assert len(chosen) == 3 + 2 + 4 + 12
    for c in chosen.values():
        assert c.memory_bound and c.target.copy_share is not None
        assert len(c.name) <= 36  # the table's case column
        assert c.run in (measure.decode_fp8, measure.decode_bf16, measure.decode_masked)
        assert c.anchors and c.anchors[0].__module__.endswith("anchors.torch")
        fp8 = c.run is not measure.decode_bf16
        assert c.dtypes == (cases.FP8 if fp8 else "bf16 x bf16 -> bf16")
        if fp8:
            assert c.shape["k"] % 128 == 0 and c.shape["n"] % 128 == 0


def test_ragged_and_masked_rows_have_their_counts_and_targets():
    c = _decode_cases()
    for name, counts, n, k in [
        ("decode_ragged_E32_T1024_N4096_K7168", E32, 4096, 7168),
        ("decode_ragged_E32_T1024_N7168_K2048", E32, 7168, 2048),
        ("decode_ragged_E8_T128_N4096_K7168", E8, 4096, 7168),
    ]:
        assert c[name].shape == {"lengths": counts, "n": n, "k": k}
        assert c[name].run is measure.decode_fp8
        assert c[name].target == bench.Target(vs_torch=1.3, copy_share=0.85, vs_deepgemm=1.0)
        assert c[name].anchors == cases.FP8_ANCHORS
    for n, k in [(4096, 7168), (7168, 2048)]:
        m = c[f"decode_masked_E32xM64_N{n}_K{k}"]
        assert m.shape == {"counts": cases.DECODE_MASKED, "m": 64, "n": n, "k": k}
        assert m.run is measure.decode_masked and m.target == bench.Target(copy_share=0.9, vs_deepgemm=1.05)
        assert deepgemm.m_grouped_fp8_masked in m.anchors


@pytest.mark.parametrize("t", [64, 512])
@pytest.mark.parametrize("n,k", [(4096, 7168), (7168, 2048)])
def test_deepseek_rows_route_t_tokens_top8_over_256_experts(t, n, k):
    c = _decode_cases()[f"decode_dsv3_fp8_T{t}_N{n}_K{k}"]
    lengths = c.shape["lengths"]
    assert len(lengths) == 256 and sum(lengths) == t * 8
    assert lengths == routed_counts(t, 256, 8, seed=t)
    assert (c.shape["n"], c.shape["k"]) == (n, k)
    assert c.target == bench.Target(vs_torch=1.3, copy_share=0.85)


@pytest.mark.parametrize("t", [16, 128, 512])
@pytest.mark.parametrize("n,k", [(1536, 2048), (2048, 768)])
def test_qwen3_rows_in_bf16_and_fp8(t, n, k):
    c = _decode_cases()
    bf16, fp8 = c[f"decode_qwen3_bf16_T{t}_N{n}_K{k}"], c[f"decode_qwen3_fp8_T{t}_N{n}_K{k}"]
    assert bf16.shape == fp8.shape and len(fp8.shape["lengths"]) == 128 and sum(fp8.shape["lengths"]) == t * 8
    assert (bf16.run, fp8.run) == (measure.decode_bf16, measure.decode_fp8)
    assert bf16.anchors == (bench.anchors.torch.grouped_mm, deepgemm.m_grouped_bf16)
    assert fp8.target == bf16.target == bench.Target(vs_torch=1.3, copy_share=0.85)


def test_decode_specs_build_without_a_gpu():
    for n, k in [(2048, 768), (4096, 7168)]:
        exe = gemmspec.build(specs.moe_spec("moe_fp8", n=n, k=k, e=128, fp8=True, scales_major_t=True))
        assert set(exe.argument_names()) == {"x", "x_scale", "w", "w_scale", "y", "offs"} and exe.sources
    exe = gemmspec.build(specs.moe_spec("moe_bf16", n=2048, k=768, e=128))
    assert exe.sources
    exe = gemmspec.build(specs.MASKED_SPEC.format(m=64, n=7168, k=2048, e=32))
    assert set(exe.argument_names()) == {"x", "x_scale", "w", "w_scale", "y", "counts"}


# ------------------------------------------------------------------ report
NAME = "decode_ragged_E8_T128_N4096_K7168"
MOVED = measure.decode_bytes(E8, 4096, 7168, fp8=True)


def _row(impl, ms, case=NAME, work=MOVED, unit="TB/s"):
    return bench.Result(case, impl, ms, work, unit, check="float64 reference (sampled rows): 1.0e-03")


def test_copy_share_target_judges_the_rate_in_tbs():
    case = _decode_cases()[NAME]
    at = MOVED / (4.2e12 * 0.85) * 1e3  # ms at exactly 85 % of 4.2 TB/s
    torch_row = _row("torch", at * 1.5)
    dg = _row("DeepGEMM 2.5.0 (padded to 128 rows, untimed)", at)  # 1.01x with gemmspec at 99 %
    assert verdict(case, _row("gemmspec", at * 0.99), torch_row, [torch_row, dg]) == "pass"
    assert verdict(case, _row("gemmspec", at * 1.01), torch_row, [torch_row, dg]) == "MISS"  # 84 % of the copy rate
    assert verdict(case, _row("gemmspec", at * 0.99), _row("torch", at * 1.2), [dg]) == "MISS"  # 1.21x torch
    assert verdict(case, _row("gemmspec", at * 0.99), torch_row, [_row("DeepGEMM", at * 0.98)]) == "MISS"
    flops = _row("gemmspec", at * 0.5, unit="TFLOPS")
    assert verdict(case, flops, torch_row, [dg]) == "MISS"  # a rate in another unit is not a share


def test_report_shows_tbs_share_and_the_floor_of_a_decode_row():
    floor_us = MOVED / 4.2e12 * 1e6
    ours = _row("gemmspec", floor_us / 0.8 / 1e3)  # 80 % of the copy rate: 3.36 TB/s
    torch_row = _row("torch._scaled_grouped_mm (rowwise scales)", floor_us / 0.5 / 1e3)
    text, summary = bench.report([ours, torch_row], {})
    lines = text.splitlines()
    assert lines[1].startswith(f"{NAME:36} {'gemmspec':44} {ours.ms:9.4f}    3.36 TB/s  80% of 4.2       1.00x")
    assert "   2.10 TB/s  50% of 4.2       1.60x" in lines[2]
    assert lines[3].strip() == (
        f"target >= 85% of 4.2 TB/s, >= 1.30x torch, >= 1.00x DeepGEMM: MISS; reads {MOVED / 1e6:.1f} MB: "
        f"{floor_us:.1f} us at 4.2 TB/s; its weights streamed alone: 46.9 us (no math, after the flush; "
        f"recorded 2026-12-04)"
    )
    (entry,) = summary
    assert entry["bytes_read"] == MOVED and entry["hbm_floor_us"] == pytest.approx(floor_us)
    assert entry["stream_floor_us"] == 46.9
    assert [round(r["copy_share"], 3) for r in entry["rows"]] == [0.8, 0.5]


def test_recorded_stream_floors_name_decode_rows_and_only_they_print_one():
    by_name = {c.name: c for c in bench.CASES}
    assert set(STREAM_FLOOR_US) <= set(by_name)  # no floor recorded under a stale name
    for name, us in STREAM_FLOOR_US.items():
        assert by_name[name].stream_floor_us == us and by_name[name].memory_bound
    # Each recorded floor lies above the copy rate's floor of the same row's bytes (the
    # weights alone, streamed in tiles, cannot beat the bytes at the copy rate).
    e8 = by_name[NAME]
    assert e8.stream_floor_us > MOVED / 4.2e12 * 1e6
    name = "decode_dsv3_fp8_T64_N4096_K7168"
    assert by_name[name].stream_floor_us is None
    text, summary = bench.report([_row("gemmspec", 1.5, case=name)], {})
    assert "streamed alone" not in text and summary[0]["stream_floor_us"] is None


def test_report_of_other_rows_is_unchanged():
    name = "lora_shrink_L4xE8_R16_K4096_T8192"
    row = bench.Result(name, "gemmspec", 0.025, 67e6, "TB/s", "float64 reference: 1e-06")
    text, summary = bench.report([row], {})
    assert text.splitlines()[1] == (
        f"{name:36} {'gemmspec':44}    0.0250     2.7 TB/s       1.00x  {'':17}  float64 reference: 1e-06"
    )
    assert "bytes_read" not in summary[0] and "copy_share" not in summary[0]["rows"][0]


# ------------------------------------------------------------------ the sweep
def test_decode_sweep_runs_powers_of_two_to_4096():
    s = sweep.SWEEPS["decode"]
    assert s.tokens == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert (s.experts, s.top_k, s.n, s.k) == (256, 8, 4096, 7168)
    pts = sweep.points(s)
    assert [p.tokens for p in pts] == list(s.tokens)
    for p in pts:
        assert sum(p.lengths) == 8 * p.tokens and len(p.lengths) == 256
        assert p.bytes_read == measure.decode_bytes(p.lengths, 4096, 7168, fp8=True)
        assert p.active_experts == min(p.active_experts, 8 * p.tokens, 256)
    assert pts[0].active_experts == 8 and pts[-1].active_experts == 256
    assert [p.bytes_read for p in pts] == sorted(p.bytes_read for p in pts)
    assert sweep.points(s) == pts  # seeded


def test_sweep_report_and_plot_series():
    s = sweep.Sweep("small", experts=16, top_k=2, n=256, k=256, tokens=(1, 4, 16))
    pts = sweep.points(s)
    results = []
    for p in pts[:2]:
        results += [
            bench.Result(p.name, "gemmspec", 0.010, p.bytes_read, "TB/s", "ok"),
            bench.Result(p.name, "torch._scaled_grouped_mm (rowwise scales)", 0.020, p.bytes_read, "TB/s"),
            bench.Result(p.name, "DeepGEMM 2.6.1", float("nan"), p.bytes_read, "TB/s", "not run: X"),
        ]
    text, summary = sweep.sweep_report(s, results, {pts[2].name: "AssertionError: differs"})
    lines = text.splitlines()
    assert lines[0].startswith("sweep: small; floor = bytes read / 4.2 TB/s")
    assert len(lines) == 2 + 3 + 3 + 1 and "FAILED: AssertionError: differs" in lines[-1]
    assert lines[2].split()[:5] == ["1", "2", str(pts[0].active_experts), f"{pts[0].bytes_read / 1e6:.1f}",
                                    f"{pts[0].bytes_read / 4.2e6:.1f}"]
    assert "2.00x" in lines[3] and lines[3].startswith(" " * 20)
    assert [p["tokens"] for p in summary["points"]] == [1, 4, 16] and "error" in summary["points"][2]
    first = summary["points"][0]["systems"]
    assert [x["system"] for x in first] == ["gemmspec", "torch._scaled_grouped_mm", "DeepGEMM 2.6.1"]
    assert first[0]["us"] == pytest.approx(10.0) and first[0]["tbs"] == pytest.approx(pts[0].bytes_read / 10e-6 / 1e12)
    series = sweep_series(summary)
    assert series["HBM floor"] == [(p.tokens, pytest.approx(p.bytes_read / 4.2e6)) for p in pts]
    assert series["gemmspec"] == [(1, pytest.approx(10.0)), (4, pytest.approx(10.0))]
    assert "DeepGEMM 2.6.1" not in series  # never timed


def test_sweep_options(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    assert "--sweep NAME" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        bench.main(["--sweep", "decode", "--only", "decode"])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        bench.main(["--sweep", "prefill"])
    assert e.value.code == 2


def test_sweep_is_documented():
    from pathlib import Path

    docs = Path(__file__).resolve().parents[2] / "docs"
    assert "--sweep decode" in (docs / "usage.md").read_text(encoding="utf-8")
    perf = (docs / "performance.md").read_text(encoding="utf-8")
    assert "## Decode" in perf and "`gemmspec bench --only decode`" in perf


# ------------------------------------------------------------------ on the CPU
torch = pytest.importorskip("torch")
from on_cpu import OnCpu as _OnCpu  # noqa: E402

from gemmspec.reference.data import Runtime, TensorData  # noqa: E402
from gemmspec.reference.schedule_exec import run_schedule  # noqa: E402


class _ReferenceRun:
    """A prepared launch whose `enqueue` runs the schedule reference executor on the
    bound tensors and writes the outputs back in place (`broken`: one valid row wrong)."""

    def __init__(self, exe, tensors, broken: bool):
        self.exe, self.tensors, self.broken = exe, tensors, broken

    def enqueue(self):
        spec = self.exe.spec
        groups = {g.tensor for g in spec.groups if g.tensor}
        written = {w for g in spec.gemms for w in g.writes}
        scales = {n for n in self.tensors if n.endswith("_scale")}  # x_scale, w_scale: bound beside x, w
        dims = {"T": self.tensors["x"].shape[0]} if self.tensors["x"].dim() == 2 else {}
        rt = Runtime(dims, {n: self.tensors[n].numpy() for n in groups})
        inputs = {
            n: TensorData(v.double().numpy(), self.tensors[f"{n}_scale"].double().numpy() if f"{n}_scale" in scales
                          else None)
            for n, v in self.tensors.items() if n not in groups | written | scales
        }
        init = {n: self.tensors[n].double().numpy() for n in written}
        for name, values in run_schedule(spec, rt, self.exe.schedule, inputs, init).items():
            out = self.tensors[name]
            result = torch.from_numpy(np.ascontiguousarray(values.reshape(out.shape)))
            if self.broken:
                flat = result.view(-1, out.shape[-1])
                valid = torch.nonzero(~torch.isnan(flat[:, 0]))[0, 0]
                flat[valid] += 1000.0
            out.copy_(result.to(out.dtype))


class _ReferenceExecutable:
    def __init__(self, exe, broken: bool):
        self.exe, self.broken = exe, broken

    def prepare(self, stream, **tensors):
        assert set(tensors) == set(self.exe.argument_names())
        return _ReferenceRun(self.exe, tensors, self.broken)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    state = {"broken": False}
    monkeypatch.setattr(specs, "build_spec", lambda text: _ReferenceExecutable(gemmspec.build(text), state["broken"]))
    monkeypatch.setattr(measure, "timed", lambda fn, repeat, before=None: bench.Timing([1e-3] * repeat, None))
    with _OnCpu():
        yield state


SMALL = [0, 3, 1, 0, 2]


def test_decode_fp8_runs_checked_and_rated_in_bytes(on_cpu):
    rows, problem = measure.decode_fp8(1, name="d", lengths=SMALL, n=256, k=256)
    (r,) = rows
    moved = measure.decode_bytes(SMALL, 256, 256, fp8=True)
    assert (r.impl, r.unit, r.work) == ("gemmspec", "TB/s", moved)
    assert r.check.startswith("float64 reference (sampled rows)")
    assert (problem.work, problem.unit, problem.lengths) == (moved, "TB/s", SMALL)
    assert r.rate == pytest.approx(moved / 1e-3 / 1e9)


def test_decode_fp8_reuses_given_weights(on_cpu):
    w = bench.random_fp8((5, 256, 256))
    ws = bench.random_scales((5, 2, 2))
    _, problem = measure.decode_fp8(1, name="d", lengths=SMALL, n=256, k=256, weights=(w, ws))
    assert problem.w is w and problem.ws is ws


def test_decode_masked_runs_checked_and_rated_in_bytes(on_cpu):
    counts = [2, 0, 4]
    rows, problem = measure.decode_masked(1, name="m", counts=counts, m=4, n=256, k=256)
    assert rows[0].unit == "TB/s" and rows[0].work == measure.decode_bytes(counts, 256, 256, fp8=True)
    assert problem.counts == counts and problem.unit == "TB/s"


def test_decode_check_fails_on_a_wrong_result(on_cpu):
    on_cpu["broken"] = True
    with pytest.raises(AssertionError, match="gemmspec differs from"):
        measure.decode_fp8(1, name="d", lengths=SMALL, n=256, k=256)
    with pytest.raises(AssertionError, match="gemmspec differs from"):
        measure.decode_masked(1, name="m", counts=[2, 0, 4], m=4, n=256, k=256)


# ------------------------------------------------------------------ DeepGEMM layouts
class _FakeDeepGemm:
    """DeepGEMM's BF16 contiguous call as its contract says: row r of d is row r of a
    times w[idx[r]]^T where idx[r] >= 0 (padding rows: anything)."""

    __version__ = "0.0-fake"

    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, idx):
        assert a.shape[0] % 128 == 0 and a.shape[0] == idx.shape[0] == d.shape[0]
        d.fill_(float("nan"))
        for r in torch.nonzero(idx >= 0)[:, 0].tolist():
            d[r] = (a[r].float() @ b[int(idx[r])].float().t()).to(d.dtype)


def test_deepgemm_bf16_anchor_pads_ragged_groups_and_keeps_the_unit(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(deepgemm, "DEEPGEMM", _FakeDeepGemm())
    monkeypatch.setattr(deepgemm, "timed", lambda fn, repeat, before=None: bench.Timing([2e-3] * repeat, None))
    lengths = [0, 3, 130, 1]
    x = torch.randn((sum(lengths), 64), dtype=torch.bfloat16)
    w = torch.randn((4, 32, 64), dtype=torch.bfloat16)
    offs = [0, 0, 3, 133, 134]
    y = torch.cat([x[offs[g]:offs[g + 1]].float() @ w[g].float().t() for g in range(4)]).to(torch.bfloat16)
    p = bench.anchors.Problem(work=1e6, unit="TB/s", x=x, w=w, lengths=lengths, y=y)
    (row,) = deepgemm.m_grouped_bf16("c", 1, p)
    assert row.impl == "DeepGEMM 0.0-fake (padded to 128 rows, untimed)"
    assert row.unit == "TB/s" and row.check.startswith("gemmspec's output")
    bad = bench.anchors.Problem(work=1e6, unit="TB/s", x=x, w=w, lengths=lengths, y=y + 1)
    (row,) = deepgemm.m_grouped_bf16("c", 1, bad)
    assert row.check.startswith("not run: AssertionError") and math.isnan(row.ms) and row.unit == "TB/s"
