"""accumulate(MODE): FP8 products without scales per K block are promoted into f32 every
128 of K by default; accumulate(fast) keeps the whole of K in the tensor cores'
accumulator. The directive reaches the kernel's configuration and name, and is refused
where it means nothing."""

from __future__ import annotations

import sys
from pathlib import Path

from gemmspec.codegen.emit import emit
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from located import assert_located, edited  # noqa: E402

ROWWISE = """
gemm rowwise {
  dim T
  dim N = 256, K = 1024
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, 1, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""

BLOCKWISE = edited("scale f32 [1, K]", "scale f32 [1, 128]", edited("scale f32 [1, 1, K]", "scale f32 [1, 128, 128]", ROWWISE))


def _gemm_configs(text: str):
    (x,) = lower_file(parse(text, "spec.gspec"))
    return x, [launch.gemm for launch in emit(x.spec, x.schedule).launches]


def test_per_channel_fp8_promotes_by_default():
    x, (cfg,) = _gemm_configs(ROWWISE)
    assert x.spec.directives.accumulation == "promoted"
    assert cfg.per_channel and cfg.promotes and not cfg.fast_accum
    assert "_fastacc" not in cfg.name
    assert "mma_k_atom" in emit(x.spec, x.schedule).launches[0].source  # the promoting loop is there


def test_fast_accumulation_reaches_the_kernel():
    x, (cfg,) = _gemm_configs(edited("  y[t, n]", "  accumulate(fast)\n  y[t, n]", ROWWISE))
    assert x.spec.directives.accumulation == "fast"
    assert x.schedule.launches[0].signature.fast_accum
    assert cfg.fast_accum and not cfg.promotes and cfg.name.endswith("_fastacc_inl_whole")
    source = emit(x.spec, x.schedule).launches[0].source
    assert "mma_k_atom" not in source  # one accumulator over the whole of K


def test_promoted_is_the_default_written_out():
    x, (cfg,) = _gemm_configs(edited("  y[t, n]", "  accumulate(promoted)\n  y[t, n]", ROWWISE))
    assert cfg.promotes and x.spec.directives.accumulation == "promoted"


def test_an_unknown_mode_is_located():
    text = edited("  y[t, n]", "  accumulate(sloppy)\n  y[t, n]", ROWWISE)
    assert_located(text, "accumulate(sloppy)", "accumulate(sloppy) is not a way to sum FP8 products")


def test_blockwise_scales_leave_nothing_to_choose():
    text = edited("  y[t, n]", "  accumulate(fast)\n  y[t, n]", BLOCKWISE)
    assert_located(text, "accumulate(fast)", "no statement multiplies FP8 operands whose scales are constant along K")


def test_two_modes_contradict():
    text = edited("  y[t, n]", "  accumulate(fast)\n  accumulate(promoted)\n  y[t, n]", ROWWISE)
    assert_located(text, "accumulate(promoted)", "contradicts the earlier accumulate(fast)")
