"""The CPU reference's in-place form (`<name>_out`), as the GPU's: the outputs given are
checked as the executable checks them and written in place; an `+=` output adds into
what it holds; the elements no statement writes (rows past a capacity group's end or a
masked count, a padded segment's padding rows, spare scale rows) keep their bytes; and
the functional form is what it was (fresh outputs, zeros where nothing writes). The
elements a call writes are the reference's own report (`covered`), checked here as masks
too: of FP8 outputs, their scale grids and copies as well."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402
from gemmspec.reference.data import element_offsets  # noqa: E402
from gemmspec.torch_reference import _Reference, register_reference  # noqa: E402

# Specs of their own: ops are shared by spec text, and other tests register CPU kernels.
RAGGED = """\
gemm out_form_ragged {
  dim T
  dim N = 64, K = 128
  group expert[E = 3] = ragged(T, offsets = offs, capacity)
  tensor x : bf16 [T, K]
  tensor w : bf16 [E, N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
# examples/lora_moe_scaled.gspec, small, its adapters' rows ending before T.
LORA = """\
gemm out_form_lora {
  dim T
  dim N = 64, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets, capacity)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor h       : bf16 [T, R]
  tensor wb      : bf16 [L, E, N, R]
  tensor scaling : f32  [L]
  tensor route_w : f32  [T]
  tensor bias    : bf16 [E, N]
  tensor y       : bf16 [T, N]
  y[t, n] += scaling[lora(t)] * route_w[t] * sum[r] h[t, r] * wb[lora(t), expert(t), n, r] + bias[expert(t), n]
}
"""
MASKED = """\
gemm out_form_masked {
  dim M = 32, N = 64, K = 128
  group expert[E = 3] = masked(M, counts = counts)
  tensor x : bf16 [E, M, K]
  tensor w : bf16 [E, N, K]
  tensor y : f32  [E, M, N]
  y[e, m, n] += sum[k] x[e, m, k] * w[e, n, k]
}
"""
# An FP8 output with its copy in padded segments and [128, 1] scales per expert.
COPY = """\
gemm out_form_copy {
  dim T
  dim H = 256, F = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x   : e4m3 [T, H] scale f32 [1, 128]
  tensor w   : e4m3 [E, F, H] scale f32 [1, 128, 128]
  tensor h   : e4m3 [T, F] scale f32 [1, 128]
  tensor h_t : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert = copy(h)
  h[t, f] = sum[k] x[t, k] * w[expert(t), f, k]
}
"""
# FP8 outputs a statement writes in part: rows past a capacity group's end, rows past a
# masked count (values and their [1, 128] scales alike).
CAPACITY_FP8 = """\
gemm out_form_capacity_fp8 {
  dim T
  dim N = 256, K = 128
  group expert[E = 3] = ragged(T, offsets = offs, capacity)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [T, N] scale f32 [1, 128]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
MASKED_FP8 = """\
gemm out_form_masked_fp8 {
  dim M = 32, N = 256, K = 128
  group expert[E = 3] = masked(M, counts = counts)
  tensor x : e4m3 [E, M, K] scale f32 [1, 1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [E, M, N] scale f32 [1, 1, 128]
  y[e, m, n] = sum[k] x[e, m, k] * w[e, n, k]
}
"""


def op(text: str) -> gt.GemmOp:
    o = gt.op(text)
    register_reference(o)
    return o


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def noise(shape, dtype, seed: int) -> torch.Tensor:
    """Random bytes of `dtype` (NaN and infinities among them): what memory may hold."""
    t = torch.empty(shape, dtype=dtype)
    t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, generator=gen(seed), dtype=torch.uint8))
    return t


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def ragged_inputs(t: int = 40, ends=(0, 9, 9, 30)) -> dict[str, torch.Tensor]:
    g = gen(1)
    return {
        "x": torch.randn(t, 128, generator=g).bfloat16(),
        "w": (torch.randn(3, 64, 128, generator=g) / 8).bfloat16(),
        "offs": torch.tensor(ends, dtype=torch.int32),
    }


def test_out_form_equals_the_functional_form_and_keeps_rows_past_the_capacity_end():
    o = op(RAGGED)
    inputs = ragged_inputs()
    fresh = o(**inputs)
    y = noise((40, 64), torch.bfloat16, seed=2)
    before = y.clone()
    assert o(**inputs, y=y) is y  # through the op object: written in place, returned
    assert same_bytes(y[:30], fresh[:30])
    assert same_bytes(y[30:], before[30:])  # past offs[-1]: no leaf writes them
    # The in-place op itself, as torch.compile's graphs call it.
    z = noise((40, 64), torch.bfloat16, seed=3)
    kept = z.clone()
    o.in_place(*(inputs[n] for n in o.inputs), z)
    assert same_bytes(z[:30], fresh[:30]) and same_bytes(z[30:], kept[30:])

def test_functional_form_is_unchanged():
    """Fresh outputs: the float64 product rounded once; rows past the capacity end zeros;
    an `+=` output starts from zeros."""
    o = op(RAGGED)
    inputs = ragged_inputs()
    y = o(**inputs)
    x, w = inputs["x"].double(), inputs["w"].double()
    want = torch.zeros(40, 64, dtype=torch.float64)
    for e, (a, b) in enumerate(zip((0, 9, 9), (9, 9, 30))):
        want[a:b] = x[a:b] @ w[e].T
    assert y.dtype == torch.bfloat16 and torch.equal(y, want.bfloat16())
    lo = op(LORA)
    args, _ = lora_inputs()
    zeros = torch.zeros(40, 64, dtype=torch.bfloat16)
    fresh = lo(**args)
    assert torch.equal(fresh, lo(**args, y=zeros.clone()))
    assert torch.equal(fresh[34:], zeros[34:])


def lora_inputs(t: int = 40):
    g = gen(4)
    args = {
        "h": torch.randn(t, 16, generator=g).bfloat16(),
        "wb": (torch.randn(2, 3, 64, 16, generator=g) / 4).bfloat16(),
        "scaling": torch.tensor([0.5, 2.0]),
        "route_w": torch.rand(t, generator=g),
        "bias": torch.randn(3, 64, generator=g).bfloat16(),
        "lora_offsets": torch.tensor([0, 20, 34], dtype=torch.int32),
        "expert_offsets": torch.tensor([[0, 5, 5, 20], [20, 21, 30, 34]], dtype=torch.int32),
    }
    return args, 34


def lora_expected(args, old: torch.Tensor, end: int) -> torch.Tensor:
    """old + scaling * route_w * h . wb^T + bias in float64, row by row (past `end`: old)."""
    want = old.double().clone()
    lo, ex = args["lora_offsets"].tolist(), args["expert_offsets"].tolist()
    h, wb, bias = args["h"].double(), args["wb"].double(), args["bias"].double()
    for lora in range(2):
        for e in range(3):
            a, b = ex[lora][e], ex[lora][e + 1]
            assert lo[lora] <= a <= b <= lo[lora + 1]
            part = h[a:b] @ wb[lora, e].T * args["scaling"][lora].double() * args["route_w"][a:b, None].double()
            want[a:b] += part + bias[e]
    return want


def test_out_form_adds_into_the_output_given():
    o = op(LORA)
    args, end = lora_inputs()
    y = (torch.randn(40, 64, generator=gen(5)) * 4).bfloat16()
    y[end:] = noise((40 - end, 64), torch.bfloat16, seed=6)  # rows no leaf adds into
    old = y.clone()
    o(**args, y=y)
    want = lora_expected(args, old, end)
    # One rounding of the sum to bf16: within half a bf16 step of the float64 value.
    err = (y[:end].double() - want[:end]).abs()
    assert (err <= 2.0**-8 * want[:end].abs() + 1e-30).all(), err.max()
    assert not torch.equal(y[:end], old[:end])
    assert same_bytes(y[end:], old[end:])


def test_out_form_adds_into_f32_and_keeps_rows_past_the_masked_counts():
    o = op(MASKED)
    g = gen(7)
    x = torch.randn(3, 32, 128, generator=g).bfloat16()
    w = (torch.randn(3, 64, 128, generator=g) / 8).bfloat16()
    counts = torch.tensor([32, 0, 11], dtype=torch.int32)
    y = torch.randn(3, 32, 64, generator=g)
    y[2, 11:] = noise((21, 64), torch.float32, seed=8)
    y[1] = noise((32, 64), torch.float32, seed=9)
    old = y.clone()
    o(x=x, w=w, counts=counts, y=y)
    for e, n in enumerate(counts.tolist()):
        want = old[e, :n].double() + x[e, :n].double() @ w[e].double().T
        err = (y[e, :n].double() - want).abs()
        assert (err <= 2.0**-24 * want.abs() + 1e-12).all(), (e, err.max())
        assert same_bytes(y[e, n:], old[e, n:]), e


def copy_inputs(counts=(0, 3, 17, 20)):
    g = gen(10)
    inputs = {"offs": torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)}
    for name, v, block in (
        ("x", torch.randn(sum(counts), 256, generator=g), (1, 128)),
        ("w", torch.randn(4, 256, 256, generator=g) / 16, (1, 128, 128)),
    ):
        inputs[name], inputs[f"{name}_scale"] = gt.quantize(v, "e4m3", block)
    return inputs


def padded_positions(counts, columns: int = 256) -> torch.Tensor:
    """Which elements of COPY's h_t buffer hold a logical element: each segment a block of
    ceil(n / 16) * 16 rows, stored column by column, element (i, f) of a segment of n rows
    at f * rows + i; the rest of the block is padding."""
    pitch = [-(-n // 16) * 16 for n in counts]
    stored = torch.zeros(sum(pitch) * columns, dtype=torch.bool)
    start = 0
    for n, rows in zip(counts, pitch):
        stored[start + (torch.arange(columns)[:, None] * rows + torch.arange(n)[None, :]).reshape(-1)] = True
        start += rows * columns
    return stored


def test_fp8_outputs_padded_copy_and_spare_scale_rows():
    """Every element and scale of h is written as the functional form writes it; of the
    copy h_t, each segment's elements (in blocks of 16-row multiples) and the counted
    scale rows: the padding and the spare scale row keep their bytes."""
    o = op(COPY)
    counts = (0, 3, 17, 20)
    inputs = copy_inputs(counts)
    fresh = dict(zip(o.outputs, o(**inputs)))
    given = {
        name: noise(f.shape, f.dtype, seed=11 + i) for i, (name, f) in enumerate(fresh.items())
    }
    old = {n: v.clone() for n, v in given.items()}
    o(**inputs, **given)
    assert set(given) == {"h", "h_scale", "h_t", "h_t_scale"}
    assert same_bytes(given["h"], fresh["h"]) and same_bytes(given["h_scale"], fresh["h_scale"])
    assert given["h_t"].shape == (40 + 4 * 15, 256) and given["h_t_scale"].shape == (4, 256)
    stored = torch.cat([padded_positions(counts), torch.zeros(20 * 256, dtype=torch.bool)])
    assert stored.sum() == 40 * 256
    flat = {n: v.reshape(-1) for n, v in (("given", given["h_t"]), ("fresh", fresh["h_t"]), ("old", old["h_t"]))}
    assert same_bytes(flat["given"][stored], flat["fresh"][stored])
    assert same_bytes(flat["given"][~stored], flat["old"][~stored])
    counted = sum(-(-n // 128) for n in counts)  # 3 of the 4 rows
    assert same_bytes(given["h_t_scale"][:counted], fresh["h_t_scale"][:counted])
    assert same_bytes(given["h_t_scale"][counted:], old["h_t_scale"][counted:])


def written_masks(o: gt.GemmOp, inputs: dict, outputs: dict):
    """(runtime, each output's starting and new values, its mask of the elements written)
    of an in-place call of `o`, as its in-place form decides them (logical shapes)."""
    ref = _Reference(o)
    given = o.checked_on_host(inputs, outputs)
    rt, outs, covered = ref.compute({n: given[n] for n in o.inputs}, given)
    start = {n: ref.logical(rt, n, given[n]) for n in o.outputs}
    return rt, start, outs, {n: ref.written(n, outs[n].shape, covered) for n in o.outputs}


def fp8_operands(shapes: dict, seed: int) -> dict[str, torch.Tensor]:
    """Random FP8 operands of `shapes` (name: (shape, scale block)) with their scales."""
    g, out = gen(seed), {}
    for name, (shape, block) in shapes.items():
        out[name], out[f"{name}_scale"] = gt.quantize(torch.randn(*shape, generator=g), "e4m3", block)
    return out


def test_an_fp8_output_written_in_part_reports_its_rows_and_scale_blocks():
    """Rows past a capacity group's end and past a masked count: neither the values nor
    their scales are in the mask, the rest all are; the in-place form writes exactly the
    mask (the functional form's bytes there), the rest keeping its bytes."""
    cap = op(CAPACITY_FP8)
    cap_in = {
        **fp8_operands({"x": ((40, 128), (1, 128)), "w": ((3, 256, 128), (1, 128, 128))}, seed=20),
        "offs": torch.tensor([0, 9, 9, 30], dtype=torch.int32),
    }
    masked = op(MASKED_FP8)
    counts = [32, 0, 11]
    masked_in = {
        **fp8_operands({"x": ((3, 32, 128), (1, 1, 128)), "w": ((3, 256, 128), (1, 128, 128))}, seed=21),
        "counts": torch.tensor(counts, dtype=torch.int32),
    }
    rows = torch.arange(40) < 30
    live = torch.arange(32)[None, :] < torch.tensor(counts)[:, None]
    for o, inputs, want in ((cap, cap_in, rows), (masked, masked_in, live)):
        fresh = dict(zip(o.outputs, o(**inputs)))
        given = {n: noise(f.shape, f.dtype, seed=22 + i) for i, (n, f) in enumerate(fresh.items())}
        old = {n: v.clone() for n, v in given.items()}
        _, _, _, masks = written_masks(o, inputs, given)
        assert masks["y"].shape == (*want.shape, 256) and masks["y_scale"].shape == (*want.shape, 2)
        for name in ("y", "y_scale"):
            mask = torch.from_numpy(masks[name])
            assert torch.equal(mask, want[..., None].expand(mask.shape)), (o.name, name)
        o(**inputs, **given)
        for name in ("y", "y_scale"):
            assert same_bytes(given[name][want], fresh[name][want]), name
            assert same_bytes(given[name][~want], old[name][~want]), name


def test_a_padded_copy_reports_its_logical_elements_and_counted_scale_rows():
    """The copy's mask is its logical shape, all written: mapped to its buffer it is every
    element but the padding rows; its scales' mask is the counted rows (3 of the 4 a call
    allocates), all written, the spare row outside it."""
    o = op(COPY)
    counts = (0, 3, 17, 20)
    inputs = copy_inputs(counts)
    fresh = dict(zip(o.outputs, o(**inputs)))
    given = {n: noise(f.shape, f.dtype, seed=30 + i) for i, (n, f) in enumerate(fresh.items())}
    rt, _, _, masks = written_masks(o, inputs, given)
    assert masks["h"].shape == (40, 256) and masks["h"].all() and masks["h_scale"].all()
    assert masks["h_t"].shape == (40, 256) and masks["h_t"].all()
    assert masks["h_t_scale"].shape == (3, 256) and masks["h_t_scale"].all()
    at = element_offsets(o.exe.spec, rt, o.exe.spec.tensor("h_t"))
    buffer = torch.zeros(given["h_t"].numel(), dtype=torch.bool)
    buffer[torch.from_numpy(at[masks["h_t"]])] = True
    assert torch.equal(buffer[: 80 * 256], padded_positions(counts)) and not buffer[80 * 256 :].any()


@pytest.mark.parametrize("spec", ["copy", "capacity"])
def test_an_element_written_with_its_starting_value_is_written(spec):
    """Outputs given holding exactly what the call writes: every value written equals its
    starting value bit for bit, and the mask still says written (no comparison of values
    could tell)."""
    if spec == "copy":
        o, inputs = op(COPY), copy_inputs()
        want = {n: None for n in o.outputs}  # all written
    else:
        o = op(CAPACITY_FP8)
        inputs = {
            **fp8_operands({"x": ((40, 128), (1, 128)), "w": ((3, 256, 128), (1, 128, 128))}, seed=20),
            "offs": torch.tensor([0, 9, 9, 30], dtype=torch.int32),
        }
        want = {n: torch.arange(40) < 30 for n in o.outputs}
    given = dict(zip(o.outputs, o(**inputs)))
    _, start, outs, masks = written_masks(o, inputs, given)
    for name in o.outputs:
        mask, rows = masks[name], want[name]
        new = np.asarray(outs[name], np.float64)  # a scale grid: float32
        same = new.view(np.int64) == start[name].view(np.int64)
        assert mask.any() and same[mask].all(), name  # what a comparison of values would miss
        if rows is None:
            assert mask.all(), name
        else:
            assert torch.equal(torch.from_numpy(mask), rows[:, None].expand(mask.shape)), name


@pytest.mark.parametrize(
    "wrong, match",
    [
        (torch.empty(40, 63, dtype=torch.bfloat16), r"tensor 'y' must have shape \[T, 64\]"),
        (torch.empty(40, 64, dtype=torch.float32), "tensor 'y' holds f32 data, which cannot be read as bf16"),
        (torch.empty(64, 40, dtype=torch.bfloat16).T, "tensor 'y' must have element strides"),
    ],
    ids=["shape", "dtype", "strides"],
)
def test_wrong_outputs_are_refused_naming_them(wrong, match):
    o = op(RAGGED)
    inputs = ragged_inputs()
    with pytest.raises(ArgumentError, match=match):
        o(**inputs, y=wrong)
    with pytest.raises(ArgumentError, match=match):
        o.in_place(*(inputs[n] for n in o.inputs), wrong)


def test_an_output_sharing_memory_with_an_input_is_refused():
    o = op(RAGGED)
    inputs = ragged_inputs()
    y = inputs["x"].view(-1)[: 40 * 64].view(40, 64)  # x's first rows
    with pytest.raises(ArgumentError, match="output 'y' overlaps input 'x'"):
        o(**inputs, y=y)


def misaligned(value: torch.Tensor, by: int) -> torch.Tensor:
    """`value`'s elements in memory `by` bytes past a 16-byte aligned address."""
    size = value.numel() * value.element_size()
    raw = bytearray(size + 32)
    skip = (-torch.frombuffer(raw, dtype=torch.uint8).data_ptr()) % 16 + by
    out = torch.frombuffer(raw, dtype=torch.uint8, offset=skip, count=size).view(value.dtype).view(value.shape)
    out.copy_(value)
    assert out.data_ptr() % 16 == by
    return out


@pytest.mark.parametrize(
    "spec, name, by, match",
    [
        ("ragged", "x", 2, "tensor 'x' must be 16-byte aligned"),
        ("ragged", "offs", 2, r"'offs' must be 4-byte aligned \(int32\)"),
        ("capacity_fp8", "x_scale", 4, "scale 'x_scale' must be 16-byte aligned"),
    ],
    ids=["data", "offsets", "scale"],
)
def test_misaligned_inputs_are_refused_by_both_forms(spec, name, by, match):
    """The functional form checks the inputs' addresses as the GPU's does (which checks
    every call's), with the in-place form's error."""
    if spec == "ragged":
        o, inputs = op(RAGGED), ragged_inputs()
    else:
        o = op(CAPACITY_FP8)
        inputs = {
            **fp8_operands({"x": ((40, 128), (1, 128)), "w": ((3, 256, 128), (1, 128, 128))}, seed=20),
            "offs": torch.tensor([0, 9, 9, 30], dtype=torch.int32),
        }
    fresh = o(**inputs)
    fresh = fresh if isinstance(fresh, tuple) else (fresh,)
    inputs[name] = misaligned(inputs[name], by)
    with pytest.raises(ArgumentError, match=match):
        o(**inputs)
    with pytest.raises(ArgumentError, match=match):
        o(**inputs, **dict(zip(o.outputs, fresh)))
