"""Emitted code for padded segment_major layouts (CPU only).

The GEMM kernel of a padded launch is the unpadded one (only its leaf-table builder
changes); builders and the padded requantize pass compile for sm_90a without spills;
and the builder's per-leaf arithmetic, compiled for the host, gives exactly the fields
the reference executor computes from the schedule, and keeps every leaf's block inside
the storage when the offsets are malformed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gemmspec.codegen.emit import _extent_lines, _mixed_radix, _prefix_lines, c_expr, emit
from gemmspec.codegen.kernels import RequantKernelConfig, include_dir, render_requant
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import Runtime, random_runtime
from gemmspec.reference.schedule_exec import leaf_symbols

WGRAD = """
gemm wgrad {
  dim T
  dim N = 4096, K = 7168
  group expert[E = %(e)d] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] layout segment_major(expert)%(pad)s scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert)%(pad)s scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
"""

NESTED = """
gemm nested_pad {
  dim T
  dim K = 576, R = 64
  group lora[L = 4]   = ragged(T, offsets = lora_offsets)
  group expert[E = 8] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R] layout segment_major(expert) pad 4
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""

SPLIT = """
gemm split_pad {
  dim N = 256, K = 192, T = 3000
  group part[P = 3] = split(T, sizes = [17, 0, 2983])
  tensor dy : bf16 [T, N] layout segment_major(part) pad 8
  tensor x  : bf16 [T, K] layout segment_major(part) pad 32
  tensor dw : f32 [P, N, K]
  dw[p, n, k] = sum[t in part(p)] dy[t, n] * x[t, k]
}
"""

SPECS = {
    "wgrad_e8": WGRAD % {"e": 8, "pad": " pad 16"},
    "wgrad_e256": WGRAD % {"e": 256, "pad": " pad 16"},
    "nested": NESTED,
    "split": SPLIT,
}


def launch_of(text: str):
    (low,) = lower_file(text)
    prog = emit(low.spec, low.schedule)
    return low.spec, prog


def test_padding_changes_only_the_leaf_table():
    for e in (8, 256):
        _, padded = launch_of(WGRAD % {"e": e, "pad": " pad 16"})
        _, plain = launch_of(WGRAD % {"e": e, "pad": ""})
        (a,), (b,) = padded.launches, plain.launches
        assert a.gemm == b.gemm
        cut = "// Leaf table builder"
        assert a.source.split(cut)[0] == b.source.split(cut)[0]
        assert "pstart16_k" in a.source and "pstart16_k" not in b.source
        # One scan of the offsets serves the anchored scale blocks and the padded rows.
        assert a.source.count("for (long long j = 0;") == b.source.count("for (long long j = 0;") == 1


def test_requant_with_pad_is_a_kernel_of_its_own():
    plain = render_requant(RequantKernelConfig())
    assert render_requant(RequantKernelConfig(pad=1)) == plain and "PAD" not in plain
    padded = render_requant(RequantKernelConfig(pad=16))
    assert "constexpr int PAD = 16;" in padded and "seg_pitch" in padded
    assert RequantKernelConfig(pad=16).name == RequantKernelConfig().name + "_p16"
    with pytest.raises(ValueError):
        RequantKernelConfig(pad=12)


# ---- NVRTC ---------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))



@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(SPECS))
def test_padded_launch_compiles_without_spills(key):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    _, prog = launch_of(SPECS[key])
    for launch in prog.launches:
        cubin, log = compile_cubin(launch.source, [include_dir()], name=f"{launch.gemm.name}.cu")
        assert "warning" not in log, log
        sass = disassemble(cubin)
        assert_spill_free(log, sass)
        assert all(k in sass for k in launch.kernels) and re.search(r"\bUTMALDG\.2D\b", sass)


def test_padded_requant_compiles_without_spills():
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    for cfg in (RequantKernelConfig(pad=16), RequantKernelConfig(in_type="e5m2", out_type="e4m3", pad=32)):
        cubin, log = compile_cubin(render_requant(cfg), [include_dir()], name=f"{cfg.name}.cu")
        assert "warning" not in log, log
        sass = disassemble(cubin)
        assert_spill_free(log, sass)
        assert cfg.name in sass


# ---- the builder's arithmetic, on the host ----------------------------------------------------

FIELDS = ("a_off", "a_sm", "a_sk", "b_off", "b_sn", "b_sk", "d_off", "d_sm", "d_sn")


