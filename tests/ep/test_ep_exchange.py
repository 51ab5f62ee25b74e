"""Expert parallelism on the CPU: several processes over gloo, the reference executor in
place of the kernels. Each rank's dispatched buffers (what its GEMMs read) against a
loop over every rank's rows, bit for bit; every rank's outputs and gradients against
the same layer in one process, element-wise; and a second step against the first, bit
for bit. The routings leave experts empty, a rank with nothing to receive and a rank
with nothing to send."""

from __future__ import annotations

import pytest

# Three processes over gloo, spawned once for the module (about a minute on 2 cores).
pytestmark = pytest.mark.slow
torch = pytest.importorskip("torch")
if not torch.distributed.is_available() or not torch.distributed.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

from ep_cases import (  # noqa: E402
    CASE_2,
    CASE_2_CHUNKS,
    CASE_3,
    DECODE_3,
    DECODE_3_DROP,
    DECODE_3_REFUSE,
    DECODE_3_STRAY,
    REFUSE_3,
    STRAY_3,
    dropped_rows,
    expected_dispatch,
    one_process,
    one_process_forward,
    run_ranks,
)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _check_dispatch(case, results):
    for rank, got in enumerate(results[: case.world]):
        chunks = got[case.name]["dispatched"]
        assert len(chunks) == case.chunks
        for i, chunk in enumerate(chunks):
            want = expected_dispatch(case, rank, i)
            assert torch.equal(_bits(chunk["x"]), want["x"]), (case.name, rank, i, "x")
            assert torch.equal(chunk["x_scale"], want["x_scale"].reshape(chunk["x_scale"].shape)), (rank, i)
            assert torch.equal(chunk["route_w"], want["route_w"]), (case.name, rank, i, "route_w")
            assert torch.equal(chunk["src"], want["src"]) and torch.equal(chunk["dst"], want["src"]), (rank, i)
            assert torch.equal(chunk["expert_offsets"], want["expert_offsets"]), (case.name, rank, i)


def _close(got, want, name, rtol, atol, per_expert=False):
    """Element-wise, as the GPU tests judge: |got - want| <= rtol * |want| + atol * rms,
    rms over the element's row (the last dim; a 1-D tensor is one row), or (`per_expert`)
    over each expert's block of a weight gradient: its error comes from the FP8 blocks of
    that expert's tokens. No non-finite value either."""
    want = want.double()
    if per_expert:
        rms = want.reshape(want.shape[0], -1).square().mean(1).sqrt().reshape(-1, *[1] * (want.dim() - 1))
    elif want.numel() == 0:
        rms = want.new_zeros(())
    else:
        rms = want.square().mean(-1, keepdim=True).sqrt()
    bound = rtol * want.abs() + atol * rms
    err = (got.double() - want).abs()
    assert got.isfinite().all(), name
    over = err > bound
    assert not over.any(), (
        f"{name}: {int(over.sum())} of {over.numel()} over bound, worst {err.max().item():.3e} "
        f"at {int((err - bound).argmax())}"
    )


def _check_against_one_process(case, results, weight_tolerance):
    ref = one_process(case)
    for rank, got in enumerate(results[: case.world]):
        first, again = got[case.name]["first"], got[case.name]["again"]
        for key, value in first.items():
            # The same bits on every run.
            assert torch.equal(_bits(value), _bits(again[key])), (case.name, rank, key)
        want = ref["ranks"][rank]
        # Per token the same rows and the same quantization as on one process: only the
        # float64 reference's summation order may differ (below the bf16 output's rounding).
        _close(first["out"], want["out"], f"{case.name} rank {rank} out", 2**-8, 2**-10)
        _close(first["grad_x"], want["grad_x"], f"{case.name} rank {rank} grad x", 2**-8, 2**-10)
        _close(first["grad_w"], want["grad_w"], f"{case.name} rank {rank} grad topk_w", 2**-8, 2**-10)
    # Every expert's weight gradient, from the rank that owns it.
    for name, want in ref["weights"].items():
        got = torch.cat([r[case.name]["first"][name] for r in results[: case.world]])
        _close(got, want, f"{case.name} {name}", *weight_tolerance, per_expert=True)


# Without chunks, an expert's rows are the one process's rows in the same order: its
# WGRAD operands are quantized in the same 128-row blocks.
SAME_BLOCKS = (2**-8, 2**-10)
# Chunks quantize each chunk's WGRAD operands in blocks of their own: the weight
# gradients differ from one process's by FP8 rounding (the bounds of the GPU tests of the
# FFN's WGRAD against float64).
OWN_BLOCKS = (2**-3, 1.5)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    """One spawn of three processes over gloo runs every case (the two-rank ones on a
    group of ranks 0 and 1), to pay for the processes' start once."""
    # The refused steps first: the cases after them show that no rank was left waiting.
    return run_ranks([STRAY_3, REFUSE_3, DECODE_3_REFUSE, CASE_2, CASE_2_CHUNKS, CASE_3, DECODE_3, DECODE_3_DROP,
                      DECODE_3_STRAY],
                     tmp_path_factory.mktemp("ep"))


