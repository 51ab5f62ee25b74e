"""The bench's decode FFN rows without a GPU: the table entries, the seeded routed rows,
the spec texts (the example at Qwen3's sizes, its steps as separate specs), the bytes
the layer must move, and the procedure run on the CPU with the schedule reference
executor standing in for the kernels and CUDA graphs (its checks pass, and fail on a
wrong result)."""

from __future__ import annotations

import numpy as np
import pytest

import gemmspec
from gemmspec import bench
from gemmspec.bench import measure, specs
from gemmspec.bench.inputs import routed_counts, routed_rows
from gemmspec.pipeline import lower_file

EXAMPLE = specs.EXAMPLES / "moe_ffn_fp8_decode.gspec"


def _statements(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip().startswith(("h[", "y_rows["))]


def test_table_has_the_three_rows_with_their_shapes_and_target():
    rows = {c.name: c for c in bench.selected_cases(["ffn_decode"])}
    assert set(rows) == {"ffn_decode_dsv3_T64", "ffn_decode_dsv3_T512", "ffn_decode_qwen3_T128"}
    for c in rows.values():
        assert c.run is measure.ffn_decode and c.memory_bound and not c.anchors
        assert c.target == bench.Target(vs_torch=1.5, vs_separate=1.2)
        assert c.shape["top_k"] == 8 and c.shape["seed"] == c.shape["tokens"]
        assert len(c.name) <= 36
    assert {k: rows["ffn_decode_dsv3_T512"].shape[k] for k in ("experts", "hidden", "f")} == dict(
        experts=256, hidden=7168, f=2048)
    assert {k: rows["ffn_decode_qwen3_T128"].shape[k] for k in ("experts", "hidden", "f")} == dict(
        experts=128, hidden=2048, f=768)


@pytest.mark.parametrize("tokens, experts", [(1, 256), (64, 256), (128, 128)])
def test_routed_rows_are_each_token_top_k_times_sorted_by_expert(tokens, experts):
    src, lengths = routed_rows(tokens, experts, 8, seed=tokens)
    assert lengths == routed_counts(tokens, experts, 8, seed=tokens)
    assert len(src) == sum(lengths) == 8 * tokens
    assert np.bincount(src, minlength=tokens).tolist() == [8] * tokens
    start = 0
    for n in lengths:  # within an expert, tokens ascend (and appear once)
        seg = src[start:start + n]
        assert seg == sorted(set(seg))
        start += n


def test_spec_texts_are_the_example_at_each_size_and_its_steps():
    example = EXAMPLE.read_text()
    assert specs.ffn_decode_text(hidden=7168, f=2048, e=256) == example
    qwen = specs.ffn_decode_text(hidden=2048, f=768, e=128, name="q")
    (low,) = lower_file(qwen)
    assert low.spec.name == "q" and [t.name for t in low.spec.row_passes] == ["y"]
    up = specs.FFN_DECODE_UP.format(h=2048, f=768, e=128)
    down = specs.FFN_DECODE_DOWN.format(h=2048, f=768, e=128)
    assert len(_statements(example)) == 2
    assert _statements(up) + _statements(down) == _statements(example)
    for text in (qwen, up, down):
        assert gemmspec.build(text).sources


def test_bytes_count_active_experts_three_weights_and_the_tokens_once():
    lengths, hidden, f = [0, 3, 1, 0], 256, 384
    weights = 2 * 3 * (hidden * f + 2 * 3 * 4)
    assert measure.ffn_decode_bytes(lengths, 2, hidden, f) == weights + 2 * (hidden + 2 * 4) + 2 * hidden * 2 + 4 * 8


def test_the_example_fits_the_dsv3_rows():
    (low,) = lower_file(EXAMPLE)
    dims = {d.name: d.size for d in low.spec.dims}
    assert (dims["H"], dims["F"]) == (7168, 2048) and low.spec.group("expert").count == 256


# ------------------------------------------------------------------ on the CPU
torch = pytest.importorskip("torch")
from on_cpu import OnCpu as _OnCpu  # noqa: E402

from gemmspec.reference.data import Runtime, TensorData  # noqa: E402
from gemmspec.reference.schedule_exec import run_schedule  # noqa: E402


