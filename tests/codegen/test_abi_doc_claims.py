"""docs/kernel-abi.md and the C++ section of docs/usage.md say what `gemmspec compile`
writes: the records the kernels read, the manifest's fields, the header, the host
launcher's checks and build. Each test reads the emitted files (or builds a small
driver with nvcc) and fails when one of those claims no longer holds. CPU only.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gemmspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
ABI = ROOT / "docs" / "kernel-abi.md"
USAGE = ROOT / "docs" / "usage.md"
SCHEMA = ROOT / "gemmspec" / "codegen" / "manifest.schema.json"
NVCC = shutil.which("nvcc")
CMAKE = shutil.which("cmake")
ARCH = "-gencode=arch=compute_90a,code=sm_90a"

# Examples that between them have every record, check placement and run-time choice the
# docs describe: a GEMM that builds its table, builders with the check, split K after a
# builder, pre- and row passes, SwiGLU over halves, FP8 outputs and copies, scatters,
# counts, anchored scales.
SPECS = (
    "moe_fp8_forward",
    "lora_qkv_one_spec",
    "linear_fp8_training",
    "moe_ffn_fp8_decode",
    "moe_ffn_fp8_train",
    "moe_swiglu_fp8_separate",
    "moe_masked_decode",
    "moe_fp8_wgrad",
    "lora_moe_scaled",
)


@pytest.fixture(scope="module")
def gen(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gen")
    for name in SPECS:
        assert main(["compile", str(ROOT / "examples" / f"{name}.gspec"), "-o", str(out)]) == 0
    return out


def manifest(gen: Path, name: str) -> dict:
    return json.loads((gen / f"{name}.manifest.json").read_text())


def programs(m: dict) -> list[tuple[list[dict], list[dict]]]:
    """(steps, workspaces) of the program as compiled and of its decode variant."""
    out = [(m["steps"], m["workspaces"])]
    if "run_time_choice" in m:
        out.append((m["run_time_choice"]["steps"], m["run_time_choice"]["workspaces"]))
    return out


def kernels(steps: list[dict]) -> list[dict]:
    return [s for s in steps if s["kind"] == "kernel"]


def evaluate(formula: str, env: dict[str, int]) -> int:
    """A manifest formula (integers, dims, + - * /, ceil_div, max) in Python integers."""
    names = {"ceil_div": lambda a, b: -(-a // b), "max": max, **env}
    return eval(formula.replace("/", "//"), {"__builtins__": {}}, names)  # the manifest's own formulas


def struct_fields(text: str, name: str) -> list[tuple[str, str]]:
    """(type, field) of each member of `struct NAME { ... };` in C++ text, comments dropped."""
    m = re.search(rf"struct(?: __align__\(\d+\))? {name} \{{(.*?)\n\}};", text, re.S)
    assert m, f"no struct {name}"
    body = re.sub(r"//[^\n]*", "", m.group(1))
    fields = []
    for decl in (d.strip() for d in body.split(";")):
        if not decl:
            continue
        first, *rest = (p.strip() for p in decl.split(","))
        words = first.split()
        ctype = " ".join(words[:-1])
        fields += [(ctype, words[-1])] + [(ctype, r) for r in rest]
    return fields


def test_records_are_the_documented_layouts(gen):
    """GsLeaf and GsEpilogue in gemmspec_ptx.cuh, GsGather, GsDScale and GsCopy in the
    kernels that use them: the members, types and sizes kernel-abi.md prints."""
    doc = ABI.read_text()
    ptx = (gen / "gemmspec_ptx.cuh").read_text()
    train0 = (gen / "moe_ffn_fp8_train_launch0.cu").read_text()  # FP8 output and its copy
    train1 = (gen / "moe_ffn_fp8_train_launch1.cu").read_text()  # scattered output
    for name, text, size in (
        ("GsLeaf", ptx, 144),
        ("GsEpilogue", ptx, 48),
        ("GsGather", train1, 32),
        ("GsDScale", train0, 32),
        ("GsCopy", train0, 32),
    ):
        assert struct_fields(doc, name) == struct_fields(text, name), name
        assert re.search(rf"// {size} bytes", doc[doc.index(f"struct {name} {{") :][:200]), name
        assert f"sizeof({name}) == {size}" in text, name
    assert "enum GsLoad : int { GS_LOAD_A_TMA = 1, GS_LOAD_B_TMA = 2, GS_STORE_D_TMA = 4, GS_LOAD_WHOLE = 8 };" in ptx
    assert "GS_LOAD_A_TMA (1) | GS_LOAD_B_TMA (2) | GS_STORE_D_TMA (4)" in doc and "GS_LOAD_WHOLE (8)" in doc
    assert "struct __align__(64) GsTensorMap {" in ptx and "sizeof(GsTensorMap) == 128" in ptx
    for wrapper in ("gs_grid_dependency_wait", "gs_launch_dependents"):
        assert f"void {wrapper}()" in ptx


def test_leaves_workspace_holds_the_documented_records(gen):
    """`launch<i>.leaves` is (num_leaves + 1) * 144 bytes, plus 48 per leaf with an
    epilogue, 32 per leaf for gathered or scattered rows, an FP8 output's scales and a copy."""
    seen = set()
    for name in SPECS:
        m = manifest(gen, name)
        for steps, workspaces in programs(m):
            sizes = {w["name"]: w["bytes"] for w in workspaces}
            ks = kernels(steps)
            for builder, gemm in zip(ks, ks[1:]):
                if builder["role"] != "leaf_table":
                    continue
                assert gemm["role"] == "gemm" and gemm["owner"] == builder["owner"]
                leaves = next(p for p in builder["params"] if p["name"] == "leaves")["ref"]
                n = int(next(p for p in gemm["params"] if p["name"] == "num_leaves")["ref"])
                names = [p["name"] for p in builder["params"]]
                records = {
                    "epilogue": "ALPHA" in names,
                    "gather": bool(re.search(r"_(gather|scatter)", gemm["symbol"])),
                    "dscale": "SD" in names,
                    "copy": "_copy128x1" in gemm["symbol"],
                }
                seen |= {k for k, v in records.items() if v}
                want = (n + 1) * 144 + n * (48 * records["epilogue"] + 32 * records["gather"]
                                            + 32 * records["dscale"] + 32 * records["copy"])
                assert int(sizes[leaves]) == want, (name, leaves, records)
                if records["copy"]:  # the builder takes the copy and its scale after SD
                    assert names[-3:] == ["SD", "C", "SC"]
                elif records["dscale"]:
                    assert names[-1] == "SD"
                if records["epilogue"]:
                    assert names[-3:] == ["ALPHA", "ROW", "BIAS"]
    assert seen == {"epilogue", "gather", "dscale", "copy"}


