"""The command line on output paths it cannot use: clear errors, exit 2, nothing half-written."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gemmspec.cli import main
from gemmspec.errors import OutputError, SpecError

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SPEC = EXAMPLES / "moe_bf16_forward.gspec"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    status = main(list(argv))
    return status, capsys.readouterr().err


def bad_spec(tmp_path: Path) -> Path:
    bad = tmp_path / "bad.gspec"
    bad.write_text("gemm g {\n  dim T\n  tensor x : bf16 [T, Q]\n}\n")
    return bad


def test_output_onto_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "out.txt"
    target.write_text("keep me")
    status, err = run(capsys, "compile", str(SPEC), "-o", str(target))
    assert status == 2
    assert err.startswith(f"gemmspec: error: cannot write the output directory {target}: ")
    assert "not a directory" in err and "Traceback" not in err
    assert target.read_text() == "keep me"


def test_output_under_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    status, err = run(capsys, "compile", str(SPEC), "-o", str(blocker / "sub" / "out"))
    assert status == 2
    assert err.startswith("gemmspec: error: ") and f"{blocker} exists and is not a directory" in err


@pytest.mark.parametrize("command", ["compile", "check", "explain"])
def test_dump_ir_onto_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    target = tmp_path / "dump"
    target.write_text("")
    out = tmp_path / "out"
    extra = ["-o", str(out)] if command == "compile" else []
    status, err = run(capsys, command, str(SPEC), "--dump-ir", str(target), *extra)
    assert status == 2
    assert err.startswith(f"gemmspec: error: cannot write the --dump-ir directory {target}: ")
    assert not out.exists()  # failed before writing anything


def test_a_directory_where_an_output_file_goes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    (out / "moe_bf16_forward.h").mkdir(parents=True)
    status, err = run(capsys, "compile", str(SPEC), "-o", str(out))
    assert status == 2
    assert f"{out / 'moe_bf16_forward.h'}: a directory is in the way" in err
    assert [p.name for p in out.iterdir()] == ["moe_bf16_forward.h"]  # nothing else written


def test_read_only_output_dir(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o555)
    if os.geteuid() == 0:  # root may write anyway; answer as the folder's mode says
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda p, mode: Path(p) != out and real_access(p, mode))
    try:
        status, err = run(capsys, "compile", str(SPEC), "-o", str(out / "sub"))
    finally:
        out.chmod(0o755)
    assert status == 2 and f"{out} is not writable" in err
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EACCES, errno.EROFS])
def test_failed_write_is_a_file_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    def fail(src: str, dst: str) -> None:
        raise OSError(code, os.strerror(code), src, None, dst)

    monkeypatch.setattr(os, "replace", fail)
    out = tmp_path / "out"
    status, err = run(capsys, "compile", str(SPEC), "-o", str(out))
    assert status == 2
    assert err.startswith(f"gemmspec: error: cannot write {out / 'gemmspec_ptx.cuh'}: {os.strerror(code)}")
    assert list(out.iterdir()) == []  # no temporary file left behind


def test_specs_differing_only_in_case(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = SPEC.read_text()
    two = tmp_path / "two.gspec"
    two.write_text(text.replace("moe_bf16_forward", "moe") + text.replace("moe_bf16_forward", "MOE"))
    out = tmp_path / "out"
    status, err = run(capsys, "compile", str(two), "-o", str(out))
    assert status == 2
    assert err.startswith(f"gemmspec: error: specs 'moe' ({two}:2) and 'MOE' ({two}:")
    assert "differ only in case" in err and not out.exists()


def test_compile_twice_leaves_files_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main(["compile", str(SPEC), "-o", str(out)]) == 0
    first = {p.name: p.stat().st_mtime_ns for p in out.iterdir()}
    assert main(["compile", str(SPEC), "-o", str(out)]) == 0
    assert {p.name: p.stat().st_mtime_ns for p in out.iterdir()} == first
    assert not [n for n in first if n.startswith(".")]


def test_exit_status_by_kind(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run(capsys, "check", str(bad_spec(tmp_path)))[0] == 1
    assert run(capsys, "check", str(tmp_path / "missing.gspec"))[0] == 2
    status, err = run(capsys, "check", str(tmp_path))
    assert status == 2 and "is a directory, not a .gspec file" in err


def test_traceback_flag_reraises(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SpecError, match="unknown dim 'Q'"):
        main(["--traceback", "check", str(bad_spec(tmp_path))])
    target = tmp_path / "file"
    target.write_text("")
    with pytest.raises(OutputError):
        main(["--traceback", "compile", str(SPEC), "-o", str(target)])


def test_traceback_flag_on_the_command_line(tmp_path: Path) -> None:
    bad = str(bad_spec(tmp_path))
    shown = subprocess.run(
        [sys.executable, "-m", "gemmspec", "--traceback", "check", bad], capture_output=True, text=True
    )
    assert shown.returncode != 0 and "Traceback" in shown.stderr and "SpecError" in shown.stderr
    quiet = subprocess.run([sys.executable, "-m", "gemmspec", "check", bad], capture_output=True, text=True)
    assert quiet.returncode == 1 and "Traceback" not in quiet.stderr
