"""scripts/build_deepgemm.sh without a GPU: it refuses a checkout without its submodules
before copying anything, and otherwise copies the source, links CUTLASS where DeepGEMM's
compiler looks for it and builds with the compiler it was given (a stand-in `python3`
records the call, since the real build needs a CUDA torch)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "build_deepgemm.sh"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _checkout(root: Path, without: str | None = None) -> Path:
    src = root / "DeepGEMM"
    for path in ("setup.py", "deep_gemm/__init__.py", "third-party/cutlass/include/cute/tensor.hpp",
                 "third-party/cutlass/include/cutlass/cutlass.h", "third-party/fmt/include/fmt/core.h"):
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text("")
    (src / "deep_gemm/include").mkdir()
    if without:
        shutil.rmtree(src / without)
    return src


def _run(*args: str, path: str | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    full = {"PATH": path or os.environ["PATH"], "HOME": os.environ.get("HOME", "/tmp")} | (env or {})
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=full, timeout=60)


def test_without_a_source_it_says_how_it_is_used():
    r = _run()
    assert r.returncode != 0 and "usage: scripts/build_deepgemm.sh SRC_DIR [BUILD_DIR]" in r.stderr


@pytest.mark.parametrize("missing", ["third-party/cutlass/include/cute", "third-party/fmt/include"])
def test_a_checkout_without_its_submodules_is_refused_before_anything_is_copied(tmp_path, missing):
    src = _checkout(tmp_path, without=missing)
    r = _run(str(src), str(tmp_path / "build"))
    assert r.returncode == 2
    assert f"{src}/{missing} is missing (a DeepGEMM 2.x checkout with its submodules is needed)" in r.stderr
    assert not (tmp_path / "build").exists()


def test_it_builds_a_copy_with_cutlass_linked_and_the_given_compiler(tmp_path):
    src = _checkout(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    # Stand-ins: nvcc (only its place is read) and python3 (records the build's call and
    # environment; the import check after it succeeds).
    (bin_dir / "nvcc").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python3").write_text(f'#!/bin/sh\necho "$PWD|$*|$CXX|$CUDA_HOME" >> {calls}\n')
    for tool in ("nvcc", "python3"):
        (bin_dir / tool).chmod(0o755)
    build = tmp_path / "build"
    path = f"{bin_dir}:/usr/bin:/bin"
    r = _run(str(src), str(build), path=path, env={"CXX": "/opt/my/g++", "CC": "/opt/my/gcc"})
    assert r.returncode == 0, r.stderr
    for lib in ("cute", "cutlass"):
        link = build / "deep_gemm/include" / lib
        assert link.is_symlink() and os.readlink(link) == f"../../third-party/cutlass/include/{lib}"
        assert link.resolve() == (build / "third-party/cutlass/include" / lib).resolve()
    first, second = calls.read_text().splitlines()
    assert first == f"{build}|setup.py build_ext --inplace|/opt/my/g++|{tmp_path}"
    assert second.startswith("/tmp|-c import deep_gemm")
    assert r.stdout.strip() == f"export PYTHONPATH={build}${{PYTHONPATH:+:$PYTHONPATH}} CUDA_HOME={tmp_path}"
    assert (src / "deep_gemm/include").exists() and not (src / "deep_gemm/include/cute").exists()  # source untouched