def test_kernel_parameters_follow_the_documented_signatures(gen):
    """The GEMM after a builder takes (leaves, maps, num_leaves, A, B, D, SA, SB), then U
    and SU for SwiGLU halves, then split K's two; a GEMM that builds its table (maps,
    templates, A, B, D, SA, SB, the check's parameters or the checked offsets, dims, ...);
    builders (leaves, maps, templates, A, B, D[, U], ...); SA and SB null when unscaled."""
    for name in SPECS:
        for steps, _ in programs(manifest(gen, name)):
            for k in kernels(steps):
                names = [p["name"] for p in k["params"]]
                kinds = {p["name"]: p["kind"] for p in k["params"]}
                if k["role"] == "leaf_table":
                    head = ["leaves", "maps", "templates", "A", "B", "D"]
                    assert names[:6] == head
                    if "_halves" in k["symbol"] or names[6:7] == ["U"]:
                        assert names[6] == "U"
                elif k["role"] == "gemm" and "_inl" in k["symbol"]:
                    assert names[:7] == ["maps", "templates", "A", "B", "D", "SA", "SB"]
                    assert names[7] in ("check_flags", "p_lora_offsets", "p_expert_offsets")
                elif k["role"] == "gemm":
                    assert names[:8] == ["leaves", "maps", "num_leaves", "A", "B", "D", "SA", "SB"]
                    rest = names[8:]
                    if "_swiglu_halves" in k["symbol"]:
                        assert rest[:2] == ["U", "SU"]
                        rest = rest[2:]
                    assert rest in ([], ["split_counters", "split_sums"])
                if k["role"] == "gemm":
                    assert ("_splitk" in k["symbol"]) == (names[-2:] == ["split_counters", "split_sums"])
                    unscaled = "_noscale_" in k["symbol"]
                    assert (kinds["SA"] == kinds["SB"] == "null") == unscaled


