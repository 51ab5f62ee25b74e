"""Claims of docs/usage.md, docs/explain-json.md and docs/kernel-abi.md held to the code
through the Python API, the emitted header and manifest, and the derived backward of
gemmspec.torch.function on CPU tensors (its ops run the float64 reference there). Every
expected gradient is computed here from the documented recipe: straight through each
quantization, FP8 operands quantized per block by the language's rule, dy in 1x128
blocks, WGRAD operands requantized into 128x1 blocks per expert segment."""

from __future__ import annotations

import io
import json
import math
import re
from contextlib import redirect_stdout
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

import gemmspec
from gemmspec.cli import main
from gemmspec.errors import ArgumentError, GemmspecError

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))
F32, E4, BF = np.float32, ml_dtypes.float8_e4m3fn, ml_dtypes.bfloat16


def cli_json(path) -> list:
    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["explain", "--json", str(path)]) == 0
    return json.loads(buf.getvalue())


# ---- explain --json: exactly the documented keys, with their types and meanings -------
S, OPT = str, "opt"
SPEC = {"version": int, "name": S, "file": S, "decision": S, "reasons": list, "nest": list, "launches": list,
        "prepasses": list, "order": (list, OPT), "postpasses": (list, OPT), "offsets_check": (dict, OPT),
        "run_time_choice": (dict, OPT), "backward": (dict, OPT)}
NEST = {"name": S, "kind": S, "dim": S, "count": int, "within": (S, type(None))}
LAUNCH = {"index": int, "statement": int, "statement_text": S, "kernel": S, "leaf_count": int, "leaf_axes": list,
          "pinned_axes": dict, "signature": dict, "extents": dict, "operands": dict, "scales": dict,
          "runtime_tensors": list, "runtime_dims": list, "epilogue": list, "note": (S, OPT)}
BLOCK = (list, type(None))
SIG = {"a_type": S, "b_type": S, "d_type": S, "accumulate": bool, "scaled": bool, "a_scale_block": BLOCK,
       "b_scale_block": BLOCK, "a_k_major": bool, "b_k_major": bool, "tile": list, "cluster": int,
       "multicast_b": bool, "swiglu": bool, "d_scale_pow2": bool, "fast_accum": bool, "swiglu_halves": bool,
       "gather": bool, "scatter": bool, "copy": (bool, OPT), "copy_scale_pow2": (bool, OPT)}
SCALE = (dict, type(None))
PREPASS = {"kind": S, "source": S, "target": S, "source_layout": S, "target_layout": S, "source_scale": SCALE,
           "target_scale": SCALE, "index": (S, type(None)), "weight": (S, type(None)), "other": (S, OPT),
           "anchored_per": (S, type(None)), "pow2_scales": bool, "before_launches": list, "description": S}
POSTPASS = {"kind": S, "source": S, "target": S, "other": (S, type(None)), "other_scale": (S, type(None)),
            "weight": (S, type(None)), "description": S, "index": (S, OPT)}
BACKWARD = {"name": (S, type(None)), "source": (S, type(None)), "derived": list, "output_grads": list,
            "transposed": list, "copies": list, "not_derived": list, "refused": list, "explain": SCALE}
OPERAND = {"tensor": S, "offset": S, "strides": dict, "rows_through": (dict, OPT), "padded_segments": (dict, OPT)}
SCALEMAP = {"tensor": S, "offset": S, "strides": dict, "block": dict, "anchored_per": dict, "rows_through": (dict, OPT)}
EPILOGUE = {"kind": S, "tensor": S, "dtype": S, "role": (S, type(None)), "offset": S, "stride": (S, type(None))}
RTC = {"dim": S, "group": S, "segments": int, "rows_per_segment": int, "max_rows": int, "rule": S, "launches": list}
ROLES = {"A": ("m", "k"), "B": ("n", "k"), "D": ("m", "n"), "U": ("n", "k"), "C": ("m", "n")}


