"""The derived backward's values against finite differences of the forward, for the
16-bit forms the derivation covers beyond one plain statement: `+=` into an output an
earlier statement writes, a per-leaf scalar, a chain (the LoRA shrink's output read by
the expand), one input feeding two statements (its gradients summed into one tensor) and
a per-row router weight (rowscale and rowdot).

Both specs run on the direct reference executor with the rounding of 16-bit values to
their type switched off, so each is exact float64 arithmetic: the forward is linear in
each input, so for any direction V, L(X + V) - L(X) = <dL/dX, V> exactly, L = <dy, y>.
A wrong gradient (any element of it) misses that for random V. Every derived text also
round-trips through `gemmspec check`."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec
from gemmspec.cli import main
from gemmspec.pipeline import lower_backward, lower_file
from gemmspec.reference import data as data_module
from gemmspec.reference import direct
from gemmspec.reference.data import TensorData, dim_size, random_inputs, random_runtime

LORA = """\
gemm lora_train {
  dim T
  dim N = 32, K = 48, R = 16
  group lora[L = 3] = ragged(T, offsets = lora_offsets)
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
"""

ROUTED = """\
gemm routed {
  dim T
  dim N = 32, K = 48
  group expert[E = 3] = ragged(T, offsets = expert_offsets)
  tensor x       : bf16 [T, K]
  tensor w       : bf16 [E, N, K]
  tensor route_w : f32  [T]
  tensor y       : bf16 [T, N]
  y[t, n] = route_w[t] * sum[k] x[t, k] * w[expert(t), n, k]
}
"""

# `+=` into an output no statement of the spec writes first (a LoRA expand added into
# the base output the caller passes): its gradient flows into both factors.
EXPAND = """\
gemm expand {
  dim T
  dim N = 32, R = 16
  group lora[L = 3] = ragged(T, offsets = lora_offsets)
  tensor h  : bf16 [T, R]
  tensor wb : bf16 [L, N, R]
  tensor y  : bf16 [T, N]
  y[t, n] += sum[r] h[t, r] * wb[lora(t), n, r]
}
"""


@pytest.fixture
def exact(monkeypatch):
    """No rounding of 16-bit values: every statement and row pass in float64."""
    def keep(values, dtype):
        return np.asarray(values, dtype=np.float64)

    monkeypatch.setattr(direct, "quantize", keep)
    monkeypatch.setattr(data_module, "quantize", keep)


def _loss(spec, rt, data, dys) -> float:
    init = {n: np.zeros(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims)) for n in spec.written}
    for n, d in data.items():
        if n in init:  # an output a statement adds into: its old contents
            init[n] = d.values.copy()
    out = direct.run_direct(spec, rt, {k: v for k, v in data.items() if k not in init}, init)
    return sum(float((dys[o] * out[o]).sum()) for o in dys)


def _check_gradients(text: str, lengths: dict, seed: int, expect: set[str]):
    (fwd,) = lower_file(text)
    bw, low = lower_backward(fwd.spec)
    spec, bspec = fwd.spec, low.spec
    rng = np.random.default_rng(seed)
    rt = random_runtime(spec, rng, lengths=lengths)
    data = random_inputs(spec, rt, rng)
    data = {n: d for n, d in data.items() if n not in rt.tensors}
    # Forward outputs the backward reads (a chain's h) as the forward wrote them.
    init = {n: np.zeros(tuple(dim_size(spec, rt, d) for d in spec.tensor(n).dims)) for n in spec.written}
    for n, d in data.items():
        if n in init:
            init[n] = d.values.copy()
    fwd_out = direct.run_direct(spec, rt, {k: v for k, v in data.items() if k not in init}, init)
    dys = {o: rng.standard_normal(fwd_out[o].shape) for o, _ in bw.output_grads}
    bdata = {}
    for t in bspec.tensors:
        if t.derived is not None or t.row_pass is not None or t.name in bspec.written or t.name in rt.tensors:
            continue
        grads = dict(bw.output_grads)
        src = {g: o for o, g in grads.items()}
        if t.name in src:
            bdata[t.name] = TensorData(dys[src[t.name]])
        elif t.name in data:
            bdata[t.name] = data[t.name]
        else:
            bdata[t.name] = TensorData(fwd_out[t.name])
    binit = {n: np.zeros(tuple(dim_size(bspec, rt, d) for d in bspec.tensor(n).dims)) for n in bspec.written}
    grads = direct.run_direct(bspec, rt, bdata, binit)
    by_input = {d.wrt: d.grad for d in bw.statements}
    assert set(by_input) == expect
    base = _loss(spec, rt, data, dys)
    for name, grad in by_input.items():
        # One gradient tensor per input, however many statements it feeds.
        assert len({d.grad for d in bw.statements if d.wrt == name}) == 1
        if name not in data:  # an output later statements read (h): the chain's link, checked through x
            assert name in spec.written
            continue
        for _ in range(3):
            v = rng.standard_normal(data[name].values.shape)
            moved = dict(data)
            moved[name] = TensorData(data[name].values + v)
            want = _loss(spec, rt, moved, dys) - base
            got = float((grads[grad] * v).sum())
            assert got == pytest.approx(want, rel=1e-9, abs=1e-9), (name, got, want)
    return bw


def test_lora_base_shrink_expand_gradients(exact):
    bw = _check_gradients(LORA, {"lora": [0, 5, 9]}, 1, {"x", "w", "wa", "wb", "h"})
    texts = [d.text for d in bw.statements]
    # x feeds the base and the shrink: the shrink's DGRAD adds into the base's.
    assert "dx[t, k] = sum[n] dy[t, n] * w[n, k]" in texts
    assert "dx[t, k] += sum[r] dh[t, r] * wa[lora(t), r, k]" in texts
    # The scalar in both epilogues; its own gradient is said not to be derived.
    assert "dh[t, r] = scaling[lora(t)] * sum[n] dy[t, n] * wb[lora(t), n, r]" in texts
    assert any(t.startswith("dwb[l, n, r] = scaling[l] * sum[t in lora(l)]") for t in texts)
    assert dict(bw.not_derived).keys() == {"scaling"}
    assert bw.output_grads == (("y", "dy"),)  # h's gradient comes from the expand's DGRAD
    assert not bw.skipped


def test_router_weighted_bf16_gradients(exact):
    bw = _check_gradients(ROUTED, {"expert": [4, 0, 7]}, 2, {"x", "route_w"})
    why = dict(bw.not_derived)["w"]
    assert "weights its rows by 'route_w' in bf16" in why and "WGRAD" in why
    assert "tensor dx : bf16 [T, K] = rowscale(dx_pre, weight = route_w)" in bw.source
    assert "tensor droute_w : f32 [T] = rowdot(dx_pre, x)" in bw.source


def test_accumulated_expand_gradients(exact):
    bw = _check_gradients(EXPAND, {"lora": [3, 0, 6]}, 3, {"h", "wb"})
    assert [d.text for d in bw.statements][0] == "dh[t, r] = sum[n] dy[t, n] * wb[lora(t), n, r]"


@pytest.mark.parametrize("text", [LORA, ROUTED, EXPAND], ids=["lora", "routed", "expand"])
def test_derived_text_round_trips_through_check(text, tmp_path, capsys):
    bw = gemmspec.derive_backward(text)
    path = tmp_path / f"{bw.spec_name}.gspec"
    path.write_text(bw.source)
    assert main(["check", str(path)]) == 0
    assert f"{bw.spec_name}: ok" in capsys.readouterr().out
