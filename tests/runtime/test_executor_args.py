"""Bad run-time arguments raise ArgumentError before anything touches a GPU.

Tensors here are fake `__cuda_array_interface__` objects: the executor checks
names, dtypes, shapes, strides, alignment and overlaps from metadata alone. Where
a call gets as far as the offsets values, `copy_to_host` is faked too.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import gemmspec
from gemmspec.errors import ArgumentError
from gemmspec.runtime import executor

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_fp8_forward.gspec"
T, N, K, E = 512, 4096, 7168, 8
GIB = 1 << 30

# Each tensor of good_args() at its own address, a GiB apart.
BASE = {name: (i + 1) * GIB for i, name in enumerate(["x", "x_scale", "w", "w_scale", "y", "expert_offsets"])}


class FakeCuda:
    """Just enough of a CUDA array for metadata checks."""

    def __init__(self, shape, typestr, strides=None, ptr=GIB, readonly=False):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr,
            "data": (ptr, readonly),
            "strides": strides,
            "version": 3,
        }


def good_args():
    return {
        "x": FakeCuda((T, K), "|u1", ptr=BASE["x"]),
        "x_scale": FakeCuda((T, K // 128), "<f4", strides=(4, T * 4), ptr=BASE["x_scale"]),  # MN-major
        "w": FakeCuda((E, N, K), "|u1", ptr=BASE["w"]),
        "w_scale": FakeCuda((E, N // 128, K // 128), "<f4", ptr=BASE["w_scale"]),
        "y": FakeCuda((T, N), "<u2", ptr=BASE["y"]),
        "expert_offsets": FakeCuda((E + 1,), "<i4", ptr=BASE["expert_offsets"]),
    }


@pytest.fixture
def offsets_on_host(monkeypatch):
    """Offsets read back as T tokens spread over the experts, so a call can pass validation."""
    values = np.linspace(0, T, E + 1).astype(np.int32)
    monkeypatch.setattr(executor, "copy_to_host", lambda a, shape: values.reshape(shape))


@pytest.fixture(scope="module")
def exe():
    return gemmspec.build(EXAMPLE)


def call(exe, **changes):
    args = good_args()
    for k, v in changes.items():
        if v is None:
            del args[k]
        else:
            args[k] = v
    with pytest.raises(ArgumentError) as info:
        exe(**args)
    return str(info.value)


def test_argument_names(exe):
    assert exe.argument_names() == ["x", "x_scale", "w", "w_scale", "y", "expert_offsets"]


def test_missing_tensor(exe):
    assert "missing tensor(s): w_scale" in call(exe, w_scale=None)


def test_unknown_tensor(exe):
    assert "unknown argument(s) bias" in call(exe, bias=FakeCuda((N,), "<f4"))


def test_host_array_rejected(exe):
    assert "is on the host" in call(exe, x=np.zeros((T, K), np.uint8))


def test_wrong_dtype(exe):
    msg = call(exe, y=FakeCuda((T, N), "<f4"))
    assert "'y'" in msg and "bf16" in msg and "f32" in msg


def test_wrong_rank(exe):
    assert "tensor 'x' must have 2 dims" in call(exe, x=FakeCuda((T, K, 1), "|u1"))


def test_inconsistent_runtime_dim(exe):
    assert "dim T is 512" in call(exe, y=FakeCuda((T + 1, N), "<u2"))


def test_wrong_fixed_dim(exe):
    assert "tensor 'w' must have shape [8, 4096, 7168]" in call(exe, w=FakeCuda((E, N, K - 128), "|u1"))


def test_wrong_strides(exe):
    msg = call(exe, x_scale=FakeCuda((T, K // 128), "<f4"))  # row-major, but declared major(T)
    assert "scale 'x_scale' must have element strides [1, 512] (major(T))" in msg


def test_operand_strides(exe):
    msg = call(exe, x=FakeCuda((T, K), "|u1", strides=(1, T)))
    assert "tensor 'x' must have element strides [7168, 1]" in msg


def test_misaligned(exe):
    assert "16-byte aligned" in call(exe, w=FakeCuda((E, N, K), "|u1", ptr=BASE["w"] + 8))


def test_offsets_dtype_and_shape(exe):
    assert "'expert_offsets' must be int32" in call(exe, expert_offsets=FakeCuda((E + 1,), "<i8"))
    assert "must have shape [9]" in call(exe, expert_offsets=FakeCuda((E,), "<i4"))


def test_scale_dtype(exe):
    assert "scale 'w_scale' must be float32" in call(exe, w_scale=FakeCuda((E, 32, 56), "<f8"))


def test_good_args_pass_validation(exe, offsets_on_host):
    bound = exe._bind(good_args())
    assert bound.dims == {"T": T} and set(bound.arrays) == set(exe.argument_names())


def test_wrong_fixed_dim_names_runtime_dims(exe):
    msg = call(exe, x=FakeCuda((T, K - 128), "|u1", ptr=BASE["x"]))
    assert "tensor 'x' must have shape [T, 7168], got [512, 7040]" in msg
    assert "None" not in msg


def test_wrong_rank_names_runtime_dims(exe):
    msg = call(exe, y=FakeCuda((T, N, 1), "<u2", ptr=BASE["y"]))
    assert "tensor 'y' must have 2 dims [T, 4096], got shape [512, 4096, 1]" in msg


@pytest.mark.parametrize(
    "cai",
    [
        {"typestr": "|u1", "data": (GIB, False), "version": 3},
        {"shape": (T, K), "typestr": "|u1", "version": 3},
        {"shape": (T, K), "typestr": "|u1", "data": None, "version": 3},
        {"shape": None, "typestr": "|u1", "data": (GIB, False), "version": 3},
        {"shape": (T, K), "typestr": "|u1", "data": ("0x40000000", False), "version": 3},
    ],
)
def test_malformed_cuda_array_interface(exe, cai):
    fake = FakeCuda((T, K), "|u1")
    fake.__cuda_array_interface__ = cai
    assert "tensor 'x' has a malformed __cuda_array_interface__" in call(exe, x=fake)


def test_strides_not_one_per_dim(exe):
    msg = call(exe, x=FakeCuda((T, K), "|u1", strides=(K,), ptr=BASE["x"]))
    assert "tensor 'x' has 1 byte strides [7168] for 2 dims [512, 7168]" in msg
    msg = call(exe, x=FakeCuda((T, K), "|u1", strides=(K, 1, 1), ptr=BASE["x"]))
    assert "tensor 'x' has 3 byte strides" in msg


def test_null_pointer(exe):
    assert "tensor 'w' has a null data pointer" in call(exe, w=FakeCuda((E, N, K), "|u1", ptr=0))


def test_offsets_misaligned(exe):
    msg = call(exe, expert_offsets=FakeCuda((E + 1,), "<i4", ptr=BASE["expert_offsets"] + 2))
    assert "'expert_offsets' must be 4-byte aligned (int32), got address 0x180000002" in msg


def test_output_is_the_input(exe):
    msg = call(exe, y=FakeCuda((T, N), "<u2", ptr=BASE["x"]))
    assert "output 'y' overlaps input 'x'" in msg
    assert "must not share memory with any other argument" in msg


def test_output_overlaps_input_tail(exe):
    # y starts on the last byte of w.
    msg = call(exe, y=FakeCuda((T, N), "<u2", ptr=BASE["w"] + E * N * K - 16))
    assert "output 'y' overlaps input 'w'" in msg


def test_output_overlaps_scale(exe):
    msg = call(exe, y=FakeCuda((T, N), "<u2", ptr=BASE["x_scale"] - 1024))
    assert "output 'y' overlaps scale 'x_scale'" in msg


def test_output_overlaps_offsets(exe):
    msg = call(exe, y=FakeCuda((T, N), "<u2", ptr=BASE["expert_offsets"] - 2 * T * N + 16))
    assert "output 'y' overlaps offsets 'expert_offsets'" in msg


def test_scale_inside_output(exe):
    # The scale's MN-major extent lies wholly inside y's.
    scale = FakeCuda((T, K // 128), "<f4", strides=(4, T * 4), ptr=BASE["y"] + 4096)
    assert "output 'y' overlaps scale 'x_scale'" in call(exe, x_scale=scale)


def test_output_adjacent_to_inputs_is_fine(exe, offsets_on_host):
    args = good_args()
    # y ends exactly where x begins; x_scale begins exactly where y ends.
    start = BASE["x"] - 2 * T * N
    args["y"] = FakeCuda((T, N), "<u2", ptr=start)
    args["x_scale"] = FakeCuda((T, K // 128), "<f4", strides=(4, T * 4), ptr=BASE["x"] + T * K)
    exe._bind(args)


def test_inputs_may_share_memory(exe, offsets_on_host):
    args = good_args()
    args["x"] = FakeCuda((T, K), "|u1", ptr=BASE["w"])  # read twice, written never
    exe._bind(args)


def test_read_only_output(exe):
    msg = call(exe, y=FakeCuda((T, N), "<u2", ptr=BASE["y"], readonly=True))
    assert "output 'y' is read-only; pass a writable tensor" in msg


def test_read_only_inputs_are_fine(exe, offsets_on_host):
    args = good_args()
    for name in ("x", "w", "expert_offsets"):
        cai = args[name].__cuda_array_interface__
        cai["data"] = (cai["data"][0], True)
    exe._bind(args)


CHAIN = """
gemm lora_chain {
  dim T
  dim K = 256, R = 16, N = 512

  tensor x : bf16 [T, K]
  tensor a : bf16 [R, K]
  tensor h : bf16 [T, R]
  tensor b : bf16 [N, R]
  tensor y : bf16 [T, N]

  h[t, r] = sum[k] x[t, k] * a[r, k]
  y[t, n] = sum[r] h[t, r] * b[n, r]
}
"""


@pytest.fixture(scope="module")
def chain():
    return gemmspec.build(CHAIN)


def chain_args(**ptrs):
    shapes = {"x": (T, 256), "a": (16, 256), "h": (T, 16), "b": (512, 16), "y": (T, 512)}
    base = {name: (i + 1) * GIB for i, name in enumerate(shapes)}
    base.update(ptrs)
    return {name: FakeCuda(shape, "<u2", ptr=base[name]) for name, shape in shapes.items()}


def test_tensor_written_then_read_is_one_argument(chain):
    bound = chain._bind(chain_args())
    assert list(bound.arrays) == ["x", "a", "h", "b", "y"]


def test_intermediate_must_not_overlap_its_input(chain):
    with pytest.raises(ArgumentError, match="output 'h' overlaps input 'x'"):
        chain._bind(chain_args(h=GIB + 64))


def test_outputs_must_not_overlap_each_other(chain):
    with pytest.raises(ArgumentError, match="output 'h' overlaps output 'y'"):
        chain._bind(chain_args(y=3 * GIB))


IN_PLACE = """
gemm square {
  dim T
  dim K = 256, N = 256
  tensor x : bf16 [T, K]
  tensor w : bf16 [N, K]
  tensor y : bf16 [T, N]
  y[t, n] = sum[k] x[t, k] * w[n, k]
}
"""


def test_in_place_output_is_the_same_memory():
    exe = gemmspec.build(IN_PLACE)
    args = {
        "x": FakeCuda((T, 256), "<u2", ptr=GIB),
        "w": FakeCuda((256, 256), "<u2", ptr=2 * GIB),
        "y": FakeCuda((T, 256), "<u2", ptr=GIB),
    }
    with pytest.raises(ArgumentError, match="output 'y' is the same memory as input 'x'"):
        exe(**args)


def test_per_tensor_scales_have_one_entry_per_tensor_or_expert():
    # `scale f32 [T, K]` is one scale for all of h, whatever T is: [1, 1]; w's [1, N, K]
    # one per expert: [E, 1, 1].
    per_tensor = gemmspec.build(EXAMPLE.parent / "moe_fp8_tensorwise.gspec")
    n, k = 7168, 2048  # a down-projection
    args = {
        "h": FakeCuda((T, k), "|u1", ptr=BASE["x"]),
        "h_scale": FakeCuda((1, 1), "<f4", ptr=BASE["x_scale"]),
        "w": FakeCuda((E, n, k), "|u1", ptr=BASE["w"]),
        "w_scale": FakeCuda((E, 1, 1), "<f4", ptr=BASE["w_scale"]),
        "y": FakeCuda((T, n), "<u2", ptr=BASE["y"]),
        "expert_offsets": FakeCuda((E + 1,), "<i4", ptr=BASE["expert_offsets"]),
    }

    def refused(**changes) -> str:
        with pytest.raises(ArgumentError) as info:
            per_tensor(**{**args, **changes})
        return str(info.value)

    msg = refused(h_scale=FakeCuda((T, 1), "<f4", ptr=BASE["x_scale"]))
    assert "scale 'h_scale' must have shape [1, 1], got [512, 1]" in msg
    msg = refused(w_scale=FakeCuda((E, n // 128, 1), "<f4", strides=(4, 4, 4), ptr=BASE["w_scale"]))
    assert "scale 'w_scale' must have shape [8, 1, 1], got [8, 56, 1]" in msg


# ---- an FP8 output: its scales are an output argument too ----------------------------------
FP8_OUT = """
gemm fp8_out {
  dim T
  dim N = 512, K = 256
  group expert[E = 4] = ragged(T, offsets = offs)
  tensor x : e4m3 [T, K] scale f32 [1, 128]
  tensor w : e4m3 [E, N, K] scale f32 [1, 128, 128]
  tensor y : e4m3 [T, N] scale f32 [1, 128]
  y[t, n] = sum[k] x[t, k] * w[expert(t), n, k]
}
"""
FP8_BASE = {name: (i + 1) * GIB for i, name in enumerate(["x", "x_scale", "w", "w_scale", "y", "y_scale", "offs"])}


def fp8_out_args(**changes):
    args = {
        "x": FakeCuda((T, 256), "|u1", ptr=FP8_BASE["x"]),
        "x_scale": FakeCuda((T, 2), "<f4", ptr=FP8_BASE["x_scale"]),
        "w": FakeCuda((4, 512, 256), "|u1", ptr=FP8_BASE["w"]),
        "w_scale": FakeCuda((4, 4, 2), "<f4", ptr=FP8_BASE["w_scale"]),
        "y": FakeCuda((T, 512), "|u1", ptr=FP8_BASE["y"]),
        "y_scale": FakeCuda((T, 4), "<f4", ptr=FP8_BASE["y_scale"]),
        "offs": FakeCuda((5,), "<i4", ptr=FP8_BASE["offs"]),
    }
    args.update(changes)
    return args


@pytest.fixture(scope="module")
def fp8_out():
    return gemmspec.build(FP8_OUT)


def test_fp8_output_scales_are_an_output(fp8_out, monkeypatch):
    assert fp8_out.argument_names() == ["x", "x_scale", "w", "w_scale", "y", "y_scale", "offs"]
    assert fp8_out._argument_roles()["y_scale"] == "output"
    values = np.linspace(0, T, 5).astype(np.int32)
    monkeypatch.setattr(executor, "copy_to_host", lambda a, shape: values.reshape(shape))
    fp8_out._bind(fp8_out_args())
    with pytest.raises(ArgumentError, match="output 'y_scale' is read-only"):
        fp8_out._bind(fp8_out_args(y_scale=FakeCuda((T, 4), "<f4", ptr=FP8_BASE["y_scale"], readonly=True)))
    with pytest.raises(ArgumentError, match="output 'y_scale' overlaps input 'x'"):
        fp8_out._bind(fp8_out_args(y_scale=FakeCuda((T, 4), "<f4", ptr=FP8_BASE["x"])))
    with pytest.raises(ArgumentError, match="scale 'y_scale' must have"):
        fp8_out._bind(fp8_out_args(y_scale=FakeCuda((T, 8), "<f4", ptr=FP8_BASE["y_scale"])))
