"""A SwiGLU over gate and up halves (two weights, or stacked halves of one) emits kernels
that NVRTC compiles for sm_90a without local memory: two TMA boxes of B per stage (the
gate rows from B's map, the up rows from the up map), the up weight and its scales as
launch parameters, and the quad shuffles that lay the products out for the stores."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.codegen.kernels import GemmKernelConfig, include_dir, map_specs
from gemmspec.codegen.manifest import launch_manifest
from gemmspec.pipeline import lower_file

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "gpu"))
from nvrtc_helper import spill_free_sass  # noqa: E402
from test_swiglu_halves_gpu import CASES, spec_text  # noqa: E402

EXAMPLE = HERE.parents[1] / "examples" / "moe_swiglu_fp8_separate.gspec"


def lowered(name: str):
    (x,) = lower_file(spec_text(name))
    return x


@pytest.mark.parametrize("name", sorted(CASES))
def test_launch_is_one_kernel_over_both_halves(name):
    x = lowered(name)
    form, f, _, fp8, _, _ = CASES[name]
    (launch,) = x.schedule.launches
    sig, pg = launch.signature, launch.problems
    assert sig.swiglu and sig.swiglu_halves and sig.swiglu_up_rows == (f if form == "stacked" else 0)
    assert pg.extent("n").size.value == 2 * f
    assert (pg.u.tensor, pg.su is not None) == ("w" if form == "stacked" else "wu", fp8)
    prog = emit(x.spec, x.schedule)
    cfg = prog.launches[0].gemm
    assert cfg.swiglu_halves and not cfg.inline_table
    maps = map_specs(cfg)
    assert [(m.operand, m.box_rows) for m in maps] == [("a", cfg.tile_m), ("b", cfg.tile_n // 2), ("u", cfg.tile_n // 2)]
    manifest = launch_manifest(x.spec, prog)
    gemm = next(k for k in manifest.kernels if k.role == "gemm")
    params = {p.name: p.source.ref for p in gemm.params}
    want_u = "w" if form == "stacked" else "wu"
    assert params["U"] == want_u and params["B"] == ("w" if form == "stacked" else "wg")
    assert params["SU"] == (f"{want_u}_scale" if fp8 else "")
    table = next(k for k in manifest.kernels if k.role == "leaf_table")
    assert [p.name for p in table.params][3:7] == ["A", "B", "D", "U"]


COMPILED = ["sep_bf16_f72_k100_f32", "sep_fp8_f256_k256", "stk_fp8_out", "stk_bf16_f40_k64"]


@pytest.mark.parametrize("name", COMPILED)
def test_kernel_compiles_without_spills(name):
    x = lowered(name)
    (launch,) = emit(x.spec, x.schedule).launches
    sass = spill_free_sass(launch.source, [include_dir()], f"{launch.gemm.name}.cu")
    assert re.search(r"\b[QH]GMMA\b", sass)
    # A's box and B's two (gate, up) per stage: three TMA load sites at least.
    assert len(re.findall(r"\bUTMALDG\b", sass)) >= 3
    # Two quad shuffles per row and 8-column gate block: tile_n / 4 of them.
    assert len(re.findall(r"\bSHFL\.IDX\b", sass)) >= launch.gemm.tile_n // 4


def test_example_compiles_without_spills():
    (x,) = lower_file(EXAMPLE)
    (launch,) = emit(x.spec, x.schedule).launches
    assert launch.gemm.swiglu_halves and launch.gemm.tile_n == 256 and launch.gemm.scaled
    spill_free_sass(launch.source, [include_dir()], f"{launch.gemm.name}.cu")


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"swiglu_halves": True}, "belong to a SwiGLU"),
        ({"swiglu": True, "swiglu_halves": True, "tile_n": 72}, "whole 8-row blocks"),
        ({"swiglu": True, "swiglu_halves": True, "scaled": True, "tile_n": 128, "a": "e4m3"}, "one B scale block"),
        ({"swiglu": True, "swiglu_up_rows": 128}, "up rows belong"),
    ],
)
def test_config_refuses_what_the_kernel_cannot_run(kwargs, fragment):
    a = kwargs.pop("a", "bf16")
    with pytest.raises(ValueError, match=fragment):
        GemmKernelConfig(a, a, "bf16", **kwargs)
