"""as_device_array and DeviceArray on the CPU: conversions and the errors users see."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from gemmspec.errors import ArgumentError
from gemmspec.runtime.arrays import DTYPES, DeviceArray, as_device_array, numpy_dtype

PTR = 1 << 20


class FakeCAI:
    """A device array seen only through the CUDA array interface (v3)."""

    def __init__(self, shape: tuple[int, ...], typestr: str, strides: Any = None, **extra: Any):
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (PTR, False),
            "strides": strides,
            "version": 3,
            **extra,
        }


class HostDLPack:
    """Exports a host numpy array through DLPack only (no array or CUDA array interface)."""

    def __init__(self, array: np.ndarray):
        self._array = array

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()


def test_host_numpy_rejected() -> None:
    with pytest.raises(ArgumentError, match="tensor 'x' is on the host; pass a CUDA tensor"):
        as_device_array(np.zeros((2, 3), np.float32), name="x")


def test_host_dlpack_rejected() -> None:
    with pytest.raises(ArgumentError, match="tensor 'x' is on the host"):
        as_device_array(HostDLPack(np.zeros(4, np.float32)), name="x")


def test_missing_tensor() -> None:
    with pytest.raises(ArgumentError, match="tensor 'scale_a' is missing"):
        as_device_array(None, name="scale_a")


def test_unsupported_object_named() -> None:
    with pytest.raises(ArgumentError, match=r"tensor 'a' has unsupported type list.*CUDA"):
        as_device_array([1.0, 2.0], name="a")


def test_cai_byte_strides_become_element_strides() -> None:
    obj = FakeCAI((4, 8), "<f4", strides=(4, 16))  # column-major f32
    arr = as_device_array(obj, name="a")
    assert arr == DeviceArray(PTR, (4, 8), (1, 4), "f32", 0)
    assert arr.owner is obj and arr.itemsize == 4


def test_cai_without_strides_is_c_contiguous() -> None:
    arr = as_device_array(FakeCAI((2, 3, 5), "<f2"), name="a")
    assert arr.strides == (15, 5, 1) and arr.dtype == "f16"


@pytest.mark.parametrize(
    ("typestr", "dtype"),
    [("<f4", "f32"), ("<f8", "f64"), ("<f2", "f16"), ("<i4", "i32"), ("<i8", "i64"), ("|u1", "u8")],
)
def test_cai_typestrs(typestr: str, dtype: str) -> None:
    assert as_device_array(FakeCAI((8,), typestr), name="t").dtype == dtype


def test_cupy_like_device_id() -> None:
    obj = FakeCAI((8,), "<f4")
    obj.device = SimpleNamespace(id=1)
    assert as_device_array(obj, name="t").device == 1


@pytest.mark.parametrize("typestr", ["<c8", "|b1", "|i1", ">f4", "<u4"])
def test_cai_unsupported_typestr(typestr: str) -> None:
    with pytest.raises(ArgumentError, match=r"tensor 'w' has unsupported element type"):
        as_device_array(FakeCAI((8,), typestr), name="w")


def test_cai_invalid_typestr() -> None:
    with pytest.raises(ArgumentError, match="invalid typestr"):
        as_device_array(FakeCAI((8,), "zz9"), name="w")


def test_cai_misaligned_strides() -> None:
    with pytest.raises(ArgumentError, match="not multiples of its 4-byte elements"):
        as_device_array(FakeCAI((4, 4), "<f4", strides=(18, 4)), name="a")


def test_cai_masked_rejected() -> None:
    with pytest.raises(ArgumentError, match="masked"):
        as_device_array(FakeCAI((4,), "<f4", mask=object()), name="a")


@pytest.mark.parametrize("hint", ["e4m3", "e5m2"])
def test_fp8_from_uint8_with_hint(hint: str) -> None:
    arr = as_device_array(FakeCAI((16, 32), "|u1"), name="a", dtype_hint=hint)
    assert arr.dtype == hint and arr.strides == (32, 1) and arr.itemsize == 1


@pytest.mark.parametrize("typestr", ["<V2", "|V2", "<u2"])
def test_bf16_from_raw_two_bytes_with_hint(typestr: str) -> None:
    arr = as_device_array(FakeCAI((4, 8), typestr, strides=(16, 2)), name="b", dtype_hint="bf16")
    assert arr.dtype == "bf16" and arr.strides == (8, 1)


def test_raw_two_bytes_without_hint_asks_for_one() -> None:
    with pytest.raises(ArgumentError, match="untyped 16-bit data; pass dtype_hint="):
        as_device_array(FakeCAI((4,), "<V2"), name="b")


@pytest.mark.parametrize(
    ("typestr", "hint"), [("|u1", "bf16"), ("<f4", "e4m3"), ("<u2", "e4m3"), ("<f2", "bf16")]
)
def test_hint_cannot_change_size_or_retype_typed_data(typestr: str, hint: str) -> None:
    with pytest.raises(ArgumentError, match=f"tensor 'a' holds .* data, which cannot be read as {hint} "):
        as_device_array(FakeCAI((4,), typestr), name="a", dtype_hint=hint)


def test_hint_equal_to_dtype_is_accepted() -> None:
    assert as_device_array(FakeCAI((4,), "<f4"), name="a", dtype_hint="f32").dtype == "f32"


def test_unknown_hint() -> None:
    with pytest.raises(ArgumentError, match="dtype_hint 'fp8'"):
        as_device_array(FakeCAI((4,), "|u1"), name="a", dtype_hint="fp8")


def test_device_array_passthrough_and_retype() -> None:
    arr = DeviceArray(PTR, (4,), (1,), "u8", 0)
    assert as_device_array(arr, name="a") is arr
    fp8 = as_device_array(arr, name="a", dtype_hint="e4m3")
    assert fp8.dtype == "e4m3" and fp8.ptr == PTR


def test_numpy_dtypes() -> None:
    assert numpy_dtype("e4m3") == np.dtype(ml_dtypes.float8_e4m3fn)
    assert numpy_dtype("bf16") == np.dtype(ml_dtypes.bfloat16)
    assert {numpy_dtype(d).itemsize for d in DTYPES} == {1, 2, 4, 8}
    with pytest.raises(ArgumentError, match="unknown dtype"):
        numpy_dtype("f128")


def test_torch_cpu_tensor_rejected() -> None:
    torch = pytest.importorskip("torch")
    with pytest.raises(ArgumentError, match="tensor 'x' is on cpu, not a CUDA device"):
        as_device_array(torch.zeros(4), name="x")


class RawCAI:
    """An object whose __cuda_array_interface__ is exactly what the test says."""

    def __init__(self, interface: Any):
        self.__cuda_array_interface__ = interface


def interface(**changes: Any) -> dict:
    """A valid f32[4, 8] interface with `changes` applied (None removes a key)."""
    cai = {"shape": (4, 8), "typestr": "<f4", "data": (PTR, False), "strides": None, "version": 3}
    for key, value in changes.items():
        if value is None:
            cai.pop(key)
        else:
            cai[key] = value
    return cai


@pytest.mark.parametrize(
    ("cai", "message"),
    [
        (interface(shape=None), "no 'shape'"),
        (interface(data=None), "no 'data'"),
        (interface(typestr=None), "no 'typestr'"),
        (interface(shape=None, data=None), "no 'shape', 'data'"),
        ({**interface(), "data": None}, "'data' is None, not a"),
        (interface(data=PTR), "'data' is 1048576, not a"),
        (interface(data=(PTR,)), "'data' is \\(1048576,\\), not a"),
        (interface(data=(str(PTR), False)), "'data' is \\('1048576', False\\)"),
        (interface(data=(float(PTR), False)), "'data' is \\(1048576.0, False\\)"),
        (interface(data=(PTR, "no")), "'data' is \\(1048576, 'no'\\)"),
        (interface(data=(-16, False)), "'data' is \\(-16, False\\)"),
        (interface(shape="4x8"), "'shape' is '4x8', not a tuple of integers"),
        (interface(shape=4), "'shape' is 4, not a tuple of integers"),
        (interface(shape=(4.0, 8)), "'shape' is \\(4.0, 8\\), not a tuple of integers"),
        (interface(shape=(True, 8)), "'shape' is \\(True, 8\\)"),
        (interface(typestr=b"<f4"), "'typestr' is b'<f4', not a string"),
        (interface(typestr=4), "'typestr' is 4, not a string"),
        (interface(strides="row"), "'strides' is 'row', not a tuple of integers"),
        (interface(strides=(32, "4")), "'strides' is \\(32, '4'\\)"),
    ],
)
def test_cai_malformed_is_an_argument_error(cai: dict, message: str) -> None:
    with pytest.raises(ArgumentError, match=rf"tensor 'x' has a malformed __cuda_array_interface__.*{message}"):
        as_device_array(RawCAI(cai), name="x")


@pytest.mark.parametrize("cai", [None, [("shape", (4,))], "{}"])
def test_cai_not_a_dict(cai: Any) -> None:
    with pytest.raises(ArgumentError, match=r"malformed __cuda_array_interface__: a \w+, not a dict"):
        as_device_array(RawCAI(cai), name="x")


def test_cai_numpy_integers_are_integers() -> None:
    cai = interface(shape=(np.int64(4), np.int32(8)), data=(np.uint64(PTR), np.bool_(False)))
    arr = as_device_array(RawCAI(cai), name="x")
    assert arr.shape == (4, 8) and arr.ptr == PTR and not arr.readonly


@pytest.mark.parametrize("strides", [(32,), (32, 4, 4)])
def test_cai_strides_one_per_dim(strides: tuple[int, ...]) -> None:
    n = len(strides)
    with pytest.raises(
        ArgumentError, match=rf"tensor 'x' has {n} byte strides .* for 2 dims \[4, 8\]; expected one stride per dim"
    ):
        as_device_array(FakeCAI((4, 8), "<f4", strides=strides), name="x")


def test_device_array_strides_one_per_dim() -> None:
    with pytest.raises(ArgumentError, match=r"tensor 'x' has 1 strides \[1\] for 2 dims \[4, 8\]"):
        as_device_array(DeviceArray(PTR, (4, 8), (1,), "f32", 0), name="x")


def test_negative_extent_rejected() -> None:
    with pytest.raises(ArgumentError, match=r"tensor 'x' has a negative extent in shape \[-1, 8\]"):
        as_device_array(DeviceArray(PTR, (-1, 8), (8, 1), "f32", 0), name="x")


def test_null_pointer_rejected_when_there_is_data() -> None:
    with pytest.raises(ArgumentError, match="tensor 'x' has a null data pointer but 32 elements"):
        as_device_array(RawCAI(interface(data=(0, False))), name="x")


def test_null_pointer_accepted_when_empty() -> None:
    arr = as_device_array(RawCAI(interface(shape=(0, 8), data=(0, False))), name="x")
    assert arr.ptr == 0 and arr.size == 0 and arr.byte_extent() is None


def test_cai_read_only_flag() -> None:
    assert as_device_array(RawCAI(interface(data=(PTR, True))), name="x").readonly
    assert not as_device_array(RawCAI(interface()), name="x").readonly


def test_retype_keeps_read_only_flag() -> None:
    arr = DeviceArray(PTR, (4,), (1,), "u8", 0, readonly=True)
    assert as_device_array(arr, name="a", dtype_hint="e4m3").readonly


def test_dlpack_read_only_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    from gemmspec.runtime import arrays

    view = SimpleNamespace(
        ptr=PTR, shape=(4,), strides=None, dtype=np.dtype("<f4"),
        device_id=0, is_device_accessible=True, readonly=True,
    )
    fake = SimpleNamespace(from_dlpack=lambda obj, stream_ptr: view)
    monkeypatch.setattr(arrays, "StridedMemoryView", fake)
    arr = as_device_array(HostDLPack(np.zeros(4, np.float32)), name="x")
    assert arr.readonly and arr.ptr == PTR and arr.shape == (4,)


@pytest.mark.parametrize(
    ("shape", "strides", "dtype", "extent"),
    [
        ((4, 8), (8, 1), "f32", (PTR, PTR + 128)),
        ((4, 8), (1, 4), "bf16", (PTR, PTR + 64)),
        ((4, 8), (16, 1), "u8", (PTR, PTR + 56)),  # padded rows: the gap inside counts
        ((4,), (-1,), "f32", (PTR - 12, PTR + 4)),
        ((3, 1), (0, 5), "f32", (PTR, PTR + 4)),
        ((), (), "f64", (PTR, PTR + 8)),
        ((4, 0), (0, 1), "f32", None),
    ],
)
def test_byte_extent(shape, strides, dtype, extent) -> None:
    assert DeviceArray(PTR, shape, strides, dtype, 0).byte_extent() == extent
