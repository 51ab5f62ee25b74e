"""Programmatic dependent launch of each GEMM kernel after its leaf-table builder (no GPU):
the builder lets its dependent be scheduled first thing; the GEMM kernel waits after its
prologue, before it reads the table, a map or an operand and before any store; the
manifest marks the GEMM steps, and the host launcher issues them through
cudaLaunchKernelEx with the attribute (off with -DGEMMSPEC_PDL=0). In SASS the wait is
the only difference a GEMM kernel shows against the same kernel without it."""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit, with_kernel_config
from gemmspec.codegen.host import render_host
from gemmspec.codegen.kernels import GemmKernelConfig, include_dir, map_specs, render_gemm
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from nvrtc_helper import assert_spill_free, compile_cubin, disassemble  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").glob("*.gspec"))
WAIT = "gs_grid_dependency_wait();"
TRIGGER = "gs_launch_dependents();"


def kernel_body(source: str, name: str) -> str:
    """The body of `extern "C"` kernel `name`."""
    start = source.index("{", source.index(f"{name}(", source.index('extern "C"')))
    return source[start + 1 : source.index("\n}", start)]


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_gemm_waits_after_its_prologue_and_before_it_reads(path):
    for x in lower_file(path):
        for launch in emit(x.spec, x.schedule, inline_tables=False).launches:
            assert launch.gemm.programmatic
            body = kernel_body(launch.source, launch.gemm.name)
            # One wait per role, after its register reallocation and before the first read
            # of the table (block_layout reads the sentinel), the maps or an operand.
            prologue = body[: body.index("if (threadIdx.x >= CONSUMER_THREADS)")]
            roles = body[len(prologue):]
            producer, consumer = roles.split("} else {")
            for role, realloc in ((producer, "gs_setmaxnreg_dec"), (consumer, "gs_setmaxnreg_inc")):
                assert role.count(WAIT) == 1
                assert role.index(realloc) < role.index(WAIT) < role.index("block_layout(gs_dyn_smem, leaves")
            assert "gs_mbar_init" in prologue
            if launch.gemm.split_k:
                # One thread works out the block's split work from the table: it waits first.
                assert prologue.count(WAIT) == 1 and prologue.index(WAIT) < prologue.index("leaves[num_leaves]")
            else:
                assert "leaves" not in prologue.replace("nullptr, 0", "")
            # The builder lets the GEMM be scheduled before anything else it does.
            table = kernel_body(launch.source, launch.table_kernel)
            lines = [ln.strip() for ln in table.splitlines() if ln.strip() and not ln.strip().startswith("//")]
            maps = len(map_specs(launch.gemm))
            assert lines[:4] == [
                f"using namespace {launch.table_kernel}_impl;", "__shared__ GsTensorMap slots[THREADS];",
                f"__shared__ GsTensorMap shared_templates[{maps}];", TRIGGER,
            ]


def test_the_switch_leaves_the_wait_out():
    cfg = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, tile_n=192)
    off = GemmKernelConfig("e4m3", "e4m3", "bf16", scaled=True, tile_n=192, programmatic=False)
    assert off.name == cfg.name + "_nopdl"
    assert render_gemm(cfg).count(WAIT) == 2 and WAIT not in render_gemm(off)
    # Nothing else differs in the source.
    assert render_gemm(off).replace(off.name, cfg.name) == "\n".join(
        ln for ln in render_gemm(cfg).replace(WAIT, "\0").splitlines() if "\0" not in ln
        and "Launched as a programmatic dependent" not in ln and "ran beside it; the table" not in ln
    ) + "\n"


