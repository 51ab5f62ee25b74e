"""The default call path with no GPU: a plan per signature and stream, reused with
new pointers; offsets checked by the device (a flag `check=True` reads); the caller's
stream; CUDA-graph capture taking over a plan made before it. Kernels, buffers and
streams are the fakes of conftest."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cuda.bindings import driver

import gemmspec
from gemmspec.bench import moe_spec
from gemmspec.codegen.kernels import include_dir
from gemmspec.codegen.validate import validation_kernel
from gemmspec.errors import ArgumentError, GemmspecError
from gemmspec.runtime import executor, streams
from gemmspec.runtime.arrays import DeviceArray

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))
FORWARD = EXAMPLES[0].parent / "moe_fp8_forward.gspec"
GIB = 1 << 30
T, N, K, E = 300, 4096, 7168, 8


def forward_args(base=GIB, t=T, device=0):
    return {
        "x": DeviceArray(base, (t, K), (K, 1), "e4m3", device),
        "x_scale": DeviceArray(base + GIB, (t, K // 128), (1, t), "f32", device),
        "w": DeviceArray(base + 2 * GIB, (E, N, K), (N * K, K, 1), "e4m3", device),
        "w_scale": DeviceArray(base + 3 * GIB, (E, N // 128, K // 128), (N * K // 128**2, K // 128, 1), "f32", device),
        "y": DeviceArray(base + 4 * GIB, (t, N), (N, 1), "bf16", device),
        "expert_offsets": DeviceArray(base + 5 * GIB, (E + 1,), (1,), "i32", device),
    }


class Stream:
    """A stream that may be waited on (check=True waits)."""

    def __init__(self, handle=0):
        self.handle = handle
        self.waits = 0

    def sync(self):
        self.waits += 1


@pytest.fixture
def exe():
    exe = gemmspec.build(FORWARD)
    # The compiled kernels at every size: the per-call choice of the decode variant has
    # its own tests (tests/codegen/test_decode_variant.py).
    exe.choose_at_call = False
    return exe


def user_pointers(launches):
    """The pointers of user arrays (plain ints: slots filled in per call)."""
    return {a for _, _, args in launches for a in args if type(a) is int}


def test_call_waits_for_nothing_and_reuses_its_plan(exe, offline):
    exe(**forward_args())  # NoStream: any wait would fail
    assert len(exe._plans) == 1
    first = executor.LoadedKernel.launched[:]
    names = [name for name, _, _ in first]
    # The GEMM checks the offsets and builds its leaf table itself: one launch.
    assert names == [exe.program.launches[0].gemm.name] and names[0].endswith("_inl_whole")
    executor.LoadedKernel.launched.clear()
    exe(**forward_args(base=64 * GIB))  # same shapes, other memory
    assert len(exe._plans) == 1
    again = executor.LoadedKernel.launched
    assert [name for name, _, _ in again] == names
    new = {a.ptr for a in forward_args(base=64 * GIB).values()}
    assert user_pointers(again) <= new and not user_pointers(again) & user_pointers(first)
    # The workspaces (maps, templates, flags) are the plan's own, reused.
    assert workspaces(first) == workspaces(again)


def workspaces(launches):
    return {id(a) for _, _, args in launches for a in args if not isinstance(a, (int, np.generic))}


def param(exe, symbol: str, name: str) -> int:
    """The position of parameter `name` of kernel `symbol`, as the manifest lists it."""
    step = next(k for k in exe.manifest.kernels if k.symbol == symbol)
    return [p.name for p in step.params].index(name)


def test_gemm_launches_read_the_checked_offsets(exe, offline):
    from gemmspec.codegen.emit import emit

    exe.program = emit(exe.spec, exe.schedule, inline_tables=False)  # a builder, then the GEMM
    args = forward_args()
    exe(**args)
    (table_name, _, table), (_, _, gemm) = executor.LoadedKernel.launched
    offsets = args["expert_offsets"].ptr
    # The builder reads the user's offsets once, into the checked copy it builds from.
    assert table[param(exe, table_name, "in_expert_offsets")] == offsets
    copy = table[param(exe, table_name, "checked_expert_offsets")]
    assert copy is exe._plans[next(iter(exe._plans))].workspace[1]  # the second workspace: after the flags
    assert [a for a in table if a == offsets] == [offsets] and offsets not in gemm


def test_a_gemm_that_builds_its_table_checks_into_the_flags(exe, offline):
    args = forward_args()
    exe(**args)
    ((name, _, gemm),) = executor.LoadedKernel.launched
    # It reads the user's offsets itself (each block checks them into its shared memory)
    # and block 0 writes the flags, the plan's first workspace; no checked copy exists.
    assert gemm[param(exe, name, "in_expert_offsets")] == args["expert_offsets"].ptr
    assert gemm[param(exe, name, "check_flags")] is exe._plans[next(iter(exe._plans))].workspace[0]
    assert not any(w.name.startswith("check.expert") for w in exe.manifest.workspaces)


def test_new_shapes_make_a_new_plan(exe, offline):
    exe(**forward_args())
    exe(**forward_args(t=T + 1))
    assert len(exe._plans) == 2


def test_plan_cache_is_bounded(exe, offline, monkeypatch):
    monkeypatch.setattr(executor, "PLAN_CACHE", 3)
    for t in range(1, 8):
        exe(**forward_args(t=t))
    assert len(exe._plans) == 3


def test_each_stream_has_its_own_plan(exe, offline, monkeypatch):
    monkeypatch.setattr(executor, "stream_key", lambda stream, objects, device: stream or 0)
    monkeypatch.setattr(executor, "caller_stream", lambda stream, objects, device: Stream(stream))
    exe(stream=11, **forward_args())
    exe(stream=12, **forward_args())
    exe(stream=11, **forward_args())
    assert len(exe._plans) == 2
    handles = [stream.handle for _, stream, _ in executor.LoadedKernel.launched]
    assert handles == [11, 12, 11]  # one kernel per call


def test_capture_takes_over_a_plan_made_before(exe, offline, monkeypatch):
    monkeypatch.setattr(executor, "stream_key", lambda stream, objects, device: stream or 0)
    monkeypatch.setattr(executor, "caller_stream", lambda stream, objects, device: Stream(stream))
    exe(stream=5, **forward_args())  # warm-up
    monkeypatch.setattr(executor, "is_capturing", lambda s: True)
    monkeypatch.setattr(executor, "DeviceBuffer", None)  # nothing may be allocated now
    exe(stream=6, **forward_args())
    warm, captured = exe._plans[next(iter(exe._plans))], exe._plans[list(exe._plans)[1]]
    assert captured.pinned and captured.workspace is warm.workspace
    assert captured.stream.handle == 6 and warm.stream.handle == 5


def test_capture_without_a_warm_up_says_so(exe, offline, monkeypatch):
    monkeypatch.setattr(executor, "is_capturing", lambda s: True)
    with pytest.raises(GemmspecError, match="call it once before capturing"):
        exe(**forward_args())


def test_pinned_plans_are_never_dropped(exe, offline, monkeypatch):
    monkeypatch.setattr(executor, "PLAN_CACHE", 2)
    exe(**forward_args())
    next(iter(exe._plans.values())).pinned = True
    for t in range(1, 6):
        exe(**forward_args(t=t))
    assert any(r.pinned for r in exe._plans.values())


def test_pointer_checks_run_on_every_call(exe, offline):
    exe(**forward_args())
    bad = forward_args()
    bad["y"] = DeviceArray(GIB + 16, (T, N), (N, 1), "bf16", 0)
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'"):
        exe(**bad)


def test_arrays_on_different_devices(exe, offline):
    args = forward_args()
    args["w"] = DeviceArray(9 * GIB, (E, N, K), (N * K, K, 1), "e4m3", 1)
    with pytest.raises(ArgumentError, match=r"different devices \[0, 1\].*w on device 1"):
        exe(**args)


def test_plans_are_per_device(exe, offline):
    exe(**forward_args())
    exe(**forward_args(device=1))
    assert sorted(key[1] for key in exe._plans) == [0, 1]
    assert {run.device for run in exe._plans.values()} == {0, 1}


def flags_reading(values):
    def to_numpy(self, shape, dtype):
        return np.array(values[: int(np.prod(shape))], dtype=np.int32)

    return to_numpy


def test_check_raises_what_the_device_found(exe, offline, monkeypatch):
    stream = Stream()
    monkeypatch.setattr(executor, "caller_stream", lambda s, objects, device: stream)
    monkeypatch.setattr(executor.DeviceBuffer, "to_numpy", flags_reading([0, 1]), raising=False)
    args = forward_args()
    offline[args["expert_offsets"].ptr] = np.array([0, 10, 20, 30, 40, 50, 60, 70, 299], np.int32)
    with pytest.raises(ArgumentError, match=r"must start at 0 and end at T = 300, got 0..299"):
        exe(check=True, **args)
    assert stream.waits == 1


def test_check_passes_when_every_flag_is_clear(exe, offline, monkeypatch):
    stream = Stream()
    monkeypatch.setattr(executor, "caller_stream", lambda s, objects, device: stream)
    monkeypatch.setattr(executor.DeviceBuffer, "to_numpy", flags_reading([0, 0]), raising=False)
    exe(check=True, **forward_args())
    assert stream.waits == 1


def test_debug_mode_checks_every_call(exe, offline, monkeypatch):
    stream = Stream()
    monkeypatch.setattr(executor, "caller_stream", lambda s, objects, device: stream)
    monkeypatch.setattr(executor.DeviceBuffer, "to_numpy", flags_reading([0, 0]), raising=False)
    monkeypatch.setenv("GEMMSPEC_CHECK", "1")
    exe(**forward_args())
    exe(**forward_args())
    assert stream.waits == 2


def test_debug_mode_is_read_on_every_call(exe, offline, monkeypatch):
    stream = Stream()
    monkeypatch.setattr(executor, "caller_stream", lambda s, objects, device: stream)
    monkeypatch.setattr(executor.DeviceBuffer, "to_numpy", flags_reading([0, 0]), raising=False)
    monkeypatch.delenv("GEMMSPEC_CHECK", raising=False)
    waits = []
    for value in (None, "1", "0", "", "yes", None):
        if value is None:
            monkeypatch.delenv("GEMMSPEC_CHECK", raising=False)
        else:
            monkeypatch.setenv("GEMMSPEC_CHECK", value)
        exe(**forward_args())  # planned once, then from the plan
        waits.append(stream.waits)
    assert waits == [0, 1, 1, 1, 2, 2]
    assert len(exe._plans) == 1


def test_torch_stream_is_asked_on_every_call(monkeypatch):
    torch = pytest.importorskip("torch")
    handles = iter([5, 7])
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: next(handles), raising=False)
    monkeypatch.setattr(streams, "_torch_raw_stream", None)
    assert [streams.torch_stream(0), streams.torch_stream(0)] == [5, 7]


class ContextDriver:
    """The driver's current context, per the test's one thread."""

    CUresult = driver.CUresult

    def __init__(self, current):
        self.current, self.switches = current, []

    def cuCtxGetCurrent(self):
        return self.CUresult.CUDA_SUCCESS, driver.CUcontext(self.current)

    def cuCtxSetCurrent(self, ctx):
        self.current = int(ctx)
        self.switches.append(self.current)


def test_a_kept_device_switch_restores_the_caller_each_time(monkeypatch):
    fake = ContextDriver(current=0x100)
    monkeypatch.setattr(streams, "driver", fake)
    monkeypatch.setitem(streams._CONTEXTS, 7, (driver.CUcontext(0x700), 0x700))
    switch = streams.on_device(7)
    for caller in (0x100, 0x200, 0x700, 0):
        fake.current = caller
        with switch:
            assert fake.current == 0x700
        assert fake.current == (caller or 0x700)  # no context before: the device's stays
    assert fake.switches == [0x700, 0x100, 0x700, 0x200, 0x700]


def test_keep_context_restores_the_callers_context(monkeypatch):
    # What the body makes current (cuda.core's set_current) does not outlive it: torch's
    # current device stays the caller's. A caller without a context keeps the body's.
    fake = ContextDriver(current=0)
    monkeypatch.setattr(streams, "driver", fake)
    for caller, after in ((0x100, 0x100), (0, 0x700)):
        fake.current = caller
        with streams.keep_context():
            fake.cuCtxSetCurrent(driver.CUcontext(0x700))
        assert fake.current == after


def test_keep_context_without_a_driver_restores_nothing(monkeypatch):
    class NoDriver:
        def cuCtxGetCurrent(self):
            raise RuntimeError("no NVIDIA driver")

        def cuCtxSetCurrent(self, ctx):
            raise AssertionError("nothing to restore")

    monkeypatch.setattr(streams, "driver", NoDriver())
    with streams.keep_context():
        pass


def test_a_run_launches_under_its_kept_switch(exe, offline, monkeypatch):
    entered = []

    class Switch:
        def __enter__(self):
            entered.append(self)

        def __exit__(self, *exc):
            pass

    monkeypatch.setattr(executor, "on_device", lambda device: Switch())
    exe(**forward_args())
    exe(**forward_args(base=64 * GIB))
    run = next(iter(exe._plans.values()))
    # Planning and packing enter a switch of their own; both launches the run's.
    assert len(entered) == 4 and entered[2] is entered[3] is run._bound[2]


def test_take_puts_names_in_order():
    assert executor.take(("b", "a"))({"a": 1, "b": 2}) == (2, 1)
    assert executor.take(("a",))({"a": 1}) == (1,)
    with pytest.raises(KeyError):
        executor.take(("a", "c"))({"a": 1})


def test_anchored_scale_rows_checked_against_their_range(offline):
    exe = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_wgrad.gspec")
    t = 1000
    # Buffers of T + 120 rows: 15 rows of padding for each of the 8 experts (pad 16).
    seg = lambda n, c: DeviceArray(GIB * (c + 1), (t + 120, n), (n, 1), "e4m3", 0)  # noqa: E731
    args = {
        "dy": seg(4096, 0),
        "dy_scale": DeviceArray(GIB * 10, (7, 4096), (4096, 1), "f32", 0),  # too few rows
        "x": seg(7168, 2),
        "x_scale": DeviceArray(GIB * 12, (12, 7168), (7168, 1), "f32", 0),
        "dw": DeviceArray(GIB * 20, (8, 4096, 7168), (4096 * 7168, 7168, 1), "f32", 0),
        "expert_offsets": DeviceArray(GIB * 30, (9,), (1,), "i32", 0),
    }
    with pytest.raises(ArgumentError, match=r"scale 'dy_scale' must have shape \[8..15, 4096\]"):
        exe(**args)


def test_stream_key_touches_no_device_for_plain_arrays():
    assert streams.stream_key(None, [object()], 0) == 0
    assert streams.stream_key(1234, [], 0) == 1234


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_offsets_check_compiles(path):
    """Every example's offsets check is valid CUDA for sm_90a (NVRTC, no GPU needed)."""
    from gemmspec.runtime.nvrtc import compile_cubin

    spec = gemmspec.build(path).spec
    v = validation_kernel(spec)
    if v is None:
        assert not any(g.tensor for g in spec.groups)
        return
    assert len(v.checks) >= len(v.tensors)
    assert compile_cubin(v.source, name=v.name, include_dirs=[include_dir()]).cubin