def test_manifest_step_fields_mean_what_the_table_says(gen):
    doc = ABI.read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `role` | `check`"))
    schema = json.loads(SCHEMA.read_text())
    assert set(re.findall(r"`(\w+)`", row)) - {"role"} == set(schema["$defs"]["kernel"]["properties"]["role"]["enum"])
    operands = set(schema["$defs"]["templates"]["properties"]["maps"]["items"]["properties"]["operand"]["enum"])
    assert "each map with `operand` (`a`, `b`, `d` or `u`)" in doc.replace("\n", " ")
    assert operands == {"a", "b", "d", "u"}
    for name in SPECS:
        for steps, _ in programs(manifest(gen, name)):
            assert {s["kind"] for s in steps} <= {"upload", "kernel"}
            previous_kernel = None
            for s in steps:
                if s["kind"] == "upload":
                    for t in s["contents"].get("maps", []):
                        assert t["operand"] in operands
                    continue
                assert s["set_max_dynamic_smem"] == (s["dynamic_smem_bytes"] > 48 * 1024)
                # Clusters of two exactly where the name has c2_ or c2b_ after the stage count.
                pair = bool(re.search(r"_w\d+s\d+(o2)?c2b?_", s["symbol"]))
                assert s["cluster"] == ([2, 1, 1] if pair else [1, 1, 1])
                after_builder = previous_kernel is not None and previous_kernel["role"] == "leaf_table"
                assert s["programmatic_serialization"] == (s["role"] == "gemm" and after_builder)
                assert s["symbol"].startswith(f"gs_{name}_")
                previous_kernel = s


def test_workspaces_and_the_check(gen):
    """The flags come first in both programs; the variant lists the compiled program's
    workspaces it uses, in the same order; `offsets_check.symbol` is the top-level
    program's checking kernel, and the variant checks into the same flags."""
    for name in SPECS:
        m = manifest(gen, name)
        assert m["workspace_align"] == 256
        check = m.get("offsets_check")
        compiled = [w["name"] for w in m["workspaces"]]
        for steps, workspaces in programs(m):
            names = [w["name"] for w in workspaces]
            it = iter(compiled)
            assert all(n in it for n in names), (name, names)  # a subsequence
            if check is None:
                continue
            assert names[0] == "check.flags"
            checking = [k for k in kernels(steps) if {"flags", "check_flags"} & {p["name"] for p in k["params"]}]
            assert len(checking) == 1 and checking[0]["owner"] in ("check", "launch 0")
            flags = next(p for p in checking[0]["params"] if p["name"] in ("flags", "check_flags"))
            assert flags["kind"] == "workspace" and flags["ref"] == "check.flags"
            if steps is m["steps"]:
                assert checking[0]["symbol"] == check["symbol"]
            flag_bytes = next(w["bytes"] for w in workspaces if w["name"] == "check.flags")
            assert int(flag_bytes) == 4 * len(check["checks"])
        rc = m.get("run_time_choice")
        if rc is not None:
            assert rc["max_rows"] == rc["rows_per_segment"] * rc["segments"]
            assert set(rc["files"]) <= set(m["files"]["kernels"])
    lean = manifest(gen, "moe_fp8_forward")["run_time_choice"]
    assert "launch0.split_sums" not in [w["name"] for w in lean["workspaces"]]


