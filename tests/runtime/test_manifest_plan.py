"""The Python runtime launches what the manifest (and so the host launcher) says: the
same kernels in the same order, with the grids and scalar arguments its formulas give."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_executor_plan import _arrays

import gemmspec
from gemmspec.codegen.formula import NUM_SMS
from gemmspec.codegen.manifest import KernelLaunch, Upload

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_runtime_follows_the_manifest(path, offline):
    exe = gemmspec.build(path)
    arrays = _arrays(exe, offline, np.random.default_rng(1))
    run = exe.prepare(None, **arrays)
    # The manifest of the program the call runs: as compiled, or its decode variant.
    manifest = exe.manifest_of(run.program)
    launches = run.launches  # the offsets check among them: the manifest has it too
    env = {**run.dims, NUM_SMS: 132}
    kernels = [s for s in manifest.steps if isinstance(s, KernelLaunch)]
    kernels = [k for k in kernels if min(g.evaluate(env) for g in k.grid) > 0]
    assert [k.name for k, *_ in launches] == [k.symbol for k in kernels]
    for (_kernel, grid, block, smem, args, programmatic), step in zip(launches, kernels):
        assert tuple(grid) == tuple(g.evaluate(env) for g in step.grid)
        # A GEMM after its builder is its programmatic dependent; one that builds its table
        # is launched the ordinary way.
        assert programmatic == step.programmatic == (step.role == "gemm" and "_inl" not in step.symbol)
        assert (block, smem) == (step.block, step.dynamic_smem)
        assert len(args) == len(step.params)
        for arg, p in zip(args, step.params):
            if p.source.kind == "value":
                assert int(arg) == p.source.value.evaluate(env), (step.symbol, p.name)
            if p.source.kind == "null":
                assert arg is None
            if p.source.kind == "extent":  # an argument's length: an anchored scale's rows
                assert int(arg) == arrays[p.source.ref].shape[p.source.axis], (step.symbol, p.name)
    # One buffer per workspace: allocated, or uploaded by its step.
    uploads = sum(isinstance(s, Upload) for s in manifest.steps)
    assert len(manifest.workspaces) <= len(run.workspace)
    assert uploads >= len(run.program.launches)
