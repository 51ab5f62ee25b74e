"""`gemmspec explain --json` against its documented contract (docs/explain-json.md).

Every object of every example's output, of its derived backward's and of small specs
that reach the rarer branches (masked groups, capacity, gathers and scatters, row passes,
FP8 outputs and copies, fast accumulation, batch indices, launches split per N segment,
several specs in one file) is checked against a schema written from the document: each
key's presence rule and type. A key the output adds or drops without the document saying
so fails, and so does a broken invariant the document states (counts that multiply,
indices that refer to other sections, the order of the steps, the agreement with the
text form and with the files `compile` writes).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import re
from pathlib import Path

import pytest

from gemmspec.cli import main

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
DOC = ROOT / "docs" / "explain-json.md"

# Small specs for the branches the examples do not reach.
SPECS = {
    "batched": """
gemm batched {
  dim B = 4, M = 256, N = 512, K = 1024
  tensor x : bf16 [B, M, K]
  tensor w : bf16 [B, N, K]
  tensor y : bf16 [B, M, N]
  y[b, m, n] = sum[k] x[b, m, k] * w[b, n, k]
}
""",
    "capacity": """
gemm cap {
  dim T
  dim N = 1024, K = 2048
  group expert[E = 8] = ragged(T, offsets = expert_offsets, capacity)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
""",
    "copy": """
gemm up_copy {
  dim T
  dim N = 4096, F = 2048, K = 7168
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor x   : e4m3 [T, K] scale f32 [1, 128]
  tensor w   : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor h   : e4m3 [T, F] scale f32 [1, 128] pow2
  tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert pow2 = copy(h)
  h[t, j] = silu(sum[k] x[t, k] * w[expert(t), 2*j, k]) * sum[k] x[t, k] * w[expert(t), 2*j + 1, k]
}
""",
    "fast": """
gemm fastacc {
  dim T
  dim N = 1024, K = 4096
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [T, K]
  tensor w : e4m3 [E, N, K] scale f32 [1, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k] accumulate(fast)
}
""",
    "fp8_4d_weight": """
gemm fp8_4d {
  dim T
  dim N = 1024, K = 512
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 4] = ragged(T within lora, offsets = expert_offsets)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [L, E, N, K] scale f32 [1, 1, 128, 128]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[lora(t), expert(t), n, k]
}
""",
    "gather_scatter": """
