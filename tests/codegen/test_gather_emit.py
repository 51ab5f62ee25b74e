"""Launches that gather A's rows or scatter D's through index tensors: the kernel
configuration they get, the leaf-table records they own, and NVRTC compiling them for
sm_90a without spills (CPU only), beside kernels without index tensors that render as
before."""

from __future__ import annotations

import dataclasses
import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import (
    EPILOGUE_RECORD_BYTES,
    GATHER_RECORD_BYTES,
    emit,
    with_kernel_config,
)
from gemmspec.codegen.kernels import GemmKernelConfig, include_dir, map_specs, render_gemm
from gemmspec.codegen.manifest import EPILOGUE_BYTES, GATHER_BYTES, LEAF_BYTES, launch_manifest
from gemmspec.pipeline import lower_file

SPEC = """
gemm g {{
  dim T, S
  dim N = {n}, F = {f}, K = {k}
  group expert[E = {e}] = ragged(T, offsets = offs)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x  : e4m3 [S, K] scale f32 [{bm}, 128]
  tensor xb : bf16 [S, K]
  tensor h  : bf16 [T, K]
  tensor w  : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor wb : bf16 [E, N, K]
  tensor rw : f32 [T]
  tensor bias : f32 [E, N]
  tensor y  : bf16 [T, N]
  tensor ys : {out} [S, N]
  tensor yh : bf16 [S, F]
  {statement}
  {directive}
}}
"""

CASES = {
    # The FP8 MoE forward on gathered tokens: 1x128 scales read through the index.
    "fp8_gather": ("y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]", {}),
    # 128x128 blocks over the gathered rows, a wide tile straddling B scale blocks.
    "fp8_gather_128x128_wide": ("y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]", {"bm": 128, "directive": "tile(128, 192)"}),
    # 64-row tiles (one consumer warpgroup), K of one block.
    "fp8_gather_m64": ("y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]", {"k": 128, "directive": "tile(64, 64)"}),
    "bf16_gather": ("y[t, n] = sum[k] xb[idx[t], k] * wb[expert(t), n, k]", {}),
    # The MoE down-projection combining into token order: scattered, with a router weight.
    "bf16_scatter_row_weight": ("ys[src[t], n] = rw[t] * sum[k] h[t, k] * wb[expert(t), n, k]", {}),
    "f32_scatter_bias": ("ys[src[t], n] = sum[k] h[t, k] * wb[expert(t), n, k] + bias[expert(t), n]", {"out": "f32"}),
    "fp8_gather_scatter": ("ys[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]", {}),
    "fp8_gather_swiglu": (
        "yh[idx[t], j] = silu(sum[k] x[idx[t], k] * w[expert(t), 2*j, k]) * sum[k] x[idx[t], k] * w[expert(t), 2*j + 1, k]",
        {"n": 256, "f": 128},
    ),
    "bf16_scatter_swiglu_wide": (
        "yh[src[t], j] = rw[t] * silu(sum[k] h[t, k] * wb[expert(t), 2*j, k]) * sum[k] h[t, k] * wb[expert(t), 2*j + 1, k]",
        {"n": 512, "f": 256},
    ),
}


def lowered(key: str):
    statement, opts = CASES[key]
    params = {"n": 256, "f": 64, "k": 512, "e": 4, "bm": 1, "out": "bf16", "directive": ""}
    params.update(opts)
    (x,) = lower_file(SPEC.format(statement=statement, **params))
    return x


def launch_of(key: str):
    x = lowered(key)
    program = emit(x.spec, x.schedule)
    (launch,) = program.launches
    return x, program, launch


def test_record_sizes_agree():
    assert (EPILOGUE_RECORD_BYTES, GATHER_RECORD_BYTES) == (EPILOGUE_BYTES, GATHER_BYTES) == (48, 32)


@pytest.mark.parametrize("key", sorted(CASES))
def test_kernel_configuration(key):
    x, program, launch = launch_of(key)
    cfg, g = launch.gemm, x.spec.gemms[0]
    assert cfg.gather == bool(g.gather) and cfg.scatter == bool(g.scatter)
    assert cfg.name.endswith(("_gather" if cfg.gather else "") + ("_scatter" if cfg.scatter else ""))
    if cfg.gather:
        # Rows by TMA, one box each (copied by the producer where TMA cannot describe the
        # leaf's A): one CTA per tile, the producer stages the scales.
        assert cfg.cluster == 1 and not cfg.consumer_scales and cfg.gather_tma
        assert "a map over all of A's rows" in launch.source
        assert f"Q.a_rows = p_{g.gather} + (start_m);" in launch.source
        assert "copy_rows<TILE_M>" in launch.source
    else:
        assert "Q.a_rows = nullptr;" in launch.source and "copy_rows" not in launch.source
    if cfg.scatter:
        assert not cfg.store_tma and f"Q.d_rows = p_{g.scatter} + (start_m);" in launch.source
        assert "Q.d_bound = static_cast<int>((dim_S));" in launch.source
    # The records follow the sentinel, after the epilogue's if the launch has one.
    n = launch.leaf_count
    at = n * EPILOGUE_BYTES if g.epilogue else 0
    assert f"reinterpret_cast<unsigned char*>(leaves + {n + 1}) + {at})[leaf] = Q;" in launch.source
    manifest = launch_manifest(x.spec, program)
    leaves = manifest.workspace("launch0.leaves")
    assert leaves.bytes.value == (n + 1) * LEAF_BYTES + (n * EPILOGUE_BYTES if g.epilogue else 0) + n * GATHER_BYTES
    assert "row numbers" in leaves.purpose
    table = next(k for k in manifest.kernels if k.role == "leaf_table")
    # The builder runs the offsets check: it reads the checked offsets and the index
    # tensors through the check's parameters (the index tensors as they are).
    tensors = [p for p in table.params if p.name.startswith(("p_", "checked_", "index_"))]
    assert [p.name for p in tensors] == ["checked_offs", *(f"index_{t}" for t in g.index_tensors)]
    assert [p.source.ref for p in tensors] == ["check.offs", *g.index_tensors]
    for t in ("offs", *g.index_tensors):
        assert f"const int* const p_{t} = {'checked' if t == 'offs' else 'index'}_{t};" in launch.source
    roles = {a.name: a.role for a in manifest.arguments}
    assert roles["idx"] == roles["src"] == "index"


