"""What a new user meets first: `gemmspec --version`, and `run`, `tune` and `bench`
without a Hopper GPU failing at once (before random inputs, compiling or importing torch)
with a clear message and exit status 1."""

from __future__ import annotations

import re
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace

import pytest

import gemmspec
from gemmspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
SPEC = str(ROOT / "examples" / "moe_bf16_forward.gspec")


def test_version_prints_the_package_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    try:
        want = version("gemmspec")
    except PackageNotFoundError:  # a source tree that was never installed
        want = gemmspec.__version__
    assert capsys.readouterr().out == f"gemmspec {want}\n"


def test_the_package_version_is_the_project_version() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    (declared,) = re.findall(r'^version = "([^"]+)"$', pyproject, flags=re.M)
    assert gemmspec.__version__ == declared


def _fail(what: str):
    def fail(*_args, **_kwargs):
        raise AssertionError(f"{what} ran before the device was checked")

    return fail


@pytest.fixture
def no_work(monkeypatch):
    """The slow work of each command fails the test if it starts."""
    import gemmspec.bench.run as bench_run
    import gemmspec.runtime.verify as verify
    import gemmspec.tune as tuning

    monkeypatch.setattr(verify, "run_random", _fail("run_random"))
    monkeypatch.setattr(tuning, "gpu_runner", _fail("the tune runner"))
    monkeypatch.setattr(bench_run, "load_torch", _fail("importing torch"))


def _device(monkeypatch, make) -> None:
    import gemmspec.runtime.arrays as arrays

    monkeypatch.setattr(arrays, "Device", make)


def _no_driver(_ordinal=0):
    raise RuntimeError("no driver here")


class _Ampere:
    def __init__(self, ordinal=0):
        self.compute_capability = SimpleNamespace(major=8, minor=0)
        self.name = "NVIDIA A100-SXM4-80GB"

    def set_current(self):
        pass


@pytest.mark.parametrize(
    "argv",
    [["run", SPEC, "--dims", "T=256"], ["tune", SPEC, "--dims", "T=256"], ["bench"]],
    ids=["run", "tune", "bench"],
)
@pytest.mark.parametrize(
    ("device", "message"),
    [
        (_no_driver, "no usable CUDA device 0 (is an NVIDIA GPU and driver present?): no driver here"),
        (_Ampere, "CUDA device 0 (NVIDIA A100-SXM4-80GB) is sm_80; gemmspec's kernels are built for "
                  "sm_90a and need a Hopper GPU"),
    ],
    ids=["no_driver", "not_hopper"],
)
def test_without_a_hopper_gpu_commands_stop_first(argv, device, message, monkeypatch, no_work, capsys) -> None:
    _device(monkeypatch, device)
    assert main(argv) == 1
    captured = capsys.readouterr()
    prefix = "gemmspec bench: error: " if argv[0] == "bench" else "gemmspec: error: "
    assert captured.err.startswith(prefix) and message in captured.err, captured.err
    assert "Traceback" not in captured.err and captured.out == ""


def test_a_spec_error_still_comes_before_the_device(tmp_path, monkeypatch, no_work, capsys) -> None:
    _device(monkeypatch, _no_driver)
    bad = tmp_path / "bad.gspec"
    bad.write_text(Path(SPEC).read_text().replace("[T, K]", "[T, Q]", 1))
    assert main(["run", str(bad)]) == 1
    assert capsys.readouterr().err.startswith(f"{bad}:")


def test_bench_list_needs_no_device(monkeypatch, capsys) -> None:
    _device(monkeypatch, _no_driver)
    assert main(["bench", "--list"]) == 0
    assert capsys.readouterr().out
