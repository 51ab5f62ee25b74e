"""Every variant of scripts/pipeline_probe.py names kernel options that exist: a variant
naming a removed option would stop the probe mid-run on the GPU. Read from the script's
source (it imports torch and triton, which this check does not need)."""

from __future__ import annotations

import ast
from dataclasses import fields
from pathlib import Path

from gemmspec.codegen.kernels import GemmKernelConfig

PROBE = Path(__file__).resolve().parents[2] / "scripts" / "pipeline_probe.py"
# The probe's own keys (its `variant()` parameters and a spec directive).
PROBE_KEYS = {"decode", "inline_leaves", "fuse_check", "inline_tables", "directive"}


def _variant_tables() -> dict[str, dict[str, dict]]:
    tree = ast.parse(PROBE.read_text())
    return {
        node.targets[0].id: ast.literal_eval(node.value)
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)
        and node.targets[0].id.endswith("VARIANTS")
    }


def test_every_probe_variant_names_existing_kernel_options():
    tables = _variant_tables()
    assert {"VARIANTS", "DECODE_VARIANTS", "MASKED_VARIANTS", "LORA_VARIANTS"} <= set(tables)
    known = {f.name for f in fields(GemmKernelConfig)} | PROBE_KEYS
    unknown = {
        (table, label): sorted(set(changes) - known)
        for table, variants in tables.items()
        for label, changes in variants.items()
        if set(changes) - known
    }
    assert not unknown, unknown
