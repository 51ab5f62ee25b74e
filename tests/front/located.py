"""What the located-error tests of the passes share: edit a spec's text, check it expecting
an error, and assert the error's message and the column it points at."""

from __future__ import annotations

import pytest

from gemmspec.check import check
from gemmspec.errors import SpecError
from gemmspec.parse import parse


def edited(old: str, new: str, text: str) -> str:
    """`text` with the first `old` replaced by `new` (which must be there)."""
    assert old in text, old
    return text.replace(old, new, 1)


def check_error(text: str) -> SpecError:
    """The SpecError that checking `text` raises."""
    with pytest.raises(SpecError) as info:
        check(parse(text, "spec.gspec"))
    return info.value


def assert_located(text: str, at: str, fragment: str) -> None:
    """Checking `text` fails with `fragment` in the message, pointing where `at` starts."""
    err = check_error(text)
    assert fragment in err.message, err.render()
    line = text.splitlines()[err.location.line - 1]
    assert line[err.location.column - 1:].startswith(at), err.render()
