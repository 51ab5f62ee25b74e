"""`gemmspec tune` without a GPU: which tiles it tries and why it skips the others (the
checker's own messages), how it edits the spec's text, and what it reports and suggests
from a fake runner and a fake timer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gemmspec import tune as tuning
from gemmspec.cli import main
from gemmspec.errors import GemmspecError, SpecError
from gemmspec.pipeline import lower_file
from gemmspec.runtime.verify import OutputCheck, RunReport

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"

BF16 = """# BF16 MoE
gemm moe_bf16 {
  dim T
  dim N = 4096, K = 512
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

FP8 = """gemm moe_fp8 {
  dim T
  dim N = 512, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128] per expert
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
  %s
}
"""

SKINNY = BF16.replace("N = 4096", "N = 16").replace("moe_bf16", "moe_skinny")


def tiles_of(text: str) -> set[tuple[int, int]]:
    decision = lower_file(text)[0].decision
    return {(p.tile_m, p.tile_n) for p in decision.plans}


def checker_message(text: str) -> str:
    with pytest.raises(SpecError) as e:
        lower_file(text)
    return e.value.message


# ---------------------------------------------------------------------------- text edits
def test_with_tile_adds_the_directive_to_the_body():
    text = tuning.with_tile(BF16, (64, 96))
    assert "  tile(64, 96)\n" in text
    assert tiles_of(text) == {(64, 96)}
    assert tuning.written_tile(text) == (64, 96)


def test_with_tile_finds_the_body_past_a_comment():
    text = BF16.replace("gemm moe_bf16 {", "gemm moe_bf16  # the up projection\n{")
    assert tiles_of(tuning.with_tile(text, (128, 160))) == {(128, 160)}


def test_with_tile_replaces_the_specs_own_directives():
    text = (FP8 % "tile(64, 128)").replace("dim T\n", "dim T\n  tile ( 128 ,\n 64 )  # first\n")
    assert tuning.written_tile(text) == (64, 128)  # the checker reads the last one
    edited = tuning.with_tile(text, (128, 160))
    assert edited.count("tile") == 1 and "tile(128, 160)  # first" in edited
    assert tiles_of(edited) == {(128, 160)}


def test_a_file_of_several_specs_is_refused():
    with pytest.raises(GemmspecError, match="one spec; it defines 2"):
        tuning.enumerate_candidates(BF16 + SKINNY)


# ---------------------------------------------------------------------------- candidates
def test_default_first_then_every_tile_the_checker_accepts():
    found = tuning.enumerate_candidates(BF16)
    assert found.spec == "moe_bf16"
    first, *rest = found.candidates
    assert first.is_default and first.text == BF16 and first.label == "as written (heuristic: 128x256)"
    tried = [c.tile for c in rest]
    assert (64, 256) in tried and (128, 160) in tried and (64, 64) in tried
    skipped = {s.tile: s.reason for s in found.skipped}
    # The heuristic's own 128x256: the same kernels, not timed twice.
    assert skipped[(128, 256)] == "the same kernels as the spec as written"
    assert "narrower than 64 columns with N = 4096" in skipped[(128, 32)]
    assert set(tried) | set(skipped) == {(m, w) for m in (128, 64) for w in tuning.TILE_WIDTHS}
    for c in rest:
        assert tiles_of(c.text) == {c.tile}


def test_the_checkers_refusals_are_skipped_with_its_message():
    text = FP8 % ""
    found = tuning.enumerate_candidates(text)
    skipped = {s.tile: s.reason for s in found.skipped}
    for tile in [(128, 256), (64, 256)]:
        expected = checker_message(tuning.with_tile(text, tile))
        assert skipped[tile] == expected
        assert "too wide for scaled FP8" in expected and "\n" not in expected
    assert (128, 256) not in [c.tile for c in found.candidates]


def test_a_bias_keeps_the_candidates_as_narrow_as_the_checker_says():
    text = (EXAMPLES / "lora_moe_scaled.gspec").read_text()
    found = tuning.enumerate_candidates(text)
    assert all(c.tile[1] <= 128 for c in found.candidates[1:])
    reasons = [s.reason for s in found.skipped if s.tile[1] in (144, 160, 192, 256)]
    assert reasons and all("too wide for a statement with a bias" in r for r in reasons)


def test_an_existing_directive_is_the_default_and_the_others_replace_it():
    text = FP8 % "tile(64, 128)"
    found = tuning.enumerate_candidates(text)
    default = found.candidates[0]
    assert default.is_default and default.written == (64, 128)
    assert default.label == "as written (tile(64, 128))"
    assert {s.tile: s.reason for s in found.skipped}[(64, 128)] == "the same kernels as the spec as written"
    # The heuristic's tile (128x128 here) is a candidate like any other now.
    assert (128, 128) in [c.tile for c in found.candidates]
    for c in found.candidates[1:]:
        assert c.text.count("tile(") == 1 and tiles_of(c.text) == {c.tile}


def test_widths_past_the_one_covering_n_are_skipped():
    found = tuning.enumerate_candidates(SKINNY)
    assert [c.tile for c in found.candidates[1:]] == [(128, 16)]  # 64x16 is the heuristic's
    reasons = {s.tile: s.reason for s in found.skipped}
    assert "cover N = 16" in reasons[(128, 32)] and "cover N = 16" in reasons[(64, 256)]


def test_only_replaces_the_search_space_and_still_asks_the_checker():
    found = tuning.enumerate_candidates(BF16, only=[(128, 160), (64, 300), (128, 160), (128, 48)])
    assert [c.tile for c in found.candidates] == [None, (128, 160), (128, 48)]
    assert [s.tile for s in found.skipped] == [(64, 300)]
    assert "not a supported tile" in found.skipped[0].reason


def test_a_spec_error_is_located_in_the_users_file(tmp_path):
    bad = tmp_path / "bad.gspec"
    bad.write_text(BF16.replace("[T, K]", "[T, Q]"))
    with pytest.raises(SpecError) as e:
        tuning.enumerate_candidates(bad.read_text(), str(bad))
    assert str(e.value).startswith(f"{bad}:")


# ---------------------------------------------------------------------------- measuring
def _report(ok: bool = True, flops: float = 2e12) -> RunReport:
    check = OutputCheck("y", 2.0**-7, 1e-2, elements=1024, max_abs_error=1e-3 if ok else 0.5,
                        over_bound=0 if ok else 3)
    return RunReport("moe_bf16", {"T": 1024}, (check,), 0.0, flops)


class Fake:
    """A runner and a timer: `ms[label]` the time of a candidate, `failing` those whose
    check fails, `broken` those that do not build."""

    def __init__(self, ms: dict, failing=(), broken=()):
        self.ms, self.failing, self.broken = ms, set(failing), set(broken)
        self.timed: list[str] = []

    def runner(self, c: tuning.Candidate) -> tuning.Trial:
        if c.label in self.broken:
            raise GemmspecError("NVRTC failed\nthe whole log")
        return tuning.Trial(_report(ok=c.label not in self.failing), c.label)

    def timer(self, label: str, repeat: int) -> list[float]:
        self.timed.append(label)
        base = self.ms[label]
        return [base * 1.1, base, base * 0.99, base][:repeat] + [base] * max(repeat - 4, 0)


def _measure(fake: Fake, text: str = BF16, only=((128, 160), (64, 256), (128, 64)), repeat=5):
    found = tuning.enumerate_candidates(text, only=list(only))
    lines: list[str] = []
    report = tuning.measure(found, fake.runner, fake.timer, repeat, progress=lines.append)
    return report, lines


def test_fastest_is_suggested_and_failures_are_not_timed():
    fake = Fake(
        {"as written (heuristic: 128x256)": 1.0, "tile(128, 160)": 0.8, "tile(64, 256)": 0.5, "tile(128, 64)": 2.0},
        failing={"tile(64, 256)"},
    )
    report, lines = _measure(fake)
    assert lines == [
        "[1/4] as written (heuristic: 128x256) ...",
        "[2/4] tile(128, 160) ...",
        "[3/4] tile(64, 256) ...",
        "[4/4] tile(128, 64) ...",
    ]
    assert "tile(64, 256)" not in fake.timed and len(fake.timed) == 3
    failed = report.outcomes[2]
    assert not failed.ok and failed.ms is None and "max abs error 5.000e-01, 3 of 1024 over" in failed.check
    assert not report.ok
    assert report.fastest.candidate.tile == (128, 160)
    assert report.suggestion == "tile(128, 160)"
    assert report.ratio(report.fastest) == pytest.approx(1.25)
    assert report.advice.startswith("add this line to the spec: tile(128, 160)")
    table = report.table()
    assert "FAILED: y: max abs error" in table and "1.250x" in table
    head = table.splitlines()[0].split()
    assert head == ["candidate", "ms", "TFLOPS", "vs", "default", "check"]
    # 2e12 useful FLOPs in 0.8 ms
    assert report.fastest.tflops == pytest.approx(2500.0)


def test_the_default_within_one_percent_is_kept():
    fake = Fake({"as written (heuristic: 128x256)": 1.0, "tile(128, 160)": 0.992, "tile(64, 256)": 1.3, "tile(128, 64)": 1.5})
    report, _ = _measure(fake)
    assert report.ok and report.fastest.candidate.tile == (128, 160)
    assert report.suggestion is None
    assert report.advice.startswith("keep the spec as written (within 1% of the fastest, tile(128, 160))")
    fake.ms["tile(128, 160)"] = 0.985  # now 1.5 % faster
    report, _ = _measure(fake)
    assert report.suggestion == "tile(128, 160)"


def test_the_default_fastest_is_kept():
    fake = Fake({"as written (heuristic: 128x256)": 0.9, "tile(128, 160)": 1.0, "tile(64, 256)": 1.3, "tile(128, 64)": 1.5})
    report, _ = _measure(fake)
    assert report.fastest.candidate.is_default and report.suggestion is None
    assert report.advice == "keep the spec as written (it is the fastest)"
    assert "keep the spec as written" in report.text()


def test_a_build_error_is_failed_with_its_first_line():
    fake = Fake({"as written (heuristic: 128x256)": 1.0, "tile(128, 160)": 0.8, "tile(128, 64)": 2.0}, broken={"tile(64, 256)"})
    report, _ = _measure(fake)
    broken = report.outcomes[2]
    assert not broken.ok and broken.check == "build: NVRTC failed"
    assert not report.ok and report.suggestion == "tile(128, 160)"


def test_a_failed_default_still_gets_a_suggestion():
    fake = Fake({"tile(128, 160)": 0.8, "tile(64, 256)": 0.9, "tile(128, 64)": 2.0}, failing={"as written (heuristic: 128x256)"})
    report, _ = _measure(fake)
    assert report.ratio(report.fastest) is None
    assert report.suggestion == "tile(128, 160)"
    assert "the spec as written failed" in report.advice


def test_nothing_to_suggest_when_everything_fails():
    fake = Fake({}, failing={"as written (heuristic: 128x256)", "tile(128, 160)", "tile(64, 256)", "tile(128, 64)"})
    report, _ = _measure(fake)
    assert fake.timed == [] and report.fastest is None and report.suggestion is None
    assert report.advice.startswith("no candidate matched the reference")


def test_a_written_tile_is_replaced_in_the_advice():
    text = FP8 % "tile(64, 128)"
    fake = Fake({"as written (tile(64, 128))": 1.0, "tile(128, 160)": 0.7, "tile(128, 128)": 0.9})
    report, _ = _measure(fake, text, only=[(128, 160), (128, 128)])
    assert report.suggestion == "tile(128, 160)"
    assert report.advice.startswith("replace tile(64, 128) in the spec with: tile(128, 160)")


def test_json_says_what_the_text_says():
    fake = Fake(
        {"as written (heuristic: 128x256)": 1.0, "tile(128, 160)": 0.8, "tile(64, 256)": 0.5, "tile(128, 64)": 2.0},
        failing={"tile(64, 256)"},
    )
    report, _ = _measure(fake, only=[(128, 160), (64, 256), (128, 64), (64, 300)])
    doc = json.loads(json.dumps(report.to_json()))
    assert doc["spec"] == "moe_bf16" and doc["dims"] == {"T": 1024} and doc["repeat"] == 5
    assert doc["directive"] == "tile(128, 160)" and doc["fastest"] == "tile(128, 160)"
    assert doc["advice"] == report.advice and doc["ok"] is False
    assert [c["candidate"] for c in doc["candidates"]] == [o.candidate.label for o in report.outcomes]
    assert doc["candidates"][0]["default"] and doc["candidates"][0]["tile"] is None
    assert doc["candidates"][1]["ms"] == pytest.approx(0.8) and len(doc["candidates"][1]["samples_ms"]) == 5
    assert doc["candidates"][2]["ms"] is None and doc["candidates"][2]["ok"] is False
    assert doc["skipped"] == [{"tile": [64, 300], "reason": report.skipped[0].reason}]


# ---------------------------------------------------------------------------- command line
def test_help_describes_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for word in ("--dims", "--seed", "--repeat", "--json", "--only", "float64 reference", "CUDA events", "Exit status"):
        assert word in out
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "tune" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--only", "128"], "expected M,N"),
        (["--only", "128,x"], "expected M,N"),
        (["--repeat", "0"], "expected a positive integer"),
        (["--seed", "x"], "invalid int value"),
    ],
)
def test_bad_options_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["tune", str(EXAMPLES / "moe_bf16_forward.gspec"), *argv])
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_dims_and_missing_file_are_usage_errors(tmp_path, capsys):
    assert main(["tune", str(EXAMPLES / "moe_bf16_forward.gspec"), "--dims", "T"]) == 2
    assert "--dims expects NAME=SIZE, got 'T'" in capsys.readouterr().err
    assert main(["tune", str(tmp_path / "none.gspec")]) == 2
    assert "no such file" in capsys.readouterr().err
    folder = tmp_path / "report"
    folder.mkdir()
    assert main(["tune", str(EXAMPLES / "moe_bf16_forward.gspec"), "--json", str(folder)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_a_spec_error_comes_first(tmp_path, capsys):
    bad = tmp_path / "bad.gspec"
    bad.write_text(BF16.replace("[T, K]", "[T, Q]"))
    assert main(["tune", str(bad)]) == 1
    assert capsys.readouterr().err.startswith(f"{bad}:")


def test_without_a_gpu_the_error_of_run(monkeypatch, capsys):
    import gemmspec.runtime.arrays as arrays

    def no_device(_ordinal):
        raise RuntimeError("no driver here")

    monkeypatch.setattr(arrays, "Device", no_device)
    spec = str(EXAMPLES / "moe_bf16_forward.gspec")
    assert main(["run", spec, "--dims", "T=256"]) == 1
    run_err = capsys.readouterr().err
    assert main(["tune", spec, "--dims", "T=256"]) == 1
    captured = capsys.readouterr()
    assert captured.err == run_err and "no usable CUDA device 0" in run_err
    assert captured.out == ""


@pytest.fixture
def fake_gpu(monkeypatch):
    """The command with a fake runner and timer in place of the GPU's."""
    import gemmspec.runtime.arrays as arrays

    fake = Fake({"as written (heuristic: 128x256)": 1.0, "tile(128, 160)": 0.8, "tile(64, 256)": 0.9})
    seen = {}

    def runner(dims=None, lengths=None, seed=0):
        seen.update(dims=dims, seed=seed)
        return fake.runner

    monkeypatch.setattr(arrays, "require_hopper", lambda _ordinal=0: None)
    monkeypatch.setattr(tuning, "gpu_runner", runner)
    monkeypatch.setattr(tuning, "event_timer", fake.timer)
    return fake, seen


def test_the_command_prints_the_table_and_writes_json(fake_gpu, tmp_path, capsys):
    fake, seen = fake_gpu
    spec = tmp_path / "moe.gspec"
    spec.write_text(BF16)
    out = tmp_path / "reports" / "tune.json"
    status = main([
        "tune", str(spec), "--dims", "T=1024", "--seed", "3", "--repeat", "4",
        "--only", "128,160", "64,256", "64,300", "--json", str(out),
    ])
    captured = capsys.readouterr()
    assert status == 0, captured.err
    assert seen == {"dims": {"T": 1024}, "seed": 3}
    assert "moe_bf16: 3 candidate(s), 1 skipped" in captured.err
    assert "[2/3] tile(128, 160) ..." in captured.err
    assert "fastest: tile(128, 160), 0.8000 ms" in captured.out
    assert "add this line to the spec: tile(128, 160)" in captured.out
    assert "skipped 1:\n  tile(64, 300): tile(64, 300) is not a supported tile" in captured.out
    doc = json.loads(out.read_text())
    assert doc["directive"] == "tile(128, 160)" and doc["seed"] == 3 and doc["repeat"] == 4


def test_the_command_fails_when_a_candidate_fails(fake_gpu, tmp_path, capsys):
    fake, _ = fake_gpu
    fake.failing.add("tile(64, 256)")
    spec = tmp_path / "moe.gspec"
    spec.write_text(BF16)
    assert main(["tune", str(spec), "--only", "128,160", "64,256"]) == 1
    out = capsys.readouterr().out
    assert "FAILED" in out and "add this line to the spec: tile(128, 160)" in out
