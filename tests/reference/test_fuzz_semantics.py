"""Differential fuzz of the lowering: the flat schedule, executed on flat memory as the GPU
would (reference.schedule_exec), against the spec's direct semantics (reference.direct), on
every shipped spec and on seeded mutants of them.

The corpus is the front-half fuzz's (tests/front/test_fuzz.py): the examples, the complete
specs of docs/language.md and its construct specs. Each spec's fixed dims are first shrunk
(big ones divided by a common factor, then some set to small, odd sizes such as 1, 7, 24,
129, 136, 200; a size the checker refuses is not taken) so that float64 numpy stays fast.
Mutants come from that file's clause mutator and from a mutator here aimed at semantics
(`=` against `+=`, capacity, layouts with `pad`, scale blocks, output types, group kinds
and nesting, dim sizes, epilogue operands, gathered and scattered rows, directives, a
second statement into one output, transposed outputs); a mutant the checker refuses is
skipped. For every spec that lowers, run-time sizes are drawn with segment lengths from
0, 1, 2, 63, 64, 65, 127, 128, 129 (masked counts up to M + 1, capacity offsets ending
short of the dim), inputs at random, and every output compared element by element:

- elements the statements leave alone (`covered` of run_direct) keep the caller's values
  bit for bit (every output starts from random values, not NaN);
- no non-finite value where the direct result is finite, and none missing where it is not;
- 16- and 32-bit outputs: |sched - direct| <= 2^-(p-1) |direct| + atol * rms, p the type's
  precision, rms the larger of the row's and the whole output's (a row may be one
  cancelled sum). Both executors sum in float64 and round once to the type (the schedule
  in 128-wide K blocks, scaled per block), so the exact results differ by float64 order
  noise (atol 1e-10, far above it) and the stored values by at most one ulp, 2^-(p-1)
  relative at worst. Where leaves, launches or statements add into one element the
  schedule rounds after each: 4 more ulps of that rms;
- FP8 outputs (and copies) compare real values, quantized * scale: a result that sums in
  another order may round to the neighbouring bf16 and FP8 value and move its block's
  amax, so the bound is one FP8 step of the larger |quantized| times the larger scale,
  2^-7 relative (the scale's shift) and a noise floor of 1e-9 of the largest real value
  (a block of cancelled sums is noise in both). Scales: 2^-6 relative, unless both blocks
  sit at that noise floor (or hold the all-zero convention 1). A statement that reads an
  FP8 output that was rounded differently would inherit the flip, so where anything
  differs the direct semantics is run again with the schedule's intermediates given.

Left out on purpose (each named in a skip reason): inputs that alias at the drawn sizes
are made consistent (one value per address); written tensors that alias, and buffers too
large for the host, are skipped.
"""

from __future__ import annotations

import collections
import importlib.util
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from gemmspec.errors import SpecError
from gemmspec.pipeline import lower_file
from gemmspec.reference.data import (
    FP8_MAX,
    TensorData,
    dim_size,
    element_offsets,
    expand_scales,
    pack,
    quantize,
    random_inputs,
    random_runtime,
    scale_grid_shape,
    scale_offsets,
)
from gemmspec.reference.direct import fp8_outputs, run_direct
from gemmspec.reference.schedule_exec import run_schedule
from gemmspec.spec import FP8_TYPES

_PATH = Path(__file__).resolve().parents[1] / "front" / "test_fuzz.py"
_SPEC = importlib.util.spec_from_file_location("front_fuzz_mutator", _PATH)
front_fuzz = importlib.util.module_from_spec(_SPEC)
sys.modules[_SPEC.name] = front_fuzz  # its dataclasses look their module up
_SPEC.loader.exec_module(front_fuzz)

SEED = 20260311
MUTANTS = 640  # mutant texts tried (about a third lower)
RUNTIMES = 2  # run-time draws per spec
PARTS = 6  # the mutants are compared in this many tests
EDGES = [0, 1, 2, 63, 64, 65, 127, 128, 129]
SMALL = [1, 7, 24, 40, 129, 136, 200, 128, 64]
PRECISION = {"bf16": 8, "f16": 11, "f32": 24, "e4m3": 4, "e5m2": 3}
FP8_MIN_EXP = {"e4m3": -6, "e5m2": -14}
MAX_WORK = 3e7  # multiply-adds of the statements, at 300 rows per run-time dim
MAX_ELEMENTS = 3e7

