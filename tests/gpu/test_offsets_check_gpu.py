"""On a Hopper GPU: the device check of the offsets, run by launch 0's leaf-table builder
and, for comparison, as a kernel of its own (`emit(..., fuse_check=False)`, the launch
sequence from before it was fused). A spec of two launches whose second reads the
copies the first builder checked: bad offsets of either group compute nothing in either
launch, `check=True` raises what the device found, and the next good call clears the
flags and writes everything, the same with the check fused or not. A spec whose
pre-passes read the offsets runs the check first and computes nothing with bad ones.
Skipped elsewhere, with a reason."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from gemmspec.codegen.emit import emit
from gemmspec.errors import ArgumentError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import dim_size, random_inputs, random_runtime
from gemmspec.runtime.arrays import DeviceBuffer
from gemmspec.runtime.executor import Executable
from gemmspec.runtime.verify import device_arguments, run_random

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]

# Ragged edges in both groups: empty segments, 1, 127 and 129 rows; T = 1000.
SPLIT_LENGTHS = {"expert": [0, 1, 127, 129, 300, 43, 0, 400], "lora": [127, 129, 0, 744]}

REQUANT_FIRST = """
gemm wgrad_requant {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor dy : e4m3 [T, N] scale f32 [1, 128]
  tensor x  : e4m3 [T, K] scale f32 [1, 128]
  tensor dy_q : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = requantize(dy)
  tensor x_q  : e4m3 [T, K] layout segment_major(expert) scale f32 [128, 1] per expert = requantize(x)
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy_q[t, n] * x_q[t, k]
}
"""


def executable(lowered, fused: bool) -> Executable:
    spec, schedule = lowered.spec, lowered.schedule
    exe = Executable(spec, schedule, emit(spec, schedule, fuse_check=fused))
    assert exe.manifest.offsets_check.fused == fused
    return exe


def split_nest():
    (x,) = lower_file(ROOT / "examples" / "split_nest.gspec")
    return x


def call_arguments(spec, lengths, seed, poison=True):
    """Random inputs, outputs poisoned with NaN (or random for `+=`), good offsets."""
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths=lengths)
    data = random_inputs(spec, rt, rng)
    init = {}
    for g in spec.gemms:
        t = spec.tensor(g.out.tensor)
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        init[t.name] = rng.standard_normal(shape) if g.accumulate or not poison else np.full(shape, np.nan)
    args, keep, outputs = device_arguments(spec, rt, data, init)
    return rt, args, keep, outputs


def read(outputs) -> dict[str, np.ndarray]:
    """The outputs' values; their guard bytes (and bytes of no element) must be as uploaded."""
    for n, (buf, _) in outputs.items():
        assert buf.changed_outside().size == 0, f"{n}: a guard byte changed"
    return {n: buf.to_numpy(host.shape, host.dtype).astype(np.float64) for n, (buf, host) in outputs.items()}


def offsets_arg(values) -> tuple[object, DeviceBuffer]:
    buf = DeviceBuffer.from_numpy(np.asarray(values, np.int32))
    return buf.view((len(values),), "i32"), buf


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "alone"])
@pytest.mark.parametrize(
    "tensor, fragment",
    [
        ("expert_offsets", "'expert_offsets' must start at 0 and end at T"),  # launch 0's group
        ("lora_offsets", "'lora_offsets' must be non-decreasing along each row"),  # launch 1's only
    ],
)
def test_bad_offsets_of_either_launch_compute_nothing(fused, tensor, fragment):
    x = split_nest()
    exe = executable(x, fused)
    rt, good, keep, outputs = call_arguments(x.spec, SPLIT_LENGTHS, seed=3)
    values = np.asarray(rt.tensors[tensor]).copy()
    if tensor == "expert_offsets":
        values[-1] -= 1  # ends one row short of T
    else:
        values[1], values[2] = values[2] + 5, values[1]  # 0, 261, 127, ...: goes down
    bad = dict(good)
    bad[tensor], buf = offsets_arg(values)
    exe(**bad)  # no wait, no error: the device saw it
    assert all(np.isnan(v).all() for v in read(outputs).values()), "a launch wrote with bad offsets"
    with pytest.raises(ArgumentError, match=fragment):
        exe(check=True, **bad)
    assert all(np.isnan(v).all() for v in read(outputs).values())
    # The same plan with good offsets: the flags are written again (clear) and every row
    # of both outputs lies in some segment, so everything is written.
    exe(check=True, **good)
    assert len(exe._plans) == 1
    assert not any(np.isnan(v).any() for v in read(outputs).values())
    del keep, buf


def test_fused_and_alone_compute_the_same_and_match_the_reference():
    x = split_nest()
    results = []
    for fused in (True, False):
        exe = executable(x, fused)
        report = run_random(exe, lengths=SPLIT_LENGTHS, seed=4, repeats=0)
        assert report.ok, report.describe()
        _, args, keep, outputs = call_arguments(x.spec, SPLIT_LENGTHS, seed=5)
        exe(check=True, **args)
        results.append(read(outputs))
        del keep
    fused, alone = results
    assert all(np.array_equal(fused[n], alone[n]) for n in fused)


def test_a_check_of_its_own_runs_before_the_prepasses_that_read_offsets():
    (x,) = lower_file(parse(REQUANT_FIRST, "wgrad_requant.gspec"))
    exe = Executable(x.spec, x.schedule, emit(x.spec, x.schedule))
    assert [k.role for k in exe.manifest.kernels][:3] == ["check", "requantize", "requantize"]
    lengths = {"expert": [0, 1, 127, 129 + 256]}
    report = run_random(exe, lengths=lengths, seed=6, repeats=0)
    assert report.ok, report.describe()
    rt, args, keep, outputs = call_arguments(x.spec, lengths, seed=7)
    before = read(outputs)
    values = np.asarray(rt.tensors["offs"]).copy()
    values[-1] -= 1  # does not end at T (and still never decreases)
    args["offs"], buf = offsets_arg(values)
    exe(**args)
    assert all(np.array_equal(before[n], v) for n, v in read(outputs).items()), "dw changed with bad offsets"
    with pytest.raises(ArgumentError, match="'offs' must start at 0 and end at T"):
        exe(check=True, **args)
    del keep, buf
