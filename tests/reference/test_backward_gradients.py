"""Every derived backward against the true gradients, element by element.

For each spec (the examples at small sizes, and small specs of the forms the derivation
covers: nested and capacity groups, split rows, gathered and scattered rows, SwiGLU,
router weights, bias, per-leaf scalars, `+=`, chains, transposed storage), with ragged
groups holding empty, one-row and odd-length segments:

- the forward runs on the direct reference executor with all rounding switched off
  (16-bit outputs kept in float64, FP8 quantize / requantize / outputs / swiglu_grad
  keeping the exact values with unit scales), and a plain torch re-implementation of the
  statements as written must agree with it element by element;
- torch.autograd (float64) gives the gradients of L = sum over the outputs whose
  gradient the backward takes of <y, g>, g random;
- the derived backward spec runs on the same exact reference, with g as its output
  gradients, and each gradient it derives must equal autograd's in every element
  (rows of empty segments, rows past a capacity group's end, rows no gather reads).

The forward is polynomial and the reference exact, so the only differences are float64
rounding of sums in another order."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from gemmspec.pipeline import lower_backward, lower_file  # noqa: E402
from gemmspec.reference import data as data_module  # noqa: E402
from gemmspec.reference import direct  # noqa: E402
from gemmspec.reference.data import (  # noqa: E402
    TensorData,
    dim_size,
    random_inputs,
    random_runtime,
    real_values,
    scale_grid_shape,
)
from gemmspec.spec import INDEX_TYPE  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


# ---- the reference without rounding ---------------------------------------------------------


def _keep(values, dtype):
    return np.asarray(values, dtype=np.float64)


def _exact_quantize_values(spec, rt, real, target):
    return np.asarray(real, dtype=np.float64), np.ones(scale_grid_shape(spec, rt, target), np.float32)


def _exact_requantize_rows_values(spec, rt, source, data, target, index, weight):
    real = real_values(spec, rt, source, data)
    rows = dim_size(spec, rt, target.dims[0])
    picked = np.arange(rows) if index is None else np.asarray(index).astype(np.int64)
    inside = (picked >= 0) & (picked < real.shape[0])
    out = np.where(inside[:, None], real[np.where(inside, picked, 0)], 0.0)
    if weight is not None:
        out = out * np.asarray(weight, dtype=np.float64)[:, None]
    return out, np.ones(scale_grid_shape(spec, rt, target), np.float32)


@pytest.fixture
def exact(monkeypatch):
    """No rounding anywhere: 16-bit values, FP8 outputs, quantize, requantize and
    swiglu_grad keep their float64 values (FP8 ones with unit scales)."""
    for module in (direct, data_module):
        monkeypatch.setattr(module, "quantize", _keep)
        monkeypatch.setattr(module, "quantize_values", _exact_quantize_values)
        monkeypatch.setattr(module, "requantize_rows_values", _exact_requantize_rows_values)


# ---- running a forward and its backward -------------------------------------------------------


def _zeros(spec, rt, name):
    return np.zeros(tuple(dim_size(spec, rt, d) for d in spec.tensor(name).dims))


def _group_ids(offsets: np.ndarray, rows: int) -> np.ndarray:
    """Row -> segment index of a ragged group (flat over its outer groups), -1 outside."""
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, offsets.shape[-1])
    gid = np.full(rows, -1, dtype=np.int64)
    for r in off:
        for i in range(len(r) - 1):
            gid[r[i] : r[i + 1]] = i
    return gid


def _mismatches(got: np.ndarray, want: np.ndarray, scale: float) -> list[tuple]:
    bad = ~np.isclose(got, want, rtol=1e-10, atol=1e-10 * scale)
    return [(tuple(int(i) for i in ix), float(got[ix]), float(want[ix])) for ix in zip(*np.nonzero(bad))]


def _compare(what: str, got: np.ndarray, want: np.ndarray) -> list[str]:
    if got.shape != want.shape:
        return [f"{what}: shape {got.shape}, want {want.shape}"]
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    bad = _mismatches(got, want, scale)
    if not bad:
        return []
    return [f"{what}: {len(bad)} of {got.size} elements differ, first {bad[:4]}"]


ForwardFn = Callable[[dict, dict, dict], dict]


def run_case(
    text: str,
    forward: ForwardFn,
    lengths: dict[str, list[int]],
    dims: dict[str, int] | None = None,
    seed: int = 0,
    edit: Callable[[str], str] | None = None,
    poison: bool = False,
):
    """Forward and derived backward of `text` on the exact reference, the gradients
    autograd takes through `forward` (float64 torch: real input values by name, index and
    offsets tensors as numpy arrays, the run-time dims; returns the outputs by name, and
    any intermediate whose gradient the backward derives). `edit` changes the backward's
    text before it runs (to see that a wrong backward fails). `poison` starts the
    backward's `=` outputs at NaN (what a fresh buffer may hold): an element no statement
    writes keeps it, and is right only where the true gradient is 0; a row pass's target
    is written whole and must be right everywhere. Returns (mismatches, the Backward,
    which inputs got a gradient)."""
    (fwd,) = lower_file(text)
    spec = fwd.spec
    bw, low = lower_backward(spec)
    assert low is not None, bw.text()
    if edit is not None:
        (low,) = lower_file(edit(bw.source))
    bspec = low.spec
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths=lengths, dims=dims)
    data = {n: d for n, d in random_inputs(spec, rt, rng).items() if n not in rt.tensors}
    init = {n: _zeros(spec, rt, n) for n in spec.written}
    old = {}
    for n in list(data):
        if n in init:  # an output a statement adds into: its old contents, an input too
            init[n] = data[n].values.copy()
            old[n] = data.pop(n)
    fwd_out = direct.run_direct(spec, rt, data, init)

    # The torch side: real values, float64, every non-index input a leaf.
    leaves = {}
    for n, d in {**data, **old}.items():
        t = spec.tensor(n)
        if t.dtype == INDEX_TYPE:
            continue
        leaves[n] = torch.tensor(real_values(spec, rt, t, d), dtype=torch.float64, requires_grad=True)
    index = {n: np.asarray(d.values).astype(np.int64) for n, d in data.items() if spec.tensor(n).dtype == INDEX_TYPE}
    index.update({k: np.asarray(v).astype(np.int64) for k, v in rt.tensors.items()})
    sizes = {d.name: dim_size(spec, rt, d.name) for d in spec.dims}
    outs = forward(dict(leaves), index, sizes)
    problems = []
    for n in spec.written:
        if n in outs and spec.tensor(n).derived is None and spec.tensor(n).row_pass is None:
            problems += _compare(f"forward {n} (torch vs reference)", outs[n].detach().numpy(), fwd_out[n])
    for v in outs.values():
        if v.requires_grad and not v.is_leaf:
            v.retain_grad()
    grads_in = {g: rng.standard_normal(fwd_out[o].shape) for o, g in bw.output_grads}
    loss = sum((outs[o] * torch.tensor(grads_in[g])).sum() for o, g in bw.output_grads)
    loss.backward()

    # The backward's inputs: output gradients, the forward's inputs, what the forward wrote.
    bdata = {}
    for t in bspec.tensors:
        if t.derived is not None or t.row_pass is not None or t.name in bspec.written or t.name in rt.tensors:
            continue
        if t.name in grads_in:
            g = grads_in[t.name]
            bdata[t.name] = TensorData(g, None if t.scale is None else np.ones(scale_grid_shape(bspec, rt, t), np.float32))
        elif t.name in data:
            bdata[t.name] = data[t.name]
        elif t.name in dict(bw.transposed).values():
            src = next(s for s, c in bw.transposed if c == t.name)
            bdata[t.name] = data[src]
        else:
            scale = None if t.scale is None else fwd_out[spec.tensor(t.name).scale.name]
            bdata[t.name] = TensorData(fwd_out[t.name], scale)
    binit = {n: _zeros(bspec, rt, n) for n in bspec.written}
    if poison:
        added = {g.out.tensor for g in bspec.gemms if g.accumulate}
        binit = {n: v if n in added else np.full_like(v, np.nan) for n, v in binit.items()}
    covered: dict[str, np.ndarray] = {}
    got = direct.run_direct(bspec, rt, bdata, binit, covered=covered)
    checked = {}
    for d in bw.statements:
        want_t = leaves.get(d.wrt, outs.get(d.wrt))
        want = np.zeros(tuple(want_t.shape)) if want_t.grad is None else want_t.grad.numpy()
        value = got[d.grad]
        if poison and d.grad in covered and bspec.tensor(d.grad).row_pass is None:
            # An element no statement writes keeps what the buffer held: right only where
            # no gradient flows (its value is then the true 0, whatever it holds).
            untouched = ~covered[d.grad]
            problems += _compare(
                f"{d.kind} {d.grad} (gradient of {d.wrt}), elements no statement writes",
                np.zeros(want.shape), np.where(untouched, want, 0.0),
            )
            value = np.where(untouched, want, value)
        problems += _compare(f"{d.kind} {d.grad} (gradient of {d.wrt})", value, want)
        checked[d.wrt] = d.grad
    return problems, bw, checked


def assert_gradients(text, forward, lengths, dims=None, seed=0, expect=None, poison=False):
    problems, bw, checked = run_case(text, forward, lengths, dims, seed, poison=poison)
    assert not problems, "\n".join(problems)
    if expect is not None:
        assert set(checked) == set(expect), (set(checked), bw.text())
    return bw


def example(name: str, subs: list[tuple[str, str]]) -> str:
    """An example spec with its fixed sizes made small."""
    text = (EXAMPLES / f"{name}.gspec").read_text()
    for a, b in subs:
        assert a in text, a
        text = text.replace(a, b)
    return text


# ---- torch re-implementations -------------------------------------------------------------------


def _t(a):
    return torch.as_tensor(a)


def _rows_of(gid):
    """Rows inside a segment (a float mask) and their segment index (clamped at 0)."""
    return _t((gid >= 0).astype(np.float64)), _t(np.maximum(gid, 0))


def silu(x):
    return x * torch.sigmoid(x)


def grouped(x, w, gid):
    """y[t, n] = sum[k] x[t, k] * w[gid[t], n, k], zero rows outside every segment."""
    mask, e = _rows_of(gid)
    return torch.einsum("tk,tnk->tn", x, w[e]) * mask[:, None]


def linear_fp8_training_fwd(v, ix, d):
    return {"y": v["x"] @ v["w"].T}


def moe_fwd(v, ix, d):  # moe_fp8_forward, moe_bf16_forward
    return {"y": grouped(v["x"], v["w"], _group_ids(ix["expert_offsets"], d["T"]))}


def lora_moe_nested_fwd(v, ix, d):
    lora = _group_ids(ix["lora_offsets"], d["T"])
    expert = _group_ids(ix["expert_offsets"], d["T"])
    mask, l_ = _rows_of(lora)
    _, e = _rows_of(expert)
    return {"y": torch.einsum("tk,trk->tr", v["x"], v["wa"][l_, e]) * mask[:, None]}


def lora_moe_scaled_fwd(v, ix, d):
    lora = _group_ids(ix["lora_offsets"], d["T"])
    expert = _group_ids(ix["expert_offsets"], d["T"])
    mask, l_ = _rows_of(lora)
    _, e = _rows_of(expert)
    prod = torch.einsum("tr,tnr->tn", v["h"], v["wb"][l_, e])
    add = v["scaling"][l_][:, None] * v["route_w"][:, None] * prod + v["bias"][e]
    return {"y": v["y"] + add * mask[:, None]}


def lora_qkv_one_spec_fwd(v, ix, d):
    lora = _group_ids(ix["lora_offsets"], d["T"])
    mask, l_ = _rows_of(lora)
    return {"a": torch.einsum("tk,trk->tr", v["x"], v["wa"][l_]) * mask[:, None]}


def slices_of(sizes):
    return np.repeat(np.arange(len(sizes)), sizes)


def lora_qkv_slices_fwd(v, ix, d):
    lora = _group_ids(ix["lora_offsets"], d["T"])
    mask, l_ = _rows_of(lora)
    s = _t(slices_of([8, 5, 3]))
    hs = v["h"][:, s, :]  # [T, N, R]: h[t, slice(n), r]
    return {"y": torch.einsum("tnr,tnr->tn", hs, v["wb"][l_]) * mask[:, None]}


def swiglu_rows(x, w, gid):
    gu = grouped(x, w, gid)
    return silu(gu[:, 0::2]) * gu[:, 1::2]


def moe_swiglu_fp8_fwd(v, ix, d):
    return {"h": swiglu_rows(v["x"], v["w"], _group_ids(ix["expert_offsets"], d["T"]))}


def moe_ffn_fwd(v, ix, d):  # moe_ffn_fp8, moe_ffn_fp8_train
    gid = _group_ids(ix["expert_offsets"], d["T"])
    x_rows = v["x"][_t(ix["src"])]
    h = swiglu_rows(x_rows, v["w_up"], gid)
    rows = v["route_w"][:, None] * grouped(h, v["w_down"], gid)
    y = torch.zeros(d["T"], d["H"], dtype=torch.float64).index_add(0, _t(ix["dst"]), rows)
    return {"h": h, "y": y, "h_t": h}


def moe_ffn_decode_fwd(v, ix, d):
    gid = _group_ids(ix["expert_offsets"], d["T"])
    x_rows = v["x"][_t(ix["src"])]
    h = silu(grouped(x_rows, v["wg"], gid)) * grouped(x_rows, v["wu"], gid)
    y_rows = v["route_w"][:, None] * grouped(h, v["w_down"], gid)
    return {"h": h, "y_rows": y_rows}


def gather_scatter_fwd(v, ix, d):
    gid = _group_ids(ix["expert_offsets"], d["T"])
    rows = grouped(v["x"][_t(ix["idx"])], v["w"], gid)
    return {"y": torch.zeros(d["S"], d["N"], dtype=torch.float64).index_add(0, _t(ix["src"]), rows)}


def split_nest_fwd(v, ix, d):
    expert = _group_ids(ix["expert_offsets"], d["T"])
    lora = _group_ids(ix["lora_offsets"], d["T"])
    return {"y": grouped(v["xq"], v["w"], expert), "h": grouped(v["x"], v["wa"], lora)}


# ---- the examples ----------------------------------------------------------------------------------

E8 = {"expert": [0, 1, 3, 0, 5, 2, 7, 1]}  # 19 rows: empty, one-row and odd segments
FP8_SMALL = [("dim N = 4096, K = 7168", "dim N = 256, K = 256")]
FFN_SMALL = [("dim H = 7168, N = 4096, F = 2048", "dim H = 256, N = 512, F = 256")]

EXAMPLE_CASES = {
    "linear_fp8_training": (FP8_SMALL, linear_fp8_training_fwd, {}, {"T": 7}, {"x", "w"}),
    "moe_fp8_forward": (FP8_SMALL, moe_fwd, E8, None, {"x", "w"}),
    "moe_bf16_forward": ([("dim N = 4096, K = 7168", "dim N = 8, K = 12")], moe_fwd, E8, None, {"x", "w"}),
    "moe_fp8_gather_scatter": (FP8_SMALL, gather_scatter_fwd, E8, {"S": 23}, {"x", "w"}),
    "moe_swiglu_fp8": ([("dim N = 4096, F = 2048, K = 7168", "dim N = 256, F = 128, K = 256")], moe_swiglu_fp8_fwd, E8, None, {"x", "w"}),
    "moe_ffn_fp8": (FFN_SMALL, moe_ffn_fwd, E8, {"S": 23}, {"x", "w_up", "w_down", "route_w", "h"}),
    "moe_ffn_fp8_train": (FFN_SMALL, moe_ffn_fwd, E8, {"S": 23}, {"x", "w_up", "w_down", "route_w", "h"}),
    "moe_ffn_fp8_decode": (
        [("dim H = 7168, F = 2048", "dim H = 256, F = 256"), ("expert[E = 256]", "expert[E = 8]")],
        moe_ffn_decode_fwd, E8, {"S": 23}, {"h", "w_down", "route_w"},
    ),
    "lora_moe_nested": (
        [("dim K = 4096, R = 16", "dim K = 12, R = 4"), ("expert[E = 8]", "expert[E = 3]")],
        lora_moe_nested_fwd, {"lora": [5, 0, 1, 7], "expert": [2, 0, 3, 0, 0, 0, 1, 0, 0, 3, 3, 1]}, None, {"x"},
    ),
    "lora_moe_scaled": (
        [("dim N = 4096, R = 16", "dim N = 8, R = 4"), ("expert[E = 8]", "expert[E = 3]")],
        lora_moe_scaled_fwd, {"lora": [5, 0, 1, 7], "expert": [2, 0, 3, 0, 0, 0, 1, 0, 0, 3, 3, 1]}, None, {"h", "route_w"},
    ),
    "lora_qkv_one_spec": (
        [("dim K = 4096, R = 16, R3 = 48, N = 6144", "dim K = 12, R = 4, R3 = 12, N = 16"),
         ("sizes = [4096, 1024, 1024]", "sizes = [8, 5, 3]")],
        lora_qkv_one_spec_fwd, {"lora": [0, 1, 5, 3]}, None, {"x", "wa"},
    ),
    "lora_qkv_slices": (
        [("dim R = 16, N = 6144", "dim R = 4, N = 16"), ("sizes = [4096, 1024, 1024]", "sizes = [8, 5, 3]")],
        lora_qkv_slices_fwd, {"lora": [0, 1, 5, 3]}, None, {"h", "wb"},
    ),
    "split_nest": (
        [("dim N = 4096, K = 4096, R = 16", "dim N = 256, K = 256, R = 4")],
        split_nest_fwd, {**E8, "lora": [7, 0, 11, 1]}, None, {"xq", "w", "x", "wa"},
    ),
}


@pytest.mark.parametrize("name", sorted(EXAMPLE_CASES))
def test_example_gradients(exact, name):
    subs, forward, lengths, dims, expect = EXAMPLE_CASES[name]
    assert_gradients(example(name, subs), forward, lengths, dims, expect=expect)
    assert_gradients(example(name, subs), forward, lengths, dims, seed=1, expect=expect, poison=True)


@pytest.mark.parametrize(
    "name",
    ["moe_bf16_in_fp8", "moe_fp8_rowwise", "moe_fp8_tensorwise", "moe_fp8_wgrad", "moe_masked_decode", "moe_swiglu_fp8_separate"],
)
def test_examples_not_derived(name):
    """The examples whose backward is refused derive nothing (each with its reason)."""
    (fwd,) = lower_file((EXAMPLES / f"{name}.gspec").read_text())
    bw, low = lower_backward(fwd.spec)
    assert not bw.statements and low is None
    assert bw.skipped and all(s.reason for s in bw.skipped)


# ---- small specs of the other forms ---------------------------------------------------------------


def nested_inner_fwd(v, ix, d):
    return {"y": grouped(v["x"], v["w"], _group_ids(ix["expert_offsets"], d["T"]))}


def scatter_scaled_fwd(v, ix, d):
    gid = _group_ids(ix["expert_offsets"], d["T"])
    mask, e = _rows_of(gid)
    rows = (v["scaling"][e][:, None] * grouped(v["x"], v["w"], gid) + v["bias"][e]) * mask[:, None]
    return {"y": torch.zeros(d["S"], d["N"], dtype=torch.float64).index_add(0, _t(ix["dst"]), rows)}


def transposed_fwd(v, ix, d):
    return {"y": grouped(v["x"].T, v["w"].transpose(1, 2), _group_ids(ix["expert_offsets"], d["T"])).T}


def a_and_b_fwd(v, ix, d):
    return {"y": v["x"] @ v["w"].T, "z": v["u"] @ v["x"].T}


def split_rows_fwd(v, ix, d):
    return {"y": grouped(v["x"], v["w"], slices_of([0, 1, 3, 5]))}


def alpha_flat_fwd(v, ix, d):
    gid = _group_ids(ix["expert_offsets"], d["T"])
    mask, e = _rows_of(gid)
    return {"y": v["scaling"][e][:, None] * (v["x"] @ v["w"].T) * mask[:, None]}


def fp8_scaled_fwd(v, ix, d):
    gid = _group_ids(ix["expert_offsets"], d["T"])
    _, e = _rows_of(gid)
    return {"y": v["y"] + v["scaling"][e][:, None] * v["route_w"][:, None] * grouped(v["x"], v["w"], gid)}


def lora_capacity_fwd(v, ix, d):
    gid = _group_ids(ix["lora_offsets"], d["T"])
    _, l_ = _rows_of(gid)
    h = grouped(v["x"], v["wa"], gid)
    return {"y": v["x"] @ v["w"].T + v["scaling"][l_][:, None] * grouped(h, v["wb"], gid), "h": h}


def routed_fwd(v, ix, d):
    gid = _group_ids(ix["expert_offsets"], d["T"])
    return {"y": v["route_w"][:, None] * grouped(v["x"], v["w"], gid)}


E4 = {"expert": [0, 1, 5, 3]}
NESTED = {"lora": [5, 0, 8], "expert": [2, 0, 3, 0, 0, 0, 1, 0, 7]}


def _capacity(text: str, group: str = "expert") -> str:
    old = f"offsets = {group}_offsets)"
    assert old in text
    return text.replace(old, f"offsets = {group}_offsets, capacity)")


MOE16 = "moe_bf16_forward", [("dim N = 4096, K = 7168", "dim N = 8, K = 12")]
SWIGLU = "moe_swiglu_fp8", [("dim N = 4096, F = 2048, K = 7168", "dim N = 256, F = 128, K = 256")]
FFN = "moe_ffn_fp8", FFN_SMALL

SPEC_CASES = {
    # B indexed by the inner group of a nest: the WGRAD sums each expert over every lora.
    "nested_inner": ("""
