"""Every fix the checker proposes is one it accepts: each wrong spec of the corpus is
refused at the expected place with the expected message, its note carries a fix as
edits of the source, and applying the fixes one after another ends in a spec that
checks and lowers, in the expected number of steps."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gemmspec.errors import SpecError
from gemmspec.parse import parse
from gemmspec.pipeline import lower_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fixit_corpus import CASES  # noqa: E402


def first_error(text: str) -> SpecError | None:
    try:
        lower_file(parse(text, "case.gspec"))
    except SpecError as e:
        return e
    return None


def test_corpus_is_large_and_distinct():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)
    assert len({c.text for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_following_the_notes_ends_in_a_spec_that_checks(case):
    text = case.text
    err = first_error(text)
    assert err is not None, "the wrong spec checks"
    loc = err.location
    assert f"{loc.line}:{loc.column}" == case.at, err.render()
    assert case.message in err.message, err.render()
    for step in range(case.steps):
        assert err is not None, f"checks after {step} of {case.steps} fixes"
        assert err.fix is not None, f"step {step + 1}: no fix proposed\n{err.render()}"
        # The note says in words what the fix does: every text it inserts is quoted there.
        for edit in err.fix.edits:
            shown = edit.text.strip().split("\n")[-1].strip()
            assert not shown or shown.lstrip(", ") in err.note or shown in err.note, (shown, err.note)
        fixed = err.fix.apply(text)
        assert fixed != text
        text = fixed
        err = first_error(text)
    assert err is None, f"still refused after {case.steps} fixes:\n{text}\n{err.render()}"
