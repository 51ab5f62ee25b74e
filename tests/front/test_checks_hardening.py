"""Specs that used to be accepted where an error was due: two copies of one output, a
second tile(...) that silently replaced the first, a pad no row could hold, a padded FP8
output, and a spec named after a word of the language. Each is a located error now."""

from __future__ import annotations

import sys
from pathlib import Path

from gemmspec.check import check
from gemmspec.parse import parse

sys.path.insert(0, str(Path(__file__).resolve().parent))
from located import assert_located, edited  # noqa: E402

FP8_OUT = """
gemm fp8_out {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor h : e4m3 [T, N] scale f32 [1, 128]
  tensor h_t : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = copy(h)
  h[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

BF16 = """
gemm plain {
  dim T
  dim N = 256, K = 256
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


def test_the_reference_specs_check():
    for text in (FP8_OUT, BF16):
        check(parse(text, "spec.gspec"))


def test_a_second_copy_of_one_output_is_located():
    second = "  tensor h_u : e4m3 [T, N] layout segment_major(expert) scale f32 [128, 1] per expert = copy(h)\n"
    text = edited("  h[t, n]", second + "  h[t, n]", FP8_OUT)
    assert_located(text, "copy(h)", "already writes 'h_t' = copy(h); a statement writes one copy")


def test_a_second_tile_that_differs_contradicts_the_first():
    text = edited("  y[t, n]", "  tile(128, 128)\n  tile(64, 64)\n  y[t, n]", BF16)
    assert_located(text, "tile(64, 64)", "tile(64, 64) contradicts the earlier tile(128, 128)")
    check(parse(edited("  y[t, n]", "  tile(128, 128)\n  tile(128, 128)\n  y[t, n]", BF16), "spec.gspec"))


def test_a_pad_no_row_can_hold_is_located():
    for pad in (2**31, 2**62):
        text = edited("tensor x : bf16 [T, K]", f"tensor x : bf16 [T, K] layout row_major pad {pad}", BF16)
        assert_located(text, str(pad), f"pad {pad} makes rows of {pad} elements")
    check(parse(edited("tensor x : bf16 [T, K]", "tensor x : bf16 [T, K] layout row_major pad 64", BF16), "spec.gspec"))


def test_a_padded_fp8_output_is_located_even_where_the_pad_changes_nothing():
    for pad in (3, 128):
        text = edited("tensor h : e4m3 [T, N] scale", f"tensor h : e4m3 [T, N] layout row_major pad {pad} scale", FP8_OUT)
        assert_located(text, "layout row_major", f"FP8 output 'h' is stored row_major pad {pad}")


def test_a_spec_named_after_a_word_of_the_language_is_located():
    for word in ("tensor", "split", "sum"):
        assert_located(edited("gemm plain", f"gemm {word}", BF16), word, f"spec name '{word}' is a word of the language")
