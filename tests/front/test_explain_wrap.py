"""`gemmspec explain` wraps its text for a reader: at the terminal's width (at most 100)
on a terminal, at `--width N` when asked, with continuation lines hanging under their
item; into a pipe (and for `explain()` and `--json`) it keeps one line per item, so
programs and tests that search the text see every phrase whole."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import gemmspec
from gemmspec.cli import main
from gemmspec.explain import wrap

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
FFN = EXAMPLES / "moe_ffn_fp8_train.gspec"


def _explain(capsys, *argv: str) -> str:
    assert main(["explain", *argv]) == 0
    return capsys.readouterr().out


def test_a_pipe_gets_one_line_per_item(capsys) -> None:
    text = _explain(capsys, str(FFN))
    assert text == gemmspec.build(FFN).explain() + "\n"
    assert max(map(len, text.splitlines())) > 300  # the case this is about


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.gspec")), ids=lambda p: p.stem)
def test_wrapped_text_holds_the_same_words_within_the_width(path, capsys) -> None:
    flat = gemmspec.build(path).explain()
    wrapped = _explain(capsys, str(path), "--width", "100")
    assert wrapped.split() == flat.split()
    for line in wrapped.splitlines():
        # Only a word longer than the line (a kernel's name) may overrun it.
        assert len(line) <= 100 or len(line.split()) <= 2, line


def test_continuations_hang_under_their_item(capsys) -> None:
    lines = iter(_explain(capsys, str(FFN), "--width", "80").splitlines())
    flat = gemmspec.build(FFN).explain().splitlines()
    wrapped_items = 0
    for item in flat:  # its first line, then continuations until its words are all there
        indent, marker = re.match(r"( *)(- |\[\d+\] )?", item).groups()
        hang = len(indent) + (len(marker) if marker else 4)
        first = next(lines)
        assert first.startswith(indent + (marker or "")) and not first[len(indent + (marker or "")):].startswith(" ")
        words = first.split()
        while len(words) < len(item.split()):
            more = next(lines)
            assert len(more) - len(more.lstrip()) == hang, (item, more)
            words += more.split()
            wrapped_items += first is not None
            first = None
        assert words == item.split()
    assert next(lines, None) is None
    assert wrapped_items > 20


def test_short_brackets_stay_whole() -> None:
    line = "  - #0: share one kernel signature: e4m3 x e4m3 with scales [1, 128] x [1, 128, 128] -> bf16"
    for width in range(40, len(line)):
        text = wrap(line, width)
        assert "[1, 128]" in text and "[1, 128, 128]" in text, text
        assert all(ln.startswith("    ") for ln in text.splitlines()[1:])


def test_a_terminal_gets_its_width_at_most_100(capsys, monkeypatch) -> None:
    import shutil
    import sys

    monkeypatch.setattr(sys.stdout, "isatty", lambda: True)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: __import__("os").terminal_size((200, 50)))
    assert _explain(capsys, str(FFN)) == _explain(capsys, str(FFN), "--width", "100")
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *a, **k: __import__("os").terminal_size((72, 50)))
    assert _explain(capsys, str(FFN)) == _explain(capsys, str(FFN), "--width", "72")
    assert _explain(capsys, str(FFN), "--width", "0") == gemmspec.build(FFN).explain() + "\n"


def test_json_ignores_the_width(capsys) -> None:
    doc = json.loads(_explain(capsys, "--json", str(FFN), "--width", "60"))
    assert doc == json.loads(_explain(capsys, "--json", str(FFN)))


@pytest.mark.parametrize("width", ["39", "-1", "x"])
def test_a_bad_width_is_a_usage_error(width, capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["explain", str(FFN), "--width", width])
    assert e.value.code == 2
    assert "expected 0 (no wrapping) or a width of at least 40" in capsys.readouterr().err