def keys(obj: dict, schema: dict, where: str) -> None:
    required = {k for k, v in schema.items() if not (isinstance(v, tuple) and OPT in v)}
    assert required <= set(obj) <= set(schema), (where, set(obj) ^ required)
    for k, value in obj.items():
        types = tuple(t for t in (schema[k] if isinstance(schema[k], tuple) else (schema[k],)) if t is not OPT)
        assert isinstance(value, types) and (bool in types or not isinstance(value, bool)), (where, k, value)


def kernel_prefix(sig: dict) -> str:
    """explain-json.md: gs_sm90a_<A><B>_<D>_<scales>_<majors>_t<M>x<N>x<K>[<cluster>]_<store/acc>."""
    sc = "ns" if not sig["scaled"] else "s{}x{}_{}x{}".format(*sig["a_scale_block"], *sig["b_scale_block"])
    majors = ("k" if sig["a_k_major"] else "m") + ("k" if sig["b_k_major"] else "n")
    cluster = "" if sig["cluster"] == 1 else ("c2b" if sig["multicast_b"] else "c2")
    m, n, k = sig["tile"]
    return (f"gs_sm90a_{sig['a_type']}{sig['b_type']}_{sig['d_type']}_{sc}_{majors}_t{m}x{n}x{k}{cluster}_"
            f"{'acc' if sig['accumulate'] else 'store'}")


