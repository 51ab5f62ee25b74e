"""The planned call's fast path with no GPU: a call of a known signature finds its plan
from the arguments' metadata, checks only the pointers (against ranges the plan
computed once) and launches with parameters packed once. Whatever changes between
calls is still checked: pointers, shapes, strides, dtypes, devices, streams, the
read-only flag. Kernels, buffers and streams are the fakes of conftest; torch CPU
tensors stand in for CUDA tensors where torch is installed."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError, GemmspecError
from gemmspec.runtime import executor, launch
from gemmspec.runtime.arrays import DeviceArray

FORWARD = Path(__file__).resolve().parents[2] / "examples" / "moe_fp8_forward.gspec"
GIB = 1 << 30
T, N, K, E = 300, 4096, 7168, 8


def forward_args(base=GIB, t=T, device=0, **replace):
    args = {
        "x": DeviceArray(base, (t, K), (K, 1), "e4m3", device),
        "x_scale": DeviceArray(base + GIB, (t, K // 128), (1, t), "f32", device),
        "w": DeviceArray(base + 2 * GIB, (E, N, K), (N * K, K, 1), "e4m3", device),
        "w_scale": DeviceArray(
            base + 3 * GIB, (E, N // 128, K // 128), (N * K // 128**2, K // 128, 1), "f32", device
        ),
        "y": DeviceArray(base + 4 * GIB, (t, N), (N, 1), "bf16", device),
        "expert_offsets": DeviceArray(base + 5 * GIB, (E + 1,), (1,), "i32", device),
    }
    args.update(replace)
    return args


@pytest.fixture
def exe():
    return gemmspec.build(FORWARD)


def launches():
    out = executor.LoadedKernel.launched[:]
    executor.LoadedKernel.launched.clear()
    return out


def builder_param(name: str) -> int:
    """Where parameter `name` of the forward spec's one kernel (a GEMM that checks the
    offsets and builds its leaf table itself) sits in its launch's arguments."""
    (step,) = gemmspec.build(FORWARD).manifest.kernels
    return [p.name for p in step.params].index(name)


OFFSETS = builder_param("in_expert_offsets")  # the user's offsets, read by the check
SIZE_T = builder_param("size_T")


def test_a_planned_call_takes_the_fast_path(exe, offline, monkeypatch):
    exe(**forward_args())
    launches()
    # From here on nothing may convert an argument or re-check its metadata.
    monkeypatch.setattr(executor, "as_device_array", None)
    monkeypatch.setattr(exe, "_check_metadata", None)
    monkeypatch.setattr(exe, "_plan_call", None)
    moved = forward_args(base=64 * GIB)
    exe(**moved)
    ((_, _, table),) = launches()
    assert table[OFFSETS] == moved["expert_offsets"].ptr
    assert moved["x"].ptr in table and moved["y"].ptr in table
    assert not {a.ptr for a in forward_args().values()} & set(table)


def test_pointer_checks_still_run_on_a_planned_signature(exe, offline):
    exe(**forward_args())
    cases = [
        (forward_args(base=GIB + 8), "must be 16-byte aligned"),  # every pointer moved by 8
        (forward_args(y=DeviceArray(0, (T, N), (N, 1), "bf16", 0)), "null data pointer"),
        (forward_args(expert_offsets=DeviceArray(7 * GIB + 2, (E + 1,), (1,), "i32", 0)), "4-byte aligned"),
        (forward_args(y=DeviceArray(GIB + 16, (T, N), (N, 1), "bf16", 0)), "output 'y' overlaps input 'x'"),
        (forward_args(y=DeviceArray(2 * GIB, (T, N), (N, 1), "bf16", 0)), "output 'y' overlaps scale 'x_scale'"),
    ]
    for args, message in cases:
        with pytest.raises(ArgumentError, match=message):
            exe(**args)
    assert len(exe._plans) == 1
    # Adjacent ranges are fine: y ends where the offsets begin.
    y_end = 5 * GIB + T * N * 2
    exe(**forward_args(expert_offsets=DeviceArray(y_end, (E + 1,), (1,), "i32", 0)))
    with pytest.raises(ArgumentError, match="overlaps offsets"):
        exe(**forward_args(expert_offsets=DeviceArray(y_end - 16, (E + 1,), (1,), "i32", 0)))


