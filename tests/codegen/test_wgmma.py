"""The per-kernel wgmma wrapper names one accumulator register per two columns."""

from __future__ import annotations

import re

import pytest

from gemmspec.codegen.wgmma import wgmma_k, wgmma_struct


@pytest.mark.parametrize("n", [8, 16, 112, 128, 144, 256])
@pytest.mark.parametrize("types", [("e4m3", "e4m3"), ("e5m2", "e4m3"), ("bf16", "bf16")])
def test_wrapper_shape(n, types):
    src = wgmma_struct(n, *types)
    k = wgmma_k(types[0])
    assert f"wgmma.mma_async.sync.aligned.m64n{n}k{k}.f32.{types[0]}.{types[1]}" in src
    assert f"float (&d)[{n // 2}]" in src
    # Outputs %0..%(n/2-1), then the two descriptors and the scale-d flag.
    assert len(re.findall(r'"\+f"\(d\[\d+\]\)', src)) == n // 2
    assert f"setp.ne.b32 p, %{n // 2 + 2}, 0" in src
    # FP8 takes no transpose immediates; 16-bit types pass K-major (0, 0).
    assert (", 1, 1, 0, 0" in src) == (types[0] == "bf16")


@pytest.mark.parametrize("n", [0, 4, 12, 264])
def test_bad_widths_are_rejected(n):
    with pytest.raises(ValueError):
        wgmma_struct(n, "e4m3", "e4m3")
