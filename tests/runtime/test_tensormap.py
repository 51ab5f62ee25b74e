"""Every tensor map a launch of any example needs has an element type the host can encode."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec
from gemmspec.codegen.kernels import map_specs

tensormap = pytest.importorskip("gemmspec.runtime.tensormap", reason="cuda-python is not installed")

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_every_map_of_every_launch_is_encodable(path: Path) -> None:
    exe = gemmspec.build(path)
    for launch in exe.program.launches:
        specs = map_specs(launch.gemm)
        # A, B, then D (a staged store) or U (a SwiGLU's up rows).
        third = ["u"] if launch.gemm.swiglu_halves else ["d"]
        assert [m.operand for m in specs] == (["a", "b"] + third)[: len(specs)]
        for m in specs:
            assert m.dtype in tensormap._DATA_TYPE, (launch.gemm.name, m)
            assert m.box_inner * {"e4m3": 1, "e5m2": 1, "bf16": 2, "f16": 2, "f32": 4}[m.dtype] == 128
            assert 0 < m.box_rows <= 256
