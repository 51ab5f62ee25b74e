"""`gemmspec bench` checks its options and output paths before it looks for the GPU: a
bad value fails at once with one clear error line and exit status 2, no traceback, and
nothing is created or overwritten; good values still reach the device check. Also:
specs name their file as it was typed (`explain ./m.gspec --json` says `./m.gspec`)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import gemmspec.bench.run as bench_run
from gemmspec.bench import specs, timing
from gemmspec.cli import main
from gemmspec.errors import DeviceUnavailableError, OutputError

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "examples" / "moe_bf16_forward.gspec"
NO_DEVICE = "no usable CUDA device 0 (is an NVIDIA GPU and driver present?): no driver here"


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `root`."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working folder with a file, a folder and a results file already in it; no GPU
    (the device check says so), torch never imported, bench's settings restored after."""
    (tmp_path / "file.txt").write_text("keep me")
    (tmp_path / "some_dir").mkdir()
    (tmp_path / "old.json").write_text('{"old": true}')
    monkeypatch.chdir(tmp_path)

    def require_hopper(_ordinal: int = 0) -> None:
        raise DeviceUnavailableError(NO_DEVICE)

    def load_torch():
        raise AssertionError("torch imported before the options were checked")

    import gemmspec.runtime.arrays as arrays

    monkeypatch.setattr(arrays, "require_hopper", require_hopper)
    monkeypatch.setattr(bench_run, "load_torch", load_torch)
    monkeypatch.setattr(specs, "FORCED_TILE", None)
    monkeypatch.setattr(timing, "IDLE_MS", 0.0)
    return tmp_path


def usage_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """argparse's refusal: exit 2, the usage, then one error line (returned)."""
    with pytest.raises(SystemExit) as e:
        main(["bench", *argv])
    assert e.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err
    assert captured.err.startswith("usage: gemmspec bench ")
    return captured.err.strip().splitlines()[-1]


def file_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """A refused output path: exit 2 and exactly one line, `gemmspec: error: ...`."""
    assert main(["bench", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gemmspec: error: "), captured.err
    return lines[0]


# ---------------------------------------------------------------------------- values
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repeat", "0"], "argument --repeat: expected a positive integer, got '0'"),
        (["--repeat", "-3"], "argument --repeat: expected a positive integer, got '-3'"),
        (["--repeat", "2.5"], "argument --repeat: expected a positive integer, got '2.5'"),
        (["--json", ""], "argument --json: expected a path, got an empty string (a file name, such as bench.json)"),
        (["--json", " "], "argument --json: expected a path, got an empty string (a file name, such as bench.json)"),
        (["--plot", ""], "argument --plot: expected a path, got an empty string (a file name, such as bench.png)"),
        (["--only"], "argument --only: expected at least one argument"),
        (["--only", ""], "argument --only: expected a case's name or the start of one, got an empty string"),
        (["--idle", "nan"], "--idle takes milliseconds >= 0, got nan"),
        (["--idle", "inf"], "--idle takes milliseconds >= 0, got inf"),
        (["--idle", "-1"], "--idle takes milliseconds >= 0, got -1.0"),
        (["--tile", "128x"], "--tile expects MxN, e.g. 128x128, got '128x'"),
    ],
    ids=["repeat0", "repeat-neg", "repeat-float", "json-empty", "json-blank", "plot-empty", "only-none",
         "only-empty", "idle-nan", "idle-inf", "idle-neg", "tile-malformed"],
)
def test_a_bad_value_is_refused_before_the_device(argv, message, here, capsys) -> None:
    before = _tree(here)
    assert usage_error(capsys, *argv) == f"gemmspec bench: error: {message}"
    assert _tree(here) == before
    assert specs.FORCED_TILE is None and timing.IDLE_MS == 0.0


@pytest.mark.parametrize("tile", ["0x0", "100x7", "96x128", "128x12", "128x264"])
def test_a_tile_the_kernels_do_not_take_is_refused(tile, here, capsys) -> None:
    err = usage_error(capsys, "--tile", tile)
    assert err == (f"gemmspec bench: error: --tile {tile}: not a supported tile: the kernels take 64 or 128 rows "
                   "by a multiple of 8 columns from 8 to 256")
    assert specs.FORCED_TILE is None


