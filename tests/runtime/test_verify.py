"""Useful FLOPs count real extents only: no padding, no masked-off rows."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from gemmspec.pipeline import lower_file
from gemmspec.reference.data import random_runtime
from gemmspec.runtime.verify import _useful_flops

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def runtime(name, **kw):
    (x,) = lower_file(EXAMPLES / f"{name}.gspec")
    return x.spec, random_runtime(x.spec, np.random.default_rng(0), **kw)


def test_ragged_forward_counts_every_token_once():
    spec, rt = runtime("moe_fp8_forward", lengths={"expert": [0, 1, 127, 129, 5, 0, 7, 3]})
    assert _useful_flops(spec, rt) == 2.0 * 272 * 4096 * 7168


def test_masked_counts_only_valid_rows():
    spec, rt = runtime("moe_masked_decode", lengths={"expert": [0, 1, 256, 3, 0, 0, 0, 10]})
    assert _useful_flops(spec, rt) == 2.0 * 270 * 4096 * 7168


def test_k_grouped_and_split_statements():
    spec, rt = runtime("moe_fp8_wgrad", lengths={"expert": [129, 0, 0, 0, 0, 0, 0, 1]})
    assert _useful_flops(spec, rt) == 2.0 * 130 * 4096 * 7168
    spec, rt = runtime("split_nest", lengths={"expert": [10] * 8, "lora": [20, 20, 20, 20]})
    assert _useful_flops(spec, rt) == 2.0 * 80 * (4096 * 4096 + 16 * 4096)
