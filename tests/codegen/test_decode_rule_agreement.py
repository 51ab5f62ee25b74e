"""One run-time choice, stated and applied alike everywhere: for every example (and its
derived backward, where one derives) the rule that picks the decode variant per call is
read from each place that states or applies it, and all of them must give the same dim,
comparison and threshold, the same pick at T = 0 and on both sides of the threshold, and
the values the docs give (kernel-abi.md's formula and table of rows per segment; the
same comparison in language.md, usage.md, performance.md and explain-json.md).

The places: the Python executor (`Executable.program_for`, no GPU needed), the emitted
host launcher's comparison (`<spec>_host.cu`) and its comments, the header's
`decode_max_rows`, the manifest's `run_time_choice`, and `gemmspec explain` as text and
as JSON (the backward's from `explain --backward` and the JSON's `backward.explain`).
The expected threshold is worked out from the docs' table of rows per segment, each
changed launch's compiled and decode GEMM (the manifest's steps) and the group's
segments (the JSON's nest), not from the code that makes the rule. Programs without a
variant (masked groups among them: their tile follows the padded bound at compile time,
and no call chooses) must show no choice anywhere. CPU only.
"""

from __future__ import annotations

import contextlib
import io
import json
import operator
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

import gemmspec
from gemmspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOCS = ROOT / "docs"
NAMES = sorted(p.stem for p in EXAMPLES.glob("*.gspec"))
MASKED = [n for n in NAMES if "= masked(" in (EXAMPLES / f"{n}.gspec").read_text()]
LARGEST = 2**31 - 1  # the largest run-time dim a call may have
OPS = {"<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}
# `T <= 128 x 8 segments of 'expert' = 1024 rows`: the rule in words, in explain, the
# manifest and the launcher's comments.
RULE = re.compile(r"^(\w+) (<=|<|>=|>) (\d+) x (\d+) segments of '(\w+)' = (\d+) rows$")
AT_CALL = re.compile(r"^at call time: the decode variant when (.+), else as above:$", re.M)
TILE = re.compile(r"_t(\d+)x(\d+)x\d+_")


def _cli(*args: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue()


@dataclass(frozen=True)
class Rule:
    """A rule as one place states it: the dim, the comparison and the largest size that
    takes the decode variant (with R and segments where the place gives them)."""

    dim: str
    op: str
    largest: int
    rows_per_segment: int | None = None
    segments: int | None = None
    group: str | None = None

    def picks(self, size: int) -> bool:
        return size <= self.largest


def _rule_in_words(text: str) -> Rule:
    found = RULE.match(text)
    assert found, f"not a rule in the documented words: {text!r}"
    dim, op, r, segments, group, total = found.groups()
    assert int(r) * int(segments) == int(total), text
    largest = int(total) if op == "<=" else int(total) - 1
    return Rule(dim, op, largest, int(r), int(segments), group)


@dataclass(frozen=True)
class Docs:
    op: str  # the comparison kernel-abi.md's formula makes
    wide: int  # rows per segment: CTA pairs as compiled, 64 x 256 whole tiles as the variant
    paired: int  # CTA pairs, the compiled width kept
    single: int  # one CTA per tile as compiled
    halves: int  # SwiGLU over separate weights


def _docs() -> Docs:
    abi = (DOCS / "kernel-abi.md").read_text()
    (op,) = re.findall(r"^ +size\(dim\) (<=|<) rows_per_segment x segments$", abi, re.M)
    (row,) = re.findall(r"^\| `rows_per_segment` \| (.*) \|$", abi, re.M)
    assert "at or below which a call takes the variant" in row and "takes the lowest" in row, row

    def number(words: str) -> int:
        (n,) = re.findall(rf"(\d+) {words}", row)
        return int(n)

    docs = Docs(
        op=op,
        wide=number(r"where the compiled kernel runs CTA pairs \(blockwise FP8\) and the variant takes 64 x 256 whole"),
        paired=number("where it runs CTA pairs and the variant keeps the compiled width"),
        single=number("where it runs one CTA per tile"),
        halves=number("for SwiGLU over separate weights"),
    )
    (max_rows,) = re.findall(r"^\| `max_rows` \| (.*) \|$", abi, re.M)
    assert "a call with `dim` at most this takes the variant" in max_rows
    # The other docs' statements of the rule make the same comparison.
    language = (DOCS / "language.md").read_text()
    usage = (DOCS / "usage.md").read_text()
    performance = (DOCS / "performance.md").read_text()
    json_doc = (DOCS / "explain-json.md").read_text()
    assert re.findall(r"\(`T (<=|<) R x E`;", language) == [op]
    assert re.findall(r"with `T (<=|<) \d+ x E`", usage) == [op]
    assert re.findall(r"the decode variant when T (<=|<) R x segments", performance) == [op]
    assert "a call takes the decode variant when `dim`'s size is at most `max_rows`" in json_doc
    assert op == "<="  # "at most", "at or below"
    return docs


@dataclass
class Program:
    """What every place says of one program: the example's forward or its backward."""

    name: str  # the spec's name, the stem of its files
    executor: object
    manifest: dict
    host: str
    header: str
    explain_text: str
    explain_json: dict
    files: set[str]


class Examples:
    """Each example compiled (with its backward where one derives) and explained, once."""

    def __init__(self, out: Path):
        self.out = out
        self._done: dict[str, dict[str, Program | None]] = {}

    def get(self, name: str, which: str) -> Program | None:
        if name not in self._done:
            self._done[name] = self._make(name)
        return self._done[name][which]

    def _make(self, name: str) -> dict[str, Program | None]:
        path = str(EXAMPLES / f"{name}.gspec")
        rc, text = _cli("explain", "--json", path)
        assert rc == 0
        (doc,) = json.loads(text)
        rc, forward_text = _cli("explain", "--width", "0", path)
        assert rc == 0
        rc, backward_text = _cli("explain", "--backward", "--width", "0", path)
        backward = doc["backward"]
        derives = backward["name"] is not None
        assert rc == (0 if derives else 1)
        out = self.out / name
        # `compile --backward` writes nothing where no statement derives.
        assert _cli("compile", path, "-o", str(out), *(["--backward"] if derives else []))[0] == 0
        files = {p.name for p in out.iterdir()}
        made = {"forward": self._program(doc["name"], out, gemmspec.build(path), forward_text, doc, files)}
        if derives:
            spec = out / f"{backward['name']}.gspec"
            assert spec.read_text() == backward["source"]
            made["backward"] = self._program(
                backward["name"], out, gemmspec.build(str(spec)), backward_text, backward["explain"], files
            )
        else:
            assert backward["explain"] is None and not any(f.startswith(f"{doc['name']}_backward") for f in files)
            made["backward"] = None
        return made

    @staticmethod
    def _program(name, out, executor, explain_text, explain_json, files) -> Program:
        return Program(
            name=name,
            executor=executor,
            manifest=json.loads((out / f"{name}.manifest.json").read_text()),
            host=(out / f"{name}_host.cu").read_text(),
            header=(out / f"{name}.h").read_text(),
            explain_text=explain_text,
            explain_json=explain_json,
            files=files,
        )


@pytest.fixture(scope="module")
def docs() -> Docs:
    return _docs()


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> Examples:
    return Examples(tmp_path_factory.mktemp("decode_rule"))


# --- the rule as each place gives it ------------------------------------------------------


def _executor_rule(p: Program) -> Rule | None:
    """The executor's pick found by bisection over the rule's dim, the other run-time dims
    held at 1: the largest size that takes the decode variant."""
    exe = p.executor
    dims = p.manifest["runtime_dims"]
    if exe.decode is None:
        for d in dims:
            for size in (0, 1, LARGEST):
                assert exe.program_for({**dict.fromkeys(dims, 1), d: size}) is exe.program
        return None
    decode = exe.decode.program

    def picks(dim: str, size: int) -> bool:
        chosen = exe.program_for({**dict.fromkeys(dims, 1), dim: size})
        assert chosen is decode or chosen is exe.program
        return chosen is decode

    # The one dim whose size moves the pick.
    (dim,) = [d for d in dims if picks(d, 0) != picks(d, LARGEST)]
    assert picks(dim, 0) and not picks(dim, LARGEST)
    lo, hi = 0, LARGEST  # picks(lo), not picks(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if picks(dim, mid) else (lo, mid)
    return Rule(dim, "<=", lo)  # the largest size that picks it: "at most"


def _host_rule(p: Program) -> Rule | None:
    found = re.findall(r"^  const bool decode = d_(\w+) (<=|<|>=|>) (-?\d+)LL;$", p.host, re.M)
    if not found:
        assert "const bool decode" not in p.host and "gs_layout_decode" not in p.host
        return None
    ((dim, op, bound),) = found
    # Its comments state the rule in words: the file's opening lines and the choice's.
    (words,) = re.findall(r"^  // The decode variant when (.+) \(run_time_choice\)\.$", p.host, re.M)
    top = re.search(r"^// Runs the steps .*? A call with\n// (.+)\n// runs the decode variant's steps", p.host, re.M)
    assert top and top.group(1) == words
    stated = _rule_in_words(words)
    assert (stated.dim, stated.op) == (dim, op)
    largest = int(bound) if op == "<=" else int(bound) - 1
    assert stated.largest == largest, (words, op, bound)
    return Rule(dim, op, largest, stated.rows_per_segment, stated.segments, stated.group)


def _header_rule(p: Program) -> Rule | None:
    found = re.findall(
        rf"^enum \{{ gemmspec_{p.name}_decode_max_rows = (\d+) \}};  // the largest (\w+) that takes the decode variant$",
        p.header, re.M,
    )
    if not found:
        assert "decode_max_rows" not in p.header
        return None
    ((largest, dim),) = found
    return Rule(dim, "<=", int(largest))


def _choice_rule(rc: dict) -> Rule:
    """A `run_time_choice` object's rule: `rule` in words says what the fields say, and its
    total is `max_rows` ("a call with `dim` at most `max_rows` takes the variant"; the
    words' comparison as written)."""
    stated = _rule_in_words(rc["rule"])
    assert (stated.dim, stated.rows_per_segment, stated.segments, stated.group) == (
        rc["dim"], rc["rows_per_segment"], rc["segments"], rc["group"])
    assert rc["max_rows"] == rc["rows_per_segment"] * rc["segments"]
    return Rule(rc["dim"], stated.op, rc["max_rows"], rc["rows_per_segment"], rc["segments"], rc["group"])


def _manifest_rule(p: Program) -> Rule | None:
    rc = p.manifest.get("run_time_choice")
    return None if rc is None else _choice_rule(rc)


def _explain_text_rule(p: Program) -> Rule | None:
    found = AT_CALL.findall(p.explain_text)
    if not found:
        assert "decode variant" not in p.explain_text
        return None
    (words,) = found
    return _rule_in_words(words)


def _explain_json_rule(p: Program) -> Rule | None:
    rc = p.explain_json.get("run_time_choice")
    if rc is None:
        return None
    # The manifest's choice is explain's, with the variant's files, workspaces and steps.
    assert {k: v for k, v in p.manifest.get("run_time_choice", {}).items() if k in rc} == rc
    return _choice_rule(rc)


SOURCES = {
    "executor": _executor_rule,
    "host launcher": _host_rule,
    "header": _header_rule,
    "manifest": _manifest_rule,
    "explain": _explain_text_rule,
    "explain --json": _explain_json_rule,
}


def _segments(nest: list[dict], group: str) -> int:
    """The segments of `group` in all: its count times those of the groups it is within."""
    by_name = {g["name"]: g for g in nest}
    total, g = 1, by_name[group]
    while g is not None:
        total *= g["count"]
        g = by_name[g["within"]] if g["within"] else None
    return total


def _documented_rule(p: Program, docs: Docs) -> Rule:
    """The rule docs/kernel-abi.md gives this program: R by each changed launch's compiled
    GEMM and its decode GEMM (the manifest's steps), the lowest of them, times the segments
    of the ragged group its rows are (explain's nest and extents)."""

    def gemms(steps: list[dict]) -> dict[int, dict]:
        return {
            int(s["owner"].split()[1]): s
            for s in steps if s["kind"] == "kernel" and s["role"] == "gemm" and s["owner"].startswith("launch ")
        }

    compiled, decode = gemms(p.manifest["steps"]), gemms(p.manifest["run_time_choice"]["steps"])
    assert compiled.keys() == decode.keys()
    changed = sorted(i for i in compiled if compiled[i]["symbol"] != decode[i]["symbol"])
    assert changed
    launches = {launch["index"]: launch for launch in p.explain_json["launches"]}
    rows, groups = [], set()
    for i in changed:
        before, after = compiled[i], decode[i]
        (tile_m, tile_n) = map(int, TILE.search(after["symbol"]).groups())
        assert tile_m == 64 and after["cluster"] == [1, 1, 1]  # 64-row tiles of one CTA each
        if launches[i]["signature"]["swiglu_halves"]:
            r = docs.halves
        elif before["cluster"] == [1, 1, 1]:
            r = docs.single
        elif tile_n == 256:
            assert "_splitk" not in after["symbol"]  # whole tiles
            r = docs.wide
        else:
            assert int(TILE.search(before["symbol"]).group(2)) == tile_n  # the compiled width kept
            r = docs.paired
        rows.append(r)
        found = re.search(r"\((\w+) segments of (\w+)\)$", launches[i]["extents"]["m"])
        assert found, launches[i]["extents"]["m"]
        groups.add(found.groups())
    ((group, dim),) = groups  # one rule: one group over one dim
    assert dim in p.manifest["runtime_dims"]
    kinds = {g["name"]: g["kind"] for g in p.explain_json["nest"]}
    assert kinds[group] == "ragged"
    segments = _segments(p.explain_json["nest"], group)
    r = min(rows)
    return Rule(dim, docs.op, r * segments, r, segments, group)


PROGRAMS = [(name, which) for name in NAMES for which in ("forward", "backward")]


@pytest.mark.parametrize(("name", "which"), PROGRAMS, ids=[f"{n}-{w}" for n, w in PROGRAMS])
def test_every_place_states_and_applies_one_rule(name, which, examples, docs):
    p = examples.get(name, which)
    if p is None:  # no backward derives: nothing of one was written (checked when made)
        assert which == "backward"
        return
    rules = {where: read(p) for where, read in SOURCES.items()}
    has = {where for where, rule in rules.items() if rule is not None}
    assert has in (set(), set(SOURCES)), f"{p.name}: a choice in {sorted(has)} only"
    decode_files = {f for f in p.files if re.fullmatch(rf"{p.name}_launch\d+_decode\.cu", f)}
    if not has:
        assert not decode_files, decode_files
        return
    assert decode_files == set(p.manifest["run_time_choice"]["files"])
    expected = _documented_rule(p, docs)
    for where, rule in rules.items():
        assert (rule.dim, rule.largest) == (expected.dim, expected.largest), (p.name, where, rule, expected)
        if rule.rows_per_segment is not None:
            assert (rule.rows_per_segment, rule.segments, rule.group) == (
                expected.rows_per_segment, expected.segments, expected.group), (p.name, where, rule)
        assert rule.op == docs.op, (p.name, where, rule.op)  # the comparison as written
    # The same pick at T = 0 (the variant: 0 rows per segment), just below, at and just
    # above the threshold, and at the largest dim a call may have.
    threshold = expected.largest
    exe = p.executor
    others = dict.fromkeys(p.manifest["runtime_dims"], 1)
    for size, wanted in ((0, True), (threshold - 1, True), (threshold, True), (threshold + 1, False),
                         (LARGEST, False)):
        ran = exe.program_for({**others, expected.dim: size}) is exe.decode.program
        picks = {where: rule.picks(size) for where, rule in rules.items()}
        assert ran == wanted and set(picks.values()) == {wanted}, (p.name, size, ran, picks)
    # The host launcher's own comparison, evaluated as C++ would.
    ((dim, op, bound),) = re.findall(r"const bool decode = d_(\w+) (<=|<|>=|>) (-?\d+)LL;", p.host)
    assert dim == expected.dim
    assert [OPS[op](size, int(bound)) for size in (0, threshold, threshold + 1)] == [True, True, False]


@pytest.mark.parametrize("name", MASKED)
def test_masked_groups_have_no_choice(name, examples):
    """Masked rows keep one kernel (docs/language.md): their tile follows the padded
    bound, known when compiling, and no call picks another by its size."""
    p = examples.get(name, "forward")
    assert {g["kind"] for g in p.explain_json["nest"]} == {"masked"}
    assert p.executor.decode is None
    assert all(read(p) is None for read in SOURCES.values())


def test_the_usage_walkthrough_states_the_examples_rule(examples, docs):
    """docs/usage.md's C++ walk-through of moe_fp8_forward: `T <= 128 x E`, its header's
    bound 1024 for eight experts, and the variant's 64 x 256 tiles of one CTA."""
    usage = (DOCS / "usage.md").read_text()
    p = examples.get("moe_fp8_forward", "forward")
    rule = _manifest_rule(p)
    ((op, r, bound),) = re.findall(
        r"with `T (<=|<) (\d+) x E` \(`gemmspec_moe_fp8_forward_decode_max_rows`, (\d+) for the example's\s+eight",
        usage,
    )
    assert (op, int(r), int(bound)) == (docs.op, rule.rows_per_segment, rule.largest) and rule.segments == 8
    ((enum,),) = [re.findall(r"_decode_max_rows = (\d+) \};", line) for line in usage.splitlines()
                  if "gemmspec_moe_fp8_forward_decode_max_rows =" in line]
    assert int(enum) == _header_rule(p).largest
    assert re.search(r"it launches the decode variant, 64 x 256 tiles of one CTA each", usage)
    ((decode,),) = [[s for s in p.manifest["run_time_choice"]["steps"] if s.get("role") == "gemm"]]
    assert TILE.search(decode["symbol"]).groups() == ("64", "256") and decode["cluster"] == [1, 1, 1]
