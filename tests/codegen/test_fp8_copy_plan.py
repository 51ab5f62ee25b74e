"""`T = copy(D)` after the checker: the launch's signature and maps, explain's text and
JSON, the manifest's written arguments, the device check of the copy's scale rows, the
torch sizes of fresh outputs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from gemmspec.codegen.manifest import spec_arguments
from gemmspec.codegen.validate import anchored_rows, validation_kernel
from gemmspec.explain import explain_text, schedule_json
from gemmspec.pipeline import lower_file

FFN = """\
gemm ffn_train {
  dim T, S
  dim H = 7168, N = 4096, F = 2048
  group expert[E = 8] = ragged(T, offsets = expert_offsets)
  tensor src  : i32 [T]
  tensor x    : e4m3 [S, H] scale f32 [1, 128]
  tensor w_up : e4m3 [E, N, H] scale f32 [1, 128, 128]
  tensor h    : e4m3 [T, F] scale f32 [1, 128]
  tensor h_t  : e4m3 [T, F] layout segment_major(expert) pad 16 scale f32 [128, 1] per expert POW2 = copy(h)
  h[t, j] = silu(sum[k] x[src[t], k] * w_up[expert(t), 2*j, k]) * sum[k] x[src[t], k] * w_up[expert(t), 2*j + 1, k]
}
"""


def lowered(pow2: bool = False):
    (x,) = lower_file(FFN.replace("POW2", "pow2" if pow2 else ""))
    return x


@pytest.mark.parametrize("pow2", [False, True])
def test_the_launch_carries_the_copy(pow2):
    x = lowered(pow2)
    (launch,) = x.schedule.launches
    sig, pg = launch.signature, launch.problems
    assert sig.copy and sig.copy_scale_pow2 == pow2 and sig.tile_m == 128
    assert sig.name.endswith("_copy128x1" + ("pow2" if pow2 else ""))
    assert pg.c.tensor == "h_t" and pg.sc.tensor == "h_t_scale"
    assert pg.sc.block == (128, 1) and pg.sc.anchors == ("expert", None)
    assert str(pg.c.offset) == "2048*pstart16.m" and [str(s) for s in pg.c.strides] == ["1", "plen16.m"]
    assert "cbstart.m" in str(pg.sc.offset)
    text = explain_text(x.spec, x.schedule)
    assert "copy: the statement writes 'h_t' = copy(h) in the same epilogue" in text
    assert "copy C h_t(m, n)" in text and "scale C h_t_scale" in text
    doc = json.loads(json.dumps(schedule_json(x.spec, x.schedule)))
    (ljson,) = doc["launches"]
    assert ljson["signature"]["copy"] is True and ljson["signature"]["copy_scale_pow2"] == pow2
    assert ljson["operands"]["C"]["tensor"] == "h_t"
    assert ljson["scales"]["C"]["block"] == {"m": 128, "n": 1}
    assert ljson["scales"]["C"]["anchored_per"] == {"m": "expert"}


def test_launches_without_a_copy_keep_their_json_and_name():
    (x,) = lower_file(FFN.replace("  tensor h_t", "  # tensor h_t"))
    (launch,) = x.schedule.launches
    assert not launch.signature.copy and "copy" not in launch.signature.name
    (ljson,) = schedule_json(x.spec, x.schedule)["launches"]
    assert "C" not in ljson["operands"] and "copy" not in ljson["signature"]


def test_the_manifest_lists_the_copy_and_its_scale_as_written():
    x = lowered()
    args = {a.name: a for a in spec_arguments(x.spec)}
    assert args["h_t"].role == "output" and args["h_t"].ctype == "__nv_fp8_e4m3*"
    assert args["h_t"].pad_rows == ("T", 15 * 8)
    assert args["h_t_scale"].role == "scale" and args["h_t_scale"].ctype == "float*"
    assert args["h_t_scale"].scale_of == "h_t"
    assert [a.name for a in spec_arguments(x.spec)].index("h_t") > [a.name for a in spec_arguments(x.spec)].index("h")


def test_the_device_check_takes_at_least_the_copys_scale_rows():
    x = lowered()
    (rows,) = anchored_rows(x.spec, x.spec.tensor("h_t"))
    assert rows.written and rows.block == 128
    kernel = validation_kernel(x.spec)
    assert "counted > (unsigned long long)rows0" in kernel.function
    assert any("at least one row per 128" in c.message for c in kernel.checks)


def test_fresh_outputs_are_sized_for_the_copy():
    torch_mod = pytest.importorskip("gemmspec.torch")
    x = lowered()
    op = torch_mod.GemmOp.__new__(torch_mod.GemmOp)
    op.exe = SimpleNamespace(spec=x.spec)
    op.outputs = ("h", "h_scale", "h_t", "h_t_scale")
    op.inputs = ("src", "x", "x_scale", "w_up", "w_up_scale", "expert_offsets")
    shapes = {n: op._output_shape(n) for n in op.outputs}
    assert shapes["h_t"].dims == (("src", 0, 15 * 8), 2048)
    assert shapes["h_t_scale"].dims == (("src", 0, 8 * 127, 128), 2048)
    op._output_dims = tuple(
        tuple(d if isinstance(d, int) else (op.inputs.index(d[0]), *d[1:]) for d in s.dims) for s in shapes.values()
    )
    op._unsized = None  # every output sized from the inputs
    assert not any(s.unsized for s in shapes.values())
    T = 300
    inputs = tuple(SimpleNamespace(shape=(T,) if n == "src" else (1,)) for n in op.inputs)
    sizes = dict(zip(op.outputs, op._sizes_of(inputs)))
    assert sizes["h"] == [T, 2048] and sizes["h_scale"] == [T, 16]
    assert sizes["h_t"] == [T + 15 * 8, 2048]
    assert sizes["h_t_scale"] == [(T + 8 * 127) // 128, 2048]  # the most rows 8 segments can need