def test_changed_metadata_is_checked_again_or_planned_anew(exe, offline):
    exe(**forward_args())
    bad = [
        (forward_args(y=DeviceArray(5 * GIB, (T, N), (N, 1), "f32", 0)), "tensor 'y' holds f32 data"),
        (forward_args(x=DeviceArray(GIB, (T, K), (1, T), "e4m3", 0)), "element strides"),
        (forward_args(y=DeviceArray(5 * GIB, (T + 1, N), (N, 1), "bf16", 0)), "dim T is 300"),
        (forward_args(y=DeviceArray(5 * GIB, (T, N), (N, 1), "bf16", 0, readonly=True)), "read-only"),
        (forward_args(w=DeviceArray(3 * GIB, (E, N, K), (N * K, K, 1), "e4m3", 1)), "different devices"),
    ]
    for args, message in bad:
        with pytest.raises(ArgumentError, match=message):
            exe(**args)
    assert len(exe._plans) == 1
    exe(**forward_args(t=T + 8))  # other shapes: a plan of their own
    assert len(exe._plans) == 2


def test_alternating_signatures_each_launch_their_own_plan(exe, offline):
    for t in (T, T + 8, T, T, T + 8):
        exe(**forward_args(t=t))
    assert len(exe._plans) == 2
    # The GEMM's offsets check takes T.
    sizes = [int(args[SIZE_T]) for name, _, args in launches()]
    assert sizes == [T, T + 8, T, T, T + 8]


def test_a_dropped_recent_plan_is_not_used_again(exe, offline, monkeypatch):
    monkeypatch.setattr(executor, "PLAN_CACHE", 1)
    exe(**forward_args())
    exe(**forward_args(t=T + 8))  # drops the first plan
    exe(**forward_args())  # planned again, not taken from the dropped one
    assert len(exe._plans) == 1
    (key,) = exe._plans
    assert exe._recent == (key, exe._plans[key])
    # Every plan pinned: a new one is made, used and dropped at once.
    exe._plans[key].pinned = True
    exe(**forward_args(t=T + 8))
    assert list(exe._plans) == [key] and exe._recent[0] == key
    exe(**forward_args(t=T + 8))
    sizes = [int(args[SIZE_T]) for name, _, args in launches()]
    assert sizes == [T, T + 8, T, T + 8, T + 8]


def reference_guard(guard, p):
    """The pointer rules of `_PointerGuard`, spelt out."""
    if any(p[i] % a for i, a in guard.aligned) or any(not p[i] for i in guard.present):
        return False
    return not any(p[i] + lo < p[j] + hi2 and p[j] + lo2 < p[i] + hi for i, lo, hi, j, lo2, hi2 in guard.apart)


def test_pointer_guard_expression_keeps_the_rules():
    guard = executor._PointerGuard(
        aligned=((0, 16), (1, 4)),
        present=(0, 2),
        apart=((0, 0, 64, 1, 0, 32), (0, 0, 64, 2, -48, 16)),  # the third has negative strides
    )
    rng = np.random.default_rng(0)
    for _ in range(2000):
        p = tuple(int(x) for x in rng.integers(0, 40, 3) * 4)
        assert guard.check(p) == reference_guard(guard, p), p
    assert executor._PointerGuard((), (), ()).check((0, 3))


def test_unknown_and_missing_names_say_so(exe, offline):
    exe(**forward_args())
    args = forward_args()
    args["z"] = args.pop("y")
    with pytest.raises(ArgumentError, match="missing tensor"):
        exe(**args)
    with pytest.raises(ArgumentError, match="unknown argument"):
        exe(**forward_args(), z=1)


