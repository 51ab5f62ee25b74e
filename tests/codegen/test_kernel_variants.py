"""Re-emitting a built program's launch under a changed kernel configuration (what the
pipeline probe and the GPU tests of kernel options use)."""

from __future__ import annotations

import gemmspec
from gemmspec.bench import moe_spec
from gemmspec.codegen.emit import with_kernel_config


def test_a_variant_changes_its_launch_and_rederives_the_rest():
    exe = gemmspec.build(moe_spec(n=768, k=576, e=4, fp8=True))
    (before,) = exe.program.launches
    program = with_kernel_config(exe.spec, exe.program, cluster=2)
    (after,) = program.launches
    assert (before.gemm.cluster, after.gemm.cluster) == (1, 2)
    assert after.gemm.name != before.gemm.name and after.gemm.name.startswith(f"gs_{exe.spec.name}_l0_")
    assert after.gemm.stages == before.gemm.stages and after.gemm.tile_n == before.gemm.tile_n
    assert "__cluster_dims__(2, 1, 1)" in after.source and "__cluster_dims__" not in before.source
    # The leaf table counts units of the pair's two column blocks.
    assert "/ 384)" in after.source and "/ 384)" not in before.source
    assert program.prepasses == exe.program.prepasses


def test_a_variant_may_set_a_derived_field():
    exe = gemmspec.build(moe_spec(n=768, k=576, e=4, fp8=True))
    (after,) = with_kernel_config(exe.spec, exe.program, stages=2, store_tma=False).launches
    assert (after.gemm.stages, after.gemm.store_tma) == (2, False)
