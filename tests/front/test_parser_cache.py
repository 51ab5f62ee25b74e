"""The spec parser is built once (strictly checked) and then loaded from the cache folder."""

from __future__ import annotations

from pathlib import Path

import pytest

from gemmspec import diskcache, parse

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def fresh_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A cache folder of its own, and no parser built in this process yet (nor after)."""
    monkeypatch.setenv("GEMMSPEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("GEMMSPEC_NO_CACHE", raising=False)
    parse._parser.cache_clear()
    yield tmp_path
    parse._parser.cache_clear()


def _refuse_to_build():
    raise AssertionError("the parser was built, not loaded from the cache")


def test_grammar_passes_the_strict_check():
    # The cached path may load a parser built elsewhere: build it here, strictly, every run.
    assert parse.build_parser().options.strict


def test_built_parser_is_saved_then_loaded(fresh_parser: Path, monkeypatch: pytest.MonkeyPatch):
    text = (EXAMPLES / "moe_fp8_forward.gspec").read_text()
    built = parse.parse(text)
    (entry,) = fresh_parser.glob("parser-*.lark")
    parse._parser.cache_clear()
    monkeypatch.setattr(parse, "build_parser", _refuse_to_build)
    assert parse.parse(text) == built
    assert list(fresh_parser.glob("parser-*.lark")) == [entry]


def test_damaged_entry_is_rebuilt_and_rewritten(fresh_parser: Path):
    parse._parser()
    (entry,) = fresh_parser.glob("parser-*.lark")
    good = entry.read_bytes()
    key = good[-72:-40].hex()  # the trailer: magic, key, length, sha256
    assert diskcache.read_entry(str(entry), key, parse._PARSER_MAGIC)
    text = (EXAMPLES / "moe_fp8_forward.gspec").read_text()
    damaged = (
        good[:100] + bytes(b ^ 0xFF for b in good[100:164]) + good[164:],  # the sha256 no longer checks
        diskcache.entry_bytes(b"not a parser", key, parse._PARSER_MAGIC),  # checks, does not load
    )
    for bad in damaged:
        entry.write_bytes(bad)
        parse._parser.cache_clear()
        assert parse.parse(text).specs
        assert diskcache.read_entry(str(entry), key, parse._PARSER_MAGIC) not in (None, b"not a parser")


def test_no_cache_writes_nothing(fresh_parser: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("GEMMSPEC_NO_CACHE", "1")
    assert parse.parse((EXAMPLES / "moe_fp8_forward.gspec").read_text()).specs
    assert not list(fresh_parser.iterdir())