# Constructs the corpus shows seldom, as small specs: a uniform group read through an
# epilogue scalar and a column-major output, a nest three deep inside compile-time slices,
# a K-grouped FP8 statement over uniform slices, a masked FP8 output with pow2 scales.
EXTRA = [
    """gemm heads_uniform {
  dim T
  dim N = 128, K = 40
  group head[H = 4] = uniform(N)
  group expert[E = 3] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, H, K]
  tensor w : bf16 [E, N, K]
  tensor alpha : f32 [H]
  tensor y : f32 [T, N] layout major(T)
  y[t, n] = alpha[head(n)] * sum[k] x[t, head(n), k] * w[expert(t), n, k]
}
""",
    """gemm three_deep {
  dim T = 200
  dim N = 24, K = 136
  group request[P = 2] = split(T, sizes = [72, 128])
  group lora[L = 2] = ragged(T within request, offsets = lora_offsets)
  group expert[E = 2] = ragged(T within lora, offsets = expert_offsets)
  tensor x : bf16 [T, K] layout segment_major(expert) pad 8
  tensor w : bf16 [L, E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] += sum[k] x[t, k] * w[lora(t), expert(t), n, k]
}
""",
    """gemm k_uniform {
  dim M = 65, N = 40, K = 256
  group part[P = 2] = uniform(K)
  tensor a : e4m3 [M, K] scale f32 [1, 128]
  tensor b : e4m3 [N, K] scale f32 [128, 128]
  tensor y : f32 [P, M, N]
  y[p, m, n] = sum[k in part(p)] a[m, k] * b[n, k]
}
""",
    """gemm masked_fp8_out {
  dim M = 130, N = 128, K = 200
  group batch[B = 3] = masked(M, counts = counts)
  tensor x : e4m3 [B, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [B, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [B, M, N] scale f32 [1, 1, 128] pow2
  y[b, m, n] = sum[k] x[b, m, k] * w[b, n, k]
}
""",
]


# ---- shrinking --------------------------------------------------------------------------

DIM_LINE = re.compile(r"^\s*dim\b")
ASSIGN = re.compile(r"\b([A-Za-z_]\w*)(\s*=\s*)(\d+)\b")
RAGGED_COUNT = re.compile(r"(\bgroup\s+\w+\s*\[\s*\w+\s*=\s*)(\d+)(?=\s*\]\s*=\s*ragged)")
SPLIT = re.compile(r"(split\(\s*(\w+)\s*,\s*sizes\s*=\s*\[)([^\]]*)(\])")


def fixed_dims(text: str) -> dict[str, int]:
    out = {}
    for line in text.split("\n"):
        if DIM_LINE.match(line):
            for m in ASSIGN.finditer(line.split("#")[0]):
                out[m.group(1)] = int(m.group(3))
    return out