def test_header_and_launcher_carry_the_manifest(gen):
    """The header's decode bound and flag count, the launcher's rule, workspace order
    and alignment, and how it launches programmatic and ordinary steps."""
    for name in SPECS:
        m = manifest(gen, name)
        header = (gen / f"{name}.h").read_text()
        host = (gen / f"{name}_host.cu").read_text()
        fields = re.search(r"typedef struct \w+ \{(.*?)\n\}", header, re.S).group(1)
        order = re.findall(r"(\w+);", fields)
        assert order == [a["name"] for a in m["arguments"]] + m["runtime_dims"]
        rc = m.get("run_time_choice")
        bound = re.search(rf"gemmspec_{name}_decode_max_rows = (\d+)", header)
        if rc is None:
            assert bound is None and "const bool decode" not in host
        else:
            assert int(bound.group(1)) == rc["max_rows"]
            assert f"const bool decode = d_{rc['dim']} <= {rc['max_rows']}LL;" in host
        check = m.get("offsets_check")
        count = re.search(rf"gemmspec_{name}_check_flags = (\d+)", header)
        if check is None:
            assert count is None
        else:
            assert int(count.group(1)) == len(check["checks"])
            listed = re.findall(r"^//   \[(\d+)\] (.*)$", header, re.M)
            assert [c["message"] for c in check["checks"]] == [msg for _, msg in listed]
        layout = host[host.index("inline long long gs_layout(") :]
        layout = layout[: layout.index("return total;")]
        assert re.findall(r"off\[\d+\] = total;  // (\S+)", layout) == [w["name"] for w in m["workspaces"]]
        assert "(bytes + 255LL) / 256LL * 256LL" in host
        assert "% 256 != 0) return cudaErrorInvalidValue;" in host
        # Programmatic GEMMs: cudaLaunchKernelEx, the attribute dropped under
        # -DGEMMSPEC_PDL=0 (still cudaLaunchKernelEx); every other kernel by <<<>>>.
        for steps, _ in programs(m):
            for k in kernels(steps):
                if k["programmatic_serialization"]:
                    assert f"cudaLaunchKernelEx(&config, {k['symbol']}," in host
                else:
                    assert f"{k['symbol']}<<<grid, {k['block'][0]}, {k['dynamic_smem_bytes']}, stream>>>(" in host
        if any(k["programmatic_serialization"] for steps, _ in programs(m) for k in kernels(steps)):
            assert "config.numAttrs = GEMMSPEC_PDL ? 1 : 0;" in host
            assert "#ifndef GEMMSPEC_PDL\n#define GEMMSPEC_PDL 1\n#endif" in host
        # The driver entry point, looked up through the runtime (no libcuda).
        assert 'cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled"' in host
        assert 'cudaGetDriverEntryPoint("cuTensorMapEncodeTiled"' in host
        assert "-lcuda" not in host


def test_the_usage_header_quote_names_real_symbols(gen):
    """The declarations docs/usage.md quotes are the ones the header has, and the
    launcher's documented refusals are all in its first lines, before any CUDA call."""
    host = (gen / "moe_fp8_forward_host.cu").read_text()
    run = host[host.index("extern \"C\" cudaError_t gemmspec_moe_fp8_forward_run(") :]
    before_cuda = run[: run.index("cudaGetDevice(")]
    for refusal in (
        "if (args == nullptr) return cudaErrorInvalidValue;",
        "if (d_T < 0 || d_T > 2147483647LL) return cudaErrorInvalidValue;",
        "if (total > 0 && workspace == nullptr) return cudaErrorInvalidValue;",
        "if (reinterpret_cast<uintptr_t>(workspace) % 256 != 0) return cudaErrorInvalidValue;",
    ):
        assert refusal in before_cuda
    assert "cudaStreamSynchronize" not in host and "cudaDeviceSynchronize" not in host
    assert "cudaMalloc" not in host and "cudaMemcpy(" not in host


