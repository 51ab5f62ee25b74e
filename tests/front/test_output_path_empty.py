"""An empty output path is refused as a usage error: Path("") is the current directory,
and `compile -o ""` filled it with the spec's files."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmspec.cli import main

SPEC = """\
gemm empty_out {
  dim T
  dim N = 64, K = 64
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


@pytest.mark.parametrize(
    "argv",
    [
        ["compile", "SPEC", "-o", ""],
        ["compile", "SPEC", "--output", "  "],
        ["compile", "SPEC", "--dump-ir", ""],
        ["check", "SPEC", "--dump-ir", ""],
        ["explain", "SPEC", "--dump-ir", ""],
        ["tune", "SPEC", "--json", ""],
    ],
)
def test_an_empty_output_path_is_a_usage_error(argv, tmp_path: Path, monkeypatch, capsys) -> None:
    spec = tmp_path / "spec.gspec"
    spec.write_text(SPEC)
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    with pytest.raises(SystemExit) as e:
        main([str(spec) if a == "SPEC" else a for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "expected a path, got an empty string" in err and "Traceback" not in err
    assert list(work.iterdir()) == []  # nothing written where the command ran


def test_dot_still_means_the_current_directory(tmp_path: Path, monkeypatch, capsys) -> None:
    spec = tmp_path / "spec.gspec"
    spec.write_text(SPEC)
    monkeypatch.chdir(tmp_path)
    assert main(["compile", str(spec), "-o", ".", "--list"]) == 0
    assert "empty_out_launch0.cu" in capsys.readouterr().out
