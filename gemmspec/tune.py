"""`gemmspec tune`: time a spec's tile choices on the GPU and say which `tile(M, N)` to write.

The tile heuristic (gemmspec/tiling.py) picks widths by operand bytes per output and
ignores the last wave's waste and partial N tiles. Tuning measures instead, and its only
result is advice: the directive line to add to the spec (or to keep the spec as written),
so the spec stays the one source of what `build` does.

Candidates are the spec as written (the default: the heuristic, or the spec's own `tile`
directive) and spec-wide `tile(M, N)` directives with M in {64, 128} and N among the
widths the heuristic considers (256 included, where the language allows it). Each one is
the spec's text with the directive added (or put in place of the spec's own), run through
the real checker and lowering: what they refuse is skipped with their message. Also
skipped, with a reason: widths wider than the narrowest one that covers every
statement's N (when the spec fixes N: the same tiles with more padding), widths under 64
columns when N is at least 128 (more tiles, each reading A again), and candidates whose
kernels come out identical to the default's. `only` replaces the search space with the
tiles given.

Each candidate is built, called once on the same random inputs (`check_random`, as
`gemmspec run` does) and compared with the float64 reference; one that fails is FAILED and
not timed. The others are timed by CUDA events (runtime/timing.py). The fastest is
suggested unless the default is within `KEEP_WITHIN` of it.
"""

from __future__ import annotations

import re
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .analyse import n_extents
from .errors import GemmspecError, SpecError, SpecErrors
from .parse import parse
from .tiling import SCALED_WIDTHS, UNSCALED_WIDTHS

TILE_ROWS = (128, 64)
# Every width the heuristic considers for some kernel, widest first.
TILE_WIDTHS = tuple(sorted(set(UNSCALED_WIDTHS) | set(SCALED_WIDTHS), reverse=True))
NARROW_WIDTH = 64  # narrower tiles are tried only when N is below WIDE_N
WIDE_N = 128
# The default is kept when it is at most this much slower than the fastest.
KEEP_WITHIN = 0.01

# Between tokens of the language: blanks and comments.
_GAP = r"(?:\s|#[^\n]*)*"
_TILE_DIRECTIVE = re.compile(rf"tile{_GAP}\({_GAP}\d+{_GAP},{_GAP}\d+{_GAP}\)")


def directive(tile: tuple[int, int]) -> str:
    """The directive line for a tile: `tile(128, 160)`."""
    return f"tile({tile[0]}, {tile[1]})"


@dataclass(frozen=True)
class Candidate:
    """One spec text to time: the spec as written (`tile` None), or with `tile(M, N)`."""

    tile: tuple[int, int] | None
    text: str
    written: tuple[int, int] | None = None  # the spec's own tile directive, if any
    heuristic: str = ""  # the default's tiles when the heuristic picks them: "128x256"

    @property
    def is_default(self) -> bool:
        return self.tile is None

    @property
    def label(self) -> str:
        if self.tile is not None:
            return directive(self.tile)
        if self.written is not None:
            return f"as written ({directive(self.written)})"
        return f"as written (heuristic: {self.heuristic})" if self.heuristic else "as written (heuristic)"


@dataclass(frozen=True)
class Skipped:
    tile: tuple[int, int]
    reason: str


@dataclass(frozen=True)
class Candidates:
    """The default first, then the directives to try; what was left out and why."""

    spec: str
    candidates: tuple[Candidate, ...]
    skipped: tuple[Skipped, ...]


# ---------------------------------------------------------------------------- spec text
def _offset(text: str, line: int, column: int) -> int:
    lines = text.split("\n")
    return sum(len(x) + 1 for x in lines[: line - 1]) + column - 1


def _one_spec(text: str, path: str):
    file = parse(text, path)
    if len(file.specs) != 1:
        names = ", ".join(s.name.text for s in file.specs) or "none"
        raise GemmspecError(f"{path}: tune takes a file with one spec; it defines {len(file.specs)} ({names})")
    return file, file.specs[0]


def written_tile(text: str, path: str = "<string>") -> tuple[int, int] | None:
    """The spec's own `tile(M, N)` directive (the last one, as the checker reads them)."""
    _, spec = _one_spec(text, path)
    tiles = [d for d in spec.directives if d.kind == "tile"]
    return (int(tiles[-1].args[0]), int(tiles[-1].args[1])) if tiles else None


