"""The Makefiles of docs/usage.md work as written: each `make` block, saved as a Makefile
beside a folder that `gemmspec compile` wrote and a main.cpp, plans (`make -n`) the
nvcc commands that build every file of the folder into `app`; with nvcc on the PATH the
per-file one really builds, and the program links and runs (it needs no GPU)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from gemmspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
USAGE = ROOT / "docs" / "usage.md"
SPEC = ROOT / "examples" / "moe_bf16_forward.gspec"  # the cheapest example to build
MAKE = shutil.which("make")
NVCC = shutil.which("nvcc")

MAIN = """\
// Calls the launcher with no arguments, which it refuses before touching a GPU.
#include <cstdio>

#include "moe_bf16_forward.h"

int main() {
  std::printf("%zu\\n", gemmspec_moe_bf16_forward_workspace_bytes(1000));
  return gemmspec_moe_bf16_forward_run(nullptr, nullptr, nullptr) == cudaErrorInvalidValue ? 0 : 1;
}
"""

pytestmark = pytest.mark.skipif(MAKE is None, reason="make is not on PATH")


def makefiles() -> list[str]:
    blocks = re.findall(r"^```make\n(.*?)^```", USAGE.read_text(encoding="utf-8"), flags=re.M | re.S)
    assert len(blocks) == 2, "docs/usage.md has a one-line and a per-file Makefile"
    return blocks


@pytest.fixture
def project(tmp_path: Path) -> Path:
    assert main(["compile", str(SPEC), "-o", str(tmp_path / "gen")]) == 0
    (tmp_path / "main.cpp").write_text(MAIN)
    return tmp_path


def _make(project: Path, makefile: str, *args: str) -> subprocess.CompletedProcess:
    (project / "Makefile").write_text(makefile)
    return subprocess.run([MAKE, *args], cwd=project, capture_output=True, text=True)


def test_the_one_line_makefile_plans_one_nvcc(project: Path) -> None:
    done = _make(project, makefiles()[0], "-n")
    assert done.returncode == 0, done.stderr
    (command,) = done.stdout.splitlines()
    words = command.split()
    assert words[0] == "nvcc" and words[-2:] == ["-o", "app"]
    cu = sorted(p.name for p in (project / "gen").glob("*.cu"))
    # The host launcher, the launch and its decode variant (a ragged launch over T).
    assert len(cu) == 3 and any(c.endswith("_decode.cu") for c in cu)
    assert sorted(Path(w).name for w in words if w.endswith(".cu")) == cu
    assert "main.cpp" in words


def test_the_per_file_makefile_plans_every_object_then_the_link(project: Path) -> None:
    done = _make(project, makefiles()[1], "-n")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    cu = sorted(str(p.relative_to(project)) for p in (project / "gen").glob("*.cu"))
    compiled = sorted(ln.split()[ln.split().index("-c") + 1] for ln in lines if " -c " in ln)
    assert compiled == sorted([*cu, "main.cpp"])
    link = lines[-1].split()
    assert link[0] == "nvcc" and link[-2:] == ["-o", "app"]
    assert sorted(w for w in link if w.endswith(".o")) == sorted(["main.o", *(c[:-3] + ".o" for c in cu)])
    assert all("-gencode=arch=compute_90a,code=sm_90a" in ln for ln in lines)


@pytest.mark.slow
@pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH (the plan above is still checked)")
def test_the_per_file_makefile_builds_a_program_that_runs(project: Path) -> None:
    jobs = str(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    done = _make(project, makefiles()[1], "-j", jobs)
    assert done.returncode == 0, done.stdout + done.stderr
    ran = subprocess.run([str(project / "app")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert int(ran.stdout) > 0  # the workspace its leaf tables and tensor maps take
    # Nothing changed: nothing to rebuild.
    again = _make(project, makefiles()[1], "-n")
    assert again.returncode == 0 and "nvcc" not in again.stdout, again.stdout