class _ReferenceRun:
    """A prepared call whose `enqueue` runs the schedule reference executor on the bound
    tensors and writes every output back in place (`broken`: the output given one wrong
    element, after the reference computed the outputs from it)."""

    def __init__(self, exe, tensors, broken: str | None):
        self.exe, self.tensors, self.broken = exe, tensors, broken

    def enqueue(self):
        spec, tensors = self.exe.spec, self.tensors
        written = set(spec.written)
        scales = {f"{n}_scale" for n in tensors if f"{n}_scale" in tensors}
        dims = {"T": tensors["route_w" if "route_w" in tensors else "src"].shape[0]}
        if "x" in tensors:
            dims["S"] = tensors["x"].shape[0]
        rt = Runtime(dims, {"expert_offsets": tensors["expert_offsets"].numpy()})
        inputs = {n: TensorData(v.double().numpy(), tensors[f"{n}_scale"].double().numpy() if f"{n}_scale" in scales
                                else None)
                  for n, v in tensors.items() if n not in written | scales | {"expert_offsets"}
                  and not any(n == f"{w}_scale" for w in written)}
        init = {n: v.double().numpy() for n, v in tensors.items() if n in written or n[:-6] in written}
        for name, values in run_schedule(spec, rt, self.exe.schedule, inputs, init).items():
            out = tensors[name]
            result = torch.from_numpy(np.ascontiguousarray(values.reshape(out.shape)))
            if name == self.broken:
                result[0, 0] += 1000.0
            out.copy_(result.to(out.dtype))


class _ReferenceExecutable:
    def __init__(self, exe, broken: str | None):
        self.exe, self.broken = exe, broken

    def prepare(self, stream, **tensors):
        assert set(tensors) == set(self.exe.argument_names())
        return _ReferenceRun(self.exe, tensors, self.broken)


@pytest.fixture
def on_cpu(monkeypatch):
    state = {"broken": None, "graphed": 0}

    def graphed(fn, stream):
        state["graphed"] += 1
        return fn

    monkeypatch.setattr(torch.cuda, "Stream", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(specs, "build_spec", lambda text: _ReferenceExecutable(gemmspec.build(text), state["broken"]))
    monkeypatch.setattr(measure, "graphed", graphed)
    monkeypatch.setattr(measure, "timed", lambda fn, repeat, before=None: bench.Timing([1e-3] * repeat, None))
    with _OnCpu():
        yield state


SMALL = dict(tokens=5, experts=4, top_k=2, hidden=256, f=256, seed=1)


def test_ffn_decode_runs_checked_and_rated_in_bytes(on_cpu):
    rows, problem = measure.ffn_decode(1, name="f", **SMALL)
    assert problem is None
    one, separate = rows[:2]
    assert one.impl.startswith("gemmspec one spec") and separate.impl.startswith("gemmspec up, down")
    _, lengths = routed_rows(5, 4, 2, seed=1)
    assert one.unit == "TB/s" and one.work == measure.ffn_decode_bytes(lengths, 5, 256, 256)
    for part in ("h vs float64 reference", "y_rows vs float64 reference", "y_rows vs separate calls",
                 "y the combine of y_rows, bit for bit", "same bits"):
        assert part in one.check
    assert on_cpu["graphed"] >= 2  # one spec, separate calls (and the torch chain where torch runs it)


@pytest.mark.parametrize("broken, message", [
    ("y_rows", "gemmspec differs from float64 reference"),  # the down-projection, row by row
    ("y", "not the combine of the y_rows it wrote"),  # the combine, bit for bit
])
def test_ffn_decode_check_fails_on_a_wrong_result(on_cpu, broken, message):
    on_cpu["broken"] = broken
    with pytest.raises(AssertionError, match=message):
        measure.ffn_decode(1, name="f", **SMALL)


def test_combined_adds_each_tokens_rows_in_ascending_row_order_in_float32():
    # Token 2 is named by rows 0, 2 and 4: 2^24 + 1 rounds to 2^24 in float32, so in
    # ascending order the sum is 0 (another order would give 1); token 1 is named by no
    # row and gets zeros.
    src = torch.tensor([2, 0, 2, 3, 2], dtype=torch.int32)
    rows = torch.tensor([[2.0**24, 1.0], [5.0, 6.0], [1.0, 2.0], [7.0, 8.0], [-(2.0**24), 3.0]]).to(torch.bfloat16)
    y = measure.combined(rows, src, 4)
    assert y.dtype == torch.bfloat16
    assert y.float().tolist() == [[5.0, 6.0], [0.0, 0.0], [0.0, 6.0], [7.0, 8.0]]


def test_route_into_writes_a_seeded_routing_in_place():
    from gemmspec.bench.inputs import route_into

    t = 5 * 2
    tensors = {"src": torch.zeros(t, dtype=torch.int32), "expert_offsets": torch.zeros(5, dtype=torch.int32),
               "route_w": torch.zeros(t)}
    expert_of = route_into(tensors, 5, 4, 2, seed=3)
    src, lengths = routed_rows(5, 4, 2, seed=3)
    assert tensors["src"].tolist() == src
    assert tensors["expert_offsets"].tolist() == np.concatenate([[0], np.cumsum(lengths)]).tolist()
    assert expert_of.tolist() == [e for e, n in enumerate(lengths) for _ in range(n)]
    weights = tensors["route_w"].clone()
    assert ((weights >= 0) & (weights < 1)).all()
    route_into(tensors, 5, 4, 2, seed=3)
    assert torch.equal(tensors["route_w"], weights)  # the same seed, the same weights
