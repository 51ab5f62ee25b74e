"""Programmatic dependent launch in the Python runtime, with no GPU: a planned call issues
each GEMM kernel right after its builder as a programmatic dependent (cuLaunchKernelEx
with the programmatic stream serialization attribute, its configuration built once),
every other kernel the ordinary way; GEMMSPEC_PDL=0 launches them all the ordinary way;
a plan taken over by a CUDA-graph capture launches the same way on the capturing stream.
Kernels, buffers and streams are the fakes of conftest; the driver call is recorded."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.codegen.emit import emit
from gemmspec.runtime import executor, launch
from gemmspec.runtime.arrays import DeviceArray

ROOT = Path(__file__).resolve().parents[2]
FORWARD = ROOT / "examples" / "moe_fp8_forward.gspec"
GIB = 1 << 30
T, N, K, E = 300, 4096, 7168, 8


def forward_args(base=GIB):
    return {
        "x": DeviceArray(base, (T, K), (K, 1), "e4m3", 0),
        "x_scale": DeviceArray(base + GIB, (T, K // 128), (1, T), "f32", 0),
        "w": DeviceArray(base + 2 * GIB, (E, N, K), (N * K, K, 1), "e4m3", 0),
        "w_scale": DeviceArray(base + 3 * GIB, (E, N // 128, K // 128), (N * K // 128**2, K // 128, 1), "f32", 0),
        "y": DeviceArray(base + 4 * GIB, (T, N), (N, 1), "bf16", 0),
        "expert_offsets": DeviceArray(base + 5 * GIB, (E + 1,), (1,), "i32", 0),
    }


def recorded():
    out = list(zip((name for name, _, _ in executor.LoadedKernel.launched), executor.LoadedKernel.programmatic))
    executor.LoadedKernel.launched.clear()
    executor.LoadedKernel.programmatic.clear()
    return out


def forward_with_builder():
    """The forward spec with a leaf-table builder before its GEMM (by default the GEMM
    builds its table itself and is launched the ordinary way, alone)."""
    exe = gemmspec.build(FORWARD)
    exe.choose_at_call = False  # the compiled kernels at every size
    exe.program = emit(exe.spec, exe.schedule, inline_tables=False)
    return exe


def test_a_gemm_that_builds_its_table_is_an_ordinary_launch(offline, monkeypatch):
    monkeypatch.setenv("GEMMSPEC_PDL", "1")
    exe = gemmspec.build(FORWARD)
    exe.choose_at_call = False  # the compiled kernels at every size
    exe(**forward_args())
    assert recorded() == [(exe.program.launches[0].gemm.name, False)]


def test_each_gemm_is_a_programmatic_dependent_of_its_builder(offline, monkeypatch):
    monkeypatch.delenv("GEMMSPEC_PDL", raising=False)
    exe = forward_with_builder()
    exe(**forward_args())
    exe(**forward_args(base=64 * GIB))  # the planned call's fast path
    gemm = exe.program.launches[0].gemm.name
    assert recorded() == [("gs_moe_fp8_forward_l0_leaves", False), (gemm, True)] * 2


def test_two_launches_alternate_builder_and_dependent(offline):
    from test_executor_plan import _arrays

    exe = gemmspec.build(ROOT / "examples" / "split_nest.gspec")

    exe.choose_at_call = False  # the compiled kernels at every size
    exe.prepare(None, **_arrays(exe, offline, np.random.default_rng(0))).enqueue()
    gemms = [x.gemm.name for x in exe.program.launches]
    assert recorded() == [
        ("gs_split_nest_l0_leaves", False), (gemms[0], True), ("gs_split_nest_l1_leaves", False), (gemms[1], True),
    ]


@pytest.mark.parametrize("value, on", [("0", False), (" 0 ", False), ("1", True), ("", True)])
def test_gemmspec_pdl_0_launches_the_ordinary_way(offline, monkeypatch, value, on):
    monkeypatch.setenv("GEMMSPEC_PDL", value)
    exe = forward_with_builder()
    exe(**forward_args())
    assert [p for _, p in recorded()] == [False, on]
    # Read when the plan was packed: later calls of the plan keep it.
    monkeypatch.setenv("GEMMSPEC_PDL", "1" if value == "0" else "0")
    exe(**forward_args())
    assert [p for _, p in recorded()] == [False, on]


def test_a_capture_launches_its_gemm_as_a_dependent_too(offline, monkeypatch):
    class Stream:
        def __init__(self, handle):
            self.handle = handle

    monkeypatch.setattr(executor, "stream_key", lambda stream, objects, device: stream or 0)
    monkeypatch.setattr(executor, "caller_stream", lambda stream, objects, device: Stream(stream))
    exe = forward_with_builder()
    exe(stream=5, **forward_args())  # warm-up
    monkeypatch.setattr(executor, "is_capturing", lambda s: True)
    exe(stream=6, **forward_args())  # captured: the same launches, packed for stream 6
    streams = [s.handle for _, s, _ in executor.LoadedKernel.launched]
    assert streams == [5, 5, 6, 6] and [p for _, p in recorded()] == [False, True] * 2


# ---- the driver call ---------------------------------------------------------------------


def bare_kernel(sizes):
    k = object.__new__(launch.LoadedKernel)
    k.name, k.device = "k", 0
    k._param_sizes, k._smem_limit = sizes, 227 * 1024  # raised already
    k._cu_function = launch.driver.CUfunction(0)
    return k


class HandleStream:
    handle = 1234


def test_a_programmatic_launch_goes_through_cuLaunchKernelEx(monkeypatch):
    seen = []

    def fake_ex(config, f, params, extra):
        attrs = config.attrs[: config.numAttrs]
        cells = [ctypes.c_uint64.from_address(params + 8 * i).value for i in range(2)]
        seen.append(
            {
                "grid": (config.gridDimX, config.gridDimY, config.gridDimZ),
                "block": (config.blockDimX, config.blockDimY, config.blockDimZ),
                "smem": config.sharedMemBytes,
                "stream": int(config.hStream),
                "attrs": [(a.id, a.value.programmaticStreamSerializationAllowed) for a in attrs],
                "values": [ctypes.c_uint64.from_address(c).value for c in cells],
                "extra": extra,
            }
        )
        return (launch.driver.CUresult.CUDA_SUCCESS,)

    def plain(*args):
        raise AssertionError("a programmatic launch went through cuLaunchKernel")

    monkeypatch.setattr(launch, "_launch_kernel_ex", fake_ex)
    monkeypatch.setattr(launch, "_launch_kernel", plain)
    monkeypatch.setattr(launch, "current_stream", lambda stream, device=0: stream)
    cells = launch.ArgumentCells(1)
    bound = bare_kernel([8, 4]).bind(
        (132, 1), 384, 200 * 1024, HandleStream(), [None, np.int32(8)], {0: 0}, cells, programmatic=True
    )
    for pointer in (0x1000, 0x2000):
        cells.write((pointer,))
        bound.launch()
    attribute = launch.driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert seen[0] == {
        "grid": (132, 1, 1), "block": (384, 1, 1), "smem": 200 * 1024, "stream": 1234,
        "attrs": [(attribute, 1)], "values": [0x1000, 8], "extra": 0,
    }
    assert seen[1]["values"] == [0x2000, 8]
    assert bound.programmatic and bound._config is not None


def test_an_ordinary_launch_stays_on_cuLaunchKernel(monkeypatch):
    calls = []
    monkeypatch.setattr(launch, "_launch_kernel", lambda *a: calls.append(a) or (launch.driver.CUresult.CUDA_SUCCESS,))
    monkeypatch.setattr(launch, "_launch_kernel_ex", None)
    monkeypatch.setattr(launch, "current_stream", lambda stream, device=0: stream)
    cells = launch.ArgumentCells(1)
    bound = bare_kernel([8]).bind(1, 256, 0, HandleStream(), [None], {0: 0}, cells)
    cells.write((16,))
    bound.launch()
    assert len(calls) == 1 and not bound.programmatic and bound._config is None
