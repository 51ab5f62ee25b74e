"""Every variant of scripts/pipeline_probe.py (and configuration of ffn_decode_probe.py)
names kernel options that exist: a variant naming a removed option would stop the probe
mid-run on the GPU; and every label decode_l2_probe.sh selects is one. Read from the
scripts' source (they import torch and triton, which these checks do not need)."""

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


def test_the_ffn_probes_configurations_name_existing_kernel_options():
    tree = ast.parse((PROBE.parent / "ffn_decode_probe.py").read_text())
    (configs,) = [ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
                  and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "CONFIGS"]
    known = {f.name for f in fields(GemmKernelConfig)}
    assert configs and all(set(options) <= known for options in configs.values()), configs


def test_every_label_the_l2_probe_selects_is_a_variant_of_the_table_it_runs():
    # decode_l2_probe.sh picks variants by substrings of their labels (--only): a label
    # renamed in pipeline_probe.py would leave a part timing nothing.
    script = (PROBE.parent / "decode_l2_probe.sh").read_text()
    tables = _variant_tables()
    only = script.split('only="', 1)[1].split('"', 1)[0]
    masked = {line.split('--only "', 1)[1].split('"', 1)[0] for line in script.splitlines() if "--masked" in line}
    assert only and len(masked) == 1
    for table, selection in (("DECODE_VARIANTS", only), ("MASKED_VARIANTS", masked.pop())):
        labels = list(tables[table])
        missing = [part for part in selection.split(",") if not any(part in label for label in labels)]
        assert not missing, (table, missing)


def test_the_tile_rows_sweep_selects_the_two_tiles_it_compares():
    # tile_rows_sweep.sh separates its parts by '|' (the labels hold commas): exactly the
    # 128 x 256 variant and the decode variant timed again, and no part in every label.
    script = (PROBE.parent / "tile_rows_sweep.sh").read_text()
    only = script.split('only="', 1)[1].split('"', 1)[0]
    labels = list(_variant_tables()["DECODE_VARIANTS"])
    parts = only.split("|")
    assert len(parts) == 2 and not any(all(part in label for label in labels) for part in parts)
    selected = [label for label in labels if any(part in label for part in parts)]
    assert selected == ["decode variant, 128 x 256 (two row warpgroups)", "decode variant (again: drift over the run)"]