def test_manifest_and_launcher_follow_the_switch():
    (x,) = lower_file(ROOT / "examples" / "split_nest.gspec")
    program = emit(x.spec, x.schedule)
    m = launch_manifest(x.spec, program)
    assert [(k.role, k.programmatic) for k in m.kernels] == [
        ("leaf_table", False), ("gemm", True), ("leaf_table", False), ("gemm", True),
    ]
    assert all(m.to_json()["steps"][i]["programmatic_serialization"] == s.programmatic
               for i, s in enumerate(m.steps) if hasattr(s, "programmatic"))
    # The GEMM step comes right after its builder: the step it depends on.
    kernels = list(m.kernels)
    for i, k in enumerate(kernels):
        if k.programmatic:
            assert kernels[i - 1].role == "leaf_table" and kernels[i - 1].owner == k.owner
    host = render_host(m)
    assert host.count("cudaLaunchKernelEx(&config, ") == 2
    assert "config.numAttrs = GEMMSPEC_PDL ? 1 : 0;" in host and "#ifndef GEMMSPEC_PDL" in host
    off = with_kernel_config(x.spec, program, 1, programmatic=False)
    m = launch_manifest(x.spec, off)
    assert [k.programmatic for k in m.kernels] == [False, True, False, False]
    assert render_host(m).count("cudaLaunchKernelEx(&config, ") == 1


def _opcodes(source: str, name: str) -> dict[str, Counter]:
    cubin, log = compile_cubin(source, [include_dir()], name=name)
    assert "warning" not in log, log
    assert_spill_free(log)
    out = {}
    for fn in re.split(r"\n\s*Function : ", disassemble(cubin))[1:]:
        ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", fn)
        out[fn.split("\n", 1)[0].strip()] = Counter(ops)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", ["moe_fp8_forward", "moe_bf16_forward", "lora_moe_nested"])
def test_in_sass_the_wait_is_all_that_changes(name):
    """griddepcontrol.wait is ACQBULK, once per role (or once before the roles part, where
    ptxas hoists the two into one; a split-K kernel also waits once in the thread that works
    out the block's split work); the GEMM kernel is otherwise the
    same instructions (the alignment NOPs move, and ptxas may allocate a couple of integer
    address computations and their branches' reconvergence differently), so its main loop is untouched: no wgmma, FFMA,
    barrier or memory instruction changes. The builder's trigger is PREEXIT."""
    (x,) = lower_file(ROOT / "examples" / f"{name}.gspec")
    program = emit(x.spec, x.schedule, inline_tables=False)
    (launch,) = program.launches
    (plain,) = with_kernel_config(x.spec, program, 0, programmatic=False).launches
    with_wait = _opcodes(launch.source, launch.table_kernel)
    without = _opcodes(plain.source, plain.table_kernel)
    a, b = with_wait[launch.gemm.name], without[plain.gemm.name]
    a.pop("NOP", None)
    b.pop("NOP", None)
    added, removed = a - b, b - a
    assert added.pop("ACQBULK") in ((1, 2, 3) if launch.gemm.split_k else (1, 2))
    # Integer arithmetic, and the warp reconvergence markers of its branches.
    integer = {"IADD3", "IMAD", "IMAD.MOV.U32", "MOV", "LEA", "LEA.HI.X", "SHF.R.S32.HI", "IMAD.SHL.U32", "LOP3.LUT",
               "BSSY", "BSYNC"}
    if launch.gemm.split_k:
        # The split work (the table's reads and integer arithmetic) moves around the
        # prologue's wait: no shared or atomic store, barrier, tensor-core or float
        # instruction changes. (ptxas may duplicate or merge one of the register
        # epilogue's scalar global stores at a leaf's edge: STG, outside the main loop.)
        work = re.compile(r"(STS|STL|ATOM|RED|[HQ]GMMA|WARPGROUP|BAR|SYNCS|UTMA|UBLKCP|MEMBAR|F[A-Z0-9]*\.?)")
        assert not [op for op in {*added, *removed} if work.match(op)], (added, removed)
        assert sum(n for op, n in (added + removed).items() if op.startswith("STG")) <= 2, (added, removed)
        # (ptxas writes some of the same integer steps in other encodings, VIADD or IADD3,
        # ISETP.GE or .LE with the operands swapped: 19 and 15 in the nested LoRA's kernel.)
        assert sum(added.values()) <= 24 and sum(removed.values()) <= 24, (added, removed)
    else:
        assert set(added) <= integer and set(removed) <= integer, (added, removed)
        assert sum(added.values()) <= 4 and sum(removed.values()) <= 4, (added, removed)
    assert with_wait[launch.table_kernel]["PREEXIT"] == 1