@pytest.mark.parametrize("only", [["nosuchrow"], ["fp8_fwd", "nosuchrow"], ["FP8"]])
def test_an_only_name_that_matches_no_case_says_which_names_there_are(only, here, capsys) -> None:
    err = usage_error(capsys, "--only", *only)
    assert err == (f"gemmspec bench: error: --only '{only[-1]}' matches no case: case names start with "
                   "bf16_, decode_, ffn_, fp8_, lora_ (`gemmspec bench --list` lists them)")
    # Those first words are every case's, and --list prints every name.
    assert main(["bench", "--list"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == [c.name for c in bench_run.CASES]
    assert {name.split("_")[0] + "_" for name in listed} == {"bf16_", "decode_", "ffn_", "fp8_", "lora_"}


# ---------------------------------------------------------------------------- paths
@pytest.mark.parametrize("option", ["--json", "--plot"])
@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("file.txt/x.out", "cannot write the {option} file's directory file.txt: it exists and is not a directory"),
        ("file.txt/sub/x.out", "cannot write the {option} file's directory file.txt/sub: file.txt exists and is "
                               "not a directory"),
        ("some_dir/", "cannot write the {option} file some_dir/: it is a directory"),
        ("some_dir", "cannot write the {option} file some_dir: it is a directory"),
        (".", "cannot write the {option} file .: it is a directory"),
        ("new_dir/", "cannot write the {option} file new_dir/: it ends in '/', a directory's name"),
    ],
    ids=["under-a-file", "deeper-under-a-file", "dir-slash", "dir", "dot", "new-dir-slash"],
)
def test_an_unusable_output_file_is_refused_and_nothing_is_touched(option, path, why, here, capsys) -> None:
    before = _tree(here)
    assert file_error(capsys, option, path) == "gemmspec: error: " + why.format(option=option)
    assert _tree(here) == before


def test_the_json_and_the_plot_may_not_be_one_file(here, capsys) -> None:
    before = _tree(here)
    err = file_error(capsys, "--json", "old.json", "--plot", "./old.json")
    assert err == "gemmspec: error: --json and --plot name the same file, ./old.json"
    assert _tree(here) == before


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs file permissions that bind")
def test_a_read_only_results_file_or_folder_is_refused(here, capsys) -> None:
    locked = here / "locked"
    locked.mkdir()
    (here / "old.json").chmod(0o444)
    locked.chmod(0o555)
    try:
        before = _tree(here)
        assert file_error(capsys, "--json", "old.json") == "gemmspec: error: cannot write the --json file old.json: " \
                                                            "it is not writable"
        err = file_error(capsys, "--json", "locked/new.json")
        assert err == "gemmspec: error: cannot write the --json file's directory locked: locked is not writable"
        assert _tree(here) == before
    finally:
        locked.chmod(0o755)
        (here / "old.json").chmod(0o644)


def test_a_plot_needs_matplotlib_and_a_type_it_saves(here, capsys, monkeypatch) -> None:
    before = _tree(here)
    monkeypatch.setattr(bench_run, "_plot_formats", lambda: None)  # matplotlib not installed
    err = file_error(capsys, "--plot", "bench.png")
    assert err == ("gemmspec: error: cannot write the --plot file bench.png: it needs matplotlib, which is not "
                   "installed (pip install matplotlib)")
    monkeypatch.setattr(bench_run, "_plot_formats", lambda: {"png", "pdf", "svg"})
    err = file_error(capsys, "--plot", "bench.txt")
    assert err == "gemmspec: error: cannot write the --plot file bench.txt: matplotlib saves no '.txt' files " \
                  "(it saves pdf, png, svg)"
    assert _tree(here) == before
    # A type it saves, in a folder still to be made: on to the device check.
    assert main(["bench", "--plot", "plots/bench.PNG", "--json", "res/bench.json"]) == 1
    assert capsys.readouterr().err == f"gemmspec bench: error: {NO_DEVICE}\n"
    assert _tree(here) == before


