"""The decode variant in the files `compile` writes: its launches' files under names of
their own, the manifest's `run_time_choice` (against the schema and the variant's own
manifest), `compile --list`, and a host launcher that picks per call by the runtime's
rule and builds with nvcc (skipped where nvcc is not installed)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gemmspec.cli import main
from gemmspec.codegen.emit import emit
from gemmspec.codegen.host import cexpr
from gemmspec.codegen.manifest import KernelLaunch, launch_manifest
from gemmspec.codegen.variants import DECODE_ROWS_PAIRED_WIDE, decode_variant
from gemmspec.output import spec_files
from gemmspec.pipeline import lower_file

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
SCHEMA = ROOT / "gemmspec" / "codegen" / "manifest.schema.json"
NVCC = shutil.which("nvcc")
ARCH = "-gencode=arch=compute_90a,code=sm_90a"
STRICT = ["-std=c++17", "-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror,-fPIC"]
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")


def _planned(name: str):
    (x,) = lower_file(EXAMPLES / f"{name}.gspec")
    program = emit(x.spec, x.schedule)
    return x, program, decode_variant(x.spec, x.schedule, program), spec_files(x.spec, x.schedule, program)


def _nvcc(*args: str, cwd: Path) -> None:
    done = subprocess.run([NVCC, *args], cwd=cwd, capture_output=True, text=True)
    assert done.returncode == 0, f"nvcc {' '.join(args)}\n{done.stdout}\n{done.stderr}"


@pytest.mark.parametrize("name", ["moe_fp8_forward", "lora_qkv_one_spec"])
def test_the_manifest_describes_the_choice(name):
    jsonschema = pytest.importorskip("jsonschema")
    x, program, variant, sf = _planned(name)
    doc = json.loads(sf.files[f"{x.spec.name}.manifest.json"])
    jsonschema.validate(doc, json.loads(SCHEMA.read_text()))
    choice, rule = doc["run_time_choice"], variant.rule
    assert (choice["dim"], choice["group"], choice["segments"]) == (rule.dim, rule.group, rule.segments)
    assert choice["rows_per_segment"] == rule.rows_per_segment
    assert choice["max_rows"] == rule.rows_per_segment * rule.segments
    assert [(c["launch"], c["compiled"], c["decode"]) for c in choice["launches"]] == list(variant.launches)
    changed = [i for i, _, _ in variant.launches]
    assert choice["files"] == [f"{x.spec.name}_launch{i}_decode.cu" for i in changed]
    assert set(choice["files"]) <= set(doc["files"]["kernels"])
    # The top level is the compiled program's manifest as before the choice.
    plain = launch_manifest(x.spec, program, x.spec.name).to_json()
    assert {k: v for k, v in doc.items() if k not in ("run_time_choice", "files")} == {
        k: v for k, v in plain.items() if k != "files"
    }
    # The choice is the variant's own manifest, its changed launches' kernels in their files.
    decode = launch_manifest(x.spec, variant.program, x.spec.name).to_json()
    assert choice["workspaces"] == decode["workspaces"]
    assert len(choice["steps"]) == len(decode["steps"])
    owners = {f"launch {i}": i for i in changed}
    for ours, theirs in zip(choice["steps"], decode["steps"]):
        if ours.get("owner") in owners:
            assert ours["file"] == f"{x.spec.name}_launch{owners[ours['owner']]}_decode.cu"
            theirs = {**theirs, "file": ours["file"]}
        assert ours == theirs
    # Only the changed launches' steps differ, and each changed GEMM is the variant's.
    for ours, compiled in zip(choice["steps"], doc["steps"]):
        if ours != compiled:
            assert ours.get("owner") in owners or ours["kind"] == "upload"
    gemms = {s["symbol"] for s in choice["steps"] if s["kind"] == "kernel" and s["role"] == "gemm"}
    assert {after for _, _, after in variant.launches} <= gemms


def test_decode_builders_and_kernels_have_symbols_of_their_own():
    """A launch with a leaf-table builder of its own: the variant's builder counts 64-row
    tiles, so it is another kernel, under another symbol, in the variant's file. (The
    second launch's variant builds its table in its GEMM: no builder of its own.)"""
    x, program, variant, sf = _planned("lora_qkv_one_spec")
    m = sf.manifest
    compiled = {k.symbol: k for k in m.kernels}
    extra = [k for k in m.decode.kernels if k.symbol not in compiled]
    roles = sorted(k.role for k in extra)
    assert roles == ["gemm", "gemm", "leaf_table"]
    assert [k.owner for k in extra if k.role == "leaf_table"] == ["launch 0"]
    for k in extra:
        assert k.file.endswith("_decode.cu")
        source = sf.files[k.file].decode()
        assert re.search(rf'extern "C" __global__ [^;{{}}]*?\b{k.symbol}\(', source), k.symbol
        # No file of the compiled program defines it.
        for f in {c.file for c in m.kernels}:
            assert not re.search(rf"\b{k.symbol}\b", sf.files[f].decode())
    assert all(k.symbol.endswith("_leaves_decode") for k in extra if k.role == "leaf_table")


