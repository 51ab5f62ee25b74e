"""Gradients past a capacity group's end: no statement of a derived backward writes the
rows past the offsets' end, and they reach no forward output, so their gradient is zero.
gemmspec.torch.function's backward operator starts such outputs from zeros (the kernels
leave those rows as they find them; torch.empty would hand back whatever memory held),
while the forward operator and a plain operator of the same backward spec keep
torch.empty where nothing asks for zeros (a memset the size of the output)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402

CAPACITY = """\
gemm capacity_grads {
  dim T
  dim N = 64, K = 128
  group expert[E = 2] = ragged(T, offsets = offs, capacity)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""


def _zero(op) -> dict[str, bool]:
    return {s.name: s.zero for s in op.shapes}


def test_a_capacity_groups_gradients_start_from_zeros_and_only_they():
    fn = gt.function(CAPACITY)
    assert _zero(fn.forward_op) == {"y": False}
    # dx has the capacity dim T as its rows: zeros; dw's T is its K, and every element of
    # it is written (an empty expert's sum is zero).
    assert _zero(fn.backward_op) == {"dx": True, "dw": False}
    assert fn.backward_op.gradients and not fn.forward_op.gradients
    plain = gt.op(fn.backward_op.exe)
    assert plain is not fn.backward_op and _zero(plain) == {"dx": False, "dw": False}

    # The allocation follows the flag: a fresh dx is zeros, whatever memory held.
    inputs = {
        name: torch.ones(size, dtype=gt.torch_dtype(fn.backward_op.exe.spec.tensor(name).dtype))
        for name, size in (("dy", (6, 64)), ("w", (2, 64, 128)), ("x", (6, 128)))
        if name in fn.backward_op.inputs
    }
    inputs["offs"] = torch.tensor([0, 2, 4], dtype=torch.int32)
    sizes = dict(zip(fn.backward_op.outputs, fn.backward_op.output_sizes(inputs)))
    assert sizes["dx"] == [6, 128]
    fresh = dict(zip(fn.backward_op.outputs, fn.backward_op._allocate(fn.backward_op._take_inputs(inputs))))
    assert torch.count_nonzero(fresh["dx"]) == 0


def test_without_capacity_nothing_more_is_zeroed():
    fn = gt.function(CAPACITY.replace(", capacity)", ")").replace("capacity_grads", "no_capacity_grads"))
    assert _zero(fn.backward_op) == {"dx": False, "dw": False}
