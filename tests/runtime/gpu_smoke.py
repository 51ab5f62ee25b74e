"""GPU smoke test of gemmspec.runtime, run by hand on a Hopper machine (not collected by pytest).

    python3 tests/runtime/gpu_smoke.py

Compiles small kernels through compile_cubin, launches them through LoadedKernel with
DeviceBuffers, null pointers and numpy scalars, needs >48 KB of dynamic shared memory,
and exercises torch / CuPy interop when those are installed. Prints one PASS, FAIL or
SKIP line per check and exits non-zero if any check failed.
"""

from __future__ import annotations

import sys
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

from gemmspec.errors import ArgumentError, GemmspecError  # noqa: E402
from gemmspec.runtime.arrays import (  # noqa: E402
    DeviceArray,
    DeviceBuffer,
    as_device_array,
    get_device,
)
from gemmspec.runtime.launch import LoadedKernel, current_stream, num_sms  # noqa: E402
from gemmspec.runtime.nvrtc import compile_cubin, disassemble  # noqa: E402

SRC = r"""
extern "C" __global__ void saxpy(const float* x, float* y, float a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = a * x[i] + y[i];
}
extern "C" __global__ void scale_or_keep(float* y, const float* scale, int n) {
  float s = scale ? *scale : 1.0f;
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] *= s;
}
extern "C" __global__ void reverse_smem(const float* x, float* out, int n) {
  extern __shared__ float s[];
  for (int i = threadIdx.x; i < n; i += blockDim.x) s[i] = x[i];
  __syncthreads();
  for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = s[n - 1 - i];
}
extern "C" __global__ void add_i64(long long* p, long long v) { p[threadIdx.x] += v; }
"""

# The FP8 wgmma probe is the one the CPU test disassembles; here it is also loaded.
from test_nvrtc import WGMMA_SRC  # noqa: E402

CACHE = tempfile.mkdtemp(prefix="gemmspec-smoke-")
CHECKS: list[Callable[[], str | None]] = []


class Skip(Exception):
    """A check that cannot run here (a missing optional package)."""


def check(fn: Callable[[], str | None]) -> Callable[[], str | None]:
    CHECKS.append(fn)
    return fn


def expect_raises(exc: type[BaseException], fn: Callable[[], object], text: str = "") -> None:
    try:
        fn()
    except exc as e:
        if text not in str(e):
            raise AssertionError(f"{exc.__name__} raised, but {text!r} not in {e}") from e
        return
    raise AssertionError(f"expected {exc.__name__}")


def kernel(name: str) -> LoadedKernel:
    return LoadedKernel(compile_cubin(SRC, name="smoke", cache_dir=CACHE), name)


def saxpy_reference(n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    return rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)


@check
def device_info() -> str:
    dev = get_device(0)
    cc = dev.compute_capability
    assert num_sms() > 0
    return f"{dev.name}, sm_{cc.major}{cc.minor}, {num_sms()} SMs"


@check
def compile_then_cache_hit() -> str:
    first = compile_cubin(SRC, name="smoke", cache_dir=CACHE)
    again = compile_cubin(SRC, name="smoke", cache_dir=CACHE)
    assert again.from_cache and again.cubin == first.cubin
    return f"{len(first.cubin)} B cubin, key {first.key[:16]}"


