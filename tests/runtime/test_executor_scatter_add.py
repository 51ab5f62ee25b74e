"""The executor's plan for a spec with scatter_add, with no GPU (the fakes of conftest):
its five kernels launch after the GEMM in the manifest's order, on the call's arrays and
one set of workspaces; empty grids (no entries, no target rows) are skipped; a call
with nothing to write launches nothing."""

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
from scatter_add_spec import SCATTER_ADD_SPEC, K  # noqa: E402

BASE = "gs_sa_q0_sm90a_scatter_add_bf16_bf16_w256"
STEPS = [f"{BASE}_zero", f"{BASE}_count", f"{BASE}_scan", f"{BASE}_place", BASE]


def args(t: int, s: int) -> dict[str, DeviceArray]:
    shapes = {
        "dy": ((t, 64), (64, 1), "bf16"), "w": ((K, 64), (64, 1), "bf16"), "src": ((t,), (1,), "i32"),
        "gi": ((t, K), (139, 1), "f16"), "dxr": ((t, K), (K, 1), "bf16"), "dx": ((s, K), (K, 1), "bf16"),
        "dx2": ((s, K), (K, 1), "f32"),
    }
    return {
        name: DeviceArray((i + 1) * GIB, shape, strides, dtype, 0)
        for i, (name, (shape, strides, dtype)) in enumerate(shapes.items())
    }


def ours(launched, base=BASE):
    return [(name, a) for name, _, a in launched if name.startswith(base)]


def test_the_steps_launch_after_the_gemm_on_one_set_of_workspaces(offline):
    exe = gemmspec.build(SCATTER_ADD_SPEC)
    given = args(129, 40)
    exe(**given)
    launched = executor.LoadedKernel.launched
    names = [name for name, _, _ in launched]
    assert exe.program.launches[0].gemm.name in names[: names.index(STEPS[0])]
    steps = ours(launched)
    assert [name for name, _ in steps] == STEPS
    (_, zero), (_, count), (_, scan), (_, place), (_, add) = steps
    ptr = {n: a.ptr for n, a in given.items()}
    counts, cursors = zero[0], zero[1]
    assert int(zero[2]) == 40
    assert (count[0], int(count[1]), int(count[2]), count[3]) == (ptr["src"], 129, 40, counts)
    assert (scan[0], int(scan[1])) == (counts, 40)
    assert (place[0], place[3], place[4]) == (ptr["src"], counts, cursors)
    slots = place[5]
    # sum(A, lda, COUNTS, SLOTS, ORDER, S, C, Y, ldy)
    assert (add[0], int(add[1]), add[2], add[3], int(add[5]), int(add[6]), add[7], int(add[8])) == (
        ptr["dxr"], K, counts, slots, 40, K, ptr["dx"], K,
    )
    assert len({counts, cursors, slots, add[4]}) == 4  # four workspaces
    second = [name for name, _ in ours(launched, "gs_sa_q1_")]
    assert len(second) == 5 and names.index(second[0]) > names.index(BASE)


def test_no_entries_or_no_target_rows_skip_the_empty_grids(offline):
    exe = gemmspec.build(SCATTER_ADD_SPEC)
    exe(**args(0, 7))  # no entries: every target row is zero
    assert [name for name, _ in ours(executor.LoadedKernel.launched)] == [STEPS[0], STEPS[2], STEPS[4]]
    executor.LoadedKernel.launched.clear()
    exe(**args(9, 0))  # no target rows: the sums have no warp
    assert [name for name, _ in ours(executor.LoadedKernel.launched)] == STEPS[:4]


def test_a_call_with_nothing_to_write_launches_nothing(offline):
    exe = gemmspec.build(SCATTER_ADD_SPEC)
    exe(**args(0, 0))
    assert executor.LoadedKernel.launched == []