gemm nested_inner {
  dim T
  dim N = 8, K = 12
  group lora[L = 3] = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
""", nested_inner_fwd, NESTED, None, {"x", "w"}),
    # 16-bit scattered rows, a per-leaf scalar and a bias: the DGRAD only.
    "scatter_scaled_bias": ("""
gemm scatter_scaled_bias {
  dim T, S
  dim N = 8, K = 12
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor dst : i32 [T]
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor scaling : f32 [E]
  tensor bias : bf16 [E, N]
  tensor y : bf16 [S, N]
  y[dst[t], n] = scaling[expert(t)] * sum[k] x[t, k] * w[expert(t), n, k] + bias[expert(t), n]
}
""", scatter_scaled_fwd, E4, {"S": 11}, {"x"}),
    # Every operand stored transposed.
    "transposed": ("""
gemm transposed {
  dim T
  dim N = 8, K = 12
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [K, T]
  tensor w : bf16 [E, K, N]
  tensor y : bf16 [N, T]
  y[n, t] = sum[k] x[k, t] * w[expert(t), k, n]
}
""", transposed_fwd, E4, None, {"x", "w"}),
    # One tensor as the A of a statement and the B of another: one gradient, two parts.
    "a_and_b": ("""
gemm a_and_b {
  dim T, S
  dim N = 8, K = 12
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor u : bf16 [S, K]
  tensor y : bf16 [T, N]
  tensor z : bf16 [S, T]
  y[t, n] = sum[k] x[t, k] * w[n, k]
  z[s, t] = sum[k] u[s, k] * x[t, k]
}
""", a_and_b_fwd, {}, {"T": 7, "S": 5}, {"x", "w", "u"}),
    # Rows split at compile time, an empty and a one-row block among them.
    "split_rows": ("""
gemm split_rows {
  dim T = 9
  dim N = 8, K = 12
  group blk[B = 4] = split(T, sizes = [0, 1, 3, 5])
  tensor x : bf16 [T, K]
  tensor w : bf16 [B, N, K]
  tensor y : f32 [T, N]
  y[t, n] = sum[k] x[t, k] * w[blk(t), n, k]
}
""", split_rows_fwd, {}, None, {"x", "w"}),
    # A per-leaf scalar over a weight of no group: the DGRAD only.
    "alpha_flat": ("""
gemm alpha_flat {
  dim T
  dim N = 8, K = 12
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor scaling : f32 [E]
  tensor y : bf16 [T, N]
  y[t, n] = scaling[expert(t)] * sum[k] x[t, k] * w[n, k]
}
""", alpha_flat_fwd, E4, None, {"x"}),
    # FP8 `+=` with a per-expert scalar and a router weight (rowscale and rowdot).
    "fp8_scaled_routed": ("""
gemm fp8_scaled_routed {
  dim T
  dim N = 256, K = 256
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor scaling : f32 [E]
  tensor route_w : f32 [T]
  tensor y : bf16 [T, N]
  y[t, n] += scaling[expert(t)] * route_w[t] * sum[k] x[t, k] * w[expert(t), n, k]
}
""", fp8_scaled_fwd, E4, None, {"x", "w", "route_w"}),
    # The LoRA chain (base, shrink, scaled expand) over a capacity group.
    "lora_capacity": ("""
gemm lora_capacity {
  dim T
  dim N = 8, K = 12, R = 4
  group lora[L = 3] = ragged(T, offsets = lora_offsets, capacity)
  tensor x       : bf16 [T, K]
  tensor w       : bf16 [N, K]
  tensor wa      : bf16 [L, R, K]
  tensor wb      : bf16 [L, N, R]
  tensor scaling : f32  [L]
  tensor h       : bf16 [T, R]
  tensor y       : bf16 [T, N]
  y[t, n]  = sum[k] x[t, k] * w[n, k]
  h[t, r]  = sum[k] x[t, k] * wa[lora(t), r, k]
  y[t, n] += scaling[lora(t)] * sum[r] h[t, r] * wb[lora(t), n, r]
}
""", lora_capacity_fwd, {"lora": [0, 1, 5]}, {"T": 9}, {"x", "w", "wa", "wb", "h"}),
    # A router weight on an A the row passes cannot read (column-major): in the epilogue.
    "routed_colmajor": ("""
gemm routed_colmajor {
  dim T
  dim N = 8, K = 12
  group expert[E = 4] = ragged(T, offsets = expert_offsets)
  tensor x : bf16 [T, K] layout major(T)
  tensor w : bf16 [E, N, K]
  tensor route_w : f32 [T]
  tensor y : bf16 [T, N]
  y[t, n] = route_w[t] * sum[k] x[t, k] * w[expert(t), n, k]
}
""", routed_fwd, E4, None, {"x"}),
    # Capacity groups: rows past the offsets' end get no gradient.
    "moe_bf16_capacity": (_capacity(example(*MOE16)), moe_fwd, E8, {"T": 24}, {"x", "w"}),
    "swiglu_fp8_capacity": (_capacity(example(*SWIGLU)), moe_swiglu_fp8_fwd, E8, {"T": 24}, {"x", "w"}),
    # Gathered SwiGLU and scattered, weighted down-projection over a capacity group: the
    # weight stays in the DGRAD's epilogue (route_w not derived), the gathered SwiGLU is
    # not derived (scatter_add would add the rows past the end).
    "ffn_fp8_capacity": (_capacity(example(*FFN)), moe_ffn_fwd, E8, {"T": 24, "S": 23}, {"h", "w_down"}),
}


@pytest.mark.parametrize("name", sorted(SPEC_CASES))
def test_spec_gradients(exact, name):
    text, forward, lengths, dims, expect = SPEC_CASES[name]
    assert_gradients(text, forward, lengths, dims, expect=expect)
    assert_gradients(text, forward, lengths, dims, seed=1, expect=expect, poison=True)


def test_masked_rows_not_derived():
    text = """
gemm masked16 {
  dim M = 8, N = 8, K = 12
  group expert[E = 3] = masked(M, counts = expert_counts)
  tensor x : bf16 [E, M, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [E, M, N]
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}
"""
    (fwd,) = lower_file(text)
    bw = lower_backward(fwd.spec)[0]
    assert not bw.statements
    assert "masked" in bw.skipped[0].reason


# ---- capacity groups and the row passes ----------------------------------------------------------


def test_capacity_gather_not_derived():
    """A gathered A over a capacity group: the DGRAD writes only the rows inside the
    segments, and scatter_add adds every row of it (the rest is whatever the buffer held)
    into the gradient of the rows the index names, so the statement is not derived."""
    for name, subs in (("moe_fp8_gather_scatter", FP8_SMALL), FFN):
        (fwd,) = lower_file(_capacity(example(name, subs)))
        bw = lower_backward(fwd.spec)[0]
        assert not any(d.forward == 0 for d in bw.statements), bw.text()
        (skip,) = [s for s in bw.skipped if s.forward == 0]
        assert "capacity group 'expert'" in skip.reason and "scatter_add" in skip.reason



def test_capacity_row_weight_in_epilogue(exact):
    """A router weight over a capacity group: rowdot and rowscale would read the rows past
    the offsets' end (of the DGRAD's output and of the forward's h, which nothing writes
    there), so the weight stays in the DGRAD's epilogue and its gradient is not derived;
    the gradients that are derived are right, past the end included."""
    text, forward, lengths, dims, expect = SPEC_CASES["ffn_fp8_capacity"]
    bw = assert_gradients(text, forward, lengths, dims, seed=2, expect=expect, poison=True)
    assert "capacity group 'expert'" in dict(bw.not_derived)["route_w"]
    assert "rowdot" not in bw.source and "rowscale" not in bw.source
    # Without the capacity the weight's gradient is derived by the row passes.
    (fwd,) = lower_file(example(*FFN))
    assert "droute_w : f32 [T] = rowdot(dh_pre, h)" in lower_backward(fwd.spec)[0].source


# ---- a wrong backward fails -------------------------------------------------------------------


WRONG = [
    ("moe_ffn_fp8_train", "rows = dst, weight = route_w", "rows = dst"),  # WGRAD operand unweighted
    ("moe_ffn_fp8_train", "dy[dst[t], n]", "dy[t, n]"),  # dy's rows not gathered
    ("moe_fp8_gather_scatter", "scatter_add(dx_rows, rows = idx)", "scatter_add(dx_rows, rows = src)"),
    ("lora_moe_scaled", "dh_pre[t, r] = scaling[lora(t)] *", "dh_pre[t, r] ="),  # scalar dropped
    ("moe_bf16_forward", "dy[t, n] * x[t, k]", "dy[t, n] * dx[t, k]"),  # WGRAD reads the wrong operand
]


@pytest.mark.parametrize("name,old,new", WRONG)
def test_wrong_backward_fails(exact, name, old, new):
    subs, forward, lengths, dims, _ = EXAMPLE_CASES[name]

    def edit(source: str) -> str:
        assert old in source
        return source.replace(old, new)

    problems, _, _ = run_case(example(name, subs), forward, lengths, dims, edit=edit)
    assert problems
