"""Expert parallelism on two GPUs over NCCL, the kernels in place of the CPU tests'
reference: every rank's dispatched buffers against a loop over every rank's rows (bit
for bit), its outputs and gradients against the same layer on one GPU (element-wise),
a second step against the first (bit for bit: the combine sums in a fixed order), and
the capacity-buffer decode captured in a CUDA graph and replayed. Skipped, with the
reason, where fewer than two GPUs are present."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ep"))
import ep_cases  # noqa: E402
import test_ep_exchange as cpu_checks  # noqa: E402

_GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(_GPUS < 2, reason=f"needs 2 GPUs for NCCL expert parallelism, found {_GPUS}"),
    pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_nccl_available(),
                       reason="needs torch.distributed with NCCL"),
]

# Two ranks on two GPUs: the CPU tests' cases, one without chunks, one with (the
# overlapped path: exchanges on NCCL's stream, waited for by events), and a decode.
DECODE_2 = ep_cases.Case("decode, 2 ranks", world=2, experts=4, tokens=(4, 4), k=2, allowed=(0, 1, 3),
                         decode=True, seed=2)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return ep_cases.run_ranks([ep_cases.CASE_2, ep_cases.CASE_2_CHUNKS, DECODE_2], tmp_path_factory.mktemp("ep_gpu"),
                              backend="nccl", device="cuda")


@pytest.mark.parametrize("case", [ep_cases.CASE_2, ep_cases.CASE_2_CHUNKS], ids=lambda c: c.name)
def test_dispatched_buffers_on_two_gpus(case, results):
    cpu_checks._check_dispatch(case, results)


def test_forward_and_backward_on_two_gpus_match_one_gpu(results):
    # The one-GPU layer: every token and expert on GPU 0 (one_process runs on the device).
    ref = _one_gpu(ep_cases.CASE_2)
    _compare(ep_cases.CASE_2, results, ref, cpu_checks.SAME_BLOCKS)


def test_chunked_overlap_on_two_gpus_matches_one_gpu(results):
    _compare(ep_cases.CASE_2_CHUNKS, results, _one_gpu(ep_cases.CASE_2_CHUNKS), cpu_checks.OWN_BLOCKS)


def test_decode_captured_in_a_cuda_graph_matches_one_gpu(results):
    want = ep_cases.one_process_forward(DECODE_2, {}, device="cuda")
    for rank in range(2):
        got = results[rank][DECODE_2.name]
        assert got["dropped"] == 0
        # "again" is the CUDA graph's replay: the same bits as the eager call.
        assert torch.equal(cpu_checks._bits(got["out"]), cpu_checks._bits(got["again"]))
        cpu_checks._close(got["out"], want[rank], f"decode rank {rank}", 2**-8, 2**-10)


def _one_gpu(case):
    return ep_cases.one_process(case, device="cuda")


def _compare(case, results, ref, weight_tolerance):
    for rank in range(case.world):
        first, again = results[rank][case.name]["first"], results[rank][case.name]["again"]
        for key, value in first.items():
            assert torch.equal(cpu_checks._bits(value), cpu_checks._bits(again[key])), (case.name, rank, key)
        want = ref["ranks"][rank]
        for key in ("out", "grad_x", "grad_w"):
            cpu_checks._close(first[key], want[key], f"{case.name} rank {rank} {key}", 2**-8, 2**-10)
    for name, want in ref["weights"].items():
        got = torch.cat([results[r][case.name]["first"][name] for r in range(case.world)])
        cpu_checks._close(got, want, f"{case.name} {name}", *weight_tolerance, per_expert=True)