def with_tile(text: str, tile: tuple[int, int], path: str = "<string>") -> str:
    """The spec's text with `tile(M, N)`: in place of its own tile directives, or as the
    first item of its body."""
    file, spec = _one_spec(text, path)
    text = file.text  # normalised: positions count in it
    line = directive(tile)
    spans = []
    for d in spec.directives:
        if d.kind != "tile":
            continue
        at = _offset(text, d.pos.line, d.pos.column)
        m = _TILE_DIRECTIVE.match(text, at)
        if m is None:  # the parser read a tile directive here: the pattern must match
            raise GemmspecError(f"{path}:{d.pos}: cannot find the end of this tile directive")
        spans.append((m.start(), m.end()))
    if spans:
        # The first one becomes the new directive; later ones (the checker reads the last) go.
        for i, (start, end) in enumerate(reversed(spans)):
            text = text[:start] + (line if i == len(spans) - 1 else "") + text[end:]
        return text
    at = _offset(text, spec.name.pos.line, spec.name.pos.column) + len(spec.name.text)
    brace = re.compile(rf"{_GAP}\{{").match(text, at)
    if brace is None:
        raise GemmspecError(f"{path}:{spec.name.pos}: cannot find the body of spec '{spec.name.text}'")
    return text[: brace.end()] + f"\n  {line}" + text[brace.end() :]


def _one_line(e: GemmspecError) -> str:
    """The checker's message alone: no location (it would point into a generated text)."""
    if isinstance(e, SpecErrors) and e.errors:
        e = e.errors[0]
    if isinstance(e, SpecError):
        return e.message
    return (str(e).splitlines() or [type(e).__name__])[0]


# ---------------------------------------------------------------------------- candidates
def _widths_to_try(lowered) -> tuple[tuple[int, str | None], ...]:
    """(width, why it is left out or None) for every width the heuristic considers."""
    spec = lowered.spec
    extents = [n for g in spec.gemms for n in n_extents(spec, g).values()]
    known = None if any(n is None for n in extents) or not extents else max(extents)
    cover = None
    if known is not None:
        cover = min((w for w in TILE_WIDTHS if w >= known), default=max(TILE_WIDTHS))
    out = []
    for w in TILE_WIDTHS:
        why = None
        if cover is not None and w > cover:
            why = f"wider than the {cover} columns that cover N = {known} (the same tiles, more padding)"
        elif w < NARROW_WIDTH and (known is None or known >= WIDE_N):
            n_text = f"N = {known}" if known is not None else "N known only at run time"
            why = f"narrower than {NARROW_WIDTH} columns with {n_text} (more tiles, each reading A again)"
        out.append((w, why))
    return tuple(out)


def enumerate_candidates(text: str, path: str = "<string>", only: Sequence[tuple[int, int]] | None = None) -> Candidates:
    """The default (the spec as written, checked as the file it came from) and every
    `tile(M, N)` the checker and lowering accept, with what was skipped and why."""
    from .codegen.emit import emit
    from .pipeline import lower_file

    _one_spec(text, path)  # several specs: say so before anything else
    default = lower_file(parse(text, path))[0]  # spec errors point into the user's file
    kernels = emit(default.spec, default.schedule).sources()
    own = written_tile(text, path)
    if only:
        tiles = [(tuple(t), None) for t in dict.fromkeys(tuple(t) for t in only)]
    else:
        widths = _widths_to_try(default)
        tiles = [((m, w), why) for m in TILE_ROWS for w, why in widths]
    chosen = dict.fromkeys(f"{p.tile_m}x{p.tile_n}" for p in default.decision.plans)
    candidates = [Candidate(None, text, own, "" if own else ", ".join(chosen))]
    skipped = []
    for tile, why in tiles:
        if why is not None:
            skipped.append(Skipped(tile, why))
            continue
        tiled = with_tile(text, tile, path)
        try:
            lowered = lower_file(tiled)[0]
            same = emit(lowered.spec, lowered.schedule).sources() == kernels
        except GemmspecError as e:
            skipped.append(Skipped(tile, _one_line(e)))
            continue
        if same:
            skipped.append(Skipped(tile, "the same kernels as the spec as written"))
            continue
        candidates.append(Candidate(tile, tiled, own))
    return Candidates(default.spec.name, tuple(candidates), tuple(skipped))