def test_a_capture_launches_on_its_own_stream(exe, offline, monkeypatch):
    class Stream:
        def __init__(self, handle):
            self.handle = handle

    monkeypatch.setattr(executor, "stream_key", lambda stream, objects, device: stream or 0)
    monkeypatch.setattr(executor, "caller_stream", lambda stream, objects, device: Stream(stream))
    exe(stream=5, **forward_args())
    monkeypatch.setattr(executor, "is_capturing", lambda s: True)
    exe(stream=6, **forward_args())
    exe(stream=5, **forward_args())
    handles = [stream.handle for _, stream, _ in launches()]
    assert handles == [5, 6, 5]  # one kernel per call


def test_prepared_enqueue_launches_on_its_arrays_or_others(exe, offline):
    offline[6 * GIB] = np.array([0, 10, 20, 30, 40, 50, 60, 70, 300], np.int32)
    args = forward_args(expert_offsets=DeviceArray(6 * GIB, (E + 1,), (1,), "i32", 0))
    run = exe.prepare(None, **args)
    run.enqueue()
    run.enqueue(forward_args(base=64 * GIB))
    done = launches()
    first, second = done[:1], done[1:]
    assert first[0][2][OFFSETS] == 6 * GIB  # the offsets check reads the prepared offsets
    assert second[0][2][OFFSETS] == 69 * GIB  # then those passed to enqueue
    assert [name for name, _, _ in first] == [name for name, _, _ in second]


# ---- torch tensors -----------------------------------------------------------------------