def check_spec_object(s: dict, where: str, backward: bool) -> None:
    keys(s, SPEC, where)
    assert ("backward" in s) == backward and s["version"] == 1 and s["reasons"]
    assert s["decision"] == ("flatten" if len(s["launches"]) == 1 else "split")
    groups = {g["name"] for g in s["nest"]}
    for g in s["nest"]:
        keys(g, NEST, where)
        assert g["kind"] in ("ragged", "split", "uniform", "masked") and g["within"] in groups | {None}
    for i, launch in enumerate(s["launches"]):
        keys(launch, LAUNCH, where)
        sig = launch["signature"]
        keys(sig, SIG, where)
        assert launch["index"] == i and launch["kernel"].startswith(kernel_prefix(sig)), (where, launch["kernel"])
        suffix = launch["kernel"][len(kernel_prefix(sig)):]
        for flag, part in (("swiglu", "_swiglu"), ("gather", "_gather"), ("scatter", "_scatter"),
                           ("fast_accum", "_fastacc"), ("swiglu_halves", "_halves"), ("copy", "_copy128x1")):
            assert bool(sig.get(flag)) == (part in suffix), (where, flag, suffix)
        assert launch["leaf_count"] == math.prod(a["count"] for a in launch["leaf_axes"])
        assert all(a["group"] in groups | {None} for a in launch["leaf_axes"])
        assert [launch["extents"][r][:3] for r in "mnk"] == ["m: ", "n: ", "k: "]
        assert set(launch["operands"]) == {"A", "B", "D"} | ({"C"} if sig.get("copy") else set()) | (
            {"U"} if sig["swiglu_halves"] else set())
        for role, op in launch["operands"].items():
            keys(op, OPERAND, where)
            assert set(op["strides"]) == set(ROLES[role])
        for role, sc in launch["scales"].items():
            if sc is not None:
                keys(sc, SCALEMAP, where)
                assert set(sc["strides"]) == set(sc["block"]) == set(ROLES[role])
                assert set(sc["anchored_per"]) <= set(ROLES[role]) and set(sc["anchored_per"].values()) <= groups
        assert (launch["scales"]["A"] is None) == (not sig["scaled"])
        for e in launch["epilogue"]:
            keys(e, EPILOGUE, where)
            assert (e["kind"], e["role"]) in (("alpha", None), ("row", "m"), ("bias", "n"))
            assert (e["stride"] is None) == (e["kind"] == "alpha")
        assert "_e" + "".join(e["kind"][0] + e["dtype"] for e in launch["epilogue"]) in suffix or not launch["epilogue"]
    for p in s["prepasses"]:
        keys(p, PREPASS, where)
        assert ("other" in p) == (p["kind"] == "swiglu_grad")
        assert any(r.startswith("pre-pass:") and p["target"] in r for r in s["reasons"]), (where, p["target"])
        for i in p["before_launches"]:
            assert p["target"] in json.dumps(s["launches"][i]["operands"]), (where, p["target"], i)
    for q in s.get("postpasses", []):
        keys(q, POSTPASS, where)
        assert ("index" in q) == (q["kind"] == "scatter_add")
    steps = [("prepass", len(s["prepasses"])), ("launch", len(s["launches"])), ("postpass", len(s.get("postpasses", [])))]
    default = [(k, i) for k, n in steps for i in range(n)]
    if "order" in s:
        got = [(o["kind"], o["index"]) for o in s["order"]]
        assert sorted(got) == sorted(default) and got != default, where
    reads = any(la["runtime_tensors"] for la in s["launches"]) or any(p["index"] for p in s["prepasses"])
    assert ("offsets_check" in s) == reads, where
    if "offsets_check" in s:
        assert set(s["offsets_check"]) == {"fused", "where"}
    if "run_time_choice" in s:
        rtc = s["run_time_choice"]
        keys(rtc, RTC, where)
        assert rtc["max_rows"] == rtc["rows_per_segment"] * rtc["segments"] and rtc["group"] in groups
        assert all(set(x) == {"launch", "compiled", "decode"} for x in rtc["launches"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_explain_json_has_exactly_the_documented_fields_and_meanings(path):
    for s in cli_json(path):
        check_spec_object(s, path.stem, backward=True)
        b = s["backward"]
        keys(b, BACKWARD, path.stem + ".backward")
        assert (b["name"] is None) == (b["source"] is None) == (not b["derived"])
        assert all(d["kind"] in ("dgrad", "wgrad", "rowdot") and f"tensor {d['grad']} " in b["source"] for d in b["derived"])
        if b["explain"] is not None:
            assert b["explain"]["name"] == b["name"]
            check_spec_object(b["explain"], path.stem + ":backward", backward=False)
        # derive_backward(...).to_json() is this key but for the backward spec's own explain.
        api = gemmspec.derive_backward(path, s["name"]).to_json()
        assert api == {k: v for k, v in b.items() if k != "explain"}
        exe = gemmspec.build(path, s["name"])
        assert (exe.decode is None) == ("run_time_choice" not in s)


# ---- the emitted header, the manifest and the Python call agree ---------------------
@pytest.mark.parametrize("stem", ["moe_fp8_forward", "moe_ffn_fp8_train", "lora_moe_scaled", "split_nest"])
def test_header_struct_is_the_python_arguments_then_the_run_time_dims(stem, tmp_path):
    path = EXAMPLES[0].parent / f"{stem}.gspec"
    with redirect_stdout(io.StringIO()):
        assert main(["compile", str(path), "-o", str(tmp_path), "--backward"]) == 0
    for name, exe in ((stem, gemmspec.build(path)), (f"{stem}_backward", gemmspec.build_backward(path)[0])):
        header = (tmp_path / f"{name}.h").read_text()
        manifest = json.loads((tmp_path / f"{name}.manifest.json").read_text())
        struct = re.search(rf"typedef struct gemmspec_{name}_args {{\n(.*?)\n}}", header, re.S).group(1)
        fields = [re.match(r"\s*(.+?)\s*(\w+);", line).groups() for line in struct.splitlines()]
        args = manifest["arguments"]
        assert [n for _, n in fields] == exe.argument_names() + manifest["runtime_dims"]
        assert [a["name"] for a in args] == exe.argument_names()
        assert [c for c, _ in fields] == [a["ctype"] for a in args] + ["long long"] * len(manifest["runtime_dims"])
        written = {a["name"] for a in args if not a["ctype"].startswith("const")}
        assert written == {a["name"] for a in args if a["role"] == "output"} | {
            a["name"] for a in args if a["role"] == "scale" and a["scale_of"] in written}
        checks = manifest.get("offsets_check", {}).get("checks", [])
        listed = re.findall(r"^//   \[(\d+)\] (.*)$", header, re.M)
        assert listed == [(str(i), c["message"]) for i, c in enumerate(checks)]
        if checks:
            assert f"enum {{ gemmspec_{name}_check_flags = {len(checks)} }};" in header
        rtc = manifest.get("run_time_choice")
        assert (f"gemmspec_{name}_decode_max_rows = {rtc['max_rows']} }}" in header) if rtc else (
            "decode_max_rows" not in header)
        for a in args:
            if "pad_rows" in a:
                assert f"{a['name']};  // " in header and f"+ {a['pad_rows']['rows']} rows" in header


def test_backward_api_and_refusals():
    bw = gemmspec.derive_backward(EXAMPLES[0].parent / "moe_masked_decode.gspec")
    assert bw.source == "" and not bw.statements and bw.skipped and all(s.reason for s in bw.skipped)
    assert bw.to_json()["name"] is None and bw.to_json()["source"] is None
    with pytest.raises(GemmspecError, match="no backward statement derived .*masked"):
        gemmspec.build_backward(EXAMPLES[0].parent / "moe_masked_decode.gspec")
    exe = gemmspec.build(EXAMPLES[0].parent / "moe_fp8_forward.gspec")
    assert gemmspec.derive_backward(exe).to_json() == gemmspec.derive_backward(exe.spec).to_json()
    built, bw = gemmspec.build_backward(exe)
    assert built.spec.name == bw.spec_name and [d.kind for d in bw.statements] == ["dgrad", "wgrad"]


def test_compile_writes_nothing_when_any_spec_of_the_file_fails(tmp_path, capsys):
    good = "gemm a_ok {\n  dim T, N = 16, K = 64\n  tensor x : bf16 [T, K]\n  tensor w : bf16 [N, K]\n  tensor y : bf16 [T, N]\n  y[t, n] = sum[k] x[t, k] * w[n, k]\n}\n"
    masked = (EXAMPLES[0].parent / "moe_masked_decode.gspec").read_text()
    for text, argv, message in ((good + good.replace("a_ok", "b_bad").replace("* w[", "* v["), [], "unknown tensor 'v'"),
                                (good + masked, ["--backward"], "moe_masked_decode: no backward derived")):
        (tmp_path / "f.gspec").write_text(text)
        assert main(["compile", str(tmp_path / "f.gspec"), "-o", str(tmp_path / "out"), *argv]) == 1
        assert message in capsys.readouterr().err and not (tmp_path / "out").exists()


# ---- gemmspec.torch.function's gradients against our own float64 ---------------------
def quant(v, block, fmax=448.0):
    """language.md section 7 in float32: the dequantized values (float64) of `v` quantized
    to e4m3 per block; edge blocks short."""
    v, out = np.asarray(v, F32), np.zeros(np.shape(v))
    for idx in np.ndindex(*(-(-n // b) for n, b in zip(v.shape, block))):
        at = tuple(slice(i * b, (i + 1) * b) for i, b in zip(idx, block))
        s = F32(np.nanmax(np.abs(v[at]), initial=0)) / F32(fmax)
        s = s if s > 0 else F32(1)
        out[at] = np.clip(v[at] / s, -fmax, fmax).astype(E4).astype(np.float64) * np.float64(s)
    return out


def bf(a):
    return np.asarray(a, np.float64).astype(BF).astype(np.float64)


def fn_of(spec):
    pytest.importorskip("torch")
    import gemmspec.torch as gt
    from gemmspec.torch_reference import register_reference

    fn = gt.function(spec)
    register_reference(fn.forward_op, fn.backward_op)
    return fn


def rand(torch, seed, *shapes, dtype=None):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=dtype or torch.float64) for s in shapes]


RAGGED = "gemm {name} {{\n  dim T, N = 136, K = 200\n  group expert[E = 4] = ragged(T, offsets = offs{cap})\n  tensor x : {x}\n  tensor w : {w}\n  tensor y : bf16 [T, N]\n  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]\n}}"
LENS = [0, 3, 130, 0]  # empty experts first and last; one longer than a 128-row block


@pytest.mark.parametrize("fp8, dtype", [(False, "float64"), (True, "float32"), (True, "bfloat16")])
def test_ragged_gradients_are_the_documented_recipe_exactly(fp8, dtype):
    types = ("e4m3 [T, K] scale f32 [1, 128]", "e4m3 [E, N, K] scale f32 [1, 128, 128]") if fp8 else (
        "bf16 [T, K]", "bf16 [E, N, K]")
    fn = fn_of(RAGGED.format(name=f"ga_{int(fp8)}", cap="", x=types[0], w=types[1]))
    import torch
    off = np.concatenate([[0], np.cumsum(LENS)])
    x, w, dy = rand(torch, 1, (off[-1], 200), (4, 136, 200), (off[-1], 136), dtype=getattr(torch, dtype))
    x, w = x.requires_grad_(), (w / 8).detach().requires_grad_()
    y = fn(x=x, w=w, offs=torch.tensor(off, dtype=torch.int32))
    y.backward(dy.bfloat16())
    assert x.grad.dtype == w.grad.dtype == getattr(torch, dtype)
    q = (lambda v, b: quant(v, b)) if fp8 else (lambda v, b: bf(v))
    xd, wd = q(x.detach().float(), (1, 128)), q(w.detach().float(), (1, 128, 128))
    dyd = q(dy.bfloat16().float(), (1, 128))
    ry, rdx, rdw = np.zeros((off[-1], 136)), np.zeros((off[-1], 200)), np.zeros((4, 136, 200))
    for e in range(4):
        a, b = off[e], off[e + 1]
        ry[a:b], rdx[a:b] = xd[a:b] @ wd[e].T, dyd[a:b] @ wd[e]
        if fp8 and b > a:  # requantize per expert into [128, 1] blocks
            rdw[e] = quant(dyd[a:b], (128, 1)).T @ quant(xd[a:b], (128, 1))
        else:
            rdw[e] = dyd[a:b].T @ xd[a:b]
    assert np.array_equal(y.detach().double().numpy(), bf(ry))
    assert np.array_equal(x.grad.double().numpy(), bf(rdx))
    want = torch.from_numpy(rdw.astype(F32)).to(w.dtype).double().numpy()  # f32, then the dtype passed in
    np.testing.assert_allclose(w.grad.double().numpy(), want, rtol=2e-7, atol=1e-6)
    assert (w.grad[0] == 0).all() and (w.grad[3] == 0).all()  # experts with no tokens


def test_capacity_rows_get_zero_gradient_and_given_outputs_keep_their_bytes():
    spec = RAGGED.format(name="gcap", cap=", capacity", x="e4m3 [T, K] scale f32 [1, 128]", w="e4m3 [E, N, K] scale f32 [1, 128, 128]")
    fn = fn_of(spec)
    import torch
    x, w, dy = rand(torch, 2, (9, 200), (4, 136, 200), (9, 136), dtype=torch.float32)
    x, w, offs = x.requires_grad_(), w.requires_grad_(), torch.tensor([0, 2, 2, 5, 6], dtype=torch.int32)
    y0 = torch.full((9, 136), float("nan"), dtype=torch.bfloat16)
    y = fn(x=x, w=w, offs=offs, y=y0)
    assert y is y0 and y.requires_grad and not y[:6].isnan().any() and y[6:].isnan().all()
    y.backward(dy.bfloat16())
    assert (x.grad[6:] == 0).all() and (x.grad[:6] != 0).any() and (w.grad[1] == 0).all()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    fn(x=x, w=w, offs=offs).backward(dy.bfloat16())  # a fresh output: the same gradients
    assert torch.equal(gx, x.grad) and torch.equal(gw, w.grad)
    weighted = fn_of(spec.replace("tensor y", "tensor rw : f32 [T]\n  tensor y").replace("= sum[k]", "= rw[t] * sum[k]").replace("gcap", "gcap_rw"))
    with pytest.raises(ArgumentError, match="'rw' requires grad, but its gradient is not derived .*capacity"):
        weighted(x=x, w=w, rw=torch.ones(9, requires_grad=True), offs=offs)


ACC = "gemm gacc {\n  dim T, N = 24, R = 16\n  group expert[E = 3] = ragged(T, offsets = offs)\n  tensor h : bf16 [T, R]\n  tensor wb : bf16 [E, N, R]\n  tensor scaling : f32 [E]\n  tensor route_w : f32 [T]\n  tensor bias : bf16 [E, N]\n  tensor y : bf16 [T, N]\n  y[t, n] += scaling[expert(t)] * route_w[t] * sum[r] h[t, r] * wb[expert(t), n, r] + bias[expert(t), n]\n}"


def test_accumulated_scaled_weighted_biased_statement():
    """`+=` derives as `=`; the scalar multiplies the DGRAD; dh = route_w * bf16(dh_pre),
    droute_w = rowdot(dh_pre, h) in f32; the bias's and scalar's gradients are refused."""
    fn = fn_of(ACC)
    import torch
    o = [0, 2, 2, 7]
    h, wb, bias, dy = rand(torch, 3, (7, 16), (3, 24, 16), (3, 24), (7, 24))
    sc, rw = torch.tensor([0.5, 2.0, -1.5]), torch.rand(7, generator=torch.Generator().manual_seed(4))
    h, rw = h.requires_grad_(), rw.requires_grad_()
    args = dict(h=h, wb=wb, scaling=sc, route_w=rw, bias=bias, offs=torch.tensor(o, dtype=torch.int32))
    y0 = torch.ones(7, 24, dtype=torch.bfloat16)
    y = fn(**args, y=y0)
    y.backward(dy.bfloat16())
    hb, wbb, bb, dyb, r, s = bf(h.detach()), bf(wb), bf(bias), bf(dy), rw.detach().double().numpy(), sc.double().numpy()
    ry, rdh, rdr = np.ones((7, 24)), np.zeros((7, 16)), np.zeros(7)
    for e in range(3):
        a, b = o[e], o[e + 1]
        ry[a:b] += s[e] * r[a:b, None] * (hb[a:b] @ wbb[e].T) + bb[e]
        pre = bf(s[e] * (dyb[a:b] @ wbb[e]))
        rdh[a:b], rdr[a:b] = bf((r[a:b, None].astype(F32) * pre.astype(F32)).astype(F32)), (pre * hb[a:b]).sum(1)
    assert np.array_equal(y.detach().double().numpy(), bf(ry))
    assert np.array_equal(h.grad.numpy(), rdh) and rw.grad.dtype == torch.float32
    np.testing.assert_allclose(rw.grad.double().numpy(), rdr, rtol=1e-6, atol=1e-5)
    for name in ("bias", "scaling", "wb"):
        with pytest.raises(ArgumentError, match=f"'{name}' requires grad, but its gradient is not derived"):
            fn(**{**args, name: args[name].detach().clone().requires_grad_()})


CHAIN = "gemm gchain {\n  dim T\n  dim K = 40, R = 8, N = 24\n  group lora[L = 3] = ragged(T, offsets = lo)\n  tensor x  : bf16 [T, K]\n  tensor w  : bf16 [N, K]\n  tensor wa : bf16 [L, R, K]\n  tensor wb : bf16 [L, N, R]\n  tensor h  : bf16 [T, R]\n  tensor y  : bf16 [T, N]\n  y[t, n]  = sum[k] x[t, k] * w[n, k]\n  h[t, r]  = sum[k] x[t, k] * wa[lora(t), r, k]\n  y[t, n] += sum[r] h[t, r] * wb[lora(t), n, r]\n}"


def test_base_plus_lora_chain_gradients():
    """language.md, Chains: dh from the expand's DGRAD, dx = bf16(dy w) then += dh wa."""
    fn = fn_of(CHAIN)
    import torch
    o = [0, 4, 4, 9]
    x, w, wa, wb, dy = (v.requires_grad_() for v in rand(torch, 5, (9, 40), (24, 40), (3, 8, 40), (3, 24, 8), (9, 24)))
    y, h = fn(x=x, w=w, wa=wa, wb=wb, lo=torch.tensor(o, dtype=torch.int32))
    assert y.requires_grad and not h.requires_grad  # h is read by the expand: its gradient is internal
    y.backward(dy.detach())
    xb, wbf, wab, wbb, dyb = (bf(v.detach()) for v in (x, w, wa, wb, dy))
    hh, dh, dx, ref = np.zeros((9, 8)), np.zeros((9, 8)), bf(dyb @ wbf), {"w": dyb.T @ xb}
    ref["wa"], ref["wb"] = np.zeros((3, 8, 40)), np.zeros((3, 24, 8))
    for lo in range(3):
        a, b = o[lo], o[lo + 1]
        hh[a:b] = bf(xb[a:b] @ wab[lo].T)
        dh[a:b] = bf(dyb[a:b] @ wbb[lo])
        ref["wb"][lo] = dyb[a:b].T @ hh[a:b]
        dx[a:b] += dh[a:b] @ wab[lo]
        ref["wa"][lo] = dh[a:b].T @ xb[a:b]
    assert np.array_equal(h.detach().double().numpy(), hh) and np.array_equal(x.grad.numpy(), bf(dx))
    for name, t in (("w", w), ("wa", wa), ("wb", wb)):
        assert np.array_equal(t.grad.numpy(), ref[name].astype(F32)), name


def test_nested_fp8_weight_is_transposed_by_the_function_and_its_wgrad_refused():
    fn = fn_of("gemm gnest {\n  dim T\n  dim K = 256, R = 136\n  group lora[L = 2]   = ragged(T, offsets = lo)\n  group expert[E = 2] = ragged(T within lora, offsets = eo)\n  tensor x  : e4m3 [T, K] scale f32 [1, 128]\n  tensor wa : e4m3 [L, E, R, K] scale f32 [1, 1, 128, 128]\n  tensor y  : bf16 [T, R]\n  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]\n}")
    import torch
    assert fn.backward.transposed == (("wa", "wa_t"),)
    eo = [[0, 1, 4], [4, 4, 9]]
    x, wa, dy = rand(torch, 7, (9, 256), (2, 2, 136, 256), (9, 136), dtype=torch.float32)
    args = dict(x=x.requires_grad_(), lo=torch.tensor([0, 4, 9], dtype=torch.int32), eo=torch.tensor(eo, dtype=torch.int32))
    with pytest.raises(ArgumentError, match="'wa' requires grad, but its gradient is not derived .*nested"):
        fn(**args, wa=wa.clone().requires_grad_())
    fn(**args, wa=wa).backward(dy.bfloat16())
    wd, dyd, dx = quant(wa, (1, 1, 128, 128)), quant(dy.bfloat16().float(), (1, 128)), np.zeros((9, 256))
    for lo in range(2):
        for e in range(2):
            dx[eo[lo][e]:eo[lo][e + 1]] = dyd[eo[lo][e]:eo[lo][e + 1]] @ wd[lo, e]
    assert np.array_equal(x.grad.double().numpy(), bf(dx))


def test_expert_ffn_gradients_through_gather_swiglu_copy_and_row_weight():
    """examples/moe_ffn_fp8_train.gspec, made small: every gradient by the recipe of
    language.md's derived backward (dh_pre, rowscale, rowdot, swiglu_grad, scatter_add,
    requantize(dy, rows = dst, weight = route_w), the forward's copy h_t)."""
    text = (EXAMPLES[0].parent / "moe_ffn_fp8_train.gspec").read_text()
    fn = fn_of(text.replace("H = 7168, N = 4096, F = 2048", "H = 256, N = 256, F = 128").replace("E = 8", "E = 3")
               .replace("gemm moe_ffn_fp8_train", "gemm gffn"))
    import torch
    lens, s_rows = [0, 5, 3], 6
    off, ex = np.concatenate([[0], np.cumsum(lens)]), np.repeat(np.arange(3), lens)
    src, dst = np.array([1, 1, 0, 5, 3, 2, 1, 4]), np.array([3, 0, 7, 1, 6, 2, 5, 4])
    x, wu, wd, dy = rand(torch, 8, (s_rows, 256), (3, 256, 256), (3, 256, 128), (8, 256), dtype=torch.float32)
    x, wu, wd = x.requires_grad_(), (wu / 16).detach().requires_grad_(), (wd / 16).detach().requires_grad_()
    rw = torch.rand(8, generator=torch.Generator().manual_seed(9)).requires_grad_()
    i32 = lambda a: torch.tensor(a, dtype=torch.int32)  # noqa: E731
    outs = fn(src=i32(src), dst=i32(dst), x=x, w_up=wu, w_down=wd, route_w=rw, expert_offsets=i32(off))
    assert fn.forward_op.outputs == ("h", "h_scale", "h_t", "h_t_scale", "y")
    assert [o.requires_grad for o in outs] == [False] * 4 + [True] and outs[2].shape == (8 + 15 * 3, 128)
    outs[-1].backward(dy.bfloat16())
    xd, wud, wdd, dyd = quant(x.detach(), (1, 128)), quant(wu.detach(), (1, 128, 128)), quant(wd.detach(), (1, 128, 128)), quant(dy.bfloat16().float(), (1, 128))
    r = rw.detach().numpy()
    gu = np.stack([wud[ex[t]] @ xd[src[t]] for t in range(8)])
    hb = bf(gu[:, 0::2] / (1 + np.exp(-gu[:, 0::2])) * gu[:, 1::2])
    hd = quant(hb, (1, 128))
    pre = bf(np.stack([dyd[dst[t]] @ wdd[ex[t]] for t in range(8)]))
    dh = bf(r[:, None] * pre.astype(F32))
    g, u = bf(gu)[:, 0::2], bf(gu)[:, 1::2]
    sg, dgu = 1 / (1 + np.exp(-g)), np.zeros((8, 256))
    dgu[:, 0::2], dgu[:, 1::2] = dh * u * sg * (1 + g * (1 - sg)), dh * g * sg
    dgu = bf(dgu)
    dxr, dx = bf(np.stack([quant(dgu, (1, 128))[t] @ wud[ex[t]] for t in range(8)])), np.zeros((s_rows, 256), F32)
    for t in range(8):
        dx[src[t]] += dxr[t].astype(F32)
    dwd, dwu = np.zeros((3, 256, 128)), np.zeros((3, 256, 256))
    for e in range(1, 3):
        a, b = off[e], off[e + 1]
        dwd[e] = quant((r[a:b, None] * dyd[dst[a:b]]).astype(F32), (128, 1)).T @ quant(hb[a:b], (128, 1))
        dwu[e] = quant(dgu[a:b], (128, 1)).T @ quant(xd[src[a:b]], (128, 1))
    assert np.array_equal(x.grad.double().numpy(), bf(dx))
    np.testing.assert_allclose(rw.grad.double().numpy(), (pre * hd).sum(1), rtol=1e-6, atol=1e-5)
    for got, want in ((wd.grad, dwd), (wu.grad, dwu)):
        np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-6, atol=1e-5)
    assert (wd.grad[0] == 0).all() and (wu.grad[0] == 0).all()


MOE = "gemm v_moe {\n  dim T, N = 24, K = 40\n  group expert[E = 3] = ragged(T, offsets = offs)\n  tensor x : bf16 [T, K]\n  tensor w : bf16 [E, N, K]\n  tensor y : bf16 [T, N]\n  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]\n}"


def test_bad_offsets_raise_naming_them_and_leave_outputs_untouched():
    torch = pytest.importorskip("torch")
    import gemmspec.torch as gt
    from gemmspec.torch_reference import register_reference

    op = gt.op(MOE)
    register_reference(op)
    x, w = torch.randn(6, 40).bfloat16(), torch.randn(3, 24, 40).bfloat16()
    for offs, message in (([0, 4, 2, 6], "decrease: entry 1 is 4, entry 2 is 2"), ([1, 2, 3, 6], "start at 0 and end at T = 6"),
                          ([0, 2, 3, 7], "got 0..7")):
        y = torch.full((6, 24), 7.0, dtype=torch.bfloat16)
        with pytest.raises(ArgumentError, match=f"'offs' of 'expert' .*{message}"):
            op(x=x, w=w, offs=torch.tensor(offs, dtype=torch.int32), y=y)
        assert (y == 7).all()
    ffn = gt.op(EXAMPLES[0].parent / "moe_ffn_fp8.gspec")
    with pytest.raises(ArgumentError, match=r"pass every output \(h, h_scale, y\) or none"):
        ffn(**{n: torch.zeros(1) for n in ffn.inputs}, y=torch.zeros(1))
