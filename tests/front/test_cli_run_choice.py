"""`gemmspec run` says which program its size ran: the kernels as compiled or the decode
variant, with the rule (the GPU call and its check faked here)."""

from __future__ import annotations

from pathlib import Path

import pytest

import gemmspec.runtime.arrays as arrays
import gemmspec.runtime.verify as verify
from gemmspec.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def fake_run(monkeypatch):
    """`run_random` returns a passing report for the dims it was given, without a GPU."""
    monkeypatch.setattr(arrays, "require_hopper", lambda _ordinal=0: None)

    def run_random(exe, dims=None, lengths=None, seed=0, repeats=10):
        return verify.RunReport(exe.spec.name, dict(dims or {}), (), 1e-3, 1e9)

    monkeypatch.setattr(verify, "run_random", run_random)


@pytest.mark.parametrize("t, said", [(1024, "the decode variant"), (1025, "the kernels as compiled")])
def test_run_names_the_program_of_its_size(fake_run, capsys, t, said):
    assert main(["run", str(EXAMPLES / "moe_fp8_forward.gspec"), "--dims", f"T={t}"]) == 0
    out = capsys.readouterr().out
    assert f"moe_fp8_forward: {said} (the decode variant when T <= 128 x 8 segments of 'expert' = 1024 rows)" in out


def test_a_spec_without_a_variant_says_nothing_of_one(fake_run, capsys):
    assert main(["run", str(EXAMPLES / "moe_masked_decode.gspec")]) == 0
    assert "decode variant" not in capsys.readouterr().out