def test_specs_without_a_variant_write_what_they_wrote():
    x, program, variant, sf = _planned("linear_fp8_training")
    assert variant is None and sf.manifest.decode is None
    assert not any("_decode" in f for f in sf.files)
    doc = json.loads(sf.files[f"{x.spec.name}.manifest.json"])
    assert "run_time_choice" not in doc
    host = sf.files[f"{x.spec.name}_host.cu"].decode()
    assert "decode" not in host and "gs_layout_decode" not in host


def test_compile_list_shows_the_decode_files(tmp_path, capsys):
    out = tmp_path / "gen"
    for name in ("moe_fp8_forward", "lora_qkv_one_spec"):
        assert main(["compile", str(EXAMPLES / f"{name}.gspec"), "-o", str(out), "--list"]) == 0
        listed = [Path(p).name for p in capsys.readouterr().out.split()]
        _, _, variant, _ = _planned(name)
        decode = [f"{name}_launch{i}_decode.cu" for i, _, _ in variant.launches]
        assert decode and set(decode) <= set(listed)
        assert all(f"{name}_launch{i}.cu" in listed for i, _, _ in variant.launches)
    assert not out.exists()
    assert main(["compile", str(EXAMPLES / "moe_fp8_forward.gspec"), "-o", str(out)]) == 0
    capsys.readouterr()
    assert (out / "moe_fp8_forward_launch0_decode.cu").is_file()


def _function(host: str, name: str) -> str:
    start = host.index(name + "(")
    return host[start : host.index("\n}\n", start)]


def test_the_launcher_picks_by_the_rule():
    x, program, variant, sf = _planned("moe_fp8_forward")
    m = sf.manifest
    host = sf.files["moe_fp8_forward_host.cu"].decode()
    header = sf.files["moe_fp8_forward.h"].decode()
    limit = variant.rule.max_rows
    assert limit == DECODE_ROWS_PAIRED_WIDE * 8
    # The rule, with the runtime's threshold, picks the program and its layout.
    run = _function(host, f"{m.prefix}_run")
    assert f"const bool decode = d_T <= {limit}LL;" in run
    assert "decode ? gs_layout_decode(d_T, off) : gs_layout(d_T, off)" in run
    assert f"enum {{ {m.prefix}_decode_max_rows = {limit} }};" in header
    # Each program's launches with its own grid, block and shared memory: the decode
    # variant's in the branch, the compiled ones after it.
    branch = run[run.index("if (decode) {") : run.index("// Otherwise the steps as compiled.")]
    rest = run[run.index("// Otherwise the steps as compiled.") :]
    for steps, text in ((m.decode.steps, branch), (m.steps, rest)):
        gemms = [s for s in steps if isinstance(s, KernelLaunch) and s.role == "gemm"]
        assert len(gemms) == 1
        (g,) = gemms
        assert f"{g.symbol}<<<grid, {g.block}, {g.dynamic_smem}, stream>>>" in text
        assert f"grid_x = {cexpr(g.grid[0])}," in text
    before, after = variant.launches[0][1:]
    assert after in branch and before not in branch and before in rest and after not in rest
    assert m.decode.steps[-1].grid != m.steps[-1].grid  # pairs against single CTAs
    # The decode layout is the variant's workspaces; the workspace covers both.
    layout = _function(host, "gs_layout_decode")
    for w in m.decode.workspaces:
        assert f"total += gs_align(gs_max({cexpr(w.bytes)}, 0LL));" in layout
    assert "gs_max(compiled, gs_layout_decode(d_T, off))" in _function(host, f"{m.prefix}_workspace_bytes")
    # Both kernels are declared for the launcher and get their shared-memory limit.
    for symbol in (before, after):
        assert re.search(rf'extern "C" __global__ void {symbol}\(', header)
        assert f"cudaFuncSetAttribute({symbol}, cudaFuncAttributeMaxDynamicSharedMemorySize" in host


@pytest.mark.slow
@needs_nvcc
def test_the_launcher_and_the_decode_kernels_build_with_nvcc(tmp_path):
    """moe_fp8_forward (a GEMM that builds its table) and lora_qkv_one_spec (builders of
    their own in both programs): every file compiles with warnings as errors and the
    files of both link into one shared library (no symbol is defined twice)."""
    out = tmp_path / "gen"
    for name in ("moe_fp8_forward", "lora_qkv_one_spec"):
        assert main(["compile", str(EXAMPLES / f"{name}.gspec"), "-o", str(out)]) == 0
    sources = sorted(p.name for p in out.glob("*.cu"))
    assert "moe_fp8_forward_launch0_decode.cu" in sources
    assert "lora_qkv_one_spec_launch1_decode.cu" in sources
    jobs = [(ARCH, *STRICT, "-c", s, "-o", f"{s}.o") for s in sources]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(lambda job: _nvcc(*job, cwd=out), jobs))
    _nvcc(ARCH, "-shared", *(f"{s}.o" for s in sources), "-o", "libdecode.so", cwd=out)
