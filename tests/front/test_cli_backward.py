"""`explain --backward`, `compile --backward` and the `backward` key of `explain --json`:
the derived backward spec reachable from the command line, and `gemmspec.derive_backward`."""

from __future__ import annotations

import json
from pathlib import Path

import gemmspec
from gemmspec.cli import main

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_explain_backward_prints_the_text_and_its_explain(capsys):
    assert main(["explain", "--backward", str(EXAMPLES / "moe_fp8_forward.gspec")]) == 0
    out = capsys.readouterr().out
    bw = gemmspec.derive_backward(EXAMPLES / "moe_fp8_forward.gspec")
    assert bw.source.strip() in out  # the spec text, whole
    assert out.startswith("backward (derived):")
    assert "spec moe_fp8_forward_backward (moe_fp8_forward_backward.gspec:2)" in out
    assert "launches: 2" in out and "requantize" in out


def test_explain_backward_of_a_spec_with_none_says_why(capsys):
    assert main(["explain", "--backward", str(EXAMPLES / "moe_masked_decode.gspec")]) == 1
    err = capsys.readouterr().err
    assert "no backward derived (statement #0: its rows are masked" in err


def test_explain_json_carries_the_backward(capsys):
    assert main(["explain", "--json", str(EXAMPLES / "moe_bf16_forward.gspec")]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    b = doc["backward"]
    assert b["name"] == "moe_bf16_forward_backward" and "gemm moe_bf16_forward_backward {" in b["source"]
    assert b["refused"] == [] and b["not_derived"] == []
    assert [(d["kind"], d["wrt"], d["grad"]) for d in b["derived"]] == [("dgrad", "x", "dx"), ("wgrad", "w", "dw")]
    assert b["output_grads"] == [{"output": "y", "grad": "dy"}]
    assert b["explain"]["name"] == "moe_bf16_forward_backward" and len(b["explain"]["launches"]) == 2
    assert "backward" not in b["explain"]


def test_explain_json_refused(capsys):
    assert main(["explain", "--json", str(EXAMPLES / "moe_fp8_rowwise.gspec")]) == 0
    (doc,) = json.loads(capsys.readouterr().out)
    b = doc["backward"]
    assert b["source"] is None and b["explain"] is None and b["derived"] == []
    (r,) = b["refused"]
    assert r["statement"] == 0 and "per-channel" in r["reason"] and "requantized" in r["reason"]


def test_compile_backward_writes_its_text_and_files(tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["compile", "--backward", str(EXAMPLES / "lora_moe_scaled.gspec"), "-o", str(out)]) == 0
    io = capsys.readouterr()
    written = {Path(p).name for p in io.out.split()}
    assert {"lora_moe_scaled_backward.gspec", "lora_moe_scaled_backward_host.cu", "lora_moe_scaled_backward.h",
            "lora_moe_scaled.h", "lora_moe_scaled_backward.manifest.json"} <= written
    # What the backward leaves out is said on stderr.
    assert "gradient of 'wb' not derived" in io.err and "gradient of 'scaling' not derived" in io.err
    text = (out / "lora_moe_scaled_backward.gspec").read_text()
    assert text == gemmspec.derive_backward(EXAMPLES / "lora_moe_scaled.gspec").source
    assert main(["check", str(out / "lora_moe_scaled_backward.gspec")]) == 0
    assert "lora_moe_scaled_backward: ok" in capsys.readouterr().out
    # --list names the same files and writes nothing.
    assert main(["compile", "--backward", "--list", str(EXAMPLES / "lora_moe_scaled.gspec"), "-o", str(tmp_path / "x")]) == 0
    listed = {Path(p).name for p in capsys.readouterr().out.split()}
    assert listed == written and not (tmp_path / "x").exists()


def test_public_functions_take_what_build_takes():
    path = EXAMPLES / "moe_fp8_forward.gspec"
    a = gemmspec.derive_backward(path)
    b = gemmspec.derive_backward(path.read_text())
    c = gemmspec.derive_backward(gemmspec.build(path))
    assert a.source == b.source == c.source and a.source
    exe, bw = gemmspec.build_backward(path)
    assert exe.spec.name == bw.spec_name == "moe_fp8_forward_backward"
