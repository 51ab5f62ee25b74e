"""On a Hopper GPU: the decode options of a GEMM kernel change where bytes go or when a
CTA leaves, never a value (kernels.py: ``b_evict_first``, B's TMA loads evicting first in
L2; ``prefetch_k_blocks``, the block's first unit's weights asked of L2 once its table is
built; ``exit_on_read``, CTAs leaving once their last TMA stores have read the staging,
the grid's completion still bringing their writes to the output). The decode variants
(FP8 64 x 256 whole tiles, FP8 at the compiled width with split K, BF16 with split K) and
the masked kernel (as compiled, with split K, and in whole tiles), each with either L2
option and with all three, judged element by element against the float64 reference
(guard bytes included, gemmspec.runtime.verify) on leaves of 0, 1, 2, 7, 8, 9, 63, 64,
65, 127 and 129 rows. Skipped without a Hopper GPU (conftest.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

import gemmspec
from gemmspec.codegen.emit import with_kernel_config
from gemmspec.codegen.variants import DECODE_INLINE_MAX_LEAVES, decode_changes
from gemmspec.runtime.verify import check_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_decode_variant_gpu import COUNTS, spec_text  # noqa: E402

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
# Each L2 option alone, and all three (CTAs leaving once their last stores have read the
# staging too) with a prefetch longer than these launches' K (512: four K blocks of FP8,
# eight of BF16), so that it ends at the row's end.
OPTIONS = {
    "bfirst": {"b_evict_first": True},
    "pf4": {"prefetch_k_blocks": 4},
    "all": {"b_evict_first": True, "prefetch_k_blocks": 16, "exit_on_read": True},
}


def with_options(exe, changes, options):
    """`exe` running launch 0 under `changes` plus `options` at every size (no choice per
    call); returns the kernel without the options, for its name."""
    exe.choose_at_call = False
    plain = with_kernel_config(exe.spec, exe.program, inline_leaves=DECODE_INLINE_MAX_LEAVES, **changes)
    exe.program = with_kernel_config(exe.spec, exe.program, inline_leaves=DECODE_INLINE_MAX_LEAVES, **changes,
                                     **options)
    gemm = exe.program.launches[0].gemm
    assert gemm.b_evict_first == options.get("b_evict_first", False)
    assert gemm.prefetch_k_blocks == options.get("prefetch_k_blocks", 0)
    assert (f"_pf{gemm.prefetch_k_blocks}" in gemm.name) == bool(gemm.prefetch_k_blocks)
    assert ("_bfirst" in gemm.name) == gemm.b_evict_first
    assert gemm.name.endswith("_xr") == gemm.exit_on_read == options.get("exit_on_read", False)
    return plain.launches[0].gemm


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("counts", ["edges_low", "edges_high"])
@pytest.mark.parametrize("kind", ["fp8", "fp8_wide", "bf16"])
def test_decode_variants_with_l2_options_match_the_reference(kind, counts, option):
    exe = gemmspec.build(spec_text(kind))
    plain = with_options(exe, decode_changes(exe.schedule.launches[0])[0], OPTIONS[option])
    assert plain.name == exe.decode.program.launches[0].gemm.name  # the decode variant's kernel
    for seed in (0, 1):
        report = check_random(exe, lengths={"expert": COUNTS[counts]}, seed=seed).report
        assert report.ok, report.describe()


@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("split_k", [True, False])
def test_masked_groups_with_l2_options_match_the_reference(split_k, option):
    exe = gemmspec.build((ROOT / "examples" / "moe_masked_decode.gspec").read_text())
    compiled = exe.program.launches[0].gemm
    plain = with_options(exe, {} if split_k else {"split_k": False}, OPTIONS[option])
    assert plain.split_k is split_k and (compiled.name == plain.name) is split_k
    report = check_random(exe, seed=5).report
    assert report.ok, report.describe()
