"""The card a bench runs on, without a GPU: on an H200 the memory-bound rows are judged
against its recorded 4.2 TB/s and the H200's recorded figures are shown; on any other
card they are judged against the copy rate measured in the run, and the H200's figures
(DeepGEMM's recorded rates, the decode rows' streamed-alone floors) are left out."""

from __future__ import annotations

import pytest

from gemmspec import bench
from gemmspec.bench import measure, sweep
from gemmspec.bench.card import REFERENCE, REFERENCE_COPY_RATE_TBS, Card, tbs_text
from gemmspec.bench.report import verdict

H200 = Card("NVIDIA H200", 4.31)
H100 = Card("NVIDIA H100 80GB HBM3", 3.0)
E8 = [0, 49, 53, 2, 0, 16, 8, 0]
NAME = "decode_ragged_E8_T128_N4096_K7168"
MOVED = measure.decode_bytes(E8, 4096, 7168, fp8=True)


def _row(impl, ms, case=NAME, work=MOVED, unit="TB/s"):
    return bench.Result(case, impl, ms, work, unit, check="ok")


def _case(name):
    return next(c for c in bench.CASES if c.name == name)


def test_the_rate_judged_against_is_the_h200s_there_and_the_measured_one_elsewhere():
    assert H200.is_reference and H200.copy_rate_tbs == REFERENCE_COPY_RATE_TBS == 4.2
    assert not H100.is_reference and H100.copy_rate_tbs == 3.0
    assert Card("NVIDIA H100 80GB HBM3").copy_rate_tbs == 4.2  # nothing measured: the targets' rate
    assert REFERENCE.is_reference and REFERENCE.measured_tbs is None
    assert "the H200's recorded rate (this run's 1 GiB device-to-device copy: 4.31 TB/s)" in H200.describe()
    assert H100.describe().startswith("copy rate: 3.00 TB/s, this run's 1 GiB device-to-device copy")
    assert "recorded H200 figures are not shown on this card" in H100.describe()
    assert (tbs_text(4.2), tbs_text(2.995), tbs_text(3.0)) == ("4.2", "3.00", "3.00")


def test_a_share_is_judged_against_the_cards_rate():
    case = _case(NAME)
    at_h100 = MOVED / (3.0e12 * 0.85) * 1e3  # ms at exactly 85 % of 3.0 TB/s
    torch_row = _row("torch", at_h100 * 1.5)
    dg = _row("DeepGEMM 2.5.0 (padded to 128 rows, untimed)", at_h100)
    fast, slow = _row("gemmspec", at_h100 * 0.99), _row("gemmspec", at_h100 * 1.01)
    assert verdict(case, fast, torch_row, [torch_row, dg], H100) == "pass"
    assert verdict(case, slow, torch_row, [torch_row, dg], H100) == "MISS"  # 84 % of 3.0 TB/s
    # The same time is 61 % of the H200's 4.2 TB/s: a miss there, with or without a card given.
    assert verdict(case, fast, torch_row, [torch_row, dg], H200) == "MISS"
    assert verdict(case, fast, torch_row, [torch_row, dg]) == "MISS"


def test_another_cards_table_uses_its_rate_and_leaves_the_h200s_figures_out():
    floor_us = MOVED / 3.0e12 * 1e6
    ours = _row("gemmspec", floor_us / 0.8 / 1e3)  # 80 % of 3.0 TB/s: 2.40 TB/s
    torch_row = _row("torch._scaled_grouped_mm (rowwise scales)", floor_us / 0.5 / 1e3)
    text, summary = bench.report([ours, torch_row], {}, 132, H100)
    lines = text.splitlines()
    assert lines[1].startswith(f"{NAME:36} {'gemmspec':44} {ours.ms:9.4f}    2.40 TB/s  80% of 3.00       1.00x")
    assert "   1.50 TB/s  50% of 3.00       1.60x" in lines[2]
    assert lines[3].strip() == (
        f"target >= 85% of 3.00 TB/s, >= 1.30x torch, >= 1.00x DeepGEMM: MISS; reads {MOVED / 1e6:.1f} MB: "
        f"{floor_us:.1f} us at 3.00 TB/s"
    )  # no streamed-alone floor: it was recorded on an H200
    (entry,) = summary
    assert entry["target"].startswith(">= 85% of 3.00 TB/s")
    assert entry["hbm_floor_us"] == pytest.approx(floor_us) and entry["stream_floor_us"] is None
    assert [round(r["copy_share"], 3) for r in entry["rows"]] == [0.8, 0.5]
    # On an H200 the same rows keep the recorded floor and the 4.2 TB/s line.
    text, summary = bench.report([ours, torch_row], {}, 132, H200)
    assert "of 4.2 TB/s" in text and "its weights streamed alone: 46.9 us" in text
    assert summary[0]["stream_floor_us"] == 46.9


