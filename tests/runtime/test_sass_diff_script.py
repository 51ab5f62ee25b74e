"""scripts/emit_hashes.py --dump and scripts/sass_diff.py, the pair that shows a template
change moves no instruction: the dump holds every kernel with the device header at its top,
and the comparison finds no change between two equal trees, the same SASS where only a
comment differs, and a difference where the code does."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "scripts"


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPTS / script), *args], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)


@pytest.fixture(scope="module")
def dumped(tmp_path_factory) -> Path:
    tree = tmp_path_factory.mktemp("dump") / "before"
    done = _run("emit_hashes.py", "--dump", str(tree))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    kernels = [line.split("  ", 1)[1] for line in lines if line.endswith(".cu") and not line.endswith("_host.cu")]
    assert kernels and (tree / "gemmspec_ptx.cuh").is_file()
    # Every hashed kernel lies in the dump, a backward spec's under its forward's folder.
    for label in kernels:
        assert tree.joinpath(*label.split(":")).is_file(), label
    return tree


def test_equal_trees_have_no_changed_kernel(dumped, tmp_path):
    other = tmp_path / "after"
    shutil.copytree(dumped, other)
    done = _run("sass_diff.py", str(dumped), str(other))
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.strip().splitlines()[-1] == "0 kernels changed source, 0 of them SASS; 0 in one tree only"


def _smallest_kernel(tree: Path) -> Path:
    kernels = [p for p in tree.rglob("*.cu") if not p.name.endswith("_host.cu")]
    return min(kernels, key=lambda p: p.stat().st_size)


@pytest.mark.slow
def test_a_comment_keeps_the_sass_and_code_changes_it(dumped, tmp_path):
    other = tmp_path / "after"
    shutil.copytree(dumped, other)
    kernel = _smallest_kernel(other)
    key = str(kernel.relative_to(other))
    kernel.write_text(kernel.read_text() + "\n// a comment moves no instruction\n")
    done = _run("sass_diff.py", str(dumped), str(other))
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"same SASS    {key}" in done.stdout
    kernel.write_text(kernel.read_text() + 'extern "C" __global__ void gs_one_more(int* p) { *p = 1; }\n')
    done = _run("sass_diff.py", str(dumped), str(other))
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"SASS differs {key}" in done.stdout
    assert "1 kernels changed source, 1 of them SASS" in done.stdout
