"""Every example emits CUDA that NVRTC compiles for sm_90a, with tensor-core SASS
(QGMMA for FP8 launches, HGMMA for BF16/F16 launches), TMA loads and mbarrier waits,
and no local-memory spills. (That every emitted .cu also builds with nvcc, warnings as
errors, is tests/codegen/test_cpp_build.py's.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.pipeline import lower_file
from gemmspec.runtime.nvrtc import compile_cubin, disassemble
from gemmspec.spec import FP8_TYPES

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))


def programs(path):
    return [emit(x.spec, x.schedule) for x in lower_file(path)]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_compiles_to_tensor_core_sass(path, tmp_path):
    for prog in programs(path):
        for launch in prog.launches:
            cubin = compile_cubin(
                launch.source, name=launch.gemm.name, include_dirs=[include_dir()], cache_dir=str(tmp_path)
            )
            assert "warning" not in cubin.log, cubin.log  # -Werror builds must take it
            sass = disassemble(cubin.cubin)
            fp8 = launch.gemm.a_type in FP8_TYPES
            assert ("QGMMA" in sass) == fp8, launch.gemm.name
            assert ("HGMMA" in sass) == (not fp8), launch.gemm.name
            assert all(k in sass for k in launch.kernels)
            assert "LDL" not in sass and "STL" not in sass, "local-memory spill"
            # The pipeline: TMA loads, mbarrier waits, and A multicast in CTA pairs.
            assert "UTMALDG.2D" in sass and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in sass
            assert ("UTMALDG.2D.MULTICAST" in sass) == (launch.gemm.cluster > 1), launch.gemm.name
        for p in prog.prepasses:
            cubin = compile_cubin(p.source, name=p.kernel, include_dirs=[include_dir()], cache_dir=str(tmp_path))
            assert p.kernel in disassemble(cubin.cubin)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_leaf_table_builder_decodes_leaves_like_the_schedule(path):
    # The builder turns a leaf number into group indices as (leaf / stride) % count; the
    # reference executor uses ProblemGenerator.leaf_indices. They must agree on every leaf.
    import re

    for prog in programs(path):
        for launch in prog.launches:
            pg = launch.launch.problems
            decode = {
                name: (int(stride), int(count))
                for name, stride, count in re.findall(
                    r"const long long g_(\w+) = \(static_cast<long long>\(leaf\) / (\d+)\) % (\d+);",
                    launch.source,
                )
            }
            assert set(decode) == {a.name for a in pg.free_axes}
            for leaf in range(pg.leaf_count):
                want = pg.leaf_indices(leaf)
                got = {a: (leaf // s) % c for a, (s, c) in decode.items()}
                assert all(want[a] == got[a] for a in got), (leaf, want, got)