@pytest.fixture
def torch_cuda(monkeypatch):
    """torch CPU tensors that pass for tensors on cuda:0 (stream: torch's default)."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cuda", 0)))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(executor, "torch_stream", lambda device: 0)
    monkeypatch.setattr(executor, "_TORCH_TENSORS", ())
    return torch


def torch_args(torch, t=64):
    f8 = torch.float8_e4m3fn
    return {
        "x": torch.empty(t, K, dtype=f8),
        "x_scale": torch.empty(K // 128, t).t(),
        "w": torch.empty(E, N, K, dtype=f8),
        "w_scale": torch.empty(E, N // 128, K // 128),
        "y": torch.empty(t, N, dtype=torch.bfloat16),
        "expert_offsets": torch.zeros(E + 1, dtype=torch.int32),
    }


def test_torch_tensors_reuse_the_plan_and_are_checked_each_call(exe, offline, torch_cuda):
    torch = torch_cuda
    args = torch_args(torch)
    exe(**args)
    exe(**args)
    assert len(exe._plans) == 1
    (_, _, table) = launches()[1]
    assert table[OFFSETS] == args["expert_offsets"].data_ptr()
    # The same tensor object, changed in place: new pointer, new shape, new dtype.
    storage = torch.empty(64 * N + 8, dtype=torch.bfloat16)
    args["y"] = storage[1:].as_strided((64, N), (N, 1))  # 2 bytes past an aligned start
    with pytest.raises(ArgumentError, match="'y' must be 16-byte aligned"):
        exe(**args)
    args["y"] = torch.empty(64, N, dtype=torch.float32)
    with pytest.raises(ArgumentError, match="tensor 'y' holds f32 data"):
        exe(**args)
    args["y"] = torch.empty(64, N, dtype=torch.bfloat16)
    args["y"].resize_(65, N)
    with pytest.raises(ArgumentError, match="dim T is 64"):
        exe(**args)
    args["y"] = args["x"].view(torch.bfloat16)[:, : N]  # the same memory as x
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'|'y' must have"):
        exe(**args)
    assert len(exe._plans) == 1


def test_torch_tensor_not_on_cuda_is_rejected_after_a_plan(exe, offline, torch_cuda, monkeypatch):
    torch = torch_cuda
    args = torch_args(torch)
    exe(**args)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: False))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: torch.device("cpu")))
    with pytest.raises(ArgumentError, match="not a CUDA device"):
        exe(**args)


def test_torch_stream_is_part_of_the_key(exe, offline, torch_cuda, monkeypatch):
    current = [0]
    monkeypatch.setattr(executor, "torch_stream", lambda device: current[0])
    args = torch_args(torch_cuda)
    exe(**args)
    current[0] = 77
    exe(**args)
    assert sorted(key[2] for key in exe._plans) == [0, 77]


# ---- packed launches ---------------------------------------------------------------------


def bare_kernel(sizes):
    k = object.__new__(launch.LoadedKernel)
    k.name, k.device = "k", 0
    k._param_sizes, k._smem_limit = sizes, 48 * 1024
    k._cu_function = launch.driver.CUfunction(0)
    return k


class HandleStream:
    handle = 1234


def recording_driver(monkeypatch, count):
    """The driver's launch, recording grid, block, smem, stream and the values of the
    first `count` parameters."""
    seen = []

    def fake_launch(f, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        cells = [ctypes.c_uint64.from_address(params + 8 * i).value for i in range(count)]
        values = [ctypes.c_uint64.from_address(c).value for c in cells]
        seen.append(((gx, gy, gz), (bx, by, bz), smem, int(stream), values))
        return (launch.driver.CUresult.CUDA_SUCCESS,)

    monkeypatch.setattr(launch, "_launch_kernel", fake_launch)
    monkeypatch.setattr(launch, "current_stream", lambda stream, device=0: stream)
    return seen


def test_bound_launch_packs_once_and_reads_pointers_from_its_cells(monkeypatch):
    seen = recording_driver(monkeypatch, 4)
    k = bare_kernel([8, 4, 8, 8])
    buf = DeviceArray(0x7000, (4,), (1,), "f32", 0)
    cells = launch.ArgumentCells(2)
    bound = k.bind((3, 2), 128, 0, HandleStream(), [None, np.int32(-2), np.int64(5), buf], {0: 1}, cells)
    cells.write((0x1000, 0x2000))
    bound.launch()
    cells.write((0x1000, 0x3000))
    bound.launch()
    assert seen[0][:4] == ((3, 2, 1), (128, 1, 1), 0, 1234)
    assert seen[0][4] == [0x2000, 0xFFFFFFFE, 5, 0x7000]
    assert seen[1][4] == [0x3000, 0xFFFFFFFE, 5, 0x7000]


def test_launches_bound_to_one_set_of_cells_share_each_pointer(monkeypatch):
    seen = recording_driver(monkeypatch, 2)
    cells = launch.ArgumentCells(3)
    first = bare_kernel([8, 8]).bind(1, 32, 0, HandleStream(), [None, None], {0: 0, 1: 2}, cells)
    second = bare_kernel([8, 4]).bind(1, 32, 0, HandleStream(), [None, np.int32(7)], {0: 2}, cells)
    for pointers in ((16, 32, 48), (16, 32, 48), (64, 80, 96)):  # the same ones twice
        cells.write(pointers)
        first.launch()
        second.launch()
    assert [values for *_, values in seen] == [[16, 48], [48, 7]] * 2 + [[64, 96], [96, 7]]


def test_bind_checks_what_launch_checks(monkeypatch):
    monkeypatch.setattr(launch, "current_stream", lambda stream, device=0: stream)
    k = bare_kernel([8, 4])
    cells = launch.ArgumentCells(1)
    with pytest.raises(ArgumentError, match="takes 2 arguments, got 3"):
        k.bind(1, 32, 0, HandleStream(), [None, np.int32(1), np.int32(2)], {0: 0}, cells)
    with pytest.raises(ArgumentError, match="argument 1 of 'k' is a 4-byte parameter; got 8"):
        k.bind(1, 32, 0, HandleStream(), [None, np.int64(1)], {0: 0}, cells)
    with pytest.raises(ArgumentError, match="python int|Python int"):
        k.bind(1, 32, 0, HandleStream(), [None, 3], {0: 0}, cells)
    with pytest.raises(ArgumentError, match="slot"):
        k.bind(1, 32, 0, HandleStream(), [DeviceArray(16, (1,), (1,), "f32", 0), np.int32(1)], {0: 0}, cells)
    with pytest.raises(ArgumentError, match="lives on device 1"):
        k.bind(1, 32, 0, HandleStream(), [DeviceArray(16, (1,), (1,), "f32", 1), np.int32(1)], {}, cells)
    with pytest.raises(ArgumentError, match="reads cell 1 of 1"):
        k.bind(1, 32, 0, HandleStream(), [None, np.int32(1)], {0: 1}, cells)


def test_a_failed_launch_raises(monkeypatch):
    monkeypatch.setattr(launch, "current_stream", lambda stream, device=0: stream)
    failed = launch.driver.CUresult.CUDA_ERROR_INVALID_VALUE
    monkeypatch.setattr(launch, "_launch_kernel", lambda *a: (failed,))
    cells = launch.ArgumentCells(1)
    bound = bare_kernel([8]).bind(1, 32, 0, HandleStream(), [None], {0: 0}, cells)
    cells.write((16,))
    with pytest.raises(GemmspecError, match="launching k .* failed: CUDA_ERROR_INVALID_VALUE"):
        bound.launch()


def test_a_dropped_executable_frees_its_plans_without_the_cyclic_collector(offline):
    # Workspaces left to the cyclic collector may be freed in the middle of a CUDA-graph
    # capture elsewhere, which invalidates it: plans must not refer back strongly.
    import gc
    import weakref

    exe = gemmspec.build(FORWARD)
    gc.disable()
    try:
        exe(**forward_args())
        buffers = [weakref.ref(b) for run in exe._plans.values() for b in run.workspace]
        assert buffers
        launches()  # the fake kernels' record of arguments holds buffers too
        del exe
        assert all(ref() is None for ref in buffers)
    finally:
        gc.enable()


# ---- gemmspec.torch ops ------------------------------------------------------------------


@pytest.fixture
def torch_op(exe, offline, torch_cuda, monkeypatch):
    """The torch op of the forward spec, calling `exe`, with CPU kernels standing in for
    its CUDA ones (the tensors are CPU tensors underneath); `op.dispatched` records each
    call that went through the dispatcher."""
    import gemmspec.torch as gt

    torch = torch_cuda
    op = gt.op(FORWARD)
    monkeypatch.setattr(op, "exe", exe)
    monkeypatch.setattr(op, "dispatched", [], raising=False)

    def run_out(*args):
        op.dispatched.append("in place")
        op._run_out(*args)

    def run(*args):
        op.dispatched.append("functional")
        return op._run(*args)

    lib = torch.library.Library("gemmspec", "IMPL")
    lib.impl(f"{op.name}_out", run_out, "CPU")
    lib.impl(op.name, run, "CPU")
    yield op
    lib._destroy()


def test_a_planned_op_call_skips_the_dispatcher(torch_op, torch_cuda):
    op, args = torch_op, torch_args(torch_cuda)
    assert op(**args) is args["y"]
    assert op.dispatched == ["in place"] and len(launches()) == 1  # planned there
    moved = torch_args(torch_cuda)
    assert op(**moved) is moved["y"]
    assert op.dispatched == ["in place"]
    ((_, _, table),) = launches()
    assert table[OFFSETS] == moved["expert_offsets"].data_ptr() and moved["y"].data_ptr() in table


def test_op_calls_the_plan_does_not_fit_take_the_dispatcher(torch_op, torch_cuda):
    torch = torch_cuda
    op, args = torch_op, torch_args(torch)
    op(**args)
    op(**torch_args(torch, t=72))  # other shapes: planned through the dispatcher
    assert op.dispatched == ["in place"] * 2 and len(op.exe._plans) == 2
    bad = dict(args, y=torch.empty(64, N, dtype=torch.float32))
    with pytest.raises(ArgumentError, match="tensor 'y' holds f32 data"):
        op(**bad)
    storage = torch.empty(64 * N + 8, dtype=torch.bfloat16)
    with pytest.raises(ArgumentError, match="'y' must be 16-byte aligned"):
        op(**dict(args, y=storage[1:].as_strided((64, N), (N, 1))))
    assert op.dispatched == ["in place"] * 4
    sparse = torch.zeros(E + 1, dtype=torch.int32).to_sparse()
    with pytest.raises(NotImplementedError, match="SparseCPU"):  # the dispatcher's word
        op(**dict(args, expert_offsets=sparse))


def test_op_calls_on_another_torch_stream_get_their_own_plan(torch_op, torch_cuda, monkeypatch):
    current = [0]
    monkeypatch.setattr(executor, "torch_stream", lambda device: current[0])
    op, args = torch_op, torch_args(torch_cuda)
    for stream in (0, 0, 9, 9, 0):
        current[0] = stream
        op(**args)
    assert op.dispatched == ["in place"] * 2  # each stream's first call plans
    assert sorted(key[2] for key in op.exe._plans) == [0, 9]


# Each watcher is made when a test runs (torch is optional: the module must import without it).
def _passing_dispatch_mode():
    torch = pytest.importorskip("torch")

    class PassingDispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return PassingDispatchMode()


def _passing_function_mode():
    torch = pytest.importorskip("torch")

    class PassingFunctionMode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    return PassingFunctionMode()


WATCHERS = {
    "dispatch mode": _passing_dispatch_mode,
    "function mode": _passing_function_mode,
    "profiler": lambda: pytest.importorskip("torch").autograd.profiler.profile(),
}


@pytest.mark.parametrize("watcher", sorted(WATCHERS))
def test_watched_op_calls_take_the_dispatcher(torch_op, torch_cuda, watcher):
    op, args = torch_op, torch_args(torch_cuda)
    op(**args)
    with WATCHERS[watcher]():
        op(**args)
    assert op.dispatched == ["in place"] * 2
    op(**args)
    assert op.dispatched == ["in place"] * 2


def test_op_calls_autograd_would_see_take_the_dispatcher(torch_op, torch_cuda, monkeypatch):
    torch = torch_cuda
    op, args = torch_op, torch_args(torch)
    args["w_scale"].requires_grad_(True)
    op(**args)
    op(**args)
    with torch.no_grad():
        op(**args)  # no grad mode: nothing to record
    assert op.dispatched == ["in place"] * 2
    monkeypatch.setattr(op, "direct", False)
    args["w_scale"].requires_grad_(False)
    op(**args)
    assert op.dispatched == ["in place"] * 3


@pytest.mark.filterwarnings("ignore:.*torch.jit.trace. is deprecated")
def test_transforms_and_tracing_count_as_watchers(torch_cuda):
    import gemmspec.torch as gt

    torch = torch_cuda
    seen = []

    def probe(t):
        seen.append(gt._unwatched())
        return t + 1

    probe(torch.ones(2))
    torch.func.vmap(probe)(torch.ones(2, 3))
    torch.jit.trace(probe, torch.ones(2), check_trace=False)
    assert seen == [True, False, False]


def test_fresh_outputs_without_the_dispatcher(torch_op, torch_cuda, monkeypatch):
    torch = torch_cuda
    op = torch_op
    inputs = torch_args(torch)
    del inputs["y"]
    # The outputs would be allocated on the inputs' device, which is a CPU one here.
    made = []

    def allocate(ins):
        made.append([torch.empty(size, dtype=torch.bfloat16) for size in op._sizes_of(ins)])
        return tuple(made[-1])

    monkeypatch.setattr(op, "_allocate", allocate)
    first, second = op(**inputs), op(**inputs)
    assert op.dispatched == ["in place"]  # the first one planned there, with the outputs made
    assert first is made[0][0] and second is made[1][0] and tuple(second.shape) == (64, N)
    ((_, _, table),) = launches()[1:]
    assert second.data_ptr() in table