gemm gath {
  dim T, S
  dim N = 128, K = 2048
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor idx : i32 [T]
  tensor src : i32 [T]
  tensor x : e4m3 [S, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : bf16 [S, N]
  y[src[t], n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
""",
    "gather16": """
gemm gath16 {
  dim T, S
  dim N = 64, K = 1024
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor idx : i32 [T]
  tensor x : bf16 [S, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[idx[t], k] * w[expert(t), n, k]
}
""",
    "masked_fp8_out": """
gemm maskfp8 {
  dim M = 256, N = 4096, K = 7168
  group expert[E = 8] = masked(M, counts = expert_counts)
  tensor x : e4m3 [E, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [E, M, N] scale f32 [1, 1, 128] pow2
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}
""",
    "row_passes": """
gemm rowp {
  dim T
  dim F = 1024, K = 512
  tensor x : bf16 [T, K]
  tensor w : bf16 [F, K]
  tensor g : bf16 [T, F]
  tensor h : bf16 [T, F]
  tensor rw : f32 [T]
  tensor drw : f32 [T] = rowdot(g, h)
  tensor dh  : bf16 [T, F] = rowscale(g, weight = rw)
  g[t, f] = sum[k] x[t, k] * w[f, k]
}
""",
    "split_per_n": """
gemm nsplit {
  split
  dim T
  dim R = 16, N = 592
  group slice[S = 3] = split(N, sizes = [16, 32, 544])
  group lora[L = 4]  = ragged(T, offsets = lora_offsets)
  tensor h  : bf16 [T, S, R]
  tensor wb : bf16 [L, N, R]
  tensor y  : bf16 [T, N]
  y[t, n] = sum[r] h[t, slice(n), r] * wb[lora(t), n, r]
}
""",
    "two_specs": """
gemm first {
  dim M = 128, N = 256, K = 512
  tensor a : bf16 [M, K]
  tensor b : bf16 [N, K]
  tensor c : f32 [M, N]
  c[m, n] = sum[k] a[m, k] * b[n, k]
}
gemm second {
  dim T
  dim N = 256, K = 512
  group expert[E = 2] = ragged(T, offsets = offs)
  tensor a : bf16 [T, K]
  tensor b : bf16 [E, N, K]
  tensor c : f32 [T, N]
  tensor alpha : f32 [E]
  c[t, n] += alpha[expert(t)] * sum[k] a[t, k] * b[expert(t), n, k]
}
""",
}


# ---------------------------------------------------------------------------------------
# The schema, as docs/explain-json.md writes it. A rule: (types, when) where `types` are
# the JSON types the document allows and `when` is True (always present) or a predicate
# over the object (and its context) saying when the key is present.

STR, INT, BOOL, NULL, LIST, OBJ = "string", "int", "bool", "null", "list", "object"


def jtype(v) -> str:
    if isinstance(v, bool):
        return BOOL
    return {int: INT, str: STR, type(None): NULL, list: LIST, dict: OBJ}[type(v)]


def check_keys(obj: dict, rules: dict, where: str, ctx=None) -> None:
    """Every key `rules` names is present exactly when its rule says, with an allowed
    type; no key outside `rules` is present."""
    assert isinstance(obj, dict), where
    extra = set(obj) - set(rules)
    assert not extra, f"{where}: keys the document does not name: {sorted(extra)}"
    for key, (types, when) in rules.items():
        present = when if isinstance(when, bool) else bool(when(obj, ctx))
        if not present:
            assert key not in obj, f"{where}: '{key}' present where the document says it is absent"
            continue
        assert key in obj, f"{where}: '{key}' missing"
        assert jtype(obj[key]) in types, f"{where}.{key}: {jtype(obj[key])}, documented {types}"


def _lists_of(v, t) -> bool:
    return isinstance(v, list) and all(jtype(x) == t for x in v)


SPEC_RULES = {
    "version": ((INT,), True),
    "name": ((STR,), True),
    "file": ((STR,), True),
    "decision": ((STR,), True),
    "reasons": ((LIST,), True),
    "nest": ((LIST,), True),
    "launches": ((LIST,), True),
    "prepasses": ((LIST,), True),
    "order": ((LIST,), lambda o, c: c["order"]),
    "postpasses": ((LIST,), lambda o, c: c["postpasses"]),
    "offsets_check": ((OBJ,), lambda o, c: c["runtime"]),
    "run_time_choice": ((OBJ,), lambda o, c: "run_time_choice" in o),  # checked below
    "backward": ((OBJ,), lambda o, c: c["backward"]),
}
BACKWARD_RULES = {
    "name": ((STR, NULL), True),
    "source": ((STR, NULL), True),
    "derived": ((LIST,), True),
    "output_grads": ((LIST,), True),
    "transposed": ((LIST,), True),
    "copies": ((LIST,), True),
    "not_derived": ((LIST,), True),
    "refused": ((LIST,), True),
    "explain": ((OBJ, NULL), True),
}
BACKWARD_ENTRY_RULES = {
    "derived": {k: ((INT,) if k == "statement" else (STR,), True) for k in ("statement", "kind", "wrt", "grad", "text")},
    "output_grads": {"output": ((STR,), True), "grad": ((STR,), True)},
    "transposed": {"tensor": ((STR,), True), "copy": ((STR,), True)},
    "copies": {"copy": ((STR,), True), "input": ((STR,), True)},
    "not_derived": {"tensor": ((STR,), True), "reason": ((STR,), True)},
    "refused": {"statement": ((INT, NULL), True), "reason": ((STR,), True)},
}
NEST_RULES = {
    "name": ((STR,), True),
    "kind": ((STR,), True),
    "dim": ((STR,), True),
    "count": ((INT,), True),
    "within": ((STR, NULL), True),
}
LAUNCH_RULES = {
    "index": ((INT,), True),
    "statement": ((INT,), True),
    "statement_text": ((STR,), True),
    "kernel": ((STR,), True),
    "symbols": ((OBJ,), lambda o, c: c["compiled"]),
    "leaf_count": ((INT,), True),
    "leaf_axes": ((LIST,), True),
    "pinned_axes": ((OBJ,), True),
    "signature": ((OBJ,), True),
    "extents": ((OBJ,), True),
    "operands": ((OBJ,), True),
    "scales": ((OBJ,), True),
    "epilogue": ((LIST,), True),
    "runtime_tensors": ((LIST,), True),
    "runtime_dims": ((LIST,), True),
    "note": ((STR,), lambda o, c: "note" in o),  # "only when the launch carries a note"
}
EPILOGUE_RULES = {
    "kind": ((STR,), True),
    "tensor": ((STR,), True),
    "dtype": ((STR,), True),
    "role": ((STR, NULL), True),
    "offset": ((STR,), True),
    "stride": ((STR, NULL), True),
}
SIGNATURE_RULES = {
    "a_type": ((STR,), True),
    "b_type": ((STR,), True),
    "d_type": ((STR,), True),
    "accumulate": ((BOOL,), True),
    "scaled": ((BOOL,), True),
    "a_scale_block": ((LIST, NULL), True),
    "b_scale_block": ((LIST, NULL), True),
    "a_k_major": ((BOOL,), True),
    "b_k_major": ((BOOL,), True),
    "tile": ((LIST,), True),
    "cluster": ((INT,), True),
    "multicast_b": ((BOOL,), True),
    "swiglu": ((BOOL,), True),
    "d_scale_pow2": ((BOOL,), True),
    "fast_accum": ((BOOL,), True),
    "swiglu_halves": ((BOOL,), True),
    "gather": ((BOOL,), True),
    "scatter": ((BOOL,), True),
    "copy": ((BOOL,), lambda o, c: c["copy"]),
    "copy_scale_pow2": ((BOOL,), lambda o, c: c["copy"]),
}
OPERAND_RULES = {
    "tensor": ((STR,), True),
    "offset": ((STR,), True),
    "strides": ((OBJ,), True),
    "rows_through": ((OBJ,), lambda o, c: c["rows"]),
    "padded_segments": ((OBJ,), lambda o, c: "padded_segments" in o),  # shape checked below
}
SCALE_RULES = {
    "tensor": ((STR,), True),
    "offset": ((STR,), True),
    "strides": ((OBJ,), True),
    "block": ((OBJ,), True),
    "anchored_per": ((OBJ,), True),
    "rows_through": ((OBJ,), lambda o, c: c["rows"]),
}
ROWS_THROUGH_RULES = {"tensor": ((STR,), True), "offset": ((STR,), True), "bound": ((STR,), True)}
PAD_RULES = {"role": ((STR,), True), "pad": ((INT,), True), "extra_rows": ((INT,), True)}
PREPASS_KINDS = ("requantize", "transpose", "quantize", "gather", "swiglu_grad")
PREPASS_RULES = {
    "kind": ((STR,), True),
    "source": ((STR,), True),
    "target": ((STR,), True),
    "source_layout": ((STR,), True),
    "target_layout": ((STR,), True),
    "source_scale": ((OBJ, NULL), True),
    "target_scale": ((OBJ, NULL), True),
    "index": ((STR, NULL), True),
    "weight": ((STR, NULL), True),
    "other": ((STR,), lambda o, c: o["kind"] == "swiglu_grad"),
    "anchored_per": ((STR, NULL), True),
    "pow2_scales": ((BOOL,), True),
    "before_launches": ((LIST,), True),
    "description": ((STR,), True),
    "symbol": ((STR,), lambda o, c: c["compiled"]),
}
POSTPASS_RULES = {
    "kind": ((STR,), True),
    "source": ((STR,), True),
    "target": ((STR,), True),
    "other": ((STR, NULL), True),
    "other_scale": ((STR, NULL), True),
    "weight": ((STR, NULL), True),
    "description": ((STR,), True),
    "index": ((STR,), lambda o, c: o["kind"] == "scatter_add"),
    "symbol": ((STR,), lambda o, c: c["compiled"]),
    "symbols": ((LIST,), lambda o, c: c["compiled"] and o["kind"] == "scatter_add"),
}
OFFSETS_CHECK_RULES = {"fused": ((BOOL,), True), "where": ((STR,), True)}
RUN_TIME_CHOICE_RULES = {
    "dim": ((STR,), True),
    "group": ((STR,), True),
    "segments": ((INT,), True),
    "rows_per_segment": ((INT,), True),
    "max_rows": ((INT,), True),
    "rule": ((STR,), True),
    "launches": ((LIST,), True),
}
RTC_LAUNCH_RULES = {"launch": ((INT,), True), "compiled": ((STR,), True), "decode": ((STR,), True)}

ROLES = {"A": ("m", "k"), "B": ("n", "k"), "D": ("m", "n"), "C": ("m", "n"), "U": ("n", "k")}
TYPES_IN = {"e4m3", "e5m2", "bf16", "f16"}
TYPES_OUT = {"bf16", "f16", "f32", "e4m3", "e5m2"}
KERNEL = re.compile(
    r"gs_sm90a_(?P<a>e4m3|e5m2|bf16|f16)(?P<b>e4m3|e5m2|bf16|f16)_(?P<d>bf16|f16|f32|e4m3|e5m2)_"
    r"(?P<scales>ns|s(?P<bm>\d+)x(?P<bk>\d+)_(?P<bn>\d+)x(?P<bk2>\d+))_(?P<majors>[km][kn])_"
    r"t(?P<tm>\d+)x(?P<tn>\d+)x(?P<tk>\d+)(?P<cluster>c2b?)?_(?P<mode>store|acc)"
    r"(?P<epilogue>(_e(?:[arb](?:f32|bf16|f16))+)?)(?P<swiglu>_swiglu)?(?P<halves>_halves\d*)?"
    r"(?P<gather>_gather)?(?P<scatter>_scatter)?(?P<pow2>_pow2)?(?P<copy>_copy128x1(?:pow2)?)?(?P<fast>_fastacc)?"
)
EXTENT_FORMS = (
    re.compile(r"(?P<r>[mnk]): \[0, \w+\)$"),
    re.compile(r"(?P<r>[mnk]): \[(?P<t>\w+)\[(?P<g>g\.\w+(, g\.\w+)*)\], (?P=t)\[(?P=g) \+ 1\]\)  \(\w+ segments of \w+\)$"),
    re.compile(r"(?P<r>[mnk]): (split|uniform) segments of \w+, starts \[[\d, ]+\], sizes \[[\d, ]+\] by g\.\w+$"),
    re.compile(r"(?P<r>[mnk]): \[0, min\(\w+\[g\.\w+\], \d+\)\)$"),
)
# A formula: terms joined by " + ", each an integer, a product `c*sym`, or a symbol.
SYMBOL = re.compile(r"^(g\.\w+|(start|len|bstart)\.[mnk]|cbstart\.m|pstart\d+\.[mnk]|plen\d+\.[mnk]|[A-Za-z_]\w*)$")


def check_formula(text: str, runtime_dims: list, where: str) -> None:
    assert isinstance(text, str) and text, where
    for term in text.split(" + "):
        factors = term.split("*")
        assert factors, where
        for f in factors:
            if f.isdigit():
                continue
            assert SYMBOL.match(f), f"{where}: '{f}' in '{text}' is no documented symbol"
            if "." not in f:  # a dim name: one of the run-time dims the launch lists
                assert f in runtime_dims, f"{where}: dim '{f}' in '{text}' not in runtime_dims {runtime_dims}"


def check_map(m: dict, roles: tuple, launch: dict, where: str, scale: bool, statement_rows) -> None:
    check_keys(m, SCALE_RULES if scale else OPERAND_RULES, where, {"rows": statement_rows})
    assert tuple(m["strides"]) == roles, f"{where}: strides keyed {list(m['strides'])}, documented {roles}"
    check_formula(m["offset"], launch["runtime_dims"], where + ".offset")
    for r, s in m["strides"].items():
        check_formula(s, launch["runtime_dims"], f"{where}.strides.{r}")
    if scale:
        assert tuple(m["block"]) == roles and all(jtype(b) == INT for b in m["block"].values()), where
        assert set(m["anchored_per"]) <= set(roles), where
        assert all(jtype(g) == STR for g in m["anchored_per"].values()), where
    if "rows_through" in m:
        check_keys(m["rows_through"], ROWS_THROUGH_RULES, where + ".rows_through")
        assert m["rows_through"]["tensor"] in launch["runtime_tensors"], where
    if "padded_segments" in m:
        pad = m["padded_segments"]
        check_keys(pad, PAD_RULES, where + ".padded_segments")
        assert pad["role"] in roles, where
        # Offset and strides then use pstart<P>.<role> / plen<P>.<role>, never start/len of that role.
        text = m["offset"] + " " + " ".join(m["strides"].values())
        assert f"pstart{pad['pad']}.{pad['role']}" in text or f"plen{pad['pad']}.{pad['role']}" in text, where
        assert f"start.{pad['role']}" not in text.replace(f"pstart{pad['pad']}", ""), where


def check_launch(launch: dict, i: int, spec: dict, compiled: bool, where: str) -> None:
    sig = launch["signature"]
    copy_ = "C" in launch["operands"]
    check_keys(launch, LAUNCH_RULES, where, {"compiled": compiled})
    assert launch["index"] == i, where
    check_keys(sig, SIGNATURE_RULES, where + ".signature", {"copy": copy_})
    if copy_:
        assert sig["copy"] is True and "C" in launch["scales"], where
    assert sig["a_type"] in TYPES_IN and sig["b_type"] in TYPES_IN and sig["d_type"] in TYPES_OUT, where
    fp8 = sig["a_type"] in ("e4m3", "e5m2")
    assert sig["tile"][2] == (128 if fp8 else 64), where
    assert len(sig["tile"]) == 3 and all(jtype(t) == INT for t in sig["tile"]), where
    assert sig["cluster"] in (1, 2) and (not sig["multicast_b"] or sig["cluster"] == 2), where
    for key in ("a_scale_block", "b_scale_block"):
        assert (sig[key] is None) == (not sig["scaled"]), where
        assert sig[key] is None or (len(sig[key]) == 2 and all(jtype(b) == INT for b in sig[key])), where
    assert not sig["d_scale_pow2"] or sig["d_type"] in ("e4m3", "e5m2"), where
    # The kernel name spells the signature (docs: the kernel's procedural name).
    k = KERNEL.fullmatch(launch["kernel"])
    assert k, f"{where}: kernel {launch['kernel']} does not follow the documented pattern"
    assert (k["a"], k["b"], k["d"]) == (sig["a_type"], sig["b_type"], sig["d_type"]), where
    assert (k["scales"] != "ns") == sig["scaled"], where
    if sig["scaled"]:
        assert [int(k["bm"]), int(k["bk"])] == sig["a_scale_block"], where
        assert [int(k["bn"]), int(k["bk2"])] == sig["b_scale_block"], where
    assert k["majors"] == ("k" if sig["a_k_major"] else "m") + ("k" if sig["b_k_major"] else "n"), where
    assert [int(k["tm"]), int(k["tn"]), int(k["tk"])] == sig["tile"], where
    assert (k["cluster"] or "") == ("" if sig["cluster"] == 1 else "c2b" if sig["multicast_b"] else "c2"), where
    assert (k["mode"] == "acc") == sig["accumulate"], where
    assert bool(k["swiglu"]) == sig["swiglu"] and bool(k["pow2"]) == sig["d_scale_pow2"], where
    assert bool(k["copy"]) == copy_ and bool(k["fast"]) == sig["fast_accum"], where
    assert bool(k["halves"]) == sig["swiglu_halves"] == ("U" in launch["operands"]), where
    assert bool(k["gather"]) == sig["gather"] and bool(k["scatter"]) == sig["scatter"], where
    # The fused epilogue operands, in the kernel name's `_e` order (a letter and a type each).
    spelled = re.findall(r"([arb])(f32|bf16|f16)", k["epilogue"] or "")
    assert [(e["kind"][0], e["dtype"]) for e in launch["epilogue"]] == spelled, where
    for j, e in enumerate(launch["epilogue"]):
        check_keys(e, EPILOGUE_RULES, f"{where}.epilogue[{j}]")
        assert e["role"] == {"alpha": None, "row": "m", "bias": "n"}[e["kind"]], where
        assert (e["stride"] is None) == (e["role"] is None), where
        check_formula(e["offset"], launch["runtime_dims"], f"{where}.epilogue[{j}].offset")
        if e["stride"] is not None:
            check_formula(e["stride"], launch["runtime_dims"], f"{where}.epilogue[{j}].stride")
    if copy_:
        assert k["copy"].endswith("pow2") == sig["copy_scale_pow2"], where
    # Leaves: the product of the free axes' counts, the pinned ones apart.
    count = 1
    for ax in launch["leaf_axes"]:
        check_keys(ax, {"name": ((STR,), True), "count": ((INT,), True), "group": ((STR, NULL), True)}, where)
        count *= ax["count"]
        groups = {g["name"] for g in spec["nest"]}
        assert ax["group"] is None or (ax["group"] in groups and ax["name"] == ax["group"]), where
    assert launch["leaf_count"] == count, where
    assert all(jtype(v) == INT for v in launch["pinned_axes"].values()), where
    assert not set(launch["pinned_axes"]) & {a["name"] for a in launch["leaf_axes"]}, where
    assert tuple(launch["extents"]) == ("m", "n", "k"), where
    for role, text in launch["extents"].items():
        assert any(f.match(text) and f.match(text)["r"] == role for f in EXTENT_FORMS), f"{where}: extent {text!r}"
    assert _lists_of(launch["runtime_tensors"], STR) and _lists_of(launch["runtime_dims"], STR), where
    # Operand and scale maps.
    up = ("U",) if sig["swiglu_halves"] else ()
    assert tuple(launch["operands"]) == ("A", "B", "D") + up + (("C",) if copy_ else ()), where
    assert tuple(launch["scales"]) == ("A", "B", "D") + up + (("C",) if copy_ else ()), where
    for role, m in launch["operands"].items():
        # Rows through an index tensor: the statement writes `x[idx[t], k]` (A) or `y[src[t], n]` (D).
        rows = role in ("A", "D") and re.search(rf"\b{m['tensor']}\[\w+\[", launch["statement_text"]) is not None
        check_map(m, ROLES[role], launch, f"{where}.operands.{role}", False, rows)
    for role, m in launch["scales"].items():
        if role in ("A", "B", "U"):
            assert (m is None) == (not sig["scaled"]), where
        if role == "D":
            assert (m is None) == (sig["d_type"] not in ("e4m3", "e5m2")), where
        if m is None:
            continue
        rows = role == "A" and "rows_through" in launch["operands"]["A"]
        check_map(m, ROLES[role], launch, f"{where}.scales.{role}", True, rows)
        if role == "D":
            assert m["block"] == {"m": 1, "n": 128}, where
        if role == "C":
            assert m["block"] == {"m": 128, "n": 1} and set(m["anchored_per"]) == {"m"}, where
            assert "cbstart.m" in m["offset"], where
    if copy_:
        assert launch["operands"]["C"]["strides"]["m"] == "1", where  # segment_major: stride 1 along m


def check_spec(doc: dict, where: str, *, backward: bool, compiled: bool = False, text: str | None = None) -> None:
    launches, prepasses = doc["launches"], doc.get("prepasses", [])
    runtime = any(x["runtime_tensors"] for x in launches) or any(p.get("index") for p in prepasses) or any(
        p.get("index") for p in doc.get("postpasses", [])
    )
    default = [("prepass", i) for i in range(len(prepasses))] + [("launch", i) for i in range(len(launches))]
    default += [("postpass", i) for i in range(len(doc.get("postpasses", [])))]
    ctx = {
        "backward": backward,
        "runtime": runtime,
        "postpasses": "postpasses" in doc,
        "order": "order" in doc,
        "compiled": compiled,
    }
    check_keys(doc, SPEC_RULES, where, ctx)
    assert doc["version"] == 1, where
    assert doc["decision"] in ("flatten", "split"), where
    assert (doc["decision"] == "flatten") == (len(launches) == 1), where
    assert doc["reasons"] and _lists_of(doc["reasons"], STR), where
    assert sum(r.startswith("pre-pass: ") for r in doc["reasons"]) == len(prepasses), where
    for i, g in enumerate(doc["nest"]):
        check_keys(g, NEST_RULES, f"{where}.nest[{i}]")
        assert g["kind"] in ("ragged", "split", "uniform", "masked"), where
        assert g["within"] is None or g["within"] in [x["name"] for x in doc["nest"][:i]], where
    for i, x in enumerate(launches):
        check_launch(x, i, doc, compiled, f"{where}.launches[{i}]")
    for i, p in enumerate(prepasses):
        w = f"{where}.prepasses[{i}]"
        check_keys(p, PREPASS_RULES, w, {"compiled": compiled})
        assert p["kind"] in PREPASS_KINDS, w
        for key in ("source_scale", "target_scale"):
            if p[key] is not None:
                check_keys(p[key], {"name": ((STR,), True), "block": ((LIST,), True)}, f"{w}.{key}")
                assert _lists_of(p[key]["block"], INT), w
        assert (p["source_scale"] is None) == (p["kind"] in ("quantize", "swiglu_grad")), w
        assert p["target_scale"] is not None or p["kind"] == "gather", w
        assert p["index"] is None or p["kind"] in ("gather", "requantize"), w
        assert (p["index"] is not None) or p["kind"] != "gather", w
        assert p["weight"] is None or p["kind"] == "requantize", w
        assert _lists_of(p["before_launches"], INT) and all(0 <= j < len(launches) for j in p["before_launches"]), w
        assert p["before_launches"] == sorted(p["before_launches"]), w
        if not p["before_launches"]:  # read only by another pre-pass
            assert any(q["source"] == p["target"] for q in prepasses), w
        for j in p["before_launches"]:  # the launch reads the target
            ops = launches[j]["operands"]
            assert p["target"] in (ops["A"]["tensor"], ops["B"]["tensor"]), w
    if "order" in doc:
        steps = []
        for o in doc["order"]:
            check_keys(o, {"kind": ((STR,), True), "index": ((INT,), True)}, where + ".order")
            steps.append((o["kind"], o["index"]))
        assert sorted(steps) == sorted(default) and steps != default, where
    for i, p in enumerate(doc.get("postpasses", [])):
        check_keys(p, POSTPASS_RULES, f"{where}.postpasses[{i}]", {"compiled": compiled})
        assert p["kind"] in ("rowdot", "rowscale", "scatter_add"), where
        assert (p["other"] is not None) == (p["kind"] == "rowdot"), where
        assert p["other_scale"] is None or p["kind"] == "rowdot", where
        assert (p["weight"] is not None) == (p["kind"] == "rowscale"), where
        if compiled and p["kind"] == "scatter_add":
            s = p["symbol"]
            assert p["symbols"] == [f"{s}_zero", f"{s}_count", f"{s}_scan", f"{s}_place", s], where
    if "offsets_check" in doc:
        check_keys(doc["offsets_check"], OFFSETS_CHECK_RULES, where + ".offsets_check")
    if "run_time_choice" in doc:
        rtc = doc["run_time_choice"]
        check_keys(rtc, RUN_TIME_CHOICE_RULES, where + ".run_time_choice")
        assert rtc["max_rows"] == rtc["rows_per_segment"] * rtc["segments"], where
        groups = {g["name"]: g for g in doc["nest"]}
        group, segments = groups[rtc["group"]], 1
        assert group["dim"] == rtc["dim"], where
        while group is not None:  # a nested group's segments: its count under each enclosing segment
            segments *= group["count"]
            group = groups.get(group["within"])
        assert rtc["segments"] == segments, where
        assert rtc["launches"], where
        for x in rtc["launches"]:
            check_keys(x, RTC_LAUNCH_RULES, where + ".run_time_choice.launches")
            assert 0 <= x["launch"] < len(launches) and x["compiled"] != x["decode"], where
            if compiled:
                assert x["compiled"] == launches[x["launch"]]["symbols"]["gemm"], where
    if compiled:
        for x in launches:
            check_keys(x["symbols"], {"leaf_table": ((STR, NULL), True), "gemm": ((STR,), True)}, where)
    if text is not None:  # the text form says the same
        assert f"decision: {doc['decision']}" in text, where
        for r in doc["reasons"]:
            assert f"  - {r}\n" in text, where
        for i, p in enumerate(prepasses):
            assert f"  [{i}] {p['description']} (" in text, where
        for i, p in enumerate(doc.get("postpasses", [])):
            assert f"  [{i}] {p['description']}" in text, where
        for x in launches:
            assert f"launch {x['index']}: statement #{x['statement']}: {x['statement_text']}" in text, where
        if "offsets_check" in doc:
            assert f"offsets check (on the device): {doc['offsets_check']['where']}" in text, where
        if "run_time_choice" in doc:
            assert f"the decode variant when {doc['run_time_choice']['rule']}," in text, where
            for x in doc["run_time_choice"]["launches"]:
                assert f"  launch {x['launch']}: {x['decode']} (" in text, where
        if "order" in doc:
            assert "order: " + ", ".join(f"{o['kind']} {o['index']}" for o in doc["order"]) in text, where


def check_backward(bw: dict, spec: dict, where: str) -> None:
    check_keys(bw, BACKWARD_RULES, where)
    for section, rules in BACKWARD_ENTRY_RULES.items():
        for i, entry in enumerate(bw[section]):
            check_keys(entry, rules, f"{where}.{section}[{i}]")
    kinds = [d["kind"] for d in bw["derived"]]
    assert set(kinds) <= {"dgrad", "wgrad", "rowdot"}, where
    assert len({d["grad"] for d in bw["derived"]}) == len({d["wrt"] for d in bw["derived"]}), where
    nothing = not bw["derived"]
    assert (bw["name"] is None) == nothing and (bw["source"] is None) == nothing, where
    if bw["name"] is not None:
        assert bw["name"] == f"{spec['name']}_backward", where
        assert f"gemm {bw['name']}" in bw["source"], where
    compiles = not any(r["statement"] is None for r in bw["refused"])
    assert (bw["explain"] is None) == (nothing or not compiles), where
    if bw["explain"] is not None:
        assert bw["explain"]["name"] == bw["name"], where
        check_spec(bw["explain"], where + ".explain", backward=False)


# ---------------------------------------------------------------------------------------

def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        status = main(list(argv))
    return status, out.getvalue()


def _sources(tmp: Path) -> dict[str, Path]:
    paths = {p.stem: p for p in sorted(EXAMPLES.glob("*.gspec"))}
    for name, text in SPECS.items():
        path = tmp / f"{name}.gspec"
        path.write_text(text)
        paths[name] = path
    return paths


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, tuple[Path, list, str]]:
    """For each source: its path, its `explain --json` and its `explain` text."""
    tmp = tmp_path_factory.mktemp("specs")
    out = {}
    for name, path in _sources(tmp).items():
        status, js = _run("explain", "--json", str(path))
        assert status == 0, name
        status, text = _run("explain", str(path))
        assert status == 0, name
        out[name] = (path, json.loads(js), text)
    return out


ALL = sorted([p.stem for p in EXAMPLES.glob("*.gspec")] + list(SPECS))


@pytest.mark.parametrize("name", ALL)
def test_spec_objects_follow_the_documented_schema(outputs, name) -> None:
    path, docs, text = outputs[name]
    assert isinstance(docs, list) and docs
    texts = text.split("\n\nspec ")  # one text block per spec, in the same order
    assert len(texts) == len(docs)
    for i, doc in enumerate(docs):
        assert doc["file"] == str(path)
        check_spec(doc, f"{name}[{i}]", backward=True, text=texts[i] + "\n")
        check_backward(doc["backward"], doc, f"{name}[{i}].backward")


def test_the_sources_reach_the_rarer_branches(outputs) -> None:
    """The schema test above sees every optional key at least once, so none goes unchecked."""
    seen: set[str] = set()

    def walk(doc: dict) -> None:
        seen.update(f"spec.{k}" for k in doc)
        for x in doc["launches"]:
            seen.update(f"launch.{k}" for k in x)
            seen.update(f"signature.{k}" for k in x["signature"])
            seen.update(f"group.{a['group'] is None}" for a in x["leaf_axes"])
            for m in list(x["operands"].values()) + [s for s in x["scales"].values() if s]:
                seen.update(f"map.{k}" for k in m)
            if "rows_through" in (x["scales"]["A"] or {}):
                seen.add("scale.rows_through")
        seen.update(f"prepass.{p['kind']}" for p in doc["prepasses"])
        seen.update(f"postpass.{p['kind']}" for p in doc.get("postpasses", []))
        bw = doc.get("backward")
        if bw:
            seen.update(f"backward.{s}" for s in BACKWARD_ENTRY_RULES if bw[s])
            if bw["explain"]:
                walk(bw["explain"])

    for _, docs, _ in outputs.values():
        for doc in docs:
            walk(doc)
    wanted = {
        "spec.order", "spec.postpasses", "spec.offsets_check", "spec.run_time_choice", "launch.note",
        "signature.copy", "signature.copy_scale_pow2", "group.True", "group.False", "map.rows_through",
        "map.padded_segments", "scale.rows_through",
        *(f"prepass.{k}" for k in PREPASS_KINDS),
        "postpass.rowdot", "postpass.rowscale", "postpass.scatter_add",
        *(f"backward.{s}" for s in BACKWARD_ENTRY_RULES),
    }
    assert wanted <= seen, sorted(wanted - seen)


def test_a_dropped_or_added_key_fails_the_schema(outputs) -> None:
    """The check itself: a copy of a real output with one documented key removed, or one
    undocumented key added, no longer passes."""
    path, (doc,), _ = outputs["moe_ffn_fp8_decode"]
    check_spec(doc, "ok", backward=True)
    cases = [
        lambda d: d.pop("reasons"),
        lambda d: d.pop("offsets_check"),
        lambda d: d["launches"][0].pop("leaf_count"),
        lambda d: d["launches"][0]["signature"].pop("fast_accum"),
        lambda d: d["launches"][0]["scales"].pop("D"),
        lambda d: d["launches"][1]["operands"]["A"].pop("strides"),
        lambda d: d["prepasses"][0].pop("before_launches"),
        lambda d: d["postpasses"][0].pop("index"),
        lambda d: d["run_time_choice"].pop("max_rows"),
        lambda d: d["launches"][0].update(extra=1),
        lambda d: d["launches"][0]["signature"].update(copy=True),
        lambda d: d["launches"][0]["signature"].update(tile=[128, 256, 64]),
        lambda d: d["prepasses"][0].update(before_launches=[5]),
        lambda d: d.update(version=2),
    ]
    for i, change in enumerate(cases):
        broken = copy.deepcopy(doc)
        change(broken)
        with pytest.raises(AssertionError):
            check_spec(broken, f"case {i}", backward=True)
    bw = copy.deepcopy(doc["backward"])
    bw["explain"]["launches"][0].pop("kernel")
    with pytest.raises(AssertionError):
        check_backward(bw, doc, "backward")


def test_dump_ir_writes_the_same_objects_without_backward(outputs, tmp_path) -> None:
    path, docs, _ = outputs["two_specs"]
    status, _ = _run("explain", "--json", str(path), "--dump-ir", str(tmp_path / "ir"))
    assert status == 0
    dumped = json.loads((tmp_path / "ir" / "04-schedule.json").read_text())
    assert dumped == [{k: v for k, v in d.items() if k != "backward"} for d in docs]


@pytest.mark.parametrize("name", ["moe_ffn_fp8_decode", "moe_ffn_fp8_train", "linear_fp8_training"])
def test_compiles_schedule_json_adds_only_the_symbols(outputs, name, tmp_path) -> None:
    """`compile`'s `<spec>.schedule.json`: the same object with `symbols`/`symbol` keys,
    naming what the manifest names."""
    path, (doc,), _ = outputs[name]
    status, _ = _run("compile", str(path), "-o", str(tmp_path))
    assert status == 0
    sched = json.loads((tmp_path / f"{doc['name']}.schedule.json").read_text())
    manifest = json.loads((tmp_path / f"{doc['name']}.manifest.json").read_text())
    check_spec(sched, name, backward=False, compiled=True)
    stripped = copy.deepcopy(sched)
    for x in stripped["launches"]:
        x.pop("symbols")
    for p in stripped["prepasses"] + stripped.get("postpasses", []):
        p.pop("symbol")
        p.pop("symbols", None)
    assert stripped == {k: v for k, v in doc.items() if k != "backward"}
    symbols = {s["symbol"] for s in manifest["steps"] if s.get("kind") == "kernel"}
    for x in sched["launches"]:
        named = {x["symbols"]["gemm"]} | ({x["symbols"]["leaf_table"]} - {None})
        assert named <= symbols or "run_time_choice" in sched  # a call may take the decode variant's
    if "run_time_choice" in sched:
        assert sched["run_time_choice"] == {k: v for k, v in manifest["run_time_choice"].items() if k in RUN_TIME_CHOICE_RULES}
    for p in sched["prepasses"]:
        assert p["symbol"] in symbols
    for p in sched.get("postpasses", []):
        assert set(p.get("symbols", [p["symbol"]])) <= symbols


def test_file_is_the_path_as_typed(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("m.gspec").write_text(SPECS["batched"])
    status, js = _run("explain", "./m.gspec", "--json")
    assert status == 0 and json.loads(js)[0]["file"] == "./m.gspec"


def test_an_error_prints_no_json(tmp_path) -> None:
    bad = tmp_path / "bad.gspec"
    bad.write_text("gemm bad {\n  dim M = 128\n  tensor a : bf16 [M, K]\n}\n")
    status, js = _run("explain", "--json", str(bad))
    assert status != 0 and js == ""


def test_the_documented_examples_are_the_output(outputs) -> None:
    """The JSON blocks of the document are what `explain --json` prints for them."""
    blocks = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.S)
    (doc,) = outputs["lora_moe_nested"][1]
    documented = json.loads(blocks[0])
    printed = copy.deepcopy([{k: v for k, v in doc.items() if k != "backward"}])
    printed[0]["file"] = "examples/lora_moe_nested.gspec"  # the test runs it by its absolute path
    # The tile, and so the kernel name and the tile's reasons, follow the tile heuristic
    # (the document says so): every key must be there, every other value the same.
    for d in (documented[0], printed[0]):
        d["reasons"] = [r for r in d["reasons"] if "tile" not in r]
        for x in d["launches"]:
            x["kernel"] = re.sub(r"_t\d+x\d+x\d+", "_t", x["kernel"])
            x["signature"]["tile"] = None
    assert documented == printed
    (wgrad,) = outputs["moe_fp8_wgrad"][1]
    excerpt = json.loads("{" + blocks[1] + "}")
    launch = wgrad["launches"][0]
    assert excerpt == {"operands": launch["operands"], "scales": launch["scales"]}
    (training,) = outputs["linear_fp8_training"][1]
    assert json.loads(blocks[2]) in training["prepasses"]
