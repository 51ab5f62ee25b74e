"""Mutants of every shipped spec either compile or fail with a located error.

A seeded mutator edits the examples and the complete specs of docs/language.md:
token deletions, duplications and swaps, integers blown up to the limits and far
past them, identifiers swapped for other names or the language's words, stray
characters and random bytes (byte-order marks, line separators, control codes),
lines duplicated or dropped, long `+`/`*` chains and deep parentheses, and
clause-level edits that keep the text parseable (layouts, scales, element types,
derivations, directives, dim sizes, extra statements), and edits that add or change the
constructs the language grew later: epilogue factors and biases, rows gathered through
an index, FP8 outputs (`pow2` scales included) and their copies, row passes (`rowdot`,
`rowscale`, `scatter_add`), `pad`, capacity offsets and the `tile` and `gather`
directives. Small specs of each construct join the corpus. Every mutant goes through
parse -> check -> analyse -> lower -> emit, and must either emit or raise a
`SpecError` whose location points at a real line of the text. A few accepted
mutants that emit code the originals do not are compiled with NVRTC.

The run is deterministic (fixed seed and count) and takes a few seconds. Its
summary line (inputs, outcomes, time) is printed to the terminal.
"""

from __future__ import annotations

import collections
import random
import re
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from gemmspec.analyse import analyse
from gemmspec.check import check
from gemmspec.codegen.emit import EmittedProgram, emit
from gemmspec.codegen.kernels import include_dir
from gemmspec.errors import SpecError, normalise_source, source_lines
from gemmspec.lower.lowering import lower
from gemmspec.parse import parse
from gemmspec.runtime.nvrtc import compile_cubin

ROOT = Path(__file__).resolve().parents[2]
SEED = 20261130
MUTANTS = 6000
COMPILED = 5

# ---- the corpus ------------------------------------------------------------------------


# Small specs of the constructs that the examples and the language reference show
# seldom or not at all; each checks and emits as written (test_the_construct_specs_emit).
CONSTRUCTS = [
    """gemm capacity_moe {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets, capacity)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
  tile(128, 128)
}
""",
    """gemm gathered_fused {
  dim T, S
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor idx : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
  gather(fused)
}
""",
    """gemm gathered_prepass {
  dim T, S
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [S, N]
  y[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
  gather(prepass)
}
""",
    """gemm fp8_out_copy {
  dim T
  dim N = 512, F = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor h   : e4m3 [T, F] scale f32 [1, 128] pow2
  tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = copy(h)
  h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]
}
""",
    """gemm fp8_out_plain {
  dim T
  dim N = 256, K = 256
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [N, K] scale f32 [128, 128]
  tensor y : e4m3 [T, N] scale f32 [1, 128]
  y[t, n] = sum[k] x[t, k] * w[n, k]
  tile(64, 128)
}
""",
    """gemm row_passes {
  dim T, S, H = 256, F = 256
  tensor dy : bf16 [T, H]
  tensor w  : bf16 [F, H]
  tensor h  : e4m3 [T, F] scale f32 [1, 128]
  tensor rw : f32 [T]
  tensor src : i32 [T]
  tensor g  : bf16 [T, F]
  tensor drw : f32 [T] = rowdot(g, h)
  tensor dh  : bf16 [T, F] = rowscale(g, weight = rw)
  tensor dx  : bf16 [S, F] = scatter_add(g, rows = src)
  g[t, f] = sum[n] dy[t, n] * w[f, n]
}
""",
    """gemm epilogue_pad {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x     : bf16 [T, K]
  tensor w     : bf16 [E, N, K]
  tensor alpha : f32 [E]
  tensor rw    : f32 [T]
  tensor bias  : bf16 [E, N]
  tensor y     : bf16 [T, N]
  y[t, n] = alpha[expert(t)] * rw[t] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]
}
""",
    """gemm wgrad_pad {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets, capacity)
  tensor dy : e4m3 [T, N] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor x  : e4m3 [T, K] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert
  tensor dw : f32 [E, N, K]
  dw[e, n, k] += sum[t in expert(e)] dy[t, n] * x[t, k]
}
""",
]


def corpus() -> list[str]:
    texts = [p.read_text(encoding="utf-8") for p in sorted((ROOT / "examples").glob("*.gspec"))]
    docs = (ROOT / "docs" / "language.md").read_text(encoding="utf-8")
    blocks = re.findall(r"^```gspec[ \t]*\n(.*?)^```", docs, re.M | re.S)
    return texts + [b for b in blocks if "gemm " in b] + CONSTRUCTS