def test_a_programmatic_gemm_follows_its_builder_directly(gen):
    """kernel-abi.md: the GEMM is launched right after its builder, as its programmatic
    dependent. No stream operation may come between the two launches."""
    for name in ("linear_fp8_training", "lora_qkv_one_spec"):
        host = (gen / f"{name}_host.cu").read_text()
        for m in re.finditer(r"_leaves(?:_decode)?<<<grid", host):
            between = host[m.end() : host.index("cudaLaunchKernelEx(&config", m.end())]
            assert "cudaMemsetAsync" not in between and "gs_upload" not in between, name


def test_the_header_names_every_refusal_of_run(gen):
    header = " ".join((gen / "moe_fp8_forward.h").read_text().replace("//", " ").split())
    comment = header[header.index("Launches every kernel of the spec") : header.index("cudaError_t gemmspec_")]
    assert "null" in comment and "2^31" in comment


def test_headers_compile_alone_in_cpp_units(gen, tmp_path):
    """`<spec>.h` declares the API for any C++ translation unit: alone, twice, and with
    another spec's header."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    units = {f"only_{name}.cpp": f'#include "{name}.h"\n#include "{name}.h"\n' for name in SPECS}
    units["two.cpp"] = '#include "moe_fp8_forward.h"\n#include "lora_qkv_one_spec.h"\nint main() { return 0; }\n'
    for unit, text in units.items():
        (tmp_path / unit).write_text(text)

    def build(unit: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [NVCC, "-std=c++17", "-Xcompiler", "-Wall,-Wextra,-Werror", f"-I{gen}", "-c", unit, "-o", f"{unit}.o"],
            cwd=tmp_path, capture_output=True, text=True,
        )

    with ThreadPoolExecutor(max_workers=4) as pool:
        for unit, done in zip(units, pool.map(build, units)):
            assert done.returncode == 0, f"{unit}\n{done.stderr}"


REFUSALS = """\
// Calls the host launcher where it must refuse before any CUDA call (no GPU needed).
#include <cstdint>
#include <cstdio>

#include "lora_qkv_one_spec.h"

