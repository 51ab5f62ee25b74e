"""Re-emitting a built program's launch under a changed kernel configuration (what the
pipeline probe and the GPU tests of kernel options use)."""

from __future__ import annotations

import gemmspec
from gemmspec.bench import moe_spec
from gemmspec.codegen.emit import with_kernel_config


def test_a_variant_changes_its_launch_and_rederives_the_rest():
    exe = gemmspec.build(moe_spec(n=768, k=576, e=4, fp8=False))
    (before,) = exe.program.launches
    program = with_kernel_config(exe.spec, exe.program, cluster=2)
    (after,) = program.launches
    assert (before.gemm.cluster, after.gemm.cluster) == (1, 2)
    assert after.gemm.name != before.gemm.name and after.gemm.name.startswith(f"gs_{exe.spec.name}_l0_")
    assert after.gemm.stages == before.gemm.stages and after.gemm.tile_n == before.gemm.tile_n
    assert "__cluster_dims__(2, 1, 1)" in after.source and "__cluster_dims__" not in before.source
    # The leaf table counts units of the pair's two column blocks.
    assert "/ 512)" in after.source and "/ 512)" not in before.source
    assert program.prepasses == exe.program.prepasses


def test_blockwise_fp8_pairs_ctas_along_m_by_default():
    exe = gemmspec.build(moe_spec(n=768, k=576, e=4, fp8=True))
    (paired,) = exe.program.launches
    assert (paired.gemm.cluster, paired.gemm.multicast_b) == (2, True) and "c2b" in paired.gemm.name
    assert "__cluster_dims__(2, 1, 1)" in paired.source
    # The leaf table counts units of the pair's two row blocks; a single-CTA variant, one.
    assert "(m + 255) / 256) * ((n + 191) / 192)" in paired.source
    (single,) = with_kernel_config(exe.spec, exe.program, cluster=1, multicast_b=False).launches
    assert "(m + 127) / 128) * ((n + 191) / 192)" in single.source
    assert "__cluster_dims__" not in single.source


def test_a_variant_may_set_a_derived_field():
    exe = gemmspec.build(moe_spec(n=768, k=576, e=4, fp8=True))
    (after,) = with_kernel_config(exe.spec, exe.program, stages=2, store_tma=False).launches
    assert (after.gemm.stages, after.gemm.store_tma) == (2, False)
