"""On a Hopper GPU: `gemmspec tune` on small M-grouped MoE specs (BF16, and FP8 with
1x128 and 128x128 scales), ragged segments of 0, 1, 127 and 129 rows. Every candidate
must match the float64 reference (outputs poisoned first, as `gemmspec run` does), the
report must name a fastest candidate, and its directive line, written into the spec by
hand, must parse, build and match the reference too. No timing is asserted."""

from __future__ import annotations

import json

import pytest

import gemmspec
from gemmspec.cli import main
from gemmspec.pipeline import lower_file
from gemmspec.runtime.timing import time_events
from gemmspec.runtime.verify import check_random, run_random
from gemmspec.tune import directive, tune, written_tile

pytestmark = pytest.mark.gpu
RAGGED = [0, 1, 127, 129]

BF16 = """
gemm tune_bf16 {
  dim T
  dim N = 320, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

FP8 = """
gemm tune_fp8 {
  dim T
  dim N = 384, K = 384
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128] per expert
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""


def _line_to_check(report) -> str:
    """The suggested line, or, when the spec is to be kept, the fastest directive tried."""
    if report.suggestion is not None:
        return report.suggestion
    tried = [o for o in report.outcomes if o.ms is not None and not o.candidate.is_default]
    return directive(min(tried, key=lambda o: o.ms).candidate.tile)


@pytest.mark.parametrize("text", [BF16, FP8], ids=["bf16", "fp8"])
def test_tune_checks_every_candidate_and_its_suggestion_builds(text):
    lines = []
    report = tune(text, lengths={"expert": RAGGED}, seed=5, repeat=5, progress=lines.append)
    print(report.text())
    assert len(lines) == len(report.outcomes) > 2
    assert report.ok, report.table()
    for o in report.outcomes:
        assert o.ok and o.ms is not None and o.ms > 0 and len(o.samples_ms) == 5, o
        assert o.dims == {"T": sum(RAGGED)}
    assert report.fastest is not None
    json.dumps(report.to_json())

    line = _line_to_check(report)
    body = text.rstrip().rstrip("}")
    edited = f"{body}  {line}\n}}\n"  # as a user adds it: a line in the spec
    tile = written_tile(edited)
    assert directive(tile) == line
    assert {(p.tile_m, p.tile_n) for p in lower_file(edited)[0].decision.plans} == {tile}
    checked = run_random(gemmspec.build(edited), lengths={"expert": RAGGED}, seed=6, repeats=0)
    assert checked.ok, checked.describe()


def test_event_timing_gives_one_sample_per_call():
    call = check_random(gemmspec.build(BF16), lengths={"expert": RAGGED}, seed=1)
    assert call.report.ok, call.report.describe()
    timing = time_events(call.prepare(), 7)
    assert len(timing.samples_ms) == 7 and all(s > 0 for s in timing.samples_ms)
    assert min(timing.samples_ms) <= timing.median_ms <= max(timing.samples_ms)
    unflushed = time_events(call.prepare(), 3, flush_l2=False)
    assert len(unflushed.samples_ms) == 3


def test_the_command_on_the_gpu(tmp_path, capsys):
    spec = tmp_path / "fp8.gspec"
    spec.write_text(FP8)
    out = tmp_path / "tune.json"
    status = main(["tune", str(spec), "--dims", "T=1000", "--repeat", "3", "--only", "128,128", "64,192", "--json", str(out)])
    captured = capsys.readouterr()
    print(captured.out)
    assert status == 0, captured.out + captured.err
    doc = json.loads(out.read_text())
    assert doc["ok"] and len(doc["candidates"]) == 3 and doc["dims"] == {"T": 1000}
    assert all(c["check"] == "ok" and c["ms"] > 0 for c in doc["candidates"])
    assert doc["advice"] in captured.out
