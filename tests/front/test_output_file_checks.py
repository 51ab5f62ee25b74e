"""`tune --json` and `bench --json` check the file they will write in one way
(output.check_output_file), before any work: a directory, a name ending in '/', a file
that is not writable and a folder that is a file are refused with exit status 2 and one
line naming the option, and nothing on disk changes (the spec included)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import gemmspec.bench.run as bench_run
import gemmspec.cli as cli
import gemmspec.tune as tuning
from gemmspec.errors import OutputError
from gemmspec.output import check_output_file

SPEC = """\
gemm file_checks {
  dim T
  dim N = 64, K = 128
  group expert[E = 2] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

# (path, message after "gemmspec: error: "): as bench has always said them.
REFUSED = [
    ("some_dir", "cannot write the --json file some_dir: it is a directory"),
    ("some_dir/", "cannot write the --json file some_dir/: it is a directory"),
    ("new_dir/", "cannot write the --json file new_dir/: it ends in '/', a directory's name"),
    ("file.txt/x.json", "cannot write the --json file's directory file.txt: it exists and is not a directory"),
    ("file.txt/sub/x.json", "cannot write the --json file's directory file.txt/sub: file.txt exists and is "
                            "not a directory"),
]
REFUSED_IDS = ["dir", "dir-slash", "new-dir-slash", "under-a-file", "deeper-under-a-file"]
NOT_WRITABLE = "cannot write the --json file old.json: it is not writable"


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `root`."""
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_device: None) -> Path:
    """A working folder with the spec, a file, a folder and an old results file; any
    work (lowering, tuning, torch) or look for a GPU fails the test."""
    (tmp_path / "spec.gspec").write_text(SPEC)
    (tmp_path / "file.txt").write_text("keep me")
    (tmp_path / "some_dir").mkdir()
    (tmp_path / "old.json").write_text('{"old": true}')
    monkeypatch.chdir(tmp_path)

    def no_work(*_args, **_kwargs):
        raise AssertionError("work began before the output file was checked")

    monkeypatch.setattr(cli, "_lower", no_work)
    monkeypatch.setattr(tuning, "tune", no_work)
    monkeypatch.setattr(bench_run, "load_torch", no_work)
    return tmp_path


def _argv(command: str, path: str) -> list[str]:
    return ["tune", "spec.gspec", "--json", path] if command == "tune" else ["bench", "--json", path]


def file_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """A refused output file: exit 2, nothing on stdout, one line `gemmspec: error: ...`."""
    assert cli.main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gemmspec: error: "), captured.err
    return lines[0].removeprefix("gemmspec: error: ")


@pytest.fixture
def read_only(here: Path):
    """old.json made read-only (its mode put back after)."""
    (here / "old.json").chmod(0o444)
    yield (here / "old.json").resolve()
    (here / "old.json").chmod(0o644)


# ---------------------------------------------------------------------------- the command line
@pytest.mark.parametrize("command", ["tune", "bench"])
@pytest.mark.parametrize(("path", "message"), REFUSED, ids=REFUSED_IDS)
def test_an_unusable_json_file_is_refused_before_any_work(command, path, message, here, capsys) -> None:
    before = _tree(here)
    assert file_error(capsys, _argv(command, path)) == message
    assert _tree(here) == before


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root writes a read-only file anyway")
@pytest.mark.parametrize("command", ["tune", "bench"])
def test_a_json_file_that_is_not_writable_is_refused(command, read_only, here, capsys) -> None:
    before = _tree(here)
    assert file_error(capsys, _argv(command, "old.json")) == NOT_WRITABLE
    assert _tree(here) == before


@pytest.mark.parametrize("command", ["tune", "bench"])
def test_the_files_mode_is_what_counts_even_for_root(command, read_only, here, capsys, monkeypatch) -> None:
    # As the mode says, whoever runs the tests: root's access() would say yes.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).resolve() != read_only and real_access(p, mode))
    before = _tree(here)
    assert file_error(capsys, _argv(command, "old.json")) == NOT_WRITABLE
    assert _tree(here) == before


@pytest.mark.parametrize("path", ["spec.gspec", "./spec.gspec", "spec.gspec/"])
def test_tune_still_names_the_spec_file_first(path, here, capsys, monkeypatch) -> None:
    (here / "spec.gspec").chmod(0o444)  # not writable either: being the spec is the reason given
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).name != "spec.gspec" and real_access(p, mode))
    try:
        before = _tree(here)
        assert file_error(capsys, _argv("tune", path)) == f"cannot write the --json file {path}: it is the spec file"
        assert _tree(here) == before
        assert (here / "spec.gspec").read_text() == SPEC
    finally:
        (here / "spec.gspec").chmod(0o644)


# ---------------------------------------------------------------------------- the function
def test_check_output_file_passes_what_can_be_written_and_creates_nothing(tmp_path: Path) -> None:
    (tmp_path / "old.json").write_text("{}")
    before = _tree(tmp_path)
    for path in [tmp_path / "old.json", tmp_path / "new.json", str(tmp_path / "a" / "b" / "new.json")]:
        check_output_file(path, "--json")
    assert _tree(tmp_path) == before


@pytest.mark.parametrize(("path", "message"), REFUSED, ids=REFUSED_IDS)
def test_check_output_file_refuses_with_the_option_and_path_as_given(path, message, here) -> None:
    before = _tree(here)
    with pytest.raises(OutputError) as e:
        check_output_file(path, "--json")
    assert str(e.value) == message
    assert e.value.path == (path if "'s directory" not in message else str(Path(path).parent))
    assert _tree(here) == before


def test_check_output_file_refuses_a_file_its_mode_makes_read_only(read_only, monkeypatch) -> None:
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: Path(p).resolve() != read_only and real_access(p, mode))
    with pytest.raises(OutputError) as e:
        check_output_file("old.json", "--json")
    assert str(e.value) == NOT_WRITABLE and e.value.path == "old.json"
    with pytest.raises(OutputError, match=r"^cannot write the --plot file old\.json: it is not writable$"):
        check_output_file(Path("old.json"), "--plot")
