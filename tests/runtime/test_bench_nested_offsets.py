"""The bench's nested offsets: L x E token counts become the `lora_offsets` and
`expert_offsets` a `ragged(T within lora)` nest reads (no GPU)."""

from __future__ import annotations

import pytest

from gemmspec import bench


def test_nested_offsets_from_counts_with_empty_and_odd_segments():
    lora_offsets, expert_offsets = bench.nested_offsets([[0, 3, 0], [1, 0, 127], [129, 0, 0]])
    assert lora_offsets == [0, 3, 131, 260]
    assert expert_offsets == [[0, 0, 3, 3], [3, 4, 4, 131], [131, 260, 260, 260]]


def test_random_counts_cut_each_adapter_and_repeat_with_the_seed():
    torch = pytest.importorskip("torch")
    counts = bench.random_nested_counts([100, 0, 7], 4, torch.Generator().manual_seed(5))
    assert [len(row) for row in counts] == [4, 4, 4]
    assert [sum(row) for row in counts] == [100, 0, 7]
    assert all(c >= 0 for row in counts for c in row)
    assert counts == bench.random_nested_counts([100, 0, 7], 4, torch.Generator().manual_seed(5))