# ---------------------------------------------------------------------------- good values
@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--only", "fp8_fwd", "decode_masked", "--repeat", "3", "--idle", "2", "--json", "old.json"],
        ["--only", "lora", "--tile", "128x160", "--json", "results/deeper/bench.json"],
        ["--sweep", "decode", "--repeat", "2", "--json", "sweep.json", "--no-deepgemm"],
    ],
    ids=["none", "only-repeat-idle-json", "tile-new-folder", "sweep"],
)
def test_good_values_still_reach_the_device_check(argv, here, capsys) -> None:
    before = _tree(here)
    assert main(["bench", *argv]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"gemmspec bench: error: {NO_DEVICE}\n"
    assert _tree(here) == before  # nothing written, no folder made, old.json as it was


def test_list_still_lists_with_good_values(here, capsys) -> None:
    assert main(["bench", "--list", "--repeat", "5", "--json", "x.json"]) == 0
    out = capsys.readouterr().out
    assert all(c.name in out for c in bench_run.CASES)
    assert not (here / "x.json").exists()


# ---------------------------------------------------------------------------- --traceback
def test_traceback_raises_what_bench_reports_itself(here, capsys) -> None:
    with pytest.raises(OutputError, match="cannot write the --json file some_dir: it is a directory"):
        main(["--traceback", "bench", "--json", "some_dir"])
    with pytest.raises(DeviceUnavailableError, match="no driver here"):
        main(["--traceback", "bench", "--repeat", "2"])
    # argparse's refusals stay a usage message, as for every command.
    with pytest.raises(SystemExit) as e:
        main(["--traceback", "bench", "--repeat", "0"])
    assert e.value.code == 2
    assert "Traceback" not in capsys.readouterr().err


def test_python_m_gemmspec_bench_reports_a_bad_path_the_same_way(tmp_path: Path) -> None:
    (tmp_path / "some_dir").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "gemmspec.bench", "--json", "some_dir/"], cwd=tmp_path,
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert done.stderr == "gemmspec: error: cannot write the --json file some_dir/: it is a directory\n"
    assert done.stdout == "" and os.listdir(tmp_path / "some_dir") == []


# ---------------------------------------------------------------------------- explain's `file`
@pytest.mark.parametrize("typed", ["./m.gspec", "m.gspec", ".//m.gspec", "sub/../m.gspec"])
def test_explain_names_the_file_as_typed(typed, tmp_path, monkeypatch, capsys) -> None:
    shutil.copy(SPEC, tmp_path / "m.gspec")
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    assert main(["explain", typed, "--json", "--dump-ir", "ir"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["file"] == typed
    (dumped,) = json.loads((tmp_path / "ir" / "04-schedule.json").read_text())
    assert dumped["file"] == typed
    assert main(["explain", typed]) == 0
    assert f"({typed}:" in capsys.readouterr().out.splitlines()[0]
    assert main(["check", typed]) == 0
    assert capsys.readouterr().out.startswith(f"{typed}: moe_bf16_forward: ok")


def test_explain_names_an_absolute_file_as_typed(capsys) -> None:
    assert main(["explain", str(SPEC), "--json"]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    assert doc["file"] == str(SPEC)


def test_a_spec_error_names_the_file_as_typed(tmp_path, monkeypatch, capsys) -> None:
    (tmp_path / "bad.gspec").write_text("gemm g {\n  dim T\n  tensor x : bf16 [T, Q]\n}\n")
    monkeypatch.chdir(tmp_path)
    assert main(["explain", "./bad.gspec", "--json"]) == 1
    assert capsys.readouterr().err.startswith("./bad.gspec:3:")
    # A missing file is still named and called missing.
    assert main(["explain", "./nope.gspec"]) == 2
    assert capsys.readouterr().err == "gemmspec: error: cannot read nope.gspec: no such file\n"
