"""The bench's table: one entry per case, with its shape, operand types, anchors and
target, and the procedure that measures gemmspec's side of it (`measure.py`).

A case runs its procedure on its shape, then each anchor it names, in order, on the
inputs gemmspec ran on (`Case.measure`). `deepgemm_recorded_tflops` is DeepGEMM 2.6.1's
figure on one H200, 2026-11-30 (same shapes; M-grouped rows count its 128-row padding
as useful work), printed where DeepGEMM does not run live, on an H200 only (`card.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

from . import measure
from .anchors import Problem, deepgemm
from .anchors import torch as torch_anchor
from .card import REFERENCE_COPY_RATE_TBS, tbs_text
from .inputs import masked_counts, routed_counts
from .timing import Result

RAGGED = [1, 127, 0, 5155, 10949, 129, 10269, 6138]
MASKED = [983, 769, 816, 1024, 734, 666]
# The expand row's tokens per adapter (rows) and expert (columns), 8192 in all: empty
# experts, single tokens, the 127 / 129 tile edges and other odd sizes.
LORA_EXPAND_COUNTS = [
    [1, 127, 129, 0, 1000, 511, 257, 23],
    [0, 0, 3001, 17, 255, 1, 0, 0],
    [129, 129, 129, 129, 127, 127, 127, 127],
    [903, 0, 1, 255, 333, 131, 0, 223],
]


@dataclass(frozen=True)
class Target:
    """What a row must reach: an absolute rate and/or a ratio to the torch anchor, or to
    every other row of its case (`vs_separate`: the same work done as separate launches),
    or a share of the HBM copy rate in TB/s of the bytes it must move (`copy_share`), or
    a ratio to DeepGEMM where DeepGEMM ran live beside it (`vs_deepgemm`: not judged
    where it did not run, and the verdict says so)."""

    tflops: float | None = None
    vs_torch: float | None = None
    max_us: float | None = None
    vs_separate: float | None = None
    copy_share: float | None = None
    vs_deepgemm: float | None = None

    def describe(self, copy_rate_tbs: float = REFERENCE_COPY_RATE_TBS) -> str:
        """The target in words; `copy_rate_tbs`: the rate a share is of (the card's, `card.py`)."""
        parts = []
        if self.tflops:
            parts.append(f">= {self.tflops:.0f} TFLOPS")
        if self.copy_share:
            parts.append(f">= {self.copy_share:.0%} of {tbs_text(copy_rate_tbs)} TB/s")
        if self.vs_torch:
            parts.append(f">= {self.vs_torch:.2f}x torch")
        if self.vs_deepgemm:
            parts.append(f">= {self.vs_deepgemm:.2f}x DeepGEMM")
        if self.max_us:
            parts.append(f"<= {self.max_us:.0f} us")
        if self.vs_separate == 1.0:
            parts.append("faster than separate launches")
        elif self.vs_separate:
            parts.append(f">= {self.vs_separate:.2f}x separate launches")
        return ", ".join(parts)


Anchor = Callable[[str, int, Problem], list[Result]]


@dataclass
class Case:
    name: str
    what: str
    target: Target
    # The procedure: run(repeat, name=..., **shape) -> (gemmspec's rows, the anchors' Problem).
    run: Callable[..., measure.Measured]
    memory_bound: bool = False
    # The tensor-core peak a compute-bound row is measured against at its clock: "fp8" or
    # "bf16" (None: memory-bound, or not one kind of GEMM).
    peak: str | None = None
    shape: dict = field(default_factory=dict)
    dtypes: str = ""  # the operands' types, A x B -> D
    anchors: tuple[Anchor, ...] = ()
    deepgemm_recorded_tflops: float | None = None
    # A decode row's weights streamed alone (see STREAM_FLOOR_US), in us.
    stream_floor_us: float | None = None

    def measure(self, repeat: int) -> list[Result]:
        """Every row of the case: gemmspec's (and its variants'), then each anchor's."""
        rows, problem = self.run(repeat, name=self.name, **self.shape)
        for anchor in self.anchors:
            rows += anchor(self.name, repeat, problem)
        return rows


FP8_ANCHORS = (torch_anchor.scaled_grouped_mm, deepgemm.m_grouped_fp8)
FP8 = "e4m3 x e4m3 -> bf16"

CASES = [
    Case("fp8_fwd_G8x4096_N4096_K7168", "FP8 1x128/128x128 M-grouped, 8 x 4096 tokens", Target(1230, 1.2),
         measure.fp8_grouped, peak="fp8", shape=dict(lengths=[4096] * 8, n=4096, k=7168), dtypes=FP8,
         anchors=FP8_ANCHORS, deepgemm_recorded_tflops=1232.4),
    Case("fp8_fwd_G8x4096_N7168_K2048", "same, N=7168, K=2048", Target(1160, 1.2),
         measure.fp8_grouped, peak="fp8", shape=dict(lengths=[4096] * 8, n=7168, k=2048), dtypes=FP8,
         anchors=FP8_ANCHORS, deepgemm_recorded_tflops=1163.8),
    Case("fp8_fwd_G4x8192_N6144_K7168", "same, 4 x 8192 tokens, N=6144", Target(1250, 1.2),
         measure.fp8_grouped, peak="fp8", shape=dict(lengths=[8192] * 4, n=6144, k=7168), dtypes=FP8,
         anchors=FP8_ANCHORS, deepgemm_recorded_tflops=1257.6),
    Case("fp8_fwd_ragged_T32768_N4096_K7168", f"FP8 ragged unpadded, lengths {RAGGED}", Target(1200),
         measure.fp8_grouped, peak="fp8", shape=dict(lengths=RAGGED, n=4096, k=7168), dtypes=FP8,
         anchors=FP8_ANCHORS, deepgemm_recorded_tflops=1202.2),
    Case("bf16_fwd_G8x4096_N4096_K7168", "BF16 M-grouped, 8 x 4096 tokens", Target(vs_torch=1.05),
         measure.bf16_grouped, peak="bf16", shape=dict(lengths=[4096] * 8, n=4096, k=7168),
         dtypes="bf16 x bf16 -> bf16", anchors=(torch_anchor.grouped_mm, deepgemm.m_grouped_bf16),
         deepgemm_recorded_tflops=697.6),
    Case("fp8_wgrad_G8x4096_N4096_K7168", "FP8 WGRAD K-grouped 128x1, FP32 +=", Target(1040),
         measure.wgrad, peak="fp8", shape=dict(lengths=[4096] * 8, n=4096, k=7168), dtypes="e4m3 x e4m3 -> f32 +=",
         anchors=(torch_anchor.grouped_mm_k, deepgemm.k_grouped_fp8_wgrad), deepgemm_recorded_tflops=833.8),
    Case("fp8_wgrad_ragged_T32768_N4096_K7168", f"FP8 WGRAD, ragged counts {RAGGED}, segment_major pad 16",
         Target(1040), measure.wgrad_ragged, peak="fp8", shape=dict(lengths=RAGGED, n=4096, k=7168),
         dtypes="e4m3 x e4m3 -> f32 +="),
    Case("fp8_masked_G6_M1024_N4096_K7168", f"FP8 masked decode, counts {MASKED}", Target(1130),
         measure.masked, peak="fp8", shape=dict(counts=MASKED, m=1024, n=4096, k=7168), dtypes=FP8,
         anchors=(torch_anchor.scaled_grouped_mm_3d, deepgemm.m_grouped_fp8_masked), deepgemm_recorded_tflops=1130.3),
    Case("fp8_rowwise_G8x4096_N4096_K7168", "FP8 per-channel scales M-grouped, 8 x 4096 tokens", Target(vs_torch=1.2),
         measure.fp8_rowwise, peak="fp8", shape=dict(lengths=[4096] * 8, n=4096, k=7168), dtypes=FP8,
         anchors=(torch_anchor.scaled_grouped_mm,)),
    Case("fp8_gather_G8x4096_N4096_K7168", "FP8 M-grouped, rows gathered through idx (top-2)", Target(vs_torch=1.2),
         measure.gather, peak="fp8", shape=dict(tokens=16384, e=8, n=4096, k=7168), dtypes=FP8,
         anchors=(torch_anchor.gather_scaled_grouped_mm,)),
    Case("fp8_dense_T4096_N7168_K7168", "FP8 dense 1x128/128x128", Target(vs_torch=1.1),
         measure.dense, peak="fp8", shape=dict(t=4096, n=7168, k=7168), dtypes=FP8,
         anchors=(torch_anchor.scaled_mm_blockwise, deepgemm.dense_fp8), deepgemm_recorded_tflops=1264.4),
    Case("lora_shrink_L4xE8_R16_K4096_T8192", "nested LoRA shrink (memory-bound)", Target(vs_torch=2.0, max_us=24),
         measure.lora_shrink, memory_bound=True, shape=dict(loras=4, experts=8, r=16, k=4096, t=8192),
         dtypes="bf16 x bf16 -> f32", anchors=(torch_anchor.grouped_mm_leaves,)),
    Case("ffn_fp8_E8_T32768_H7168_F2048", "expert FFN, FP8 h quantized in the epilogue vs separate launches",
         Target(vs_torch=1.0), measure.ffn, peak="fp8",
         shape=dict(e=8, tokens=16384, top_k=2, hidden=7168, n=4096, f=2048),
         dtypes="e4m3 x e4m3 -> e4m3 h -> bf16"),
    Case("lora_expand_L4xE8_R16_N4096_T8192",
         "scaled LoRA expand += over experts vs separate launches (memory-bound; y restored before each launch, untimed)",
         Target(vs_separate=1.0), measure.lora_expand, memory_bound=True,
         shape=dict(counts=LORA_EXPAND_COUNTS, r=16, n=4096), dtypes="bf16 x bf16 -> bf16 +="),
]

# ------------------------------------------------------------------------------ decode
# A few tokens per expert: each active expert's weights are read once, so these rows are
# bound by HBM bandwidth and launch latency, and rated in TB/s of the bytes they must move
# (`measure.decode_bytes`) against the card's copy rate (`card.py`). Ragged rows are contiguous tokens
# with offsets; the routed rows draw each token's experts by a seeded top-k routing.
DECODE_E32 = [0, 55, 57, 2, 0, 18, 9, 0, 61, 46, 40, 56, 2, 25, 0, 106, 0, 86, 0, 61, 14, 0, 91, 0, 0, 108, 33, 1, 0,
              129, 1, 23]
DECODE_E8 = [0, 49, 53, 2, 0, 16, 8, 0]
DECODE_MASKED = masked_counts(32, 38, 64, seed=0)  # E = 32 groups of M = 64 rows
DECODE_TOP_K = 8
DSV3_EXPERTS = 256  # DeepSeek-V3's routed experts: gate/up N = 4096 (2 x 2048), K = 7168; down N = 7168, K = 2048
QWEN3_EXPERTS = 128  # Qwen3-30B-A3B: hidden 2048, intermediate 768
DSV3_SHAPES = [(4096, 7168, "gate/up"), (7168, 2048, "down")]
QWEN3_SHAPES = [(1536, 2048, "gate/up"), (2048, 768, "down")]
DSV3_TOKENS = [64, 512]
QWEN3_TOKENS = [16, 128, 512]

# The ragged rows are timed against DeepGEMM's kernel without its pad and unpad copies.
RAGGED_DECODE_TARGET = Target(vs_torch=1.3, copy_share=0.85, vs_deepgemm=1.0)
MASKED_DECODE_TARGET = Target(copy_share=0.90, vs_deepgemm=1.05)
ROUTED_DECODE_TARGET = Target(vs_torch=1.3, copy_share=0.85)
BF16 = "bf16 x bf16 -> bf16"


# Decode rows' weights streamed alone, in us: by TMA in the decode variant's access pattern
# (64 x 256 tiles, 4 stages, the kernel's tile order, row tiles included) with no math,
# timed around one launch after a 256 MB memset as the bench's flush leaves L2
# (scripts/decode_stream_floor.cu, one H200, 2026-12-04). No kernel that loads the bytes
# this way takes less under the bench's method: a target below it is out of reach so.
# Shown on an H200 only (`card.py`).
STREAM_FLOOR_RECORDED = "2026-12-04"
STREAM_FLOOR_US = {
    "decode_ragged_E32_T1024_N4096_K7168": 176.0,
    "decode_ragged_E32_T1024_N7168_K2048": 89.7,
    "decode_ragged_E8_T128_N4096_K7168": 46.9,
    "decode_masked_E32xM64_N4096_K7168": 235.3,
    "decode_masked_E32xM64_N7168_K2048": 122.9,
    "decode_qwen3_fp8_T128_N2048_K768": 61.7,
    "decode_qwen3_fp8_T512_N2048_K768": 61.7,
}


def _decode_cases() -> list[Case]:
    out = []
    for counts, n, k in ((DECODE_E32, 4096, 7168), (DECODE_E32, 7168, 2048), (DECODE_E8, 4096, 7168)):
        e, t = len(counts), sum(counts)
        out.append(Case(f"decode_ragged_E{e}_T{t}_N{n}_K{k}", f"FP8 decode, ragged counts {counts}",
                        RAGGED_DECODE_TARGET, measure.decode_fp8, memory_bound=True,
                        shape=dict(lengths=counts, n=n, k=k), dtypes=FP8, anchors=FP8_ANCHORS))
    for n, k in ((4096, 7168), (7168, 2048)):
        out.append(Case(f"decode_masked_E32xM64_N{n}_K{k}", f"FP8 masked decode, 32 x 64 rows, counts {DECODE_MASKED}",
                        MASKED_DECODE_TARGET, measure.decode_masked, memory_bound=True,
                        shape=dict(counts=DECODE_MASKED, m=64, n=n, k=k), dtypes=FP8,
                        anchors=(torch_anchor.scaled_grouped_mm_3d, deepgemm.m_grouped_fp8_masked)))
    for t in DSV3_TOKENS:
        lengths = routed_counts(t, DSV3_EXPERTS, DECODE_TOP_K, seed=t)
        for n, k, what in DSV3_SHAPES:
            out.append(Case(f"decode_dsv3_fp8_T{t}_N{n}_K{k}",
                            f"DeepSeek-V3 {what}: {t} tokens top-{DECODE_TOP_K} of {DSV3_EXPERTS} experts, FP8",
                            ROUTED_DECODE_TARGET, measure.decode_fp8, memory_bound=True,
                            shape=dict(lengths=lengths, n=n, k=k), dtypes=FP8, anchors=FP8_ANCHORS))
    for t in QWEN3_TOKENS:
        lengths = routed_counts(t, QWEN3_EXPERTS, DECODE_TOP_K, seed=t)
        for n, k, what in QWEN3_SHAPES:
            for fp8 in (False, True):
                kind = "fp8" if fp8 else "bf16"
                out.append(Case(f"decode_qwen3_{kind}_T{t}_N{n}_K{k}",
                                f"Qwen3-30B-A3B {what}: {t} tokens top-{DECODE_TOP_K} of {QWEN3_EXPERTS} experts, "
                                f"{kind.upper()}", ROUTED_DECODE_TARGET,
                                measure.decode_fp8 if fp8 else measure.decode_bf16, memory_bound=True,
                                shape=dict(lengths=lengths, n=n, k=k), dtypes=FP8 if fp8 else BF16,
                                anchors=FP8_ANCHORS if fp8 else (torch_anchor.grouped_mm, deepgemm.m_grouped_bf16)))
    return [replace(c, stream_floor_us=STREAM_FLOOR_US.get(c.name)) for c in out]


CASES += _decode_cases()

# ------------------------------------------------------------------------------ decode FFN
# The whole routed-expert FFN at decode in one spec (examples/moe_ffn_fp8_decode.gspec, the
# top-k combine into token order in it), against the same steps as separate calls and
# against torch's chain, every implementation captured in a CUDA graph. Rated in TB/s of
# the bytes the layer must move (`measure.ffn_decode_bytes`).
FFN_DECODE_TARGET = Target(vs_torch=1.5, vs_separate=1.2)
FFN_DECODE = "e4m3 x e4m3 -> e4m3 h -> bf16 rows -> bf16 y (scatter_add)"
FFN_DECODE_SHAPES = [  # (model, tokens, experts, hidden, intermediate)
    ("dsv3", 64, DSV3_EXPERTS, 7168, 2048),
    ("dsv3", 512, DSV3_EXPERTS, 7168, 2048),
    ("qwen3", 128, QWEN3_EXPERTS, 2048, 768),
]
CASES += [
    Case(f"ffn_decode_{model}_T{t}",
         f"{'DeepSeek-V3' if model == 'dsv3' else 'Qwen3-30B-A3B'} decode expert FFN, {t} tokens top-{DECODE_TOP_K} "
         f"of {e} experts, one spec with the combine vs separate calls vs torch (CUDA graphs)",
         FFN_DECODE_TARGET, measure.ffn_decode, memory_bound=True,
         shape=dict(tokens=t, experts=e, top_k=DECODE_TOP_K, hidden=hidden, f=f, seed=t), dtypes=FFN_DECODE)
    for model, t, e, hidden, f in FFN_DECODE_SHAPES
]


def selected_cases(only: list[str] | None) -> list[Case]:
    """The cases `--only` names by prefix (every case without it)."""
    return [c for c in CASES if only is None or any(c.name.startswith(p) for p in only)]