# ---------------------------------------------------------------------------- measuring
@dataclass(frozen=True)
class Trial:
    """A candidate built and called once: its report (`ok`, `checks`, `useful_flops`,
    `dims`, `describe()`, as `RunReport`) and what the timer times."""

    report: object
    timeable: object


Runner = Callable[[Candidate], Trial]
Timer = Callable[[object, int], Sequence[float]]  # (timeable, repeat) -> milliseconds


@dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    ok: bool
    check: str  # "ok", or what failed
    samples_ms: tuple[float, ...] = ()
    useful_flops: float = 0.0
    dims: dict = field(default_factory=dict)

    @property
    def ms(self) -> float | None:
        """The median timing; None when not timed (FAILED)."""
        return statistics.median(self.samples_ms) if self.samples_ms else None

    @property
    def tflops(self) -> float | None:
        ms = self.ms
        return self.useful_flops / ms / 1e9 if ms else None


@dataclass(frozen=True)
class TuneReport:
    spec: str
    outcomes: tuple[Outcome, ...]  # the default first
    skipped: tuple[Skipped, ...]
    repeat: int = 0
    seed: int = 0

    @property
    def default(self) -> Outcome:
        return self.outcomes[0]

    @property
    def ok(self) -> bool:
        """Every candidate built and matched the reference."""
        return all(o.ok for o in self.outcomes)

    @property
    def fastest(self) -> Outcome | None:
        timed = [o for o in self.outcomes if o.ms is not None]
        return min(timed, key=lambda o: o.ms) if timed else None

    def ratio(self, o: Outcome) -> float | None:
        """How many times faster than the default (above 1: faster)."""
        if o.ms is None or self.default.ms is None:
            return None
        return self.default.ms / o.ms

    @property
    def suggestion(self) -> str | None:
        """The directive line to write, or None to keep the spec as written."""
        best = self.fastest
        if best is None or best.candidate.is_default:
            return None
        d = self.default
        if d.ms is not None and d.ms <= best.ms * (1 + KEEP_WITHIN):
            return None
        return directive(best.candidate.tile)

    @property
    def advice(self) -> str:
        best, line = self.fastest, self.suggestion
        if best is None:
            return "no candidate matched the reference: nothing to suggest"
        if line is None:
            if best.candidate.is_default:
                return "keep the spec as written (it is the fastest)"
            return (
                f"keep the spec as written (within {KEEP_WITHIN:.0%} of the fastest, "
                f"{best.candidate.label})"
            )
        written = self.default.candidate.written
        if self.default.ms is None:
            why = "the spec as written failed"
        else:
            why = f"{self.ratio(best):.3f}x the speed of the spec as written"
        if written is not None:
            return f"replace {directive(written)} in the spec with: {line}  ({why})"
        return f"add this line to the spec: {line}  ({why})"

    def table(self) -> str:
        rows = [("candidate", "ms", "TFLOPS", "vs default", "check")]
        for o in self.outcomes:
            ratio = self.ratio(o)
            rows.append((
                o.candidate.label,
                f"{o.ms:.4f}" if o.ms is not None else "-",
                f"{o.tflops:.1f}" if o.tflops is not None else "-",
                f"{ratio:.3f}x" if ratio is not None else "-",
                "ok" if o.ok else f"FAILED: {o.check}",
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for r in rows:
            cells = [r[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(r[1:4], widths[1:])] + [r[4]]
            lines.append("  ".join(cells).rstrip())
        return "\n".join(lines)

    def text(self) -> str:
        dims = self.outcomes[0].dims if self.outcomes else {}
        head = f"{self.spec}: dims {dims}, median of {self.repeat} timing(s), seed {self.seed}"
        out = [head, self.table()]
        if self.skipped:
            out.append(f"skipped {len(self.skipped)}:")
            out += [f"  {directive(s.tile)}: {s.reason}" for s in self.skipped]
        best = self.fastest
        if best is not None:
            out.append(f"fastest: {best.candidate.label}, {best.ms:.4f} ms")
        out.append(self.advice)
        return "\n".join(out)

    def to_json(self) -> dict:
        def one(o: Outcome) -> dict:
            return {
                "candidate": o.candidate.label,
                "tile": list(o.candidate.tile) if o.candidate.tile else None,
                "default": o.candidate.is_default,
                "ok": o.ok,
                "check": o.check,
                "ms": o.ms,
                "samples_ms": list(o.samples_ms),
                "tflops": o.tflops,
                "vs_default": self.ratio(o),
            }

        best = self.fastest
        return {
            "spec": self.spec,
            "dims": dict(self.outcomes[0].dims) if self.outcomes else {},
            "seed": self.seed,
            "repeat": self.repeat,
            "written_tile": list(self.default.candidate.written) if self.default.candidate.written else None,
            "candidates": [one(o) for o in self.outcomes],
            "skipped": [{"tile": list(s.tile), "reason": s.reason} for s in self.skipped],
            "fastest": best.candidate.label if best else None,
            "directive": self.suggestion,
            "advice": self.advice,
            "ok": self.ok,
        }


def measure(found: Candidates, runner: Runner, timer: Timer, repeat: int, *, seed: int = 0,
            progress: Callable[[str], None] = lambda _: None) -> TuneReport:
    """Run and time every candidate: build errors and failed checks are FAILED, not timed."""
    outcomes = []
    total = len(found.candidates)
    for i, c in enumerate(found.candidates, 1):
        progress(f"[{i}/{total}] {c.label} ...")
        try:
            trial = runner(c)
        except GemmspecError as e:
            outcomes.append(Outcome(c, False, f"build: {_one_line(e)}"))
            continue
        r = trial.report
        if not r.ok:
            failed = "; ".join(x.describe() for x in r.checks if not x.ok)
            outcomes.append(Outcome(c, False, failed or r.describe(), (), r.useful_flops, dict(r.dims)))
            continue
        samples = tuple(float(s) for s in timer(trial.timeable, repeat))
        outcomes.append(Outcome(c, True, "ok", samples, r.useful_flops, dict(r.dims)))
    return TuneReport(found.spec, tuple(outcomes), found.skipped, repeat, seed)


def gpu_runner(dims: dict[str, int] | None = None, lengths: dict | None = None, seed: int = 0) -> Runner:
    """Build a candidate and check one call on random inputs (the same for every candidate:
    same seed, same spec but for the tile)."""
    from .build import build
    from .runtime.verify import check_random

    memo: dict = {}  # the float64 reference, computed for the first candidate only

    def run(c: Candidate) -> Trial:
        call = check_random(build(c.text), dims=dims, lengths=lengths, seed=seed, reference_memo=memo)
        return Trial(call.report, call)

    return run


def event_timer(call, repeat: int) -> tuple[float, ...]:
    """CUDA-event timings of a checked call (L2 flushed before each)."""
    from .runtime.timing import time_events

    return time_events(call.prepare(), repeat).samples_ms


def tune(
    spec: str | Path,
    *,
    dims: dict[str, int] | None = None,
    lengths: dict | None = None,
    seed: int = 0,
    repeat: int = 20,
    only: Sequence[tuple[int, int]] | None = None,
    runner: Runner | None = None,
    timer: Timer | None = None,
    progress: Callable[[str], None] = lambda _: None,
    on_candidates: Callable[[Candidates], None] = lambda _: None,
) -> TuneReport:
    """Tune the tile of a one-spec file (a path or .gspec text) on the GPU; `runner` and
    `timer` replace the GPU's for tests."""
    if isinstance(spec, Path) or "{" not in spec:
        path = str(spec)
        text = Path(spec).read_text(encoding="utf-8")
    else:
        path, text = "<string>", spec
    found = enumerate_candidates(text, path, only)  # spec errors first, as `gemmspec run`
    if runner is None:
        from .runtime.arrays import require_hopper

        require_hopper(0)  # no Hopper GPU: the error `gemmspec run` gives, before any compiling
    on_candidates(found)
    runner = runner or gpu_runner(dims, lengths, seed)
    timer = timer or event_timer
    return measure(found, runner, timer, repeat, seed=seed, progress=progress)


__all__ = [
    "Candidate",
    "Candidates",
    "Outcome",
    "Skipped",
    "Trial",
    "TuneReport",
    "directive",
    "enumerate_candidates",
    "measure",
    "tune",
    "with_tile",
    "written_tile",
]
