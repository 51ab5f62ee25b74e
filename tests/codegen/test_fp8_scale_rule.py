"""The FP8 block-scale rule is held once, in the device header: the quantize and requantize
passes and an FP8 D's power-of-two scales call it. An FP8 D's plain scales keep their own
form (they test amax, not the quotient, which bf16 values allow), and say why."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gemmspec.codegen.kernels import (
    GemmKernelConfig,
    QuantizeKernelConfig,
    RequantKernelConfig,
    include_dir,
    render_gemm,
    render_quantize,
    render_requant,
)

HEADER = Path(include_dir(), "gemmspec_ptx.cuh").read_text()
TEMPLATES = Path(include_dir()).parent / "templates"
BIT_RULE = "static_cast<int>(bits >> 23) - 127 - max_exp + ((bits & 0x7fffffu) > 0x600000u ? 1 : 0)"


def _fp8_d(**kw) -> GemmKernelConfig:
    return GemmKernelConfig("e4m3", "e4m3", "e4m3", scaled=True, sa_bm=1, sb_bn=128, copy=True, **kw)


def test_the_header_spells_the_rule():
    assert "float gs_fp8_scale(float amax, float fp8_max) {\n  const float q = __fdiv_rn(amax, fp8_max);" in HEADER
    assert "return q > 0.0f ? q : 1.0f;" in HEADER
    assert "float gs_fp8_scale_pow2(float amax, int max_exp) {" in HEADER and BIT_RULE in HEADER
    assert "e = max(e, -127);" in HEADER and "__uint_as_float(0x00400000u)" in HEADER
    assert "if (bits >= 0x7f800000u) return amax;" in HEADER and "if (!(amax > 0.0f)) return 1.0f;" in HEADER


def test_no_template_repeats_it():
    for path in TEMPLATES.rglob("*.jinja"):
        text = path.read_text()
        assert "0x600000u" not in text and "q > 0.0f ? q : 1.0f" not in text, path.name


@pytest.mark.parametrize("dst, exp", [("e4m3", 8), ("e5m2", 15)])
def test_the_passes_call_it(dst, exp):
    src = render_quantize(QuantizeKernelConfig(out_type=dst, pow2=True))
    assert f"constexpr int OUT_MAX_EXP = {exp};" in src and "gs_fp8_scale_pow2(amax, OUT_MAX_EXP)" in src
    for src in (
        render_quantize(QuantizeKernelConfig(out_type=dst)),
        render_quantize(QuantizeKernelConfig(out_type=dst, swiglu_grad=True)),
        render_requant(RequantKernelConfig(out_type=dst)),
        render_requant(RequantKernelConfig(in_type="bf16", out_type=dst, swiglu=True)),
    ):
        assert "return gs_fp8_scale(amax, OUT_MAX);" in src
        assert not re.search(r"amax\s*/\s*OUT_MAX|__fdiv_rn\(amax", src)


def test_an_fp8_d_calls_the_pow2_rule_and_keeps_its_plain_form():
    src = render_gemm(_fp8_d(d_scale_pow2=True, copy_pow2=True))
    assert "return gs_fp8_scale_pow2(amax, OUT_MAX_EXP);" in src and "return gs_fp8_scale_pow2(amax, 8);" in src
    src = render_gemm(_fp8_d())
    assert "float scale_of(float amax) { return amax > 0.0f ? __fdiv_rn(amax, OUT_MAX) : 1.0f; }" in src
    assert "copy_scale_of(float amax) { return amax > 0.0f ? __fdiv_rn(amax, 448.0f) : 1.0f; }" in src
    assert "gs_fp8_scale(" not in src and "bf16, whose least nonzero magnitude" in src