@check
def saxpy_buffers_and_scalars() -> None:
    n = 1000
    x, y = saxpy_reference(n)
    dx, dy = DeviceBuffer.from_numpy(x), DeviceBuffer.from_numpy(y)
    kernel("saxpy").launch((n + 255) // 256, 256, 0, None, dx, dy, np.float32(2.0), np.int32(n))
    np.testing.assert_allclose(dy.to_numpy(n, np.float32), 2.0 * x + y, rtol=1e-6)


@check
def device_array_views() -> None:
    n = 512
    x, y = saxpy_reference(n)
    dx, dy = DeviceBuffer.from_numpy(x), DeviceBuffer.from_numpy(y)
    vx, vy = dx.view((n,), "f32"), dy.view((n,), "f32")
    assert isinstance(as_device_array(vx, name="x"), DeviceArray)
    kernel("saxpy").launch(2, 256, 0, None, vx, vy, np.float32(-1.0), np.int32(n))
    np.testing.assert_allclose(dy.to_numpy(n, "f32"), y - x, rtol=1e-6)


@check
def null_pointer_argument() -> None:
    n = 300
    y = np.arange(n, dtype=np.float32)
    dy = DeviceBuffer.from_numpy(y)
    k = kernel("scale_or_keep")
    k.launch(2, 256, 0, None, dy, None, np.int32(n))
    np.testing.assert_array_equal(dy.to_numpy(n, np.float32), y)
    k.launch(2, 256, 0, None, dy, DeviceBuffer.from_numpy(np.float32([3.0])), np.int32(n))
    np.testing.assert_array_equal(dy.to_numpy(n, np.float32), 3 * y)


@check
def int64_by_value() -> None:
    p = DeviceBuffer.from_numpy(np.zeros(32, np.int64))
    kernel("add_i64").launch(1, 32, 0, None, p, np.int64(1 << 40))
    assert (p.to_numpy(32, np.int64) == 1 << 40).all()


@check
def dynamic_smem_above_48k() -> str:
    n = 100 * 1024 // 4  # 100 KB of floats in shared memory
    x = np.arange(n, dtype=np.float32)
    dx, dout = DeviceBuffer.from_numpy(x), DeviceBuffer(4 * n)
    k = kernel("reverse_smem")
    k.launch(1, 256, 4 * n, None, dx, dout, np.int32(n))  # raises the limit itself
    np.testing.assert_array_equal(dout.to_numpy(n, np.float32), x[::-1])
    k.set_max_dynamic_smem(200 * 1024)
    k.launch(1, 256, 200 * 1024, None, dx, dout, np.int32(n))
    expect_raises(ArgumentError, lambda: k.set_max_dynamic_smem(300 * 1024), "allows")
    return "100 KB and 200 KB launches ok; 300 KB rejected"


@check
def argument_checks() -> None:
    k = kernel("saxpy")
    buf = DeviceBuffer(64)
    expect_raises(ArgumentError, lambda: k.launch(1, 32, 0, None, buf, buf, 2.0, np.int32(16)))
    expect_raises(
        ArgumentError, lambda: k.launch(1, 32, 0, None, buf, buf, np.float32(2)), "takes 4"
    )
    expect_raises(
        ArgumentError,
        lambda: k.launch(1, 32, 0, None, buf, buf, np.float32(2), np.int64(16)),
        "4-byte parameter",
    )


@check
def launch_error_is_gemmspec_error() -> None:
    k = kernel("saxpy")
    buf = DeviceBuffer(64)
    args = (buf, buf, np.float32(1), np.int32(0))
    expect_raises(GemmspecError, lambda: k.launch(1, 4096, 0, None, *args), "launching saxpy")


@check
def cuda_core_and_handle_streams() -> None:
    n = 256
    x, y = saxpy_reference(n)
    dx, dy = DeviceBuffer.from_numpy(x), DeviceBuffer.from_numpy(y)
    stream = get_device(0).create_stream()
    k = kernel("saxpy")
    k.launch(1, 256, 0, stream, dx, dy, np.float32(1.0), np.int32(n))
    k.launch(1, 256, 0, int(stream.handle), dx, dy, np.float32(1.0), np.int32(n))
    assert current_stream(0) == get_device(0).default_stream
    stream.sync()
    np.testing.assert_allclose(dy.to_numpy(n, np.float32), y + 2 * x, rtol=1e-6)


@check
def sm90a_wgmma_cubin_loads() -> str:
    cubin = compile_cubin(WGMMA_SRC, name="wgmma_probe", cache_dir=CACHE)
    LoadedKernel(cubin, "wgmma_probe")
    try:
        sass = disassemble(cubin.cubin)
    except GemmspecError as e:
        return f"loaded; no SASS check ({e})"
    assert "QGMMA.64x16x32.F32.E4M3.E4M3" in sass
    return "loaded; SASS has QGMMA"


@check
def torch_interop() -> str:
    try:
        import torch
    except ImportError as e:
        raise Skip("torch not installed") from e
    a = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)[:, :96]
    arr = as_device_array(a, name="a")
    assert (arr.ptr, arr.shape, arr.strides, arr.dtype) == (
        a.data_ptr(),
        (64, 96),
        (128, 1),
        "bf16",
    )
    f8 = torch.zeros(32, 64, device="cuda", dtype=torch.float8_e4m3fn)
    assert as_device_array(f8, name="f8").dtype == "e4m3"
    u8 = torch.zeros(32, 64, device="cuda", dtype=torch.uint8)
    assert as_device_array(u8, name="u8", dtype_hint="e5m2").dtype == "e5m2"
    expect_raises(ArgumentError, lambda: as_device_array(torch.zeros(4), name="x"), "not a CUDA")

    n = 4096
    x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
    expected = 3 * x + y
    k = kernel("saxpy")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dx, dy = as_device_array(x, name="x"), as_device_array(y, name="y")
        k.launch(n // 256, 256, 0, torch.cuda.current_stream(), dx, dy, np.float32(3), np.int32(n))
    side.synchronize()
    torch.testing.assert_close(y, expected)

    class OnlyDLPack:
        def __init__(self, t: object):
            self.t = t

        def __dlpack__(self, **kw: object) -> object:
            return self.t.__dlpack__(**kw)

        def __dlpack_device__(self) -> tuple[int, int]:
            return self.t.__dlpack_device__()

    via = as_device_array(OnlyDLPack(x), name="x")
    assert (via.ptr, via.shape, via.dtype, via.device) == (x.data_ptr(), (n,), "f32", 0)
    return f"torch {torch.__version__}"


@check
def cupy_interop() -> str:
    try:
        import cupy
    except ImportError as e:
        raise Skip("cupy not installed") from e
    n = 1024
    with cupy.cuda.Stream(non_blocking=True) as s:
        x = cupy.arange(n, dtype=cupy.float32)
        y = cupy.ones(n, dtype=cupy.float32)
        dx, dy = as_device_array(x, name="x"), as_device_array(y, name="y")
        assert dx.device == 0 and dx.ptr == x.data.ptr
        kernel("saxpy").launch(n // 256, 256, 0, s, dx, dy, np.float32(2), np.int32(n))
        s.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(y), 2 * np.arange(n) + 1)
    fp8 = as_device_array(cupy.zeros((16, 32), cupy.uint8), name="f", dtype_hint="e4m3")
    assert fp8.dtype == "e4m3" and fp8.strides == (32, 1)
    return f"cupy {cupy.__version__}"


def main() -> int:
    counts = {"PASS": 0, "FAIL": 0, "SKIP": 0}
    for fn in CHECKS:
        try:
            note = fn()
        except Skip as e:
            counts["SKIP"] += 1
            print(f"SKIP {fn.__name__}: {e}")
        except Exception as e:  # report every check, whatever it raises
            counts["FAIL"] += 1
            print(f"FAIL {fn.__name__}: {type(e).__name__}: {e}")
            traceback.print_exc(file=sys.stdout)
        else:
            counts["PASS"] += 1
            print(f"PASS {fn.__name__}" + (f" ({note})" if note else ""))
    print(", ".join(f"{n} {k}" for k, n in counts.items()))
    return 1 if counts["FAIL"] else 0


if __name__ == "__main__":
    sys.exit(main())
