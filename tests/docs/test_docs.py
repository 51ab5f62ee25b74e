"""The documentation stays true to the code.

Every complete spec in docs/language.md checks; every key docs/explain-json.md
marks as required appears in real `explain --json` output; the element types the
language reference lists are exactly the grammar's DTYPE terminal.
"""

from __future__ import annotations

import json
import re
import textwrap
from pathlib import Path

import pytest

import gemmspec
from gemmspec.check import check
from gemmspec.cli import main
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

ROOT = Path(__file__).resolve().parents[2]
LANGUAGE = ROOT / "docs" / "language.md"
EXPLAIN_JSON = ROOT / "docs" / "explain-json.md"
EXAMPLES = ROOT / "examples"
GRAMMAR = Path(gemmspec.__file__).resolve().parent / "grammar.lark"


def gspec_blocks(text: str) -> list[str]:
    """Bodies of the ```gspec fenced blocks that hold a complete spec, those indented
    inside a list item too (dedented)."""
    blocks = re.findall(r"^([ \t]*)```gspec[ \t]*\n(.*?)^\1```", text, re.M | re.S)
    return [textwrap.dedent(b) for _, b in blocks if "gemm " in b]


def section(text: str, heading: str) -> str:
    """The text under a markdown heading, up to the next heading of the same or higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    m = re.search(rf"^{re.escape(heading)}[ \t]*$", text, re.M)
    assert m, f"no heading {heading!r}"
    rest = text[m.end() :]
    end = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return rest[: end.start()] if end else rest


def table_rows(text: str) -> list[list[str]]:
    """Cells of the rows of the first markdown table in `text` (header and separator included)."""
    rows: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("|") and line.endswith("|"):
            rows.append([c.strip() for c in line[1:-1].split("|")])
        elif rows:
            break
    return rows


def required_keys(heading: str) -> list[str]:
    """Keys of a `| key | type | required | meaning |` table marked required."""
    rows = table_rows(section(EXPLAIN_JSON.read_text(encoding="utf-8"), heading))
    assert rows and [c.lower() for c in rows[0][:3]] == ["key", "type", "required"], rows[:1]
    keys = []
    for cells in rows[2:]:
        if cells[2] == "yes":
            keys += re.findall(r"`([A-Za-z_]+)`", cells[0])
    assert keys, f"no required keys under {heading!r}"
    return keys


def explain_json(path: Path, capsys) -> list[dict]:
    assert main(["explain", "--json", str(path)]) == 0
    return json.loads(capsys.readouterr().out)


BLOCKS = gspec_blocks(LANGUAGE.read_text(encoding="utf-8"))


def test_language_reference_has_examples():
    assert len(BLOCKS) >= 10


@pytest.mark.parametrize("text", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_language_example_checks(text):
    specs = check(parse(text, "doc.gspec"))
    assert specs and all(s.gemms for s in specs)
    # The whole front half accepts it too (analysis and lowering raise their own errors).
    lowered = lower_file(parse(text, "doc.gspec"))
    assert all(x.schedule.launches for x in lowered)


def test_documented_dtypes_match_grammar():
    grammar = GRAMMAR.read_text(encoding="utf-8")
    m = re.search(r"^DTYPE(?:\.\d+)?\s*:\s*(.+)$", grammar, re.M)
    assert m, "no DTYPE terminal in grammar.lark"
    in_grammar = set(re.findall(r'"([^"]+)"', m.group(1)))
    rows = table_rows(section(LANGUAGE.read_text(encoding="utf-8"), "### Element types"))
    documented = {re.sub(r"`", "", cells[0]) for cells in rows[2:]}
    assert documented == in_grammar


def test_required_spec_and_launch_keys_present(capsys):
    (doc,) = explain_json(EXAMPLES / "lora_moe_nested.gspec", capsys)
    top = required_keys("## Spec object")
    assert {"name", "decision", "reasons", "launches", "prepasses"} <= set(top)
    assert set(top) <= set(doc)
    assert doc["decision"] in ("flatten", "split")
    assert all(isinstance(r, str) for r in doc["reasons"])
    launch_keys = required_keys("## Launch object")
    assert "leaf_count" in launch_keys
    assert doc["launches"]
    for launch in doc["launches"]:
        assert set(launch_keys) <= set(launch)
        assert isinstance(launch["leaf_count"], int)
    nest_keys = required_keys("## Nest entry")
    assert doc["nest"] and all(set(nest_keys) <= set(g) for g in doc["nest"])


def test_required_prepass_keys_present(capsys):
    (doc,) = explain_json(EXAMPLES / "linear_fp8_training.gspec", capsys)
    keys = required_keys("## Pre-pass object")
    assert "kind" in keys
    assert doc["prepasses"]
    for p in doc["prepasses"]:
        assert set(keys) <= set(p)
        assert p["kind"] in ("requantize", "transpose")


def test_required_backward_keys_present(capsys):
    keys = required_keys("## Backward object")
    assert {"source", "refused", "explain"} <= set(keys)
    for example in ("moe_fp8_forward", "moe_masked_decode"):
        (doc,) = explain_json(EXAMPLES / f"{example}.gspec", capsys)
        assert set(keys) == set(doc["backward"])
    assert doc["backward"]["refused"] and doc["backward"]["explain"] is None


def test_usage_header_block_is_what_compile_writes(tmp_path):
    # docs/usage.md quotes gen/moe_fp8_forward.h (its declarations and the decode rule's
    # largest T, aligned and wrapped for reading): each quoted line, spaces collapsed, is
    # in the header `gemmspec compile` writes.
    usage = (ROOT / "docs" / "usage.md").read_text(encoding="utf-8")
    start = usage.index("`gen/moe_fp8_forward.h` declares")
    block = re.search(r"```c\+\+\n(.*?)```", usage[start:], flags=re.S).group(1)
    assert main(["compile", str(EXAMPLES / "moe_fp8_forward.gspec"), "-o", str(tmp_path)]) == 0
    header = " ".join((tmp_path / "moe_fp8_forward.h").read_text().split())
    quoted = [" ".join(line.split()) for line in block.splitlines() if line.strip()]
    assert any("decode_max_rows" in line for line in quoted)
    missing = [line for line in quoted if line not in header]
    assert not missing, f"docs/usage.md quotes lines the header does not have: {missing}"