CAPACITY = moe_spec("capacity_moe", n=72, k=300, e=4, fp8=True, scales_major_t=True, capacity=True)


def test_capacity_offsets_end_at_or_below(offline):
    exe = gemmspec.build(CAPACITY)
    assert "ragged(T, offsets=offs, capacity)" in exe.explain()
    messages = [c.message for c in exe.manifest.offsets_check.checks]
    assert "'offs' must start at 0 and end at or below T" in messages
    gib = 1 << 30
    args = {
        "x": DeviceArray(gib, (500, 300), (300, 1), "e4m3", 0),
        "x_scale": DeviceArray(2 * gib, (500, 3), (1, 500), "f32", 0),
        "w": DeviceArray(3 * gib, (4, 72, 300), (72 * 300, 300, 1), "e4m3", 0),
        "w_scale": DeviceArray(4 * gib, (4, 1, 3), (3, 3, 1), "f32", 0),
        "y": DeviceArray(5 * gib, (500, 72), (72, 1), "bf16", 0),
        "offs": DeviceArray(6 * gib, (5,), (1,), "i32", 0),
    }
    offline[6 * gib] = np.array([0, 10, 10, 200, 400], np.int32)  # ends below T = 500
    exe.prepare(None, **args)
    offline[6 * gib] = np.array([0, 10, 10, 200, 501], np.int32)
    with pytest.raises(ArgumentError, match=r"end at or below T = 500, got 0..501"):
        exe.prepare(None, **args)