def host_fields(spec, launch, rt: Runtime) -> list[dict[str, int]]:
    """Compile the builder's per-leaf lines (the extents, the prefix scans) into a host
    program with g++ and return each leaf's operand fields."""
    pg = launch.problems
    counts = {ax.name: ax.count for ax in pg.leaf_axes}
    body = [ln for ext in pg.extents for ln in _extent_lines(spec, ext, counts)]
    body += _prefix_lines(spec, pg, counts)
    exprs = [pg.a.offset, *pg.a.strides, pg.b.offset, *pg.b.strides, pg.d.offset, *pg.d.strides]
    lines = ["#include <cstdio>", "int main() {"]
    for name in pg.runtime_tensors:
        values = ", ".join(str(int(v)) for v in np.asarray(rt.tensors[name]).ravel())
        lines.append(f"  const int p_{name}[] = {{{values}}};")
    for d in pg.runtime_dims:
        lines.append(f"  const long long dim_{d} = {int(rt.dims[d])}LL;")
    lines.append(f"  for (long long leaf = 0; leaf < {pg.leaf_count}; ++leaf) {{")
    for ax in _mixed_radix(pg):
        lines.append(f"    const long long {ax['var']} = (leaf / {ax['stride']}) % {ax['count']};")
    for ax, i in pg.fixed_axes:
        lines.append(f"    const long long g_{ax} = {i};")
    lines += [f"    {ln}" for ln in body]
    fmt = " ".join(["%lld"] * len(exprs))
    args = ", ".join(f"(long long){c_expr(p)}" for p in exprs)
    lines += [f'    printf("{fmt} %lld\\n", {args}, (long long)len_k);', "  }", "}"]
    return lines


def run_host(lines: list[str], tmp_path: Path) -> list[list[int]]:
    src = tmp_path / "builder.cpp"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "builder"
    subprocess.run(["g++", "-std=c++17", "-O1", str(src), "-o", str(exe)], check=True, capture_output=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    return [[int(v) for v in row.split()] for row in out.splitlines()]


needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not installed")

CASES = {
    "wgrad": (WGRAD % {"e": 8, "pad": " pad 16"}, {"expert": [0, 1, 15, 16, 17, 127, 129, 1000]}),
    "nested": (NESTED, {"lora": [16, 160, 1, 300], "expert": None}),
    "split": (SPLIT, {}),
}


@needs_gxx
@pytest.mark.parametrize("key", sorted(CASES))
def test_builder_fields_match_the_schedule(key, tmp_path):
    text, lengths = CASES[key]
    spec, prog = launch_of(text)
    lengths = {k: v for k, v in lengths.items() if v is not None}
    rt = random_runtime(spec, np.random.default_rng(7), lengths=lengths)
    for x in prog.launches:
        pg = x.launch.problems
        rows = run_host(host_fields(spec, x.launch, rt), tmp_path)
        assert len(rows) == pg.leaf_count
        exprs = [pg.a.offset, *pg.a.strides, pg.b.offset, *pg.b.strides, pg.d.offset, *pg.d.strides]
        for leaf, row in enumerate(rows):
            env = leaf_symbols(spec, rt, pg, leaf)
            assert row[:-1] == [p.evaluate(env) for p in exprs], (leaf, dict(zip(FIELDS, row)))


@needs_gxx
def test_builder_keeps_blocks_inside_the_storage_for_malformed_offsets(tmp_path):
    """The host launcher hands the builder offsets unchecked: segments that overlap or run
    backwards must still leave every leaf's padded block inside T + 120 rows."""
    spec, prog = launch_of(WGRAD % {"e": 8, "pad": " pad 16"})
    (x,) = prog.launches
    t, n, k_dim = 100, 4096, 7168
    for bad in ([0, 100, 0, 100, 0, 100, 0, 100, 100], [0, 90, 3, 99, 1, 100, 7, 100, 100], [50] * 9):
        rt = Runtime({"T": t}, {"offs": np.array(bad, np.int32)})
        for a_off, a_sm, _, b_off, b_sn, _, _, _, _, k in run_host(host_fields(spec, x.launch, rt), tmp_path):
            if k == 0:
                continue
            assert 0 <= a_off and a_off + (n - 1) * a_sm + k <= (t + 120) * n
            assert 0 <= b_off and b_off + (k_dim - 1) * b_sn + k <= (t + 120) * k_dim
