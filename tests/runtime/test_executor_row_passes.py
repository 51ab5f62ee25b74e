"""The executor's plan for a spec with row passes, with no GPU (the fakes of conftest):
the rowdot and rowscale kernels launch after the GEMM, on the call's own arrays (the
targets are outputs the caller passes: no workspace), in the manifest's order; a call
with no rows launches nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

import gemmspec  # noqa: E402
from gemmspec.runtime import executor  # noqa: E402
from gemmspec.runtime.arrays import DeviceArray  # noqa: E402

GIB = 1 << 30

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
from row_pass_spec import ROW_PASS_SPEC, F, H  # noqa: E402

SPEC = ROW_PASS_SPEC


def args(t: int) -> dict[str, DeviceArray]:
    shapes = {
        "dy": ((t, H), "bf16"), "w": ((F, H), "bf16"), "h": ((t, F), "e4m3"), "h_scale": ((t, F // 128), "f32"),
        "rw": ((t,), "f32"), "g": ((t, F), "bf16"), "drw": ((t,), "f32"), "dh": ((t, F), "bf16"),
    }
    out = {}
    for i, (name, (shape, dtype)) in enumerate(shapes.items()):
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
        out[name] = DeviceArray((i + 1) * GIB, shape, strides, dtype, 0)
    return out


def test_the_row_passes_launch_after_the_gemm_on_the_callers_arrays(offline):
    exe = gemmspec.build(SPEC)
    given = args(129)
    exe(**given)
    launched = executor.LoadedKernel.launched
    names = [name for name, _, _ in launched]
    assert names[-2:] == ["gs_rp_q0_sm90a_rowdot_bf16_e4m3_scaled_w256", "gs_rp_q1_sm90a_rowscale_bf16_bf16_w256"]
    assert exe.program.launches[0].gemm.name in names[:-2]
    (_, _, dot), (_, _, scale) = launched[-2:]
    ptr = {n: a.ptr for n, a in given.items()}
    # rowdot(A, lda, B, ldb, SB, sb_r, sb_c, R, C, Y)
    assert [dot[i] for i in (0, 2, 4, 9)] == [ptr["g"], ptr["h"], ptr["h_scale"], ptr["drw"]]
    assert [int(dot[i]) for i in (1, 3, 5, 6, 7, 8)] == [F, F, F // 128, 1, 129, F]
    # rowscale(A, lda, W, R, C, Y, ldy)
    assert [scale[i] for i in (0, 2, 5)] == [ptr["g"], ptr["rw"], ptr["dh"]]
    assert [int(scale[i]) for i in (1, 3, 4, 6)] == [F, 129, F, F]


def test_a_call_with_no_rows_launches_nothing(offline):
    exe = gemmspec.build(SPEC)
    exe(**args(0))
    assert executor.LoadedKernel.launched == []
