"""The standalone quantize launch without a GPU: which tensors the kernel takes and how
it reads them (plan_quantize), the reason for each it refuses, and the standalone
source compiling for sm_90a with its kernel under the configuration's name."""

from __future__ import annotations

import re

import pytest

from gemmspec.codegen.kernels import QuantizeKernelConfig, include_dir
from gemmspec.runtime import nvrtc
from gemmspec.runtime.quantize import QuantizeLaunch, QuantizePlan, plan_quantize, quantize_source


def test_tokens_per_row_block():
    p = plan_quantize("bf16", "e4m3", (4096, 1024), (1024, 1), (1, 128))
    assert p.config == QuantizeKernelConfig("bf16", "e4m3", block_r=1)
    assert (p.batch, p.rows, p.cols, p.batch_stride, p.row_stride) == (1, 4096, 1024, 0, 1024)
    assert p.grid == (512, 8, 1)  # eight rows (a warp each) per CTA, a CTA per column block
    assert p.scale_shape == (4096, 8) and not p.empty and p.reason == ""


def test_expert_weights_per_square_block():
    p = plan_quantize("f32", "e4m3", (8, 264, 1024), (264 * 1024, 1024, 1), (1, 128, 128))
    assert p.config == QuantizeKernelConfig("f32", "e4m3", block_r=128)
    assert (p.batch, p.rows, p.cols, p.batch_stride) == (8, 264, 1024, 264 * 1024)
    assert p.grid == (3, 8, 8) and p.scale_shape == (8, 3, 8)  # 264 rows end in a short block


def test_free_row_and_batch_strides():
    # A column slice of a wider tensor and a batch with padding between its entries.
    p = plan_quantize("f16", "e5m2", (129, 256), (640, 1), (1, 128))
    assert p.row_stride == 640 and p.config.out_type == "e5m2"
    p = plan_quantize("bf16", "e4m3", (3, 127, 128), (20000, 130, 1), (1, 1, 128))
    assert (p.batch_stride, p.row_stride, p.grid, p.scale_shape) == (20000, 130, (16, 1, 3), (3, 127, 1))


def test_ragged_rows_and_empty_tensors():
    for rows in (1, 127, 129):
        p = plan_quantize("bf16", "e4m3", (rows, 256), (256, 1), (128, 128))
        assert p.grid == (-(-rows // 128), 2, 1) and p.scale_shape == (-(-rows // 128), 2)
    p = plan_quantize("bf16", "e4m3", (0, 256), (256, 1), (1, 128))
    assert p.config is not None and p.empty and p.scale_shape == (0, 2)
    with pytest.raises(ValueError, match="nothing to launch"):
        QuantizeLaunch(p, 0, 0)


@pytest.mark.parametrize(
    "args, reason",
    [
        (("bf16", "e4m3", (130, 300), (300, 1), (1, 128)), "300 columns are not a whole number of 128-column blocks"),
        (("f64", "e4m3", (128, 128), (128, 1), (1, 128)), "reads bf16, f16 or f32, not f64"),
        (("bf16", "bf16", (128, 128), (128, 1), (1, 128)), "writes e4m3 or e5m2, not bf16"),
        (("bf16", "e4m3", (256,), (1,), (128,)), "2-D or 3-D"),
        (("bf16", "e4m3", (2, 2, 128, 128), (1, 1, 128, 1), (1, 1, 1, 128)), "2-D or 3-D"),
        (("bf16", "e4m3", (128, 128), (128, 1), (1, 64)), "[1, 128] or [128, 128] blocks"),
        (("bf16", "e4m3", (128, 128), (128, 1), (64, 128)), "[1, 128] or [128, 128] blocks"),
        (("bf16", "e4m3", (4, 128, 128), (1, 512, 4), (2, 1, 128)), "[1, 128] or [128, 128] blocks"),
        (("bf16", "e4m3", (128, 128), (128, 1), ("T", 128)), "not all sizes"),
        (("bf16", "e4m3", (128, 256), (1, 128), (1, 128)), "columns are not contiguous"),
        (("bf16", "e4m3", (70000, 128, 128), (16384, 128, 1), (1, 1, 128)), "more than CUDA allows"),
    ],
)
def test_refusals_say_why(args, reason):
    p = plan_quantize(*args)
    assert p.config is None and reason in p.reason, p.reason
    assert str(p).startswith("no quantize kernel: ")


def test_plans_are_values():
    a = plan_quantize("bf16", "e4m3", (129, 256), (256, 1), (1, 128))
    assert a == plan_quantize("bf16", "e4m3", (129, 256), (256, 1), (1, 128)) and hash(a) == hash(
        plan_quantize("bf16", "e4m3", (129, 256), (256, 1), (1, 128))
    )
    assert isinstance(a, QuantizePlan)
    assert str(a) == "gs_sm90a_quantize_bf16_e4m3_b1x128_w256: [1, 129, 256] (strides 0, 256, 1) -> scales [129, 2], grid (17, 2, 1)"


@pytest.mark.parametrize("config", [QuantizeKernelConfig("bf16", "e4m3", 1), QuantizeKernelConfig("f32", "e4m3", 128)], ids=lambda c: c.name)
def test_standalone_source_compiles_without_spills(config, tmp_path):
    # A fresh cache: NVRTC runs and its log carries ptxas's report.
    compiled = nvrtc.compile_cubin(
        quantize_source(config), name=config.name, include_dirs=[include_dir()],
        extra_options=("-Xptxas=-v",), cache_dir=str(tmp_path),
    )
    cubin, log = compiled.cubin, compiled.log
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert spills and all(s == ("0", "0") for s in spills), log
    sass = nvrtc.disassemble(cubin)
    assert f"Function : {config.name}" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass)