# ---- token-level mutations ----------------------------------------------------------------

TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|\+=|#[^\n]*|\s+|.", re.S)
INTEGERS = [
    "0", "1", "3", "127", "129", "65537", "1048577", "2147483647", "2147483648",
    "4294967296", "9223372036854775807", "9223372036854775808", "1" + "0" * 30, "9" * 4400,
]
CHARACTERS = [
    "\ufeff", "\u2028", "\x85", "\x0b", "\x0c", "\r", "\r\n", "\t", "\x00", "\xa0", "@", "é",
    "{", "}", "(", ")", "[", "]", ",", "*", "+", "=", "+=", ":", "#",
]
WORDS = [
    "dim", "group", "tensor", "sum", "in", "layout", "scale", "per", "as", "ragged", "split",
    "uniform", "masked", "within", "offsets", "sizes", "counts", "row_major", "major",
    "strides", "segment_major", "pad", "requantize", "transpose", "flatten", "target", "tile", "silu",
    "e4m3", "e5m2", "bf16", "f16", "f32", "int", "gs_x", "T_blocks", "a" * 70,
    "capacity", "copy", "rowdot", "rowscale", "scatter_add", "rows", "weight", "pow2", "quantize",
    "swiglu_grad", "gather", "fused", "prepass", "auto", "i32",
]


def mutate_tokens(text: str, rng: random.Random) -> str:
    toks = TOKEN.findall(text)
    names = [t for t in toks if re.fullmatch(r"[A-Za-z_]\w*", t)]
    for _ in range(rng.choice((1, 1, 2, 3))):
        solid = [i for i, t in enumerate(toks) if not t.isspace()]
        if not solid:
            break
        i = rng.choice(solid)
        ints = [k for k in solid if toks[k].isdigit()] or [i]
        op = rng.randrange(10)
        if op == 0:  # deletion
            del toks[i]
        elif op == 1:  # duplication
            toks.insert(i, toks[i] + " ")
        elif op == 2:  # swap
            j = rng.choice(solid)
            toks[i], toks[j] = toks[j], toks[i]
        elif op == 3:  # an integer at or past a limit
            toks[rng.choice(ints)] = rng.choice(INTEGERS)
        elif op == 4:  # an identifier swapped for another name or a word of the language
            toks[i] = rng.choice(names + WORDS)
        elif op == 5:
            toks.insert(i, rng.choice(CHARACTERS))
        elif op == 6:
            toks.insert(i, "".join(rng.choice(CHARACTERS + names[:5]) for _ in range(rng.randrange(1, 6))))
        elif op == 7:  # a line duplicated or dropped
            lines = "".join(toks).split("\n")
            k = rng.randrange(len(lines))
            if rng.random() < 0.5:
                lines.insert(k, lines[k])
            else:
                del lines[k]
            toks = TOKEN.findall("\n".join(lines))
        elif op == 8:  # a long chain or deep nesting where an integer stood
            k = rng.choice(ints)
            n = rng.choice((50, 500, 3000))
            toks[k] = rng.choice([
                "+".join([toks[k]] * n),
                "*".join(["1"] * n) + "*" + toks[k],
                "(" * n + toks[k] + ")" * n,
                "(" * 20 + toks[k] + ")" * 20,
            ])
        else:  # random characters from the first planes
            toks.insert(i, "".join(chr(rng.randrange(0, 0x3000)) for _ in range(rng.randrange(1, 4))))
    return "".join(toks)


# ---- clause-level mutations (the text mostly still parses) -------------------------------------

TENSOR = re.compile(r"^(\s*tensor\s+(\w+)\s*:\s*)(\w+)(\s*\[([^\]]*)\])(.*)$")
DTYPES = ["e4m3", "e5m2", "bf16", "f16", "f32"]
DIRECTIVES = [
    "split", "flatten", "tile(64, 8)", "tile(128, 256)", "tile(64, 192)", "tile(128, 64)", "target sm_90a",
    "tile(128, 160)", "tile(64, 16)", "tile(256, 64)", "tile(128, 7)", "tile(0, 0)",
    "gather(fused)", "gather(prepass)", "gather(auto)", "gather(sideways)",
]
PADS = [1, 2, 16, 17, 128, 2**31 - 1, 2**31, 2**62]
SIZES = [1, 2, 7, 64, 128, 1000, 2**30, 2**31 - 1]


def _expr(rng: random.Random, dims: list[str]) -> str:
    atoms = dims + [str(rng.choice([0, 1, 2, 3, 16, 128, 4096, 2**31 - 1, 2**40]))]
    terms = ["*".join(rng.choice(atoms) for _ in range(rng.randrange(1, 3))) for _ in range(rng.randrange(1, 4))]
    return " + ".join(terms)


