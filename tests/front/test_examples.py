"""Every shipped example checks, and explain --json gives the documented decisions."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gemmspec.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ALL = sorted(EXAMPLES.glob("*.gspec"))

# name -> (decision, leaf count of each launch, prepass kinds)
EXPECTED = {
    "moe_fp8_forward": ("flatten", [8], []),
    "moe_bf16_forward": ("flatten", [8], []),
    "moe_bf16_in_fp8": ("flatten", [8], ["quantize"]),
    "moe_masked_decode": ("flatten", [8], []),
    "moe_swiglu_fp8": ("flatten", [8], []),
    "moe_swiglu_fp8_separate": ("flatten", [8], []),
    "lora_moe_nested": ("flatten", [32], []),
    "lora_moe_scaled": ("flatten", [32], []),
    "lora_qkv_slices": ("flatten", [12], []),
    "lora_qkv_one_spec": ("split", [4, 12], []),
    "split_nest": ("split", [8, 4], []),
    "moe_fp8_wgrad": ("flatten", [8], []),
    "moe_fp8_rowwise": ("flatten", [8], []),
    "moe_fp8_tensorwise": ("flatten", [8], []),
    "moe_fp8_gather_scatter": ("flatten", [8], ["gather"]),
    "moe_ffn_fp8": ("split", [8, 8], ["gather"]),
    "moe_ffn_fp8_train": ("split", [8, 8], ["gather"]),
    "moe_ffn_fp8_decode": ("split", [256, 256], ["gather"]),
    "linear_fp8_training": ("split", [1, 1, 1], ["transpose", "requantize", "requantize"]),
}


def explain_json(path: Path, capsys) -> list[dict]:
    assert main(["explain", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


def test_every_expected_example_is_shipped():
    assert sorted(p.stem for p in ALL) == sorted(EXPECTED)


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_example_checks(path, capsys):
    assert main(["check", str(path)]) == 0
    assert ": ok" in capsys.readouterr().out


@pytest.mark.parametrize("path", ALL, ids=lambda p: p.stem)
def test_explain_json_contract(path, capsys):
    (doc,) = explain_json(path, capsys)
    decision, leaves, prepasses = EXPECTED[path.stem]
    assert doc["name"] == path.stem
    assert doc["decision"] == decision
    assert isinstance(doc["reasons"], list) and all(isinstance(r, str) for r in doc["reasons"])
    assert doc["reasons"], "a decision always has reasons"
    assert [launch["leaf_count"] for launch in doc["launches"]] == leaves
    assert [p["kind"] for p in doc["prepasses"]] == prepasses


def test_split_nest_says_why(capsys):
    (doc,) = explain_json(EXAMPLES / "split_nest.gspec", capsys)
    assert any("not legal as one launch" in r for r in doc["reasons"])
    assert len(doc["launches"]) >= 2


def test_wgrad_requantization_is_listed_before_its_launch(capsys):
    (doc,) = explain_json(EXAMPLES / "linear_fp8_training.gspec", capsys)
    wgrad = next(x for x in doc["launches"] if "dw" in x["statement_text"])
    requants = [p for p in doc["prepasses"] if p["kind"] == "requantize"]
    assert {p["source"] for p in requants} == {"x", "dy"}
    for p in requants:
        assert p["target_scale"]["block"] == [128, 1]
        assert wgrad["index"] in p["before_launches"]


def test_qkv_slices_share_the_row_stride(capsys):
    (doc,) = explain_json(EXAMPLES / "lora_qkv_slices.gspec", capsys)
    (launch,) = doc["launches"]
    assert launch["operands"]["A"]["strides"]["m"] == "48"  # 3R with R = 16


def test_explain_text_and_dump_ir(tmp_path, capsys):
    path = EXAMPLES / "lora_moe_nested.gspec"
    assert main(["explain", str(path), "--dump-ir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "decision: flatten" in out and "expert_offsets[g.lora, g.expert]" in out
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["01-ast.txt", "02-spec.txt", "03-decision.txt", "04-schedule.json", "04-schedule.txt"]
    assert "lora_moe_nested" in (tmp_path / "04-schedule.txt").read_text()


def test_cli_error_has_no_traceback(tmp_path):
    bad = tmp_path / "bad.gspec"
    bad.write_text("gemm g {\n  dim T\n  tensor x : bf16 [T, Q]\n}\n")
    proc = subprocess.run(
        [sys.executable, "-m", "gemmspec", "check", str(bad)], capture_output=True, text=True
    )
    assert proc.returncode == 1
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith(f"{bad}:3:23: error: unknown dim 'Q'")
    assert "^" in proc.stderr


def test_cli_missing_file_and_help():
    proc = subprocess.run(
        [sys.executable, "-m", "gemmspec", "check", "no/such.gspec"], capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    for args in (["--help"], ["check", "--help"], ["explain", "--help"]):
        proc = subprocess.run([sys.executable, "-m", "gemmspec", *args], capture_output=True, text=True)
        assert proc.returncode == 0 and "usage: gemmspec" in proc.stdout


def test_decode_ffn_combines_the_top_k_rows_in_the_spec(capsys):
    # The top-k combine is the spec's own deterministic row pass, into token order.
    (doc,) = explain_json(EXAMPLES / "moe_ffn_fp8_decode.gspec", capsys)
    (combine,) = doc["postpasses"]
    assert (combine["kind"], combine["source"], combine["target"], combine["index"]) == (
        "scatter_add", "y_rows", "y", "src")
    assert "deterministic" in combine["description"]
    # The SwiGLU reads the gate and up weights as two tensors, the rows gathered through src.
    up = doc["launches"][0]
    assert "wg" in up["statement_text"] and "wu" in up["statement_text"]
    assert doc["prepasses"][0]["source"] == "x"
