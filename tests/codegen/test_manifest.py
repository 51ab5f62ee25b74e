"""The launch manifest, the header and the host launcher agree with the compiler and
with the CUDA they describe (no GPU, no nvcc: NVRTC checks the declarations)."""

from __future__ import annotations

import dataclasses
import json
import random
import re
from pathlib import Path

import pytest
from cuda.bindings import nvrtc

from gemmspec.cli import main
from gemmspec.codegen.emit import emit
from gemmspec.codegen.formula import NUM_SMS, Formula
from gemmspec.codegen.host import declaration
from gemmspec.codegen.kernels import INLINE_MAX_BLOCKS, SCATTER_STEPS, include_dir, map_specs
from gemmspec.codegen.manifest import (
    LEAF_BYTES,
    TENSOR_MAP_BYTES,
    TENSOR_MAP_DATA_TYPE,
    KernelLaunch,
    Upload,
    launch_manifest,
)
from gemmspec.errors import OutputError
from gemmspec.output import SHARED_HEADER, check_symbols, plan_programs, spec_files
from gemmspec.pipeline import lower_file
from gemmspec.runtime import executor, tensormap
from gemmspec.runtime.nvrtc import cuda_include_dirs

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.gspec"))
SCHEMA = ROOT / "gemmspec" / "codegen" / "manifest.schema.json"


def programs(path: Path):
    return [(x.spec, x.schedule, emit(x.spec, x.schedule)) for x in lower_file(path)]


@pytest.fixture(scope="module")
def planned():
    """Every example's files, planned together as if compiled into one folder."""
    return plan_programs([p for path in EXAMPLES for p in programs(path)])


def test_manifests_validate_against_the_documented_schema(planned):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    for sf in planned:
        doc = json.loads(sf.files[f"{sf.manifest.stem}.manifest.json"])
        jsonschema.validate(doc, schema)
        assert doc == sf.manifest.to_json()


def test_documented_fields_are_the_schema_fields():
    """docs/kernel-abi.md describes every field the schema allows."""
    text = (ROOT / "docs" / "kernel-abi.md").read_text()
    section = text[text.index("## The launch manifest") :]
    schema = json.loads(SCHEMA.read_text())
    fields = set(schema["properties"])
    for d in schema["$defs"].values():
        fields |= set(d.get("properties", {}))
    missing = sorted(f for f in fields if f"`{f}`" not in section)
    assert not missing, missing


def test_symbols_are_unique_across_every_example(planned):
    symbols = []
    for sf in planned:
        symbols += [k.symbol for k in sf.manifest.all_kernels]
        symbols += [f"{sf.manifest.prefix}_run", f"{sf.manifest.prefix}_workspace_bytes"]
    assert len(symbols) == len(set(symbols))
    assert all(re.fullmatch(r"[A-Za-z_]\w*", s) for s in symbols)
    for sf in planned:
        assert all(k.symbol.startswith(f"gs_{sf.spec.name}_") for k in sf.manifest.all_kernels)


