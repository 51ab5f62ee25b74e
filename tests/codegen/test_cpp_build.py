"""The files `compile` writes build into other programs: with nvcc, the files of every
example compiled into one folder build with every warning an error, each header
compiles alone in a C++ translation unit, all objects link into one shared library,
and two specs link with a C++ driver into one executable that calls both. Skipped
where nvcc is not installed."""

from __future__ import annotations

import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gemmspec.cli import main
from gemmspec.codegen.emit import emit
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.codegen.variants import decode_variant
from gemmspec.pipeline import lower_file

ROOT = Path(__file__).resolve().parents[2]
SPECS = ("moe_fp8_forward", "linear_fp8_training")
NVCC = shutil.which("nvcc")
ARCH = "-gencode=arch=compute_90a,code=sm_90a"
STRICT = ["-std=c++17", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror,-fPIC"]
TOKENS = 1000
# One nvcc per core this process may run on: more only queue up and starve the rest of
# the machine (each nvcc of an FP8 kernel takes seconds of CPU and ~1 GB).
WORKERS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1

# Minutes of nvcc: in the slow set (README, "Contributing").
pytestmark = [pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH"), pytest.mark.slow]

DRIVER = """\
// Links both specs' host launchers into one program; needs no GPU to run.
#include <cstdio>

#include "linear_fp8_training.h"
#include "moe_fp8_forward.h"

int main() {
  std::printf("%zu %zu\\n", gemmspec_moe_fp8_forward_workspace_bytes(TOKENS),
              gemmspec_linear_fp8_training_workspace_bytes(TOKENS));
  const bool refused = gemmspec_moe_fp8_forward_run(nullptr, nullptr, nullptr) == cudaErrorInvalidValue &&
                       gemmspec_linear_fp8_training_run(nullptr, nullptr, nullptr) == cudaErrorInvalidValue;
  return refused ? 0 : 1;
}
""".replace("TOKENS", str(TOKENS))


def _nvcc(*args: str, cwd: Path) -> None:
    done = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"nvcc {' '.join(args)}\n{done.stdout}\n{done.stderr}"


def _workspace_bytes(name: str) -> int:
    """What the launcher's workspace_bytes returns: the larger of the layouts of the
    program as compiled and of its decode variant, where it has one."""
    (x,) = lower_file(ROOT / "examples" / f"{name}.gspec")
    program = emit(x.spec, x.schedule)
    m = launch_manifest(x.spec, program)
    env = {d: TOKENS for d in m.runtime_dims}
    align = 256
    programs = [m.workspaces]
    variant = decode_variant(x.spec, x.schedule, program)
    if variant is not None:
        programs.append(launch_manifest(x.spec, variant.program).workspaces)
    return max(sum(-(-max(w.bytes.evaluate(env), 0) // align) * align for w in ws) for ws in programs)


def test_every_example_builds_and_links_into_one_program(tmp_path):
    out = tmp_path / "gen"
    examples = sorted((ROOT / "examples").glob("*.gspec"))
    for path in examples:
        assert main(["compile", str(path), "-o", str(out)]) == 0
    sources = sorted(p.name for p in out.glob("*.cu"))
    assert sum(s.endswith("_host.cu") for s in sources) == len(examples)
    (out / "driver.cpp").write_text(DRIVER)

    jobs = [(ARCH, *STRICT, "-c", s, "-o", f"{s}.o") for s in sources]
    jobs.append((*STRICT, "-I.", "-c", "driver.cpp", "-o", "driver.o"))
    for header in sorted(p.name for p in out.glob("*.h")):
        # Alone, in a plain C++ unit and in a CUDA unit.
        (out / f"only_{header}.cpp").write_text(f'#include "{header}"\n')
        (out / f"only_{header}.cu").write_text(f'#include "{header}"\n')
        jobs.append((*STRICT, "-c", f"only_{header}.cpp", "-o", f"only_{header}.cpp.o"))
        jobs.append((ARCH, *STRICT, "-c", f"only_{header}.cu", "-o", f"only_{header}.cu.o"))
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(lambda job: _nvcc(*job, cwd=out), jobs))

    objects = [f"{s}.o" for s in sources]
    _nvcc(ARCH, "-shared", *objects, "-o", "libgemms.so", cwd=out)
    two = [o for o in objects if o.startswith(SPECS)]
    _nvcc(ARCH, *two, "driver.o", "-o", "app", cwd=out)
    ran = subprocess.run([str(out / "app")], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert [int(v) for v in ran.stdout.split()] == [_workspace_bytes(n) for n in SPECS]


def test_a_check_of_its_own_builds_into_the_launcher(tmp_path):
    """A spec whose pre-pass reads the offsets runs the check as a kernel of its own: its
    file, the launcher that launches it first and the header build like the others."""
    from test_offsets_check import REQUANT_FIRST

    spec = tmp_path / "wgrad_requant.gspec"
    spec.write_text(REQUANT_FIRST)
    out = tmp_path / "gen"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    sources = sorted(p.name for p in out.glob("*.cu"))
    assert "wgrad_requant_check.cu" in sources
    host = (out / "wgrad_requant_host.cu").read_text()
    assert host.index("gs_wgrad_requant_check") < host.index("_p0_sm90a_requant")
    jobs = [(ARCH, *STRICT, "-c", s, "-o", f"{s}.o") for s in sources]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(lambda job: _nvcc(*job, cwd=out), jobs))
    _nvcc(ARCH, "-shared", *(f"{s}.o" for s in sources), "-o", "libwgrad.so", cwd=out)


def test_the_scattered_backward_builds_into_the_launcher(tmp_path):
    """The derived backward of examples/moe_ffn_fp8_train.gspec: its requantize with rows
    and a weight takes the index, the source's rows and the weight from the launcher's
    arguments; every file builds."""
    from gemmspec.backward import derive_backward
    from gemmspec.build import build

    bw = derive_backward(build(ROOT / "examples" / "moe_ffn_fp8_train.gspec").spec)
    spec = tmp_path / f"{bw.spec_name}.gspec"
    spec.write_text(bw.source)
    out = tmp_path / "gen"
    assert main(["compile", str(spec), "-o", str(out)]) == 0
    sources = sorted(p.name for p in out.glob("*.cu"))
    host = (out / f"{bw.spec_name}_host.cu").read_text()
    assert "_p16_rows_rw" in host
    jobs = [(ARCH, *STRICT, "-c", s, "-o", f"{s}.o") for s in sources]
    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        list(pool.map(lambda job: _nvcc(*job, cwd=out), jobs))
    _nvcc(ARCH, "-shared", *(f"{s}.o" for s in sources), "-o", "libbackward.so", cwd=out)
