"""Files `compile` writes: names and include guards stay distinct and short enough."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from gemmspec.codegen.emit import emit
from gemmspec.errors import OutputError
from gemmspec.output import (
    MAX_FILE_NAME_BYTES,
    check_file_names,
    file_stem,
    header_guard,
    spec_files,
)
from gemmspec.pipeline import lower_file

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_bf16_forward.gspec"


def renamed(name: str):
    """The example's spec, schedule and program, as if its spec were called `name`."""
    (x,) = lower_file(EXAMPLE)
    spec = dataclasses.replace(x.spec, name=name)
    program = dataclasses.replace(emit(x.spec, x.schedule), spec=name)
    return spec, x.schedule, program


def test_header_guard_differs_by_case_and_is_an_identifier() -> None:
    guards = {header_guard(n) for n in ("moe", "MOE", "Moe", "moe_")}
    assert len(guards) == 4
    assert all(re.fullmatch(r"[A-Z_][A-Z0-9_]*", g) for g in guards)
    assert header_guard("moe") == header_guard("moe")  # deterministic


def test_header_of_a_spec_uses_its_guard() -> None:
    spec, schedule, program = renamed("MOE")
    text = spec_files(spec, schedule, program).files["MOE.h"].decode()
    guard = header_guard("MOE")
    assert f"#ifndef {guard}\n#define {guard}\n" in text and guard != header_guard("moe")


def test_names_differing_only_in_case_are_refused() -> None:
    planned = [spec_files(*renamed(n)) for n in ("moe", "MOE")]
    with pytest.raises(OutputError, match=r"specs 'moe' \(.*\) and 'MOE' \(.*\).*differ only in case"):
        check_file_names(planned)
    check_file_names(planned[:1])


@pytest.mark.parametrize("length", [64, 150, 151, 300, 5000])
def test_file_names_stay_short(length: int) -> None:
    name = "g" * length
    files = spec_files(*renamed(name)).files
    assert all(len(f.encode()) <= MAX_FILE_NAME_BYTES for f in files)
    assert f"{file_stem(name)}.h" in files
    check_file_names([spec_files(*renamed(name))])


def test_long_names_shorten_deterministically_and_distinctly() -> None:
    a, b = "x" * 300, "x" * 299 + "y"
    assert file_stem(a) == file_stem(a) != file_stem(b)
    assert file_stem("moe") == "moe"
    assert len(file_stem(a).encode()) <= 150
