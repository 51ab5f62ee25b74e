"""Fixtures the command-line tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def no_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any look for a GPU fails the test: what it checks must come before one."""
    import gemmspec.runtime.arrays as arrays

    def fail(*_args, **_kwargs):
        raise AssertionError("a device was looked for")

    monkeypatch.setattr(arrays, "Device", fail)
    monkeypatch.setattr(arrays, "get_device", fail)
    monkeypatch.setattr(arrays, "require_hopper", fail)
