"""On a Hopper GPU: GEMM kernels launched as programmatic dependents of their leaf-table
builders. The outputs are bit for bit those of ordinary launches (GEMMSPEC_PDL=0); a GEMM
never reads the table of the call before (offsets changed in place between calls on one
plan, the tables alternating); a CUDA-graph capture records the dependency as a
programmatic edge (none with GEMMSPEC_PDL=0) and its replay matches the eager call; and
torch's current stream orders the work around a call. Skipped elsewhere, with a reason."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.bench import moe_spec
from gemmspec.reference.data import dim_size, random_inputs, random_runtime
from gemmspec.runtime.verify import device_arguments, run_random

sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]
EDGE = [0, 1, 127, 129, 4097]

CASES = {
    "moe_fp8_forward": {"expert": [*EDGE, 300, 1000, 512]},
    "split_nest": {"expert": [*EDGE, 300, 1000, 512], "lora": [127, 129, 4097, 1813]},
    "lora_moe_scaled": {"lora": [0, 1, 4097, 1813], "expert": None},
    "moe_fp8_wgrad": {"expert": [*EDGE, 300, 1000, 512]},
}


def with_builders(exe):
    """The executable with a leaf-table builder before each GEMM (the programmatic edge),
    also where the GEMM would build its table itself."""
    from gemmspec.codegen.emit import emit

    exe.program = emit(exe.spec, exe.schedule, inline_tables=False)
    assert all(not x.gemm.inline_table for x in exe.program.launches)
    return exe


def outputs_of(exe, lengths, seed):
    """One call on fresh random inputs; the outputs as float64 host arrays."""
    spec = exe.spec
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths={k: v for k, v in lengths.items() if v is not None})
    data = random_inputs(spec, rt, rng)
    init = {}
    for g in spec.gemms:
        t = spec.tensor(g.out.tensor)
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        init[t.name] = rng.standard_normal(shape) if g.accumulate else np.full(shape, np.nan)
    args, keep, outs = device_arguments(spec, rt, data, init)
    exe(check=True, **args)
    got = {n: buf.to_numpy(host.shape, host.dtype).astype(np.float64) for n, (buf, host) in outs.items()}
    assert all(buf.changed_outside().size == 0 for buf, _ in outs.values()), "a guard byte changed"
    del keep
    return got


@pytest.mark.parametrize("name", sorted(CASES))
def test_programmatic_and_ordinary_launches_agree_bit_for_bit(name, monkeypatch):
    path = ROOT / "examples" / f"{name}.gspec"
    lengths = CASES[name]
    monkeypatch.setenv("GEMMSPEC_PDL", "1")
    exe = with_builders(gemmspec.build(path))
    report = run_random(exe, lengths={k: v for k, v in lengths.items() if v is not None}, seed=1, repeats=0)
    assert report.ok, report.describe()
    with_pdl = outputs_of(exe, lengths, seed=2)
    monkeypatch.setenv("GEMMSPEC_PDL", "0")  # read when a plan is packed: a new executable
    without = outputs_of(with_builders(gemmspec.build(path)), lengths, seed=2)
    for n in with_pdl:
        assert np.array_equal(with_pdl[n], without[n], equal_nan=True), n


def test_a_gemm_reads_the_table_of_its_own_call():
    """Offsets changed in place between back-to-back calls of one plan: each call's GEMM
    must see the table its own builder wrote, never the one before."""
    torch = pytest.importorskip("torch")
    exe = gemmspec.build(moe_spec(n=256, k=256, e=4, out="f32"))
    dev = torch.device("cuda:0")
    t = 8192
    x = torch.randn(t, 256, device=dev).to(torch.bfloat16)
    w = torch.randn(4, 256, 256, device=dev).to(torch.bfloat16)
    sets = [[0, 4096, 4096, 8000, t], [0, 0, 129, 8191, t]]
    offs = torch.tensor(sets[0], dtype=torch.int32, device=dev)
    guarded = GuardedTensor((t, 256), torch.float32, fill=0.0)
    y = guarded.tensor
    expected = []
    for s in sets:
        expected.append(
            torch.cat([x[a:b].double() @ w[e].double().T for e, (a, b) in enumerate(zip(s[:-1], s[1:]))])
        )
    staged = [torch.tensor(s, dtype=torch.int32, device=dev) for s in sets]
    exe(x=x, w=w, y=y, offs=offs)  # plans
    results = []
    for i in range(40):
        offs.copy_(staged[i % 2])  # on the current stream, between the calls
        exe(x=x, w=w, y=y, offs=offs)
        results.append(y.clone())
    torch.cuda.synchronize()
    for i, got in enumerate(results):
        assert_close_elementwise(got, expected[i % 2], dtype="f32", name=f"call {i}")
    assert guarded.changed_outside().size == 0


def _programmatic_edges(graph) -> int:
    from cuda.bindings import driver

    err, _, _, _, count = driver.cuGraphGetEdges(graph, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    err, _, _, data, count = driver.cuGraphGetEdges(graph, count)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    kind = driver.CUgraphDependencyType.CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
    return sum(1 for d in data[:count] if d.type == kind)


@pytest.mark.parametrize("pdl", ["1", "0"])
def test_a_capture_records_the_programmatic_edge_and_replays(pdl, monkeypatch):
    from cuda.bindings import driver

    from gemmspec.runtime.arrays import get_device

    monkeypatch.setenv("GEMMSPEC_PDL", pdl)
    exe = gemmspec.build(ROOT / "examples" / "split_nest.gspec")
    stream = get_device(0).create_stream()
    handle = driver.CUstream(int(stream.handle))
    lengths = CASES["split_nest"]
    spec = exe.spec
    rng = np.random.default_rng(3)
    rt = random_runtime(spec, rng, lengths=lengths)
    data = random_inputs(spec, rt, rng)
    init = {g.out.tensor: np.full(tuple(dim_size(spec, rt, d) for d in spec.tensor(g.out.tensor).dims), np.nan)
            for g in spec.gemms}
    args, keep, outs = device_arguments(spec, rt, data, init)
    exe(stream=stream, **args)  # warm-up: plans on this stream
    stream.sync()
    eager = {n: buf.to_numpy(host.shape, host.dtype).astype(np.float64) for n, (buf, host) in outs.items()}
    for buf, host in outs.values():  # poisoned again (from pageable memory: the host waits)
        assert driver.cuMemcpyHtoD(buf.ptr, host.ctypes.data, host.nbytes)[0] == driver.CUresult.CUDA_SUCCESS
    mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL
    assert driver.cuStreamBeginCapture(handle, mode)[0] == driver.CUresult.CUDA_SUCCESS
    exe(stream=stream, **args)
    err, graph = driver.cuStreamEndCapture(handle)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    # Two launches, each a builder and its GEMM: one programmatic edge per GEMM.
    assert _programmatic_edges(graph) == (2 if pdl == "1" else 0)
    err, instance = driver.cuGraphInstantiate(graph, 0)
    assert err == driver.CUresult.CUDA_SUCCESS, err
    assert driver.cuGraphLaunch(instance, handle)[0] == driver.CUresult.CUDA_SUCCESS
    stream.sync()
    replay = {n: buf.to_numpy(host.shape, host.dtype).astype(np.float64) for n, (buf, host) in outs.items()}
    for n in eager:
        assert np.array_equal(eager[n], replay[n]), n
    assert all(buf.changed_outside().size == 0 for buf, _ in outs.values()), "a guard byte changed"
    driver.cuGraphExecDestroy(instance)
    driver.cuGraphDestroy(graph)
    del keep