@pytest.mark.parametrize("case", [CASE_2, CASE_2_CHUNKS, CASE_3], ids=lambda c: c.name)
def test_dispatched_buffers_match_a_loop_over_every_ranks_rows(case, results):
    _check_dispatch(case, results)


def test_two_ranks_match_one_process(results):
    _check_against_one_process(CASE_2, results, SAME_BLOCKS)
    assert all(r[CASE_2.name]["bytes"] > 0 for r in results[:2])


def test_chunks_match_one_process(results):
    _check_against_one_process(CASE_2_CHUNKS, results, OWN_BLOCKS)


def test_three_ranks_with_empty_experts_and_ranks(results):
    _check_against_one_process(CASE_3, results, OWN_BLOCKS)
    # Rank 2 owns experts 4 and 5, which no token picks: it receives nothing, and its
    # weight gradients are zeros.
    assert all(c["x"].shape[0] == 0 for c in results[2][CASE_3.name]["dispatched"])
    assert all((v == 0).all() for k, v in results[2][CASE_3.name]["first"].items() if k.startswith("grad_w_"))
    # Rank 1 has no tokens: nothing to send, but it runs its experts for the others.
    assert results[1][CASE_3.name]["first"]["out"].shape == (0, 128)
    assert sum(c["x"].shape[0] for c in results[1][CASE_3.name]["dispatched"]) > 0
    assert results[1][CASE_3.name]["bytes"] > 0


def test_decode_with_capacity_buffers_matches_one_process(results):
    want = one_process_forward(DECODE_3, {})
    for rank in range(3):
        got = results[rank][DECODE_3.name]
        assert got["dropped"] == 0
        assert torch.equal(_bits(got["out"]), _bits(got["again"]))
        _close(got["out"], want[rank], f"decode rank {rank}", 2**-8, 2**-10)


def test_decode_drops_the_rows_past_the_capacity(results):
    dropped = {r: dropped_rows(DECODE_3_DROP, r) for r in range(3)}
    assert any(dropped.values())  # the case does drop rows
    want = one_process_forward(DECODE_3_DROP, dropped)
    for rank in range(3):
        got = results[rank][DECODE_3_DROP.name]
        assert got["dropped"] == len(dropped[rank])
        _close(got["out"], want[rank], f"decode capacity 2 rank {rank}", 2**-8, 2**-10)


def test_every_rank_refuses_a_step_with_stray_ids(results):
    # Rank 1 has no tokens and no stray ids of its own: it learns of the others' in the
    # counts exchange, so it raises too instead of waiting for rows that never come.
    errors = {results[r][STRAY_3.name].get("error") for r in range(3)}
    assert len(errors) == 1
    message = errors.pop()
    assert message is not None
    assert message.endswith("topk_idx holds expert ids outside [0, 6): 1 on rank 0, 2 on rank 2; no rows were exchanged")


def test_a_rank_refusing_its_own_arguments_takes_every_rank_with_it(results):
    # Rank 1's x is one column too wide. It says what is wrong with it; ranks 0 and 2,
    # already in the counts exchange, learn of the refusal there and raise too, ahead of
    # rank 2's stray id. The cases after this one ran, so no rank was left waiting.
    own = results[1][REFUSE_3.name]["error"]
    assert "x is [3, 129]" in own and own.endswith("; every rank refuses this step")
    for rank in (0, 2):
        assert results[rank][REFUSE_3.name]["error"].endswith(
            ": rank 1 refused its own arguments (its error says why); no rows were exchanged")
    assert all(CASE_2.name in results[r] for r in (0, 1)) and DECODE_3_STRAY.name in results[2]


def test_a_decode_rank_refusing_its_arguments_still_serves_the_others(results):
    # Rank 1 raises on both calls; ranks 0 and 2 made both calls with it (no rank waits,
    # and the cases after this one ran) and their outputs are whole: rank 1's experts
    # computed their rows.
    own = results[1][DECODE_3_REFUSE.name]
    assert len(own["errors"]) == 2
    for message in own["errors"]:
        assert "x is [4, 129]" in message
        assert message.endswith("; this rank's experts still served the other ranks' rows")
    assert own["stray"] is None and own["dropped"] is None
    want = one_process_forward(DECODE_3_REFUSE, {})
    for rank in (0, 2):
        got = results[rank][DECODE_3_REFUSE.name]
        assert (got["stray"], got["dropped"]) == (0, 0)
        assert torch.equal(_bits(got["out"]), _bits(got["again"]))
        _close(got["out"], want[rank], f"decode beside a refusing rank, rank {rank}", 2**-8, 2**-10)
    assert DECODE_3_STRAY.name in results[2]


def test_decode_sends_stray_rows_nowhere(results):
    want = one_process_forward(DECODE_3_STRAY, {})
    for rank in range(3):
        got = results[rank][DECODE_3_STRAY.name]
        assert (got["stray"], got["dropped"]) == ({1: 1, 2: 1}.get(rank, 0), 0)
        assert torch.equal(_bits(got["out"]), _bits(got["again"]))
        _close(got["out"], want[rank], f"decode with stray ids, rank {rank}", 2**-8, 2**-10)
