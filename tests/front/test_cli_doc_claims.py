"""What docs/usage.md and the README's Commands section say of the command line, held to
the code: the options each command takes, `--dump-ir` on `run`, the fields of
`tune --json`, and the clear usage or file errors (exit 2, no traceback, no user file
lost) for the inputs a new user gets wrong. The GPU is faked where a command needs one."""

from __future__ import annotations

import argparse
import errno
import re
import sys
from pathlib import Path

import pytest

import gemmspec.runtime.arrays as arrays
import gemmspec.runtime.verify as verify
import gemmspec.tune as tuning
from gemmspec.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[2]
USAGE = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")

SPEC = """\
gemm doc_claims {
  dim T
  dim N = 64, K = 128
  group expert[E = 2] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
STAGES = ["01-ast.txt", "02-spec.txt", "03-decision.txt", "04-schedule.json", "04-schedule.txt"]


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "doc_claims.gspec"
    path.write_text(SPEC)
    return path


@pytest.fixture
def fake_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """`gemmspec run` on a passing report, without a GPU."""
    monkeypatch.setattr(arrays, "require_hopper", lambda _ordinal=0: None)

    def run_random(exe, dims=None, lengths=None, seed=0, repeats=10):
        return verify.RunReport(exe.spec.name, dict(dims or {}), (), 1e-3, 1e9)

    monkeypatch.setattr(verify, "run_random", run_random)


def usage_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The message of an argument error: argparse's exit status 2, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


# ---------------------------------------------------------------------------- options
def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(sub.choices)


def _bench_options(capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    return set(re.findall(r"--[a-z][a-z-]*", capsys.readouterr().out))


def _synopses(text: str, pattern: str) -> dict[str, str]:
    return {m.group(1): m.group(0) for m in re.finditer(pattern, text, flags=re.M)}


def _options(synopsis: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*|-o)\b", synopsis))


def test_the_usage_table_names_every_option_and_no_other(capsys) -> None:
    rows = _synopses(USAGE, r"^\| `gemmspec (\w+) [^`]*`")
    assert set(rows) == {"check", "explain", "compile", "run", "tune", "bench"}
    for command, parser in _subparsers().items():
        documented = _options(rows[command])
        if command == "bench":
            assert documented == _bench_options(capsys) - {"--help"}, command
            continue
        strings = [a.option_strings for a in parser._actions if a.option_strings]
        known = {s for opts in strings for s in opts}
        assert documented <= known, (command, documented - known)
        missing = [opts for opts in strings if not set(opts) & (documented | {"--help", "--dump-ir"})]
        assert not missing, (command, missing)


def test_the_readme_names_only_options_that_exist(capsys) -> None:
    commands = README.split("## Commands", 1)[1].split("\n## ", 1)[0]
    items = _synopses(commands, r"^- `gemmspec (\w+) [^`]*`")
    assert set(items) == {"check", "explain", "compile", "run", "tune", "bench"}
    parsers = _subparsers()
    for command, synopsis in items.items():
        if command == "bench":
            known = _bench_options(capsys)
        else:
            known = {s for a in parsers[command]._actions for s in a.option_strings}
        assert _options(synopsis) <= known, (command, _options(synopsis) - known)
    # `compile -o` is optional, with a default the docs name.
    assert "`gemmspec compile FILE [-o DIR]" in commands and "default `out`" in commands
    assert parsers["compile"].get_default("output") == Path("out")


def test_bench_takes_no_dump_ir_and_the_docs_say_so(capsys) -> None:
    assert "--dump-ir" not in _bench_options(capsys)
    assert "All commands but `bench` take a `.gspec` file and accept `--dump-ir DIR`" in USAGE
    assert "`--dump-ir DIR` on any of them but `bench`" in README


# ---------------------------------------------------------------------------- run
def test_run_writes_dump_ir(spec_file, fake_run, tmp_path, capsys) -> None:
    dump = tmp_path / "ir"
    assert main(["run", str(spec_file), "--dims", "T=64", "--dump-ir", str(dump)]) == 0
    assert "doc_claims: dims {'T': 64}" in capsys.readouterr().out
    assert sorted(p.name for p in dump.iterdir()) == STAGES


def test_run_dump_ir_onto_a_file_is_refused_before_the_device(spec_file, no_device, tmp_path, capsys) -> None:
    target = tmp_path / "ir"
    target.write_text("keep me")
    assert main(["run", str(spec_file), "--dump-ir", str(target)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"gemmspec: error: cannot write the --dump-ir directory {target}: ")
    assert target.read_text() == "keep me"


def test_run_refuses_a_file_of_several_specs_in_the_command_lines_words(tmp_path, no_device, capsys) -> None:
    two = tmp_path / "two.gspec"
    two.write_text(SPEC + "\n" + SPEC.replace("doc_claims", "other"))
    assert main(["run", str(two)]) == 1
    err = capsys.readouterr().err
    assert err == f"{two}: run takes a file with one spec; it defines 2 (doc_claims, other)\n"
    assert "name=" not in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "SPEC", "--repeats", "0"], "argument --repeats: expected a positive integer, got '0'"),
        (["run", "SPEC", "--repeats", "-3"], "argument --repeats: expected a positive integer, got '-3'"),
        (["explain", "SPEC", "--width", "\u00b2"], "argument --width: expected 0 (no wrapping) or a width of at least 40"),
        (["tune", "SPEC", "--repeat", "\u00b9"], "argument --repeat: expected a positive integer"),
        (["tune", "SPEC", "--only", "1,\u00b2"], "argument --only: expected M,N (a tile such as 128,160)"),
        (["explain", "SPEC", "--json", "--backward"], "argument --backward: not allowed with argument --json"),
    ],
)
def test_bad_option_values_are_usage_errors(argv, message, spec_file, no_device, capsys) -> None:
    line = usage_error(capsys, [str(spec_file) if a == "SPEC" else a for a in argv])
    assert message in line, line
    assert "invalid _" not in line  # no helper's name in place of what is expected


@pytest.mark.parametrize("command", ["run", "tune"])
def test_a_negative_seed_is_a_usage_error(command, spec_file, no_device, capsys) -> None:
    # numpy's generators refuse it with a traceback once the GPU is found
    assert main([command, str(spec_file), "--seed", "-1"]) == 2
    assert capsys.readouterr().err == "gemmspec: error: --seed: expected a seed of 0 or more, got -1\n"


@pytest.mark.parametrize("command", ["run", "tune"])
def test_a_spec_file_after_dims_is_named(command, spec_file, no_device, capsys) -> None:
    line = usage_error(capsys, [command, "--dims", "T=64", str(spec_file)])
    assert f"expected NAME=SIZE, got '{spec_file}' (FILE goes before --dims)" in line
    assert "required" not in line


# ---------------------------------------------------------------------------- tune
def test_tune_json_empty_is_refused_without_advice_for_folders(spec_file, no_device, capsys) -> None:
    line = usage_error(capsys, ["tune", str(spec_file), "--json", ""])
    assert "expected a path, got an empty string" in line and "current directory" not in line


def test_tune_json_onto_the_spec_is_refused(spec_file, no_device, capsys) -> None:
    assert main(["tune", str(spec_file), "--json", str(spec_file.parent / "." / spec_file.name)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gemmspec: error: cannot write the --json file ") and "it is the spec file" in err
    assert spec_file.read_text() == SPEC


def test_tune_json_fields_are_the_documented_ones() -> None:
    found = tuning.enumerate_candidates(SPEC, only=[(128, 64)])
    report = verify.RunReport("doc_claims", {"T": 64}, (), 0.0, 1e9)
    result = tuning.measure(found, lambda c: tuning.Trial(report, c.label), lambda _t, n: [1.0] * n, 2)
    doc = result.to_json()
    said = USAGE.split("`--json OUT` writes the same:", 1)[1].split("- **Exit status.**", 1)[0]
    documented = set(re.findall(r"`([a-z_]+)`", said))
    fields = set(doc) | set(doc["candidates"][0]) | {k for s in doc["skipped"] for k in s}
    assert documented == fields


# ---------------------------------------------------------------------------- errors
class _FullDisk:
    def write(self, _text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False


def test_a_full_disk_on_stdout_does_not_blame_the_spec(spec_file, monkeypatch, capsys) -> None:
    monkeypatch.setattr(sys, "stdout", _FullDisk())
    assert main(["check", str(spec_file)]) == 2
    err = capsys.readouterr().err
    assert err == "gemmspec: error: cannot write the output: No space left on device\n"


def test_a_missing_output_file_is_not_called_unreadable(monkeypatch, capsys) -> None:
    import gemmspec.bench as bench

    def bench_main(_argv):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory", "results/bench.json")

    monkeypatch.setattr(bench, "main", bench_main)
    assert main(["bench", "--json", "results/bench.json"]) == 2
    err = capsys.readouterr().err
    assert err == "gemmspec: error: results/bench.json: No such file or directory\n"


def test_a_missing_spec_is_still_called_unreadable(tmp_path, capsys) -> None:
    missing = tmp_path / "nope.gspec"
    assert main(["check", str(missing)]) == 2
    assert capsys.readouterr().err == f"gemmspec: error: cannot read {missing}: no such file\n"


def _listed(argv: list[str], capsys) -> list[str]:
    assert main(argv) == 0
    return [Path(p).name for p in capsys.readouterr().out.split()]


def test_compile_list_names_the_cubins_without_compiling_them(tmp_path, capsys, monkeypatch):
    # A build system's query: the names come from the plan, and no kernel goes to NVRTC.
    import gemmspec.runtime.nvrtc as nvrtc

    def refuse(*_args, **_kwargs):
        raise AssertionError("a kernel was compiled to be listed")

    monkeypatch.setattr(nvrtc, "compile_cubin", refuse)
    out = tmp_path / "gen"
    spec = str(ROOT / "examples" / "moe_fp8_forward.gspec")
    plain = _listed(["compile", spec, "-o", str(out), "--list"], capsys)
    listed = _listed(["compile", spec, "-o", str(out), "--list", "--cubin"], capsys)
    kernels = [n for n in plain if n.endswith(".cu") and not n.endswith("_host.cu")]
    assert kernels and "moe_fp8_forward_launch0_decode.cu" in kernels
    assert sorted(listed) == sorted(plain + [n[: -len(".cu")] + ".cubin" for n in kernels])
    assert not out.exists()


@pytest.mark.slow
def test_compile_list_with_cubins_names_what_compile_writes(tmp_path, capsys):
    out = tmp_path / "gen"
    spec = str(ROOT / "examples" / "moe_bf16_forward.gspec")
    listed = _listed(["compile", spec, "-o", str(out), "--list", "--cubin"], capsys)
    written = _listed(["compile", spec, "-o", str(out), "--cubin"], capsys)
    assert listed == written
    assert all((out / n).stat().st_size > 0 for n in written if n.endswith(".cubin"))