def mutate_clauses(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    groups = re.findall(r"group\s+(\w+)", text) or ["g"]
    names = re.findall(r"tensor\s+(\w+)", text) or ["x"]
    statements = [line for line in lines if "sum[" in line]
    for _ in range(rng.choice((1, 2, 3))):
        tensors = [k for k, line in enumerate(lines) if TENSOR.match(line)]
        if not tensors:
            break
        i = rng.choice(tensors)
        head, name, dtype, shape, dims_text, rest = TENSOR.match(lines[i]).groups()
        dims = [d.strip() for d in dims_text.split(",") if d.strip()] or ["T"]
        op = rng.randrange(15)
        if op == 0:  # the tensor's layout
            clause = rng.choice([
                "layout strides(" + ", ".join(_expr(rng, dims) for _ in dims) + ")",
                f"layout major({rng.choice(dims)})",
                f"layout segment_major({rng.choice(groups)})",
                f"layout row_major pad {rng.choice([1, 8, 100, 2**31, 2**62])}",
                "layout row_major",
            ])
            rest = re.sub(r"^\s*layout\s+\w+(\([^)]*\))?(\s+pad\s+\d+)?", "", rest)
            lines[i] = f"{head}{dtype}{shape} {clause}{rest}"
        elif op == 1:  # its scale
            blocks = ", ".join(str(rng.choice([1, 1, 2, 64, 128, 128, 256, 1000, 2**20, 2**21])) for _ in dims)
            extra = rng.choice(["", f" per {rng.choice(groups)}", f" layout major({rng.choice(dims)})", f" as {name}_sf"])
            body, _, derived = rest.partition("=")
            body = re.sub(r"\s*scale\s+\w+\s*\[[^\]]*\].*", "", body)
            lines[i] = f"{head}{dtype}{shape}{body} scale f32 [{blocks}]{extra}" + (f" ={derived}" if derived else "")
        elif op == 2:  # its element type
            lines[i] = f"{head}{rng.choice(DTYPES)}{shape}{rest}"
        elif op == 3:  # a derivation
            lines[i] = f"{head}{dtype}{shape}{rest.partition('=')[0]} = {rng.choice(['requantize', 'transpose'])}({rng.choice(names)})"
        elif op == 4:  # a directive
            lines.insert(max(len(lines) - 2, 0), "  " + rng.choice(DIRECTIVES))
        elif op == 5:  # dim sizes and group counts
            lines = [
                re.sub(r"(\b\w+\s*=\s*)(\d+)", lambda m: m.group(1) + str(rng.choice(SIZES)) if rng.random() < 0.3 else m.group(0), line)
                if line.strip().startswith(("dim", "group")) else line
                for line in lines
            ]
        elif op == 6:  # the tensor bare
            lines[i] = f"{head}{dtype}{shape}"
        elif op == 7 and statements:  # one more statement, storing or accumulating
            extra = rng.choice(statements)
            lines.insert(max(len(lines) - 2, 0), extra.replace("=", "+=", 1) if rng.random() < 0.5 and "+=" not in extra else extra)
        elif op == 8:  # capacity offsets, added or taken away
            lines = [
                (line.replace(", capacity)", ")") if ", capacity)" in line else re.sub(r"(ragged\([^)]*)\)", r"\1, capacity)", line))
                if "ragged(" in line and rng.random() < 0.7 else line
                for line in lines
            ]
        elif op == 9:  # padded segments or rows
            layout = rng.choice([f"segment_major({rng.choice(groups)})", "row_major", f"major({rng.choice(dims)})"])
            rest = re.sub(r"^\s*layout\s+\w+(\([^)]*\))?(\s+pad\s+\d+)?", "", rest)
            lines[i] = f"{head}{dtype}{shape} layout {layout} pad {rng.choice(PADS)}{rest}"
        elif op == 10:  # an FP8 output (or input) with its quantization scales
            scale = rng.choice(["scale f32 [1, 128]", "scale f32 [1, 128] pow2", "scale f32 [128, 1] per " + rng.choice(groups), ""])
            body = re.sub(r"\s*scale\s+\w+\s*\[[^\]]*\].*", "", rest.partition("=")[0])
            lines[i] = f"{head}{rng.choice(['e4m3', 'e5m2'])}{shape}{body} {scale}".rstrip()
        elif op == 11:  # an FP8 copy of a tensor (one more, when it has one already)
            g = rng.choice(groups)
            layout = rng.choice([f"layout segment_major({g}) pad 16 ", f"layout segment_major({g}) ", ""])
            scale = rng.choice([f"scale f32 [128, 1] per {g}", "scale f32 [1, 128]", f"scale f32 [128, 1] per {g} pow2", ""])
            lines.insert(i + 1, f"  tensor {name}_c{rng.randrange(3)} : e4m3 {shape.strip()} {layout}{scale} = copy({name})")
        elif op == 12:  # a row pass over the tensor
            other, weight = rng.choice(names), rng.choice(names)
            rows = rng.choice(names)
            derived = rng.choice([f"rowdot({name}, {other})", f"rowscale({name}, weight = {weight})", f"scatter_add({name}, rows = {rows})"])
            target = rng.choice([f"f32 [{dims[0]}]", f"bf16 {shape.strip()}", f"bf16 [S, {dims[-1]}]", f"f32 [{dims[0]}, {dims[-1]}]"])
            lines.insert(i + 1, f"  tensor {name}_rp : {target} = {derived}")
        elif op == 13 and statements:  # epilogue factors and a bias on a statement
            k = rng.choice([j for j, line in enumerate(lines) if "sum[" in line] or [i])
            out, eq, rhs = lines[k].partition("=")
            factor = f"{rng.choice(names)}[{rng.choice(['t', 'e', 'expert(t)', 'lora(t)', 'n', 't, n'])}]"
            bias = f" + {rng.choice(names)}[{rng.choice(['n', 'expert(t), n', 't, n', 't'])}]"
            rhs = (f" {factor} *" + rhs) if rng.random() < 0.7 else rhs
            lines[k] = out + eq + (rhs + bias if rng.random() < 0.5 else rhs)
        elif statements:  # rows gathered or scattered through an index tensor
            k = rng.choice([j for j, line in enumerate(lines) if "sum[" in line] or [i])
            index = rng.choice(["idx", "src", name])
            at = rng.choice(["[t, ", "[s, "])
            where = rng.choice(["rhs", "out"])
            out, eq, rhs = lines[k].partition("=")
            if where == "rhs":
                rhs = rhs.replace(at, f"[{index}[t], ", 1)
            else:
                out = out.replace(at, f"[{index}[t], ", 1)
            lines[k] = out + eq + rhs
            if index != name and not re.search(rf"tensor\s+{index}\b", "\n".join(lines)):
                lines.insert(i, f"  tensor {index} : i32 [{rng.choice(['T', 'S', dims[0]])}]")
    return "\n".join(lines)


# ---- one run --------------------------------------------------------------------------------------


def front(text: str) -> list[EmittedProgram]:
    return [emit(spec, lower(spec, analyse(spec))) for spec in check(parse(text, "fuzz.gspec"))]


def stage_of(err: SpecError) -> str:
    """Where the error was raised: the parser, the checker or the analysis."""
    module = Path(traceback.extract_tb(err.__traceback__)[-1].filename)
    if module.parent.name == "check":  # the checker is a package of modules
        return "check"
    return {"parse.py": "parse", "analyse.py": "analyse"}.get(module.name, module.stem)


def location_problem(err: SpecError, text: str) -> str | None:
    """Why the error's location is not a real place in `text` (None when it is)."""
    loc = err.location
    if loc is None:
        return "no location"
    if loc.line < 1 or loc.column < 1:
        return f"location {loc.line}:{loc.column}"
    lines = source_lines(normalise_source(text))
    if loc.line > max(len(lines), 1):
        return f"line {loc.line} past the last line {len(lines)}"
    if lines and loc.source_line != lines[loc.line - 1]:
        return f"echoes {loc.source_line!r}, but line {loc.line} is {lines[loc.line - 1]!r}"
    rendered = err.render()
    if not rendered.startswith(f"fuzz.gspec:{loc.line}:{loc.column}: error: "):
        return f"renders as {rendered.splitlines()[0]!r}"
    return None


@dataclass
class FuzzRun:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[tuple[str, str]] = field(default_factory=list)  # (what went wrong, the input)
    accepted: list[tuple[str, list[EmittedProgram]]] = field(default_factory=list)
    seconds: float = 0.0
    slowest: float = 0.0

    def summary(self) -> str:
        checked = self.outcomes["checked"]
        errors = {k.split(":", 1)[1]: v for k, v in sorted(self.outcomes.items()) if k.startswith("error:")}
        return (
            f"front-half fuzz (seed {SEED}): {sum(self.outcomes.values())} inputs, "
            f"{checked} checked and emitted, {sum(errors.values())} located errors "
            f"({', '.join(f'{k} {v}' for k, v in errors.items())}), {len(self.failures)} escaped; "
            f"{self.seconds:.1f} s, slowest input {self.slowest:.2f} s"
        )


@pytest.fixture(scope="module")
def fuzz_run() -> FuzzRun:
    rng = random.Random(SEED)
    texts = corpus()
    run = FuzzRun()
    start = time.perf_counter()
    for _ in range(MUTANTS):
        base = rng.choice(texts)
        text = mutate_clauses(base, rng) if rng.random() < 0.5 else mutate_tokens(base, rng)
        if rng.random() < 0.2:
            text = mutate_tokens(text, rng)
        t0 = time.perf_counter()
        try:
            programs = front(text)
        except SpecError as err:
            problem = location_problem(err, text)
            if problem is not None:
                run.failures.append((f"{problem}: {err.message}", text))
            run.outcomes[f"error:{stage_of(err)}"] += 1
        except Exception as exc:  # anything else escaped the front half
            run.failures.append((f"{type(exc).__name__}: {exc}"[:300], text))
            run.outcomes["escaped"] += 1
        else:
            run.outcomes["checked"] += 1
            run.accepted.append((text, programs))
        run.slowest = max(run.slowest, time.perf_counter() - t0)
    run.seconds = time.perf_counter() - start
    return run


@pytest.mark.slow
def test_every_mutant_checks_or_fails_located(fuzz_run, capsys):
    with capsys.disabled():
        print("\n" + fuzz_run.summary())
    shown = "\n\n".join(f"{what}\n--- input ---\n{text[:2000]}" for what, text in fuzz_run.failures[:3])
    assert not fuzz_run.failures, f"{fuzz_run.summary()}\n\n{shown}"
    # The mutator reaches every stage, and a fair share of mutants is valid.
    assert {"checked", "error:parse", "error:check", "error:analyse"} <= set(fuzz_run.outcomes), fuzz_run.summary()
    assert fuzz_run.outcomes["checked"] >= MUTANTS // 20, fuzz_run.summary()


def test_the_construct_specs_emit():
    """The corpus's own construct specs are valid: mutants start from working code."""
    for text in CONSTRUCTS:
        assert front(text), text


@pytest.mark.slow
def test_the_mutants_reach_the_later_constructs(fuzz_run):
    """Some accepted mutants carry each construct, and some refused ones name it."""
    marks = {
        "capacity": r"capacity\)", "pad": r"\bpad\s+\d", "copy": r"= copy\(", "pow2": r"\bpow2\b",
        "row pass": r"= (rowdot|rowscale|scatter_add)\(", "gather": r"\w\[\w+\[t\]",
        "tile": r"^\s*tile\(", "gather directive": r"^\s*gather\(", "epilogue": r"\] \* sum\[|\+ \w+\[",
        "FP8 output": r"e4m3 \[[^\]]*\][^=\n]*scale f32 \[1, 128\]",
    }
    accepted = [text for text, _ in fuzz_run.accepted]
    missing = [what for what, mark in marks.items() if not any(re.search(mark, t, re.M) for t in accepted)]
    assert not missing, f"no accepted mutant has: {', '.join(missing)}"


@pytest.mark.slow
def test_accepted_mutants_compile(fuzz_run, tmp_path, capsys):
    """A sample of accepted mutants whose code the unmutated specs do not emit."""
    known = {x.source for text in corpus() for prog in front(text) for x in prog.launches}
    known |= {p.source for text in corpus() for prog in front(text) for p in prog.prepasses}
    picked: list[tuple[str, str, str]] = []  # (kernel, source, mutant)
    for text, programs in fuzz_run.accepted:
        sources = [(x.gemm.name, x.source) for prog in programs for x in prog.launches]
        sources += [(p.kernel, p.source) for prog in programs for p in prog.prepasses]
        new = [(name, src) for name, src in sources if src not in known]
        if new:
            known.add(new[0][1])
            picked.append((*new[0], text))
        if len(picked) == COMPILED:
            break
    assert len(picked) == COMPILED
    for name, source, text in picked:
        log = compile_cubin(source, name=name, include_dirs=[include_dir()], cache_dir=str(tmp_path)).log
        assert not re.search(r"truncation|change of sign", log), f"{log}\n--- input ---\n{text}"
    with capsys.disabled():
        print(f"front-half fuzz: {len(picked)} accepted mutants compiled with NVRTC: " + ", ".join(n for n, _, _ in picked))