def test_deepgemms_recorded_figure_is_shown_on_an_h200_only():
    name = "fp8_fwd_G8x4096_N4096_K7168"
    ours = bench.Result(name, "gemmspec", 1.6, 1.9e15 * 1.6e-3, "TFLOPS", "ok")
    on_h200, s200 = bench.report([ours], {}, 132, H200)
    on_h100, s100 = bench.report([ours], {}, 132, H100)
    assert "DeepGEMM 2.6.1 (recorded 2026-11-30)" in on_h200 and s200[0]["deepgemm_recorded_tflops"] == 1232.4
    assert "DeepGEMM" not in on_h100 and s100[0]["deepgemm_recorded_tflops"] is None
    # A compute-bound row's own line does not depend on the card's copy rate.
    assert on_h200.splitlines()[1] == on_h100.splitlines()[1]


def test_the_sweeps_floor_is_at_the_cards_rate():
    s = sweep.Sweep("small", experts=16, top_k=2, n=256, k=256, tokens=(1, 4))
    pts = sweep.points(s)
    results = [bench.Result(p.name, "gemmspec", 0.010, p.bytes_read, "TB/s", "ok") for p in pts]
    text, summary = sweep.sweep_report(s, results, {}, H100)
    lines = text.splitlines()
    assert lines[0] == "sweep: small; floor = bytes read / 3.00 TB/s"
    assert lines[2].split()[4] == f"{pts[0].bytes_read / 3.0e6:.1f}"
    assert summary["copy_rate_tbs"] == 3.0
    assert summary["points"][0]["hbm_floor_us"] == pytest.approx(pts[0].bytes_read / 3.0e6)
    share = summary["points"][0]["systems"][0]["copy_share"]
    assert share == pytest.approx(pts[0].bytes_read / 10e-6 / 3.0e12)


def test_the_copy_rate_counts_bytes_read_and_written(monkeypatch):
    """measure_copy_rate's arithmetic and what it times, with stand-ins for torch and
    triton's do_bench: a 1 GiB copy that takes 0.7158 ms moves 3.0 TB/s."""
    import sys
    import types

    from gemmspec.bench import card

    timed = []

    class Tensor:
        def __init__(self, n):
            self.n = n
            self.copied_from = None

        def copy_(self, other):
            self.copied_from = other

    class FakeCuda:
        emptied = 0

        def empty_cache(self):
            FakeCuda.emptied += 1

    fake_torch = types.SimpleNamespace(
        uint8="uint8", cuda=FakeCuda(),
        empty=lambda n, dtype, device: Tensor(n), empty_like=lambda t: Tensor(t.n),
    )

    def do_bench(fn, warmup, rep, return_mode):
        fn()
        timed.append((warmup, rep, return_mode))
        return 2 * card.COPY_BYTES / 3.0e12 * 1e3

    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setitem(sys.modules, "triton.testing", types.SimpleNamespace(do_bench=do_bench))
    assert card.measure_copy_rate(fake_torch) == pytest.approx(3.0)
    assert timed == [(50, 300, "median")] and FakeCuda.emptied == 1
    assert card.COPY_BYTES == 1 << 30