int main() {
  gemmspec_lora_qkv_one_spec_args args = {};
  alignas(256) static unsigned char aligned[512];
  auto run = [&](const gemmspec_lora_qkv_one_spec_args* a, void* ws) {
    return static_cast<int>(gemmspec_lora_qkv_one_spec_run(a, ws, nullptr));
  };
  std::printf("invalid %d\\n", static_cast<int>(cudaErrorInvalidValue));
  std::printf("null_args %d\\n", run(nullptr, aligned));
  args.T = -1;
  std::printf("negative_dim %d\\n", run(&args, aligned));
  args.T = 2147483648LL;
  std::printf("dim_over_int32 %d\\n", run(&args, aligned));
  args.T = 1000;
  std::printf("null_workspace %d\\n", run(&args, nullptr));
  std::printf("misaligned_workspace %d\\n", run(&args, aligned + 16));
  args.T = 0;
  std::printf("empty_null_workspace %d\\n", run(&args, nullptr));
  for (long long t : {-1LL, 0LL, 1LL, 128LL, 129LL, 1000LL, 2147483647LL})
    std::printf("bytes %lld %zu\\n", t, gemmspec_lora_qkv_one_spec_workspace_bytes(t));
  return 0;
}
"""


def _stubs(m: dict) -> str:
    """Empty definitions of every kernel the launcher names (both programs), so it links
    without compiling the kernels."""
    seen, lines = set(), [f'#include "{m["files"]["header"]}"']
    for steps, _ in programs(m):
        for k in kernels(steps):
            if k["symbol"] not in seen:
                seen.add(k["symbol"])
                params = ", ".join(f"{p['ctype']} {p['name']}" for p in k["params"])
                lines.append(f'extern "C" __global__ void {k["symbol"]}({params}) {{}}')
    return "\n".join(lines) + "\n"


def test_the_launcher_refuses_what_usage_md_lists(gen, tmp_path):
    """Built with nvcc against stub kernels and run without a GPU: a null `args`, a
    negative dim or one above 2^31 - 1, a missing workspace (also for an empty call) and
    a workspace not 256-byte aligned are cudaErrorInvalidValue; workspace_bytes is 0 for
    a negative dim and otherwise the larger of the two programs' layouts."""
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    name = "lora_qkv_one_spec"
    m = manifest(gen, name)
    (tmp_path / "stubs.cu").write_text(_stubs(m))
    (tmp_path / "driver.cpp").write_text(REFUSALS)
    host = str(gen / f"{name}_host.cu")
    jobs = [
        [ARCH, "-std=c++17", f"-I{gen}", "-c", "stubs.cu", "-o", "stubs.o"],
        [ARCH, "-std=c++17", f"-I{gen}", "-c", host, "-o", "host.o"],
        [ARCH, "-std=c++17", "-DGEMMSPEC_PDL=0", f"-I{gen}", "-c", host, "-o", "host_nopdl.o"],
        ["-std=c++17", f"-I{gen}", "-c", "driver.cpp", "-o", "driver.o"],
    ]

    def nvcc(args: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run([NVCC, *args], cwd=tmp_path, capture_output=True, text=True)

    with ThreadPoolExecutor(max_workers=4) as pool:
        for job, done in zip(jobs, pool.map(nvcc, jobs)):
            assert done.returncode == 0, f"{job}\n{done.stderr}"
    done = nvcc([ARCH, "stubs.o", "host.o", "driver.o", "-o", "refusals"])
    assert done.returncode == 0, done.stderr
    ran = subprocess.run([str(tmp_path / "refusals")], capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    lines = [line.split() for line in ran.stdout.splitlines()]
    codes = {w[0]: int(w[1]) for w in lines if w[0] != "bytes"}
    invalid = codes.pop("invalid")
    assert codes == dict.fromkeys(
        ("null_args", "negative_dim", "dim_over_int32", "null_workspace", "misaligned_workspace", "empty_null_workspace"),
        invalid,
    )
    rc = m["run_time_choice"]
    for _, t, got in (w for w in lines if w[0] == "bytes"):
        t = int(t)
        if t < 0:
            assert int(got) == 0
            continue
        layouts = [m["workspaces"], rc["workspaces"]]
        want = max(sum(-(-max(evaluate(w["bytes"], {"T": t}), 0) // 256) * 256 for w in ws) for ws in layouts)
        assert int(got) == want, t


@pytest.mark.slow
@pytest.mark.skipif(CMAKE is None or NVCC is None, reason="cmake or nvcc is not on PATH")
def test_the_cmake_snippet_builds_a_program(tmp_path):
    """docs/usage.md's CMake lines, in a project with a main.cpp, configure, build the
    folder `compile` wrote into a library and link the program (which needs no GPU)."""
    block = re.search(r"```cmake\n(.*?)```", USAGE.read_text(), re.S).group(1)
    lines = block.splitlines()
    last = next(i for i, line in enumerate(lines) if "my_app" in line)
    body = "\n".join([*lines[:last], "add_executable(my_app main.cpp)", *lines[last:]])
    (tmp_path / "CMakeLists.txt").write_text(f"cmake_minimum_required(VERSION 3.24)\nproject(app LANGUAGES CXX)\n{body}\n")
    (tmp_path / "main.cpp").write_text(
        '#include "moe_bf16_forward.h"\n'
        "int main() { return gemmspec_moe_bf16_forward_run(nullptr, nullptr, nullptr) == cudaErrorInvalidValue ? 0 : 1; }\n"
    )
    assert main(["compile", str(ROOT / "examples" / "moe_bf16_forward.gspec"), "-o", str(tmp_path / "gen")]) == 0
    for args in (["-S", ".", "-B", "build", f"-DCMAKE_CUDA_COMPILER={NVCC}"], ["--build", "build", "-j", "4"]):
        done = subprocess.run([CMAKE, *args], cwd=tmp_path, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    assert subprocess.run([str(tmp_path / "build" / "my_app")]).returncode == 0
