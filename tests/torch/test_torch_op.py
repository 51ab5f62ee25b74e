"""gemmspec.torch without a GPU: the custom ops' schemas, their fake implementations
(shapes and dtypes of fresh outputs, from the input shapes) on meta and fake tensors,
and tracing under torch.compile(fullgraph=True) with no graph break."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import gemmspec  # noqa: E402
import gemmspec.torch as gt  # noqa: E402
from gemmspec.errors import ArgumentError  # noqa: E402
from gemmspec.reference.data import dim_size, random_runtime, scale_grid_shape  # noqa: E402

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.gspec"))


def meta_inputs(op, t=300, device="meta"):
    """Inputs of every argument the op takes, on `device`, shaped as the spec says."""
    import numpy as np

    spec = op.exe.spec
    rt = random_runtime(spec, np.random.default_rng(0), dims={d: t for d in spec.runtime_dims})
    out = {}
    for tensor in spec.tensors:
        if tensor.derived is not None or tensor.name not in op.inputs:
            continue
        # A padded segment_major buffer carries its padding rows.
        shape = list(tensor.layout.storage_shape(tuple(dim_size(spec, rt, d) for d in tensor.dims)))
        out[tensor.name] = torch.empty(shape, dtype=gt.torch_dtype(tensor.dtype), device=device)
        if tensor.scale:
            out[tensor.scale.name] = torch.empty(scale_grid_shape(spec, rt, tensor), device=device)
    for name, values in rt.tensors.items():
        out[name] = torch.empty(values.shape, dtype=torch.int32, device=device)
    return out, rt


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fake_outputs_have_the_declared_shapes_and_dtypes(path):
    op = gt.op(path)
    spec = op.exe.spec
    inputs, rt = meta_inputs(op)
    outs = op(**inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    assert len(outs) == len(op.outputs)
    scales = {t.scale.name: t for t in spec.tensors if t.scale is not None}
    for name, out in zip(op.outputs, outs):
        if name in scales:  # an FP8 output's scales, written beside it
            t = scales[name]
            want = scale_grid_shape(spec, rt, t)
            if t.copy_of is not None:  # a copy's [128, 1] scales per segment: the most rows any counts need
                g = spec.group(t.scale.anchor)
                want = ((dim_size(spec, rt, t.dims[0]) + g.count * 127) // 128, *want[1:])
            assert t.name in op.outputs and tuple(out.shape) == tuple(want), name
            assert out.dtype == torch.float32 and out.device.type == "meta"
            continue
        t = spec.tensor(name)
        assert tuple(out.shape) == t.layout.storage_shape(tuple(dim_size(spec, rt, d) for d in t.dims)), name
        assert out.dtype == gt.torch_dtype(t.dtype) and out.device.type == "meta"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_fresh_outputs_are_sized_from_the_inputs_in_op_order(path):
    op = gt.op(path)
    inputs, _ = meta_inputs(op)
    outs = op._allocate(op._take_inputs(inputs))
    assert [list(o.shape) for o in outs] == op.output_sizes(inputs)
    assert [o.dtype for o in outs] == [gt.torch_dtype(s.dtype) for s in op.shapes]
    assert all(o.device.type == "meta" for o in outs)


PADDED = """
gemm padded_out {
  dim T
  dim K = 200, R = 16
  group lora[L = 2]   = ragged(T, offsets = lora_offsets)
  group expert[E = 3] = ragged(T within lora, offsets = expert_offsets)
  tensor x  : bf16 [T, K] layout segment_major(expert) pad 8
  tensor wa : bf16 [L, E, R, K]
  tensor y  : f32  [T, R] layout segment_major(expert) pad 4
  tensor z  : f32  [T, R]
  y[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
  z[t, r] = sum[k] x[t, k] * wa[lora(t), expert(t), r, k]
}
"""


def test_fresh_outputs_of_padded_layouts_carry_their_padding():
    """T comes from x's buffer, T + 7 * 6 rows (pad 8 over 2 x 3 segments); y's buffer has
    T + 3 * 6 rows (pad 4), z's T."""
    op = gt.op(PADDED)
    inputs, _ = meta_inputs(op, t=300)
    assert list(inputs["x"].shape) == [342, 200]
    y, z = op(**inputs)
    assert list(y.shape) == [318, 16] and list(z.shape) == [300, 16]
    assert op.output_sizes(inputs) == [[318, 16], [300, 16]]


def test_the_op_hands_the_executable_its_arguments_in_order(monkeypatch):
    op = gt.op(EXAMPLES[0].parent / "linear_fp8_training.gspec")
    names = op.inputs + op.outputs
    calls = []
    monkeypatch.setattr(op.exe, "_call", lambda objects, stream, check: calls.append((objects, stream, check)))
    values = tuple(object() for _ in names)
    op._run_out(*values)
    ((objects, stream, check),) = calls
    assert objects == tuple(values[names.index(n)] for n in op.exe.argument_names())
    assert stream is None and check is None


def test_fake_tensors_on_cuda_keep_their_device():
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = gt.op(EXAMPLES[0].parent / "moe_fp8_forward.gspec")
    with FakeTensorMode():
        inputs, _ = meta_inputs(op, t=777, device="cuda")
        y = op(**inputs)
    assert tuple(y.shape) == (777, 4096) and y.dtype == torch.bfloat16 and y.device.type == "cuda"


def test_schemas():
    op = gt.op(EXAMPLES[0].parent / "moe_fp8_forward.gspec")
    assert str(op.functional._schema).endswith(
        "(Tensor x, Tensor x_scale, Tensor w, Tensor w_scale, Tensor expert_offsets) -> Tensor"
    )
    assert str(op.in_place._schema).endswith("Tensor expert_offsets, Tensor(a0!) y) -> ()")


def test_same_spec_same_operator_and_other_spec_other_operator():
    path = EXAMPLES[0].parent / "moe_fp8_forward.gspec"
    assert gt.op(path) is gt.op(gemmspec.build(path))
    other = path.read_text().replace("N = 4096", "N = 2048")
    assert gt.op(other).name != gt.op(path).name


def test_accumulated_outputs_start_from_zeros_when_fresh():
    op = gt.op(EXAMPLES[0].parent / "linear_fp8_training.gspec")
    assert op.outputs == ("y", "dx", "dw")
    assert [s.zero for s in op.shapes] == [False, False, True]


def test_outputs_all_or_none():
    op = gt.op(EXAMPLES[0].parent / "linear_fp8_training.gspec")
    inputs, _ = meta_inputs(op)
    y = torch.empty(300, 4096, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ArgumentError, match="pass every output"):
        op(y=y, **inputs)
    with pytest.raises(ArgumentError, match="missing tensor"):
        op(**{k: v for k, v in inputs.items() if k != "x"})


def compiled(fn):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward  # runs the meta kernels: nothing needs a GPU

    return torch.compile(fn, fullgraph=True, backend=backend), graphs


def test_traced_whole_by_torch_compile():
    torch._dynamo.reset()
    op = gt.op(EXAMPLES[0].parent / "moe_fp8_forward.gspec")
    inputs, _ = meta_inputs(op)

    def returned(**kw):
        return op(**kw).float() * 2

    def in_place(y, **kw):
        op(y=y, **kw)
        return y + 1

    f, graphs = compiled(returned)
    assert f(**inputs).shape == (300, 4096)
    g, more = compiled(in_place)
    y = torch.empty(300, 4096, dtype=torch.bfloat16, device="meta")
    assert g(y, **inputs).shape == (300, 4096)
    assert len(graphs) == 1 and len(more) == 1  # fullgraph: one graph each, no break
    assert f"gemmspec.{op.name}.default" in graphs[0].code
    assert f"gemmspec.{op.name}_out.default" in more[0].code