def set_dims(text: str, new: dict[str, int]) -> str:
    """Fixed dim sizes replaced on the dim lines; literal split sizes over them rescaled."""
    old = fixed_dims(text)
    lines = []
    for line in text.split("\n"):
        if DIM_LINE.match(line):
            code, hash_, comment = line.partition("#")
            code = ASSIGN.sub(lambda m: m.group(1) + m.group(2) + str(new.get(m.group(1), m.group(3))), code)
            line = code + hash_ + comment
        lines.append(line)

    def split_sizes(m: re.Match) -> str:
        d = m.group(2)
        parts = [p.strip() for p in m.group(3).split(",")]
        if d not in new or new[d] == old.get(d) or not all(p.isdigit() for p in parts):
            return m.group(0)
        values = [int(p) for p in parts]
        total = sum(values) or 1
        scaled = [v * new[d] // total for v in values]
        scaled[-1] += new[d] - sum(scaled)
        return m.group(1) + ", ".join(map(str, scaled)) + m.group(4)

    return SPLIT.sub(split_sizes, "\n".join(lines))


def lowers(text: str):
    try:
        return lower_file(text)
    except SpecError:
        return None


def work(lowered) -> float:
    """Rough cost of both executors: multiply-adds, plus the full output the direct
    semantics touches per leaf; a run-time dim has about 70 rows per segment over it."""
    total = 0.0
    for low in lowered:
        spec = low.spec
        segments: dict[str, int] = {}
        for g in spec.groups:
            n = g.count
            for outer in spec.enclosing(g.name)[1:]:
                n *= outer.count
            segments[g.dim] = max(segments.get(g.dim, 1), n)
        size = {d.name: d.size if d.size is not None else max(300, 70 * segments.get(d.name, 1)) for d in spec.dims}
        for g in spec.gemms:
            m, n, k = (size[g.role(r).dim] for r in "mnk")
            batch = float(np.prod([ax.count for ax in g.leaf_axes if ax.group is None]))
            leaves = float(np.prod([ax.count for ax in g.leaf_axes]))
            total += batch * m * n * k + leaves * m * n
    return total


def shrink(text: str, rng: random.Random):
    """(text, lowered) with small fixed dims and at most 4 segments per ragged group, or
    (None, None): big dims divided by a common factor, then some set to small sizes."""
    if lowers(text) is None:
        return None, None
    fewer = RAGGED_COUNT.sub(lambda m: m.group(1) + str(min(int(m.group(2)), 4)), text)
    text = fewer if lowers(fewer) is not None else text
    dims = fixed_dims(text)
    best = text
    for d in (32, 16, 64, 8, 4, 2):
        cand = set_dims(text, {k: v // d for k, v in dims.items() if v >= 256 and v % d == 0})
        if lowers(cand) is not None:
            best = cand
            break
    dims = fixed_dims(best)
    for name in sorted(dims, key=lambda _: rng.random()):
        if rng.random() < 0.3 and work(lowers(best)) <= MAX_WORK:
            continue
        for c in sorted(SMALL, key=lambda _: rng.random()):
            cand = set_dims(best, {name: c})
            if c != dims[name] and lowers(cand) is not None:
                best, dims = cand, fixed_dims(cand)
                break
    low = lowers(best)
    if low is None or work(low) > MAX_WORK:
        return None, None
    return best, low


# ---- a mutator aimed at semantics -----------------------------------------------------------

TENSOR = re.compile(r"^(\s*tensor\s+(\w+)\s*:\s*)(\w+)(\s*\[([^\]]*)\])(.*)$")
STATEMENT = re.compile(r"^(\s*)(\w+)\[([^\]]*)\]\s*(\+?=)\s*(.*)$")
GROUP = re.compile(r"^\s*group\s+(\w+)\s*\[\s*(\w+)\s*(?:=\s*(\d+))?\s*\]\s*=\s*(\w+)\((.*)\)\s*(#.*)?$")
LAYOUT = re.compile(r"^\s*layout\s+\w+(\([^)]*\))?(\s+pad\s+\d+)?")


def _code(line: str) -> str:
    return line.split("#")[0].rstrip()


def _parts(text: str):
    lines = text.split("\n")
    tensors, groups = {}, {}
    for i, line in enumerate(lines):
        m = TENSOR.match(_code(line))
        if m:
            dims = [d.strip() for d in m.group(5).split(",") if d.strip()]
            tensors[m.group(2)] = (i, m.group(1), m.group(3), dims, m.group(6))
        m = GROUP.match(line)
        if m:
            groups[m.group(1)] = (i, m.group(2), m.group(3), m.group(4), m.group(5))
    statements = [i for i, line in enumerate(lines) if "sum[" in line and STATEMENT.match(_code(line))]
    return lines, tensors, groups, statements


def _body_start(lines: list[str]) -> int:
    return next((j + 1 for j, line in enumerate(lines) if line.lstrip().startswith("gemm ")), 1)


def mutate_semantics(text: str, rng: random.Random) -> str:
    for _ in range(rng.choice((1, 1, 2, 3))):
        text = _mutate_once(text, rng)
    return text


def _mutate_once(text: str, rng: random.Random) -> str:  # noqa: C901 - one branch per edit
    lines, tensors, groups, statements = _parts(text)
    if not tensors:
        return text
    op = rng.randrange(14)
    fixed = fixed_dims(text)
    stmt = None
    if statements:
        k = rng.choice(statements)
        stmt = (k, *STATEMENT.match(_code(lines[k])).groups())
    if op == 0 and stmt:  # `=` <-> `+=`
        k, indent, out, idx, eq, rhs = stmt
        lines[k] = f"{indent}{out}[{idx}] {'=' if eq == '+=' else '+='} {rhs}"
    elif op == 1 and groups:  # capacity on or off
        i = groups[rng.choice(list(groups))][0]
        if ", capacity)" in lines[i]:
            lines[i] = lines[i].replace(", capacity)", ")")
        elif "ragged(" in lines[i] and " within " not in lines[i]:
            lines[i] = re.sub(r"(ragged\([^)]*)\)", r"\1, capacity)", lines[i])
    elif op in (2, 3):  # a tensor's layout
        i, head, dtype, dims, rest = tensors[rng.choice(list(tensors))]
        choices = [
            "layout row_major",
            f"layout major({rng.choice(dims)})",
            f"layout row_major pad {rng.choice([8, 16, 24, 128])}",
            f"layout major({rng.choice(dims)}) pad {rng.choice([8, 16, 128])}",
        ]
        cut = [g for g, v in groups.items() if v[3] in ("ragged", "split", "uniform")]
        if cut:
            g = rng.choice(cut)
            choices += [f"layout segment_major({g})", f"layout segment_major({g}) pad {rng.choice([2, 8, 16, 128])}"]
        order = sorted(range(len(dims)), key=lambda _: rng.random())
        strides, step = [""] * len(dims), "1"
        for a in reversed(order):  # a permuted layout, some dims padded
            strides[a] = step
            step = f"({step})*({dims[a]} + {rng.choice([0, 0, 1, 3])})"
        choices.append("layout strides(" + ", ".join(strides) + ")")
        if len(dims) > 1:  # a broadcast (valid on a tensor that is only read)
            choices.append("layout strides(" + ", ".join(["0", *strides[1:]]) + ")")
        lines[i] = f"{head}{dtype} [{', '.join(dims)}] {rng.choice(choices)}{LAYOUT.sub('', rest)}".rstrip()
    elif op == 4:  # scale blocks
        fp8 = [n for n, v in tensors.items() if v[2] in FP8_TYPES and "scale" in v[4]]
        if fp8:
            i, head, dtype, dims, rest = tensors[rng.choice(fp8)]
            body, eq, derived = rest.partition("=")
            m = re.search(r"scale\s+f32\s*\[([^\]]*)\](.*)$", body)
            if m:
                blocks = [rng.choice(["1", "1", "128", "128", "64", "256", d]) for d in dims]
                extra = f" per {rng.choice(list(groups))}" if groups and rng.random() < 0.3 else ""
                extra += f" layout major({rng.choice(dims)})" if rng.random() < 0.2 else ""
                extra += " pow2" if " pow2" in m.group(2) else ""
                lines[i] = (
                    f"{head}{dtype} [{', '.join(dims)}]{body[: m.start()].rstrip()} "
                    f"scale f32 [{', '.join(blocks)}]{extra}" + (f" ={derived}" if eq else "")
                )
    elif op == 5 and stmt and stmt[2] in tensors:  # the output's type
        i, head, dtype, dims, rest = tensors[stmt[2]]
        new = rng.choice(["bf16", "f16", "f32", "e4m3", "e5m2"])
        rest = re.sub(r"\s*scale\s+\w+\s*\[[^\]]*\][^=]*", " ", rest.partition("=")[0]).rstrip()
        rest = re.sub(r"\s+pad\s+\d+", "", rest)
        if new in FP8_TYPES:
            rest += " scale f32 [" + ", ".join(["1"] * (len(dims) - 1) + ["128"]) + "]" + rng.choice(["", " pow2"])
        lines[i] = f"{head}{new} [{', '.join(dims)}]{rest}"
    elif op == 6 and groups:  # a group's kind or nesting
        g = rng.choice(list(groups))
        i, _, count, kind, args = groups[g]
        dim = args.split(",")[0].split()[0]
        if count and dim in fixed and kind == "ragged" and " within " not in args:
            size, n = fixed[dim], int(count)
            if rng.random() < 0.5 and size % n == 0:
                new = f"uniform({dim})"
            else:
                cuts = sorted(rng.randrange(size + 1) for _ in range(n - 1))
                new = f"split({dim}, sizes = [{', '.join(str(b - a) for a, b in zip([0, *cuts], [*cuts, size]))}])"
            lines[i] = re.sub(r"=\s*\w+\(.*\)", "= " + new, _code(lines[i]))
        elif kind == "ragged" and " within " not in args:
            outer = [h for h, v in groups.items() if h != g and v[0] < i and v[3] != "masked" and v[4].split(",")[0].split()[0] == dim]
            if outer:
                lines[i] = lines[i].replace(f"ragged({dim}", f"ragged({dim} within {rng.choice(outer)}", 1).replace(", capacity)", ")")
        elif kind in ("split", "uniform") and count:
            lines[i] = re.sub(r"=\s*\w+\(.*\)", f"= ragged({dim}, offsets = {g}_offs)", _code(lines[i]))
    elif op == 7 and fixed:  # a dim's size
        d, v = rng.choice(list(fixed)), rng.choice([1, 2, 7, 24, 40, 64, 128, 129, 136, 200, 256])
        lines = [re.sub(rf"\b{d}(\s*=\s*)\d+", rf"{d}\g<1>{v}", x) if DIM_LINE.match(x) else x for x in lines]
    elif op == 8 and stmt and stmt[2] in tensors:  # an epilogue operand
        k, indent, out, idx_text, eq, rhs = stmt
        idx = [x.strip() for x in idx_text.split(",")]
        odims = tensors[out][3]
        refs = [r for r in re.findall(r"(\w+)\((\w+)\)", rhs) if r[0] in groups]
        at = min(v[0] for v in tensors.values())
        kind = rng.choice(["alpha", "row", "bias"])
        if kind == "row" and len(idx) >= 2 and "[" not in idx[0]:
            lines.insert(at, f"  tensor rwx : {rng.choice(['f32', 'bf16'])} [{odims[0]}]")
            lines[k + 1] = f"{indent}{out}[{idx_text}] {eq} rwx[{idx[0]}] * {rhs}"
        elif kind == "alpha" and refs:
            g, var = rng.choice(refs)
            lines.insert(at, f"  tensor alx : f32 [{groups[g][1]}]")
            lines[k + 1] = f"{indent}{out}[{idx_text}] {eq} alx[{g}({var})] * {rhs}"
        elif kind == "bias" and len(idx) >= 2:
            if refs and rng.random() < 0.5:
                g, var = rng.choice(refs)
                lines.insert(at, f"  tensor bsx : {rng.choice(['f32', 'bf16'])} [{groups[g][1]}, {odims[-1]}]")
                lines[k + 1] = f"{indent}{out}[{idx_text}] {eq} {rhs} + bsx[{g}({var}), {idx[-1]}]"
            else:
                lines.insert(at, f"  tensor bsx : {rng.choice(['f32', 'bf16', 'f16'])} [{odims[-1]}]")
                lines[k + 1] = f"{indent}{out}[{idx_text}] {eq} {rhs} + bsx[{idx[-1]}]"
    elif op == 9 and stmt:  # the first factor's rows gathered through an index
        k, indent, out, idx_text, eq, rhs = stmt
        m = re.search(r"sum\[[^\]]*\]\s*(\w+)\[(\w+),", rhs)
        if m and m.group(1) in tensors:
            i, head, dtype, dims, rest = tensors[m.group(1)]
            src = rng.choice(["SG", dims[0]])
            lines[i] = f"{head}{dtype} [{', '.join([src, *dims[1:]])}]{rest}"
            lines[k] = f"{indent}{out}[{idx_text}] {eq} {rhs[: m.start(2)]}gix[{m.group(2)}]{rhs[m.end(2):]}"
            lines.insert(i, f"  tensor gix : i32 [{dims[0]}]")
            if src == "SG" and "dim SG" not in text:
                lines.insert(_body_start(lines), "  dim SG")
    elif op == 10 and stmt and stmt[2] in tensors:  # the output's rows scattered through an index
        k, indent, out, idx_text, eq, rhs = stmt
        idx = [x.strip() for x in idx_text.split(",")]
        if "[" not in idx[0]:
            i, head, dtype, dims, rest = tensors[out]
            dst = rng.choice(["SD", dims[0]])
            lines[i] = f"{head}{dtype} [{', '.join([dst, *dims[1:]])}]{rest}"
            lines[k] = f"{indent}{out}[{', '.join([f'six[{idx[0]}]', *idx[1:]])}] {eq} {rhs}"
            lines.insert(i, f"  tensor six : i32 [{dims[0]}]")
            if dst == "SD" and "dim SD" not in text:
                lines.insert(_body_start(lines), "  dim SD")
    elif op == 11:  # a directive
        directive = rng.choice(["split", "flatten", "tile(64, 16)", "tile(128, 128)", "tile(64, 64)", "tile(128, 64)", "gather(fused)", "gather(prepass)"])
        lines.insert(max(len(lines) - 2, 0), "  " + directive)
    elif op == 12 and stmt:  # a second statement into the same output
        line = lines[stmt[0]]
        lines.insert(stmt[0] + 1, line if "+=" in line else line.replace("=", "+=", 1))
    elif op == 13 and stmt and stmt[2] in tensors:  # the output's last two dims swapped
        k, indent, out, idx_text, eq, rhs = stmt
        idx = [x.strip() for x in idx_text.split(",")]
        i, head, dtype, dims, rest = tensors[out]
        if len(idx) >= 2:
            idx[-1], idx[-2], dims[-1], dims[-2] = idx[-2], idx[-1], dims[-2], dims[-1]
            rest = re.sub(r"\s*scale.*", "", rest) if dtype in FP8_TYPES else rest
            lines[i] = f"{head}{dtype} [{', '.join(dims)}]{rest}"
            lines[k] = f"{indent}{out}[{', '.join(idx)}] {eq} {rhs}"
    return "\n".join(lines)


# ---- run-time sizes ---------------------------------------------------------------------------


def _edge_partition(rng: random.Random, total: int, parts: int) -> list[int]:
    lens, rest = [], total
    for _ in range(parts - 1):
        lens.append(rng.choice([e for e in EDGES if e <= rest]))
        rest -= lens[-1]
    lens.append(rest)
    rng.shuffle(lens)
    return lens


def draw_runtime(spec, rng: random.Random, nrng: np.random.Generator):
    """Segment lengths from EDGES for every run-time group (nests drawn at the innermost
    level and summed outwards), masked counts up to M + 1, capacity offsets ending short of
    the dim; other run-time dims drawn."""
    children: dict[str, list[str]] = {}
    for g in spec.groups:
        if g.kind == "ragged" and g.within is not None:
            children.setdefault(g.within, []).append(g.name)

    def flat_count(name: str) -> int:
        g = spec.group(name)
        return g.count * (flat_count(g.within) if g.within is not None else 1)

    lengths: dict[str, list[int]] = {}
    dims: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for g in spec.groups:
        if g.kind == "masked":
            bound = spec.dim(g.dim).size
            lengths[g.name] = [rng.choice([*EDGES, bound, bound + 1]) for _ in range(g.count)]
        if g.kind != "ragged" or g.name in lengths:
            continue
        short = g.capacity
        if g.within is not None:
            outer = spec.group(g.within)
            outer_lengths = list(outer.sizes) if outer.kind in ("split", "uniform") else lengths.get(g.within)
            if outer_lengths is not None:
                lengths[g.name] = [n for total in outer_lengths for n in _edge_partition(rng, total, g.count)]
            continue
        fixed = spec.dim(g.dim).size
        known = fixed if fixed is not None else sizes.get(g.dim)
        if known is not None:
            lengths[g.name] = _edge_partition(rng, known - (rng.choice([0, 1, 3]) if short and known >= 3 else 0), g.count)
            continue
        chain = [g.name]
        while chain[-1] in children:
            chain.append(children[chain[-1]][0])
        flat = [rng.choice(EDGES) for _ in range(flat_count(chain[-1]))]
        lengths[chain[-1]] = flat
        for outer, inner in zip(reversed(chain[:-1]), reversed(chain[1:])):
            n = spec.group(inner).count
            flat = [sum(flat[j : j + n]) for j in range(0, len(flat), n)]
            lengths[outer] = flat
        sizes[g.dim] = dims[g.dim] = sum(lengths[g.name]) + (rng.choice([0, 1, 5]) if short else 0)
    picked = list(dict.fromkeys(
        spec.tensor(acc.tensor).dims[acc.axis_of_role("m")]
        for g in spec.gemms for acc, via in ((g.a, g.gather), (g.out, g.scatter)) if via
    ))
    sizes_of = [1, 2, 63, 64, 65, 127, 128, 129, 200]
    for d in spec.dims:
        if d.size is None and d.name not in dims and d.name not in picked:
            dims[d.name] = rng.choice(sizes_of)
    try:
        return random_runtime(spec, nrng, lengths=lengths, dims=dims), lengths
    except KeyError:  # rows picked from the index's own dim: size it first
        for d in picked:
            if spec.dim(d).size is None and d not in dims:
                dims[d] = rng.choice(sizes_of)
        return random_runtime(spec, nrng, lengths=lengths, dims=dims), lengths


# ---- what is compared, and what not -----------------------------------------------------------


def infeasible(spec, rt) -> str | None:
    written = set(spec.written) | {t.name for t in spec.tensors if t.derived is not None and t.view_of is None}
    env = dict(rt.dims)
    for t in spec.tensors:
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        if np.prod(shape, dtype=np.float64) > MAX_ELEMENTS:
            return "too many elements"
        if t.layout.kind != "strided":
            continue
        if sum((n - 1) * abs(s.evaluate(env)) for n, s in zip(shape, t.layout.strides) if n > 0) > MAX_ELEMENTS:
            return "storage too large"
        if t.name in written:
            off = element_offsets(spec, rt, t)
            if np.unique(off).size != off.size:
                return "written tensor aliases at these sizes"
    return None


def consistent(spec, rt, data: dict[str, TensorData]) -> None:
    """Inputs whose layout puts several elements at one address hold one value there."""
    for name, d in data.items():
        t = spec.tensor(name)
        off = element_offsets(spec, rt, t)
        if np.unique(off).size != off.size:
            d.values = pack(off, d.values)[off]
        if d.scale_grid is not None:
            so = scale_offsets(spec, rt, t)
            if np.unique(so).size != so.size:
                d.scale_grid = pack(so, d.scale_grid)[so]


def starting_values(spec, rt, data, nrng) -> dict[str, np.ndarray]:
    """Every written tensor starts from random values of its type (an FP8 output's scales
    from 0.625): what no statement writes must come back as it was."""
    init = {}
    for name in spec.written:
        t = spec.tensor(name)
        shape = tuple(dim_size(spec, rt, d) for d in t.dims)
        if name in data:  # a `+=` output's random start
            init[name] = data.pop(name).values
        else:
            init[name] = quantize(3 * nrng.standard_normal(shape), "e4m3" if t.dtype in FP8_TYPES else t.dtype)
        if t.dtype in FP8_TYPES and t.scale is not None and any(name in g.writes for g in spec.gemms):
            init[t.scale.name] = np.full(scale_grid_shape(spec, rt, t), 0.625)
    return init


def _fp8_step(q: np.ndarray, dtype: str) -> np.ndarray:
    e = np.floor(np.log2(np.where(q > 0, q, 1.0)))
    return 2.0 ** (np.maximum(e, FP8_MIN_EXP[dtype]) - (PRECISION[dtype] - 1))


def _noise(spec, rt, t, direct, covered) -> float:
    real = direct[t.name] * expand_scales(spec, rt, t, direct[t.scale.name])
    m = covered.get(t.name, np.ones(real.shape, dtype=bool)) & np.isfinite(real)
    return 1e-9 * float(np.abs(real[m]).max()) if m.any() else 0.0


def _first(bad: np.ndarray) -> tuple[int, ...]:
    return tuple(int(x[0]) for x in np.nonzero(bad))


def differences(spec, rt, direct, flat, covered, accumulated) -> list[str]:
    """Every output element outside the bounds of the module docstring."""
    out = []
    scales = {t.scale.name: t for t in fp8_outputs(spec)}
    for name, a in direct.items():
        a, b = np.asarray(a, dtype=np.float64), np.asarray(flat[name], dtype=np.float64)
        if a.shape != b.shape:
            out.append(f"{name}: shape {a.shape} against {b.shape}")
            continue
        cov = covered.get(name, np.ones(a.shape, dtype=bool))
        bad = ~cov & (a.view(np.int64) != b.view(np.int64))
        if bad.any():
            out.append(f"{name}: untouched {_first(bad)} was {a[_first(bad)]!r}, schedule {b[_first(bad)]!r}")
        if name in scales:
            t = scales[name]
            floor = _noise(spec, rt, t, direct, covered) / FP8_MAX[t.dtype]
            with np.errstate(invalid="ignore"):
                ok = np.isclose(b, a, rtol=2.0**-6, atol=0) | (np.isnan(a) & np.isnan(b))
                ok |= ((a <= floor) | (a == 1)) & ((b <= floor) | (b == 1))
            bad = cov & ~ok
            if bad.any():
                out.append(f"{name}: scale {_first(bad)} direct {a[_first(bad)]!r}, schedule {b[_first(bad)]!r}")
            continue
        t = spec.tensor(name)
        fa, fb = np.isfinite(a), np.isfinite(b)
        bad = cov & (fa != fb)
        if bad.any():
            out.append(f"{name}: finite differs at {_first(bad)}: direct {a[_first(bad)]!r}, schedule {b[_first(bad)]!r}")
        m = cov & fa & fb
        if t.dtype in FP8_TYPES and t.scale is not None and t.scale.name in direct:
            sa, sb = expand_scales(spec, rt, t, direct[t.scale.name]), expand_scales(spec, rt, t, flat[t.scale.name])
            ra, rb = a * sa, b * sb
            with np.errstate(invalid="ignore"):
                tol = _fp8_step(np.maximum(np.abs(a), np.abs(b)), t.dtype) * np.maximum(sa, sb) * 1.001
                tol += 2.0**-7 * np.abs(ra) + _noise(spec, rt, t, direct, covered)
                bad = m & ~(np.abs(ra - rb) <= tol)
            if bad.any():
                at = _first(bad)
                out.append(f"{name}: real value {at} direct {ra[at]!r}, schedule {rb[at]!r} ({bad.sum()} such)")
            continue
        ulp = 2.0 ** -(PRECISION[t.dtype] - 1)
        atol = 1e-10 + (4 * ulp if name in accumulated else 0.0)
        v = np.where(m, a, 0.0)
        rms = np.sqrt((v * v).sum(axis=-1, keepdims=True) / np.maximum(m.sum(axis=-1, keepdims=True), 1))
        rms = np.maximum(rms, np.sqrt((v * v).sum() / max(m.sum(), 1)))  # a row of one cancelled sum
        with np.errstate(invalid="ignore"):
            bad = m & ~(np.abs(a - b) <= ulp * np.abs(a) + atol * rms)
        if bad.any():
            at = _first(bad)
            out.append(f"{name}: {at} direct {a[at]!r}, schedule {b[at]!r} ({bad.sum()} of {m.sum()})")
    return out


def compare_once(low, seed: int) -> tuple[str, list[str]]:
    """('compared' | 'skipped: why', differences) for one run-time draw."""
    spec, schedule = low.spec, low.schedule
    nrng = np.random.default_rng(seed)
    rt, _ = draw_runtime(spec, random.Random(seed), nrng)
    why = infeasible(spec, rt)
    if why:
        return f"skipped: {why}", []
    try:
        data = random_inputs(spec, rt, nrng)
    except ValueError as err:  # index values the drawn sizes cannot hold
        return f"skipped: {str(err)[:40]}", []
    consistent(spec, rt, data)
    init = starting_values(spec, rt, data, nrng)
    covered: dict[str, np.ndarray] = {}
    try:
        direct = run_direct(spec, rt, data, init, covered=covered)
    except ValueError as err:  # index values the drawn sizes cannot hold
        return f"skipped: {str(err)[:40]}", []
    flat = run_schedule(spec, rt, schedule, data, init)
    counts = collections.Counter(g.out.tensor for g in spec.gemms)
    accumulated = {n for n, c in counts.items() if c > 1} | {g.out.tensor for g in spec.gemms if g.accumulate}
    found = differences(spec, rt, direct, flat, covered, accumulated)
    if found:
        # FP8 intermediates rounded the other way propagate: read the schedule's instead.
        reads = {r for g in spec.gemms for r in g.reads}
        reads |= {r for t in spec.tensors for x in (t.derived, t.row_pass) if x is not None for r in x.reads}
        inter = [n for n in spec.written if n in reads and spec.tensor(n).row_pass is None]
        names = set(inter) | {spec.tensor(n).scale.name for n in inter if spec.tensor(n).scale is not None}
        own = [p for p in found if p.split(":")[0] in names]
        given = {
            n: TensorData(flat[n], flat.get(spec.tensor(n).scale.name) if spec.tensor(n).scale else None)
            for n in inter
        }
        if given:
            again = run_direct(spec, rt, data, init, given=given)
            found = own + differences(spec, rt, again, flat, covered, accumulated)
    return "compared", found


# ---- the run ---------------------------------------------------------------------------------

MARKS = {
    "capacity": r"capacity\)", "segment_major pad": r"segment_major\(\w+\) pad", "copy": r"= copy\(",
    "row pass": r"= (rowdot|rowscale|scatter_add)\(", "gather": r"\w\[\w+\[\w\], ", "scatter": r"^\s*\w+\[\w+\[\w\]",
    "epilogue": r"\] \* sum\[|\+ \w+\[\w", "FP8 output": r"e[45]m[23] \[[^\]]*\][^=\n]*scale f32 \[1, (1, )?128\]",
    "within": r" within ", "masked": r"masked\(", "split": r"= split\(", "uniform": r"uniform\(",
    "k-grouped": r"sum\[\w+ in ", "+=": r"\+=", "swiglu": r"silu\(", "requantize": r"requantize\(",
    "quantize": r"= quantize\(", "transpose": r"transpose\(", "view": r"view\(", "strides": r"strides\(",
    "per-group scales": r"\] per \w", "tile": r"^\s*tile\(",
}


@dataclass
class Run:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    constructs: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(self.outcomes.items()))


def check_text(run: Run, text: str, lowered, seed: int, kind: str) -> None:
    for low in lowered:
        run.outcomes[f"{kind} specs"] += 1
        for what, mark in MARKS.items():
            if re.search(mark, text, re.M):
                run.constructs[what] += 1
        for r in range(RUNTIMES):
            outcome, found = compare_once(low, seed * 10 + r)
            run.outcomes["runtimes " + outcome if outcome != "compared" else "runtimes compared"] += 1
            if found:
                run.failures.append(f"seed {seed * 10 + r}:\n{text}\n" + "\n".join(found[:4]))


@pytest.fixture(scope="module")
def bases() -> list[tuple[str, list]]:
    out = []
    for i, text in enumerate(front_fuzz.corpus() + EXTRA):
        small, low = shrink(text, random.Random(SEED + i))
        if low is not None:
            out.append((small, low))
    return out


@pytest.fixture(scope="module")
def mutants(bases) -> list[tuple[int, str, list]]:
    """The mutants that lower (shrunk again where a mutation made them large), with the
    number of the draw that made each."""
    rng = random.Random(SEED)
    out, seen = [], set()
    for it in range(MUTANTS):
        base = bases[rng.randrange(len(bases))][0]
        choice = rng.random()
        if choice < 0.4:
            text = front_fuzz.mutate_clauses(base, rng)
        elif choice < 0.8:
            text = mutate_semantics(base, rng)
        else:
            text = mutate_semantics(front_fuzz.mutate_clauses(base, rng), rng)
        if text in seen:
            continue
        seen.add(text)
        low = lowers(text)
        if low is not None and work(low) > MAX_WORK:
            text, low = shrink(text, random.Random(it))
        if low is not None:
            out.append((it, text, low))
    return out


def test_the_corpus_shrinks_and_lowers(bases):
    # Every spec takes small sizes (the decode spec's 256 experts become 4).
    assert len(bases) == len(front_fuzz.corpus()) + len(EXTRA)


@pytest.mark.parametrize("part", range(2))
def test_shipped_specs_agree(bases, part):
    run = Run()
    for i, (text, low) in enumerate(bases):
        if i % 2 == part:
            check_text(run, text, low, SEED + i, "shipped")
    assert not run.failures, run.summary() + "\n\n" + "\n\n".join(run.failures[:3])
    assert run.outcomes["runtimes compared"] >= RUNTIMES * (len(bases) // 2 - 3), run.summary()


def test_mutants_reach_the_constructs(mutants):
    """A fair share of mutants lowers, and the compared ones carry every construct."""
    compared = [text for _, text, low in mutants if low]
    assert len(compared) >= MUTANTS // 4, len(compared)
    missing = [what for what, mark in MARKS.items() if not any(re.search(mark, t, re.M) for t in compared)]
    assert not missing, f"no compared mutant carries: {missing}"


@pytest.mark.parametrize("part", range(PARTS))
def test_mutants_agree(mutants, part):
    run = Run()
    for it, text, low in mutants[part::PARTS]:
        check_text(run, text, low, SEED + 1000 + it, "mutant")
    assert not run.failures, run.summary() + "\n\n" + "\n\n".join(run.failures[:3])
    assert run.outcomes["runtimes compared"] >= 20, run.summary()