def test_two_specs_defining_one_symbol_are_refused(planned):
    sf = planned[0]
    twin = dataclasses.replace(sf, spec=dataclasses.replace(sf.spec, line=sf.spec.line + 1))
    with pytest.raises(OutputError, match="would both define gs_"):
        check_symbols([sf, twin])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_manifest_describes_the_emitted_program(path):
    for spec, schedule, program in programs(path):
        m = launch_manifest(spec, program)
        files = spec_files(spec, schedule, program).files
        assert set(m.files["kernels"]) <= set(files)
        assert [a.name for a in m.arguments] == executor.Executable(spec, schedule, program).argument_names()
        roles = [k.role for k in m.kernels if k.role != "check"]
        expected = []
        for kind, _, step in program.steps():
            if kind == "prepass":
                expected.append(step.prepass.kind)  # the role is the pass's kind
            elif kind == "launch":  # a GEMM that builds its table has no builder
                expected += ["gemm"] if step.gemm.inline_table else ["leaf_table", "gemm"]
            elif step.config.kind == "scatter_add":  # its index kernels, then the sum
                expected += [role for role, _ in SCATTER_STEPS]
            else:
                expected.append(step.postpass.kind)
        assert roles == expected
        names = {w.name for w in m.workspaces}
        dims = set(m.runtime_dims) | {NUM_SMS}
        arguments = {a.name for a in m.arguments}
        for step in m.steps:
            if isinstance(step, Upload):
                assert step.workspace in names
                continue
            assert step.symbol in files[step.file].decode()
            for g in step.grid:
                assert g.names <= dims
            gemm = next((x.gemm for x in program.launches if x.gemm.name == step.symbol), None)
            if gemm is not None:  # persistent: ctas_per_sm blocks per SM, whole clusters
                for sms in (1, 7, 132):
                    blocks = step.grid[0].evaluate({NUM_SMS: sms})
                    assert blocks % gemm.cluster == 0
                    assert blocks == max(1, sms * gemm.ctas_per_sm // gemm.cluster) * gemm.cluster
            for p in step.params:
                s = p.source
                if s.kind == "tensor":
                    assert s.ref in arguments
                elif s.kind == "workspace":
                    assert s.ref in names
                elif s.kind == "dim":
                    assert s.ref in m.runtime_dims
                elif s.kind == "value":
                    assert s.value.names <= dims
        for w in m.workspaces:
            assert w.bytes.names <= set(m.runtime_dims)
        # Tensor-map templates: exactly the per-leaf maps the kernel configuration owns.
        uploads = [s for s in m.steps if isinstance(s, Upload) and s.templates]
        assert len(uploads) == len(program.launches)
        for x, up in zip(program.launches, uploads):
            want = [(s.operand, s.dtype, s.box_inner, s.box_rows) for s in map_specs(x.gemm)]
            assert [(t.operand, t.dtype, t.box_inner, t.box_rows) for t in up.templates] == want
            maps = m.workspace(up.address_of)
            if x.gemm.inline_table:  # each block's slots: A, B and a D per consumer warpgroup
                per_leaf = 2 + (x.gemm.consumer_warpgroups if x.gemm.store_tma else 0)
                whole = 2 if x.gemm.whole_maps else 0  # then its maps of A's and B's whole buffers
                slots = INLINE_MAX_BLOCKS * (per_leaf * x.leaf_count + whole)
                assert maps.bytes.evaluate({}) == slots * TENSOR_MAP_BYTES
            else:
                assert maps.bytes.evaluate({}) == len(want) * x.leaf_count * TENSOR_MAP_BYTES


def test_constants_agree_with_the_runtime():
    assert LEAF_BYTES == executor.GS_LEAF_BYTES
    assert TENSOR_MAP_BYTES == tensormap.TENSOR_MAP_BYTES
    for dtype, enum in tensormap._DATA_TYPE.items():
        assert TENSOR_MAP_DATA_TYPE[dtype] == enum.name


def _eval_text(text: str, env: dict[str, int]) -> int:
    """The manifest's documented formula syntax, read back with Python."""
    code = text.replace(" / ", " // ")
    assert re.fullmatch(r"[\w +*/()\-,]+", code)
    return eval(code, {"__builtins__": {}}, {"ceil_div": lambda a, b: -(-a // b), "max": max, **env})


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_formula_text_means_what_the_runtime_evaluates(path):
    rng = random.Random(0)
    for spec, _, program in programs(path):
        m = launch_manifest(spec, program)
        formulas = [w.bytes for w in m.workspaces]
        for s in m.steps:
            if isinstance(s, KernelLaunch):
                formulas += [*s.grid, *(p.source.value for p in s.params if p.source.kind == "value")]
            else:
                formulas += list(s.int32)
        for _ in range(5):
            env = {d: rng.choice([0, 1, 127, 128, 129, 4096, 70000]) for d in m.runtime_dims}
            env[NUM_SMS] = rng.choice([1, 2, 132])
            for f in formulas:
                assert _eval_text(str(f), env) == f.evaluate(env), str(f)


def test_formula_printing_keeps_precedence():
    t = Formula.var("T")
    f = (t - (t - 1)) * 2
    assert str(f) == "(T - (T - 1)) * 2" and f.evaluate({"T": 5}) == 2
    assert str((t + 1).ceil_div(128)) == "ceil_div(T + 1, 128)"
    assert str(Formula.const(3) * 4 + 0) == "12"


def _syntax_check(source: str) -> tuple[bool, str]:
    opts = ["-arch=sm_90a", "-std=c++17", "-fdevice-syntax-only", f"-I{include_dir()}"]
    opts += [f"-I{d}" for d in cuda_include_dirs()]
    err, prog = nvrtc.nvrtcCreateProgram(source.encode(), b"check.cu", 0, [], [])
    assert err == nvrtc.nvrtcResult.NVRTC_SUCCESS
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    return result == nvrtc.nvrtcResult.NVRTC_SUCCESS, log.decode(errors="replace")


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_declarations_match_the_kernel_definitions(path):
    """Each .cu followed by the header's declarations of its kernels: an extern "C"
    redeclaration with other parameter types does not compile."""
    for spec, schedule, program in programs(path):
        sf = spec_files(spec, schedule, program)
        header = sf.files[f"{sf.manifest.stem}.h"].decode()
        for file in sf.manifest.files["kernels"]:
            decls = [declaration(k) for k in sf.manifest.kernels if k.file == file]
            assert all(d in header for d in decls)
            ok, log = _syntax_check(sf.files[file].decode() + "\n" + "\n".join(decls) + "\n")
            assert ok, f"{file}: {log}"


def test_a_wrong_declaration_is_caught():
    (spec, schedule, program), *_ = programs(ROOT / "examples" / "split_nest.gspec")
    sf = spec_files(spec, schedule, program)
    table = next(k for k in sf.manifest.kernels if k.role == "leaf_table")
    wrong = declaration(table).replace("long long dim_T", "int dim_T")
    ok, log = _syntax_check(sf.files[table.file].decode() + "\n" + wrong + "\n")
    assert not ok and table.symbol in log


def test_header_and_launcher_are_the_manifest_laid_out(planned):
    for sf in planned:
        m = sf.manifest
        header = sf.files[f"{m.stem}.h"].decode()
        host = sf.files[f"{m.stem}_host.cu"].decode()
        assert f"cudaError_t {m.prefix}_run(const {m.prefix}_args* args" in header
        assert re.search(rf"size_t {m.prefix}_workspace_bytes\(", header)
        for a in m.arguments:
            assert f"  {a.ctype} {a.name};" in header
        # Every kernel is launched once, in manifest order (the decode variant's steps
        # first, in their branch, where there is one): GEMM kernels as programmatic
        # dependents of their builders (cudaLaunchKernelEx), the others (GEMM kernels that
        # build their tables too) with <<<>>>.
        found = re.findall(r"^\s+(gs_\w+)<<<|cudaLaunchKernelEx\(&config, (gs_\w+),", host, re.MULTILINE)
        launched = [a or b for a, b in found if (a or b) != "gs_upload_kernel"]
        kernels = [*(m.decode.kernels if m.decode else ()), *m.kernels]
        assert launched == [k.symbol for k in kernels]
        ex = [b for _, b in found if b]
        after_builder = [
            k.symbol for i, k in enumerate(kernels)
            if i > 0 and kernels[i - 1].role == "leaf_table" and kernels[i - 1].owner == k.owner
        ]
        assert ex == [k.symbol for k in kernels if k.programmatic] == after_builder
        assert host.count("cudaLaunchAttributeProgrammaticStreamSerialization") == len(ex)
        assert ("#define GEMMSPEC_PDL 1" in host) == bool(ex)
        assert "cuTensorMapEncodeTiled" in host and "cudaStreamSynchronize" not in host
        assert "cudaDeviceSynchronize" not in host and "cudaMemcpy" not in host


def test_compile_list_names_what_compile_writes(tmp_path, capsys):
    example = str(ROOT / "examples" / "linear_fp8_training.gspec")
    out = tmp_path / "out"
    assert main(["compile", example, "-o", str(out), "--list"]) == 0
    listed = capsys.readouterr().out.split()
    assert not out.exists()
    assert main(["compile", example, "-o", str(out)]) == 0
    written = capsys.readouterr().out.split()
    assert listed == written
    assert sorted(p.name for p in out.iterdir()) == sorted(Path(p).name for p in listed)
    assert listed.count(str(out / SHARED_HEADER)) == 1
