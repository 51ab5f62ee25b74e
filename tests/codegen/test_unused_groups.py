"""Groups whose offsets nothing reads: still arguments of the call, but no kernel takes
them and the device check skips them. A thousand of them once made launch 0's builder a
kernel of two thousand pointer parameters (an 843 KB .cu) that NVRTC never finished."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.codegen.validate import validation_kernel
from gemmspec.pipeline import lower_file
from gemmspec.runtime.executor import Executable

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import compile_cubin  # noqa: E402


def spec_text(unused: int, statements: int = 2) -> str:
    """`statements` statements over one ragged group, beside `unused` ragged groups that
    nothing reads (two statements: two launches, so a builder runs the check)."""
    lines = ["gemm spare_groups {", "  dim T", "  dim N = 64, K = 64"]
    lines.append("  group expert[E = 40] = ragged(T, offsets = expert_offsets)")
    lines += [f"  group spare{i}[S{i} = 2] = ragged(T, offsets = spare{i}_offsets)" for i in range(unused)]
    lines.append("  tensor x : bf16 [T, K]")
    for j in range(statements):
        lines += [f"  tensor w{j} : bf16 [E, N, K]", f"  tensor y{j} : bf16 [T, N]"]
    lines += [f"  y{j}[t, n] = sum[k] x[t, k] * w{j}[expert(t), n, k]" for j in range(statements)]
    return "\n".join([*lines, "}"]) + "\n"


def lowered(unused: int):
    (x,) = lower_file(spec_text(unused))
    return x


def test_only_the_read_group_is_checked_and_passed() -> None:
    x = lowered(1000)
    assert [g.name for g in x.spec.read_groups] == ["expert"]
    v = validation_kernel(x.spec)
    assert v is not None and v.tensors == ("expert_offsets",)
    program = emit(x.spec, x.schedule)
    without = lowered(0)
    # The kernels are those of the same spec without the spare groups, byte for byte.
    assert program.sources() == emit(without.spec, without.schedule).sources()
    launch0 = program.sources()["spare_groups_launch0.cu"]
    assert len(launch0) < 200_000 and "spare0_offsets" not in launch0
    manifest = launch_manifest(x.spec, program)
    passed = {p.source.ref for kernel in manifest.kernels for p in kernel.params}
    assert "expert_offsets" in passed and not any(ref.startswith("spare") for ref in passed)
    assert not any(w.name.startswith("check.spare") for w in manifest.workspaces)
    # Every spare offsets tensor is still an argument of the call.
    names = Executable(x.spec, x.schedule, program).argument_names()
    assert sum(n.startswith("spare") for n in names) == 1000


def test_a_group_read_only_through_a_nested_one_is_checked() -> None:
    text = spec_text(0).replace(
        "  group expert[E = 40] = ragged(T, offsets = expert_offsets)",
        "  group outer[L = 2] = ragged(T, offsets = outer_offsets)\n"
        "  group expert[E = 20] = ragged(T within outer, offsets = expert_offsets)",
    )
    (x,) = lower_file(text)
    assert [g.name for g in x.spec.read_groups] == ["outer", "expert"]


def test_the_builder_compiles(tmp_path: Path) -> None:
    program = emit(*(lambda x: (x.spec, x.schedule))(lowered(1000)))
    source = program.sources()["spare_groups_launch0.cu"]
    kernels = re.findall(r"__global__[^{]*\(([^)]*)\)", source)
    assert kernels and all(params.count(",") < 100 for params in kernels)
    cubin, _ = compile_cubin(source, [str(include_dir())], name="spare_groups_launch0.cu")
    assert cubin