def test_configs_without_index_tensors_render_no_gather_code():
    for cfg in (
        GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128),
        GemmKernelConfig("bf16", "bf16", "bf16", swiglu=True),
    ):
        source = render_gemm(cfg)
        assert "GsGather" not in source and "gathered_row" not in source
    gathered = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128, gather=True)
    plain = dataclasses.replace(gathered, gather=False, name="", stages=0, consumer_scales=None, prefetch_scales=None,
                                staged_products=None)
    assert plain == GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, sa_bm=1, sb_bn=128)
    # The producer stages the gathered rows' scales: the ring is shallower.
    assert gathered.scale_bytes > 0 and gathered.stages <= plain.stages


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(gather=True, cluster=2),
        dict(gather=True, scaled=True, sa_bm=1, sb_bn=128, consumer_scales=True),
        dict(gather=True, scaled=True, sa_bm=1, sa_bk=0, sb_bn=1, sb_bk=0),
        dict(scatter=True, store_tma=True),
        dict(scatter=True, accumulate=True, d_type="f32"),
    ],
)
def test_bad_gather_configs_are_rejected(kwargs):
    args = dict(a_type="e4m3", b_type="e4m3", d_type="bf16")
    args.update(kwargs)
    if not args.get("scaled"):
        args.update(a_type="bf16", b_type="bf16")
    with pytest.raises(ValueError):
        GemmKernelConfig(**args)


# ---- NVRTC ---------------------------------------------------------------------------------

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(CASES))
def test_emitted_launch_compiles_without_spills(key):
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    _, _, launch = launch_of(key)
    cfg = launch.gemm
    cubin, log = compile_cubin(launch.source, [include_dir()], name=f"{cfg.name}.cu")
    assert "warning" not in log, log
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    assert launch.table_kernel in sass
    fp8 = cfg.a_type in ("e4m3", "e5m2")
    assert ("QGMMA" in sass) == fp8 and ("HGMMA" in sass) == (not fp8)
    # B still arrives by TMA; A is multicast only in CTA pairs (never when gathered).
    assert re.search(r"\bUTMALDG\.2D\b", sass)
    assert bool(re.search(r"\bUTMALDG\.2D\.MULTICAST\b", sass)) == (cfg.cluster > 1) and not (cfg.gather and cfg.cluster > 1)
    assert re.search(r"\bSYNCS\.PHASECHK\.TRANS64\.TRYWAIT\b", sass)
    # The gathered copy's 16-byte loads; scattered rows stored from registers, never by TMA.
    if cfg.gather:
        assert "LDG.E.128" in sass, "no 16-byte loads of the gathered rows"
    if cfg.scatter:
        assert not re.search(r"\bUTMA(STG|REDG)\b", sass), "a scattered D stored by TMA"


@pytest.mark.slow
@pytest.mark.parametrize("key", sorted(k for k in CASES if "gather" in k))
def test_rows_by_tma_by_default(key):
    """gather_tma (the default for a gathered A): A's map is a box of one row over all of
    A's rows, the builder writes it for gathered leaves, and the producer issues one box
    per tile row."""
    pytest.importorskip("cuda.core", reason="cuda-python (cuda.core) is not installed")
    pytest.importorskip("cuda.pathfinder", reason="cuda-pathfinder is not installed")
    from nvrtc_helper import assert_spill_free, compile_cubin, disassemble

    x, program, _ = launch_of(key)
    (launch,) = program.launches
    cfg = launch.gemm
    assert cfg.gather_tma and cfg.name.endswith(("_gather", "_gather_scatter"))
    copy = with_kernel_config(x.spec, program, 0, gather_tma=False).launches[0]
    assert "_gathercopy" in copy.gemm.name and "copy_rows<TILE_M>" in copy.source
    assert "(void)A;  // A's rows are gathered" in copy.source
    a_map = map_specs(cfg)[0]
    assert (a_map.operand, a_map.box_inner, a_map.box_rows) == ("a", cfg.tile_k, 1)
    assert "a map over all of A's rows" in launch.source
    # Rows by TMA only where B loads by TMA too (a stage with B by hand is copied whole).
    gathered = launch.source[launch.source.index("a map over all of A's rows"):]
    gathered = gathered[: gathered.index("L.loads |= GS_LOAD_A_TMA;")]
    assert "tma_describable(B, L.b_off, L.b_sn, L.b_sk, L.n, L.k," in gathered
    assert "tile_rows[ptid]);" in launch.source
    cubin, log = compile_cubin(launch.source, [include_dir()], name=f"{cfg.name}.cu")
    sass = disassemble(cubin)
    assert_spill_free(log, sass)
    # B's box by the issuer and the rows' boxes by every producer thread.
    assert len(re.findall(r"\bUTMALDG\.2D\b", sass)) >= 2


def test_rows_by_tma_only_for_a_gathered_a():
    with pytest.raises(ValueError, match="gathered A"):
        GemmKernelConfig("bf16", "bf16", "bf16", gather_tma=True)
