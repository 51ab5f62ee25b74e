"""On a Hopper GPU: a QKV LoRA as one spec, the expand reading the shrink's output a
[T, 3R] through the view a3 [T, 3, R].

- The example (K = 4096, q 4096 wide, k and v 1024) on random ragged adapters, every
  output held element-wise to the float64 reference (gemmspec.runtime.verify).
- The small spec with torch tensors, in both source orders (the expand written first
  must still run after the shrink): the caller passes a, never a3; a and y held
  element-wise to the QKV LoRA computed by hand from the inputs (tests/reference/
  view_spec.py), their guard bytes untouched, and a3 refused as an argument.

The GPU tests are skipped elsewhere, with a reason; one test (not marked gpu) checks
what they build."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.runtime.verify import run_random

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "reference"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from judge import GuardedTensor, assert_close_elementwise  # noqa: E402
from view_spec import expected, qkv_view  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lora_qkv_one_spec.gspec"
LENGTHS = [[0, 129, 4097, 1], [1, 0, 0, 0], [127, 128, 129, 3000]]
SMALL = [[0, 0, 0], [1, 127, 129], [300, 0, 1000]]


def test_the_view_is_no_argument_of_the_built_spec():
    for exe in (gemmspec.build(EXAMPLE), gemmspec.build(qkv_view(expand_first=True))):
        names = exe.argument_names()
        assert "a" in names and "a3" not in names
        assert [exe.spec.gemms[x.statement].out.tensor for x in exe.schedule.launches] == ["a", "y"]


@pytest.mark.gpu
@pytest.mark.parametrize("lengths", LENGTHS, ids=str)
def test_example_matches_reference(lengths):
    exe = gemmspec.build(EXAMPLE)
    report = run_random(exe, lengths={"lora": lengths}, seed=len(lengths) + sum(lengths), repeats=0)
    print(report.describe())
    assert report.ok, report.describe()
    assert {c.tensor for c in report.checks} == {"a", "y"}


@pytest.mark.gpu
@pytest.mark.parametrize("expand_first", [False, True])
@pytest.mark.parametrize("lengths", SMALL, ids=str)
def test_torch_call_binds_the_view_to_the_source(lengths, expand_first):
    torch = pytest.importorskip("torch")
    exe = gemmspec.build(qkv_view(k=200, expand_first=expand_first))
    gen = torch.Generator().manual_seed(sum(lengths) + expand_first)
    t = sum(lengths)
    x = torch.randn(t, 200, generator=gen).to(torch.bfloat16)
    wa = (torch.randn(3, 48, 200, generator=gen) / 8).to(torch.bfloat16)
    wb = torch.randn(3, 96, 16, generator=gen).to(torch.bfloat16)
    offsets = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)
    a = GuardedTensor((t, 48), torch.bfloat16)
    y = GuardedTensor((t, 96), torch.bfloat16)
    dev = {n: v.cuda() for n, v in {"x": x, "wa": wa, "wb": wb, "lora_offsets": offsets}.items()}
    exe(**dev, a=a.tensor, y=y.tensor)
    torch.cuda.synchronize()
    want = expected(*(v.double().numpy() for v in (x, wa, wb)), lengths, "bf16")
    for name, got in (("a", a), ("y", y)):
        assert_close_elementwise(got.tensor, want[name], dtype="bf16", name=name, operand_dtype="bf16", guards=got)
    with pytest.raises(ArgumentError, match="unknown argument.*a3"):
        exe(**dev, a=a.tensor, y=y.tensor, a3=a.tensor.view(t, 3, 16))
