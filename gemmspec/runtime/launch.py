"""Load a cubin and launch its kernels (cuda.core), with arguments checked against the ABI.

cuda.core passes a Python int as a pointer and cannot tell an int32 from an int64, so
`LoadedKernel.launch` accepts only unambiguous arguments: device arrays and buffers
(their pointer), None (a null pointer) and numpy scalars (by value), and checks each
one's size against the kernel's parameter table before launching.

`LoadedKernel.bind` does those checks once for a launch that is repeated with new
pointers: its arguments are packed into a parameter block when bound, and the
pointers that change from call to call are read from `ArgumentCells` that every
launch of a run shares, so a call writes each pointer once and calls the driver
directly for each kernel. A launch bound as `programmatic` goes through
cuLaunchKernelEx with the programmatic stream serialization attribute (a programmatic
dependent launch: the kernel may start while the one before it on the stream runs),
its launch configuration built once as well.
"""

from __future__ import annotations

import threading
from array import array
from typing import Any

import numpy as np
from cuda.bindings import driver
from cuda.core import LaunchConfig, ObjectCode, Stream
from cuda.core import launch as _cuda_launch
from cuda.core._utils.cuda_utils import CUDAError

from gemmspec.errors import ArgumentError, GemmspecError
from gemmspec.runtime.arrays import DeviceArray, DeviceBuffer, get_device
from gemmspec.runtime.nvrtc import CompiledCubin

__all__ = ["ArgumentCells", "BoundLaunch", "LoadedKernel", "current_stream", "num_sms"]

_MAX_DYNAMIC_SMEM = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_STATIC_SMEM = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES
_CARVEOUT = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_MAX_SHARED_CARVEOUT = 100  # percent of the unified L1/shared memory given to shared memory
_POINTER_SIZE = 8
_PROGRAMMATIC = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_launch_kernel = driver.cuLaunchKernel
_launch_kernel_ex = driver.cuLaunchKernelEx


def num_sms(device: int = 0) -> int:
    """Number of SMs: the size of a persistent grid."""
    return get_device(device).properties.multiprocessor_count


def current_stream(stream: object = None, *, device: int = 0) -> Stream:
    """A cuda.core Stream for what the caller passed.

    Accepts None (the device's default stream), a cuda.core Stream, a torch or CuPy
    stream, anything with ``__cuda_stream__``, or a raw CUstream handle as an int
    (0 is the default stream).
    """
    if isinstance(stream, Stream):
        return stream
    handle = 0 if stream is None else _stream_handle(stream)
    dev = get_device(device)
    return dev.default_stream if handle == 0 else Stream.from_handle(handle)


def _stream_handle(stream: object) -> int:
    if isinstance(stream, int) and not isinstance(stream, bool):
        return stream
    if hasattr(stream, "__cuda_stream__"):
        return int(stream.__cuda_stream__()[1])
    for attr in ("cuda_stream", "ptr"):  # torch.cuda.Stream, cupy.cuda.Stream
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    raise ArgumentError(
        f"cannot use a {type(stream).__qualname__} as a CUDA stream; pass a torch, CuPy or "
        "cuda.core stream, a CUstream handle (int), or None"
    )


def _checked(result: tuple, what: str) -> Any:
    """Unpack a cuda.bindings (err, value...) tuple, raising GemmspecError on failure."""
    err = result[0]
    if err != driver.CUresult.CUDA_SUCCESS:
        raise GemmspecError(f"{what} failed: {err.name}")
    return result[1] if len(result) == 2 else None


class LoadedKernel:
    """One `extern "C"` kernel of a cubin, loaded on a device and ready to launch."""

    def __init__(self, cubin: bytes | CompiledCubin, name: str, *, device: int = 0):
        dev = get_device(device)
        self.name = name
        self.device = dev.device_id
        data = cubin.cubin if isinstance(cubin, CompiledCubin) else cubin
        try:
            self._module = ObjectCode.from_cubin(data, name=name)
            self._kernel = self._module.get_kernel(name)
        except CUDAError as e:
            cc = dev.compute_capability
            raise GemmspecError(
                f"cannot load kernel {name!r} on device {self.device} "
                f"(sm_{cc.major}{cc.minor}): {e}"
            ) from e
        self._cu_kernel = driver.CUkernel(int(self._kernel.handle))
        # cuLaunchKernel takes a library kernel where it takes a function.
        self._cu_function = driver.CUfunction(int(self._kernel.handle))
        self._cu_device = driver.CUdevice(self.device)
        self._smem_limit = self._attribute(_MAX_DYNAMIC_SMEM)
        self._param_sizes = self._parameter_sizes()

    def _attribute(self, attr: driver.CUfunction_attribute) -> int:
        result = driver.cuKernelGetAttribute(attr, self._cu_kernel, self._cu_device)
        return int(_checked(result, f"cuKernelGetAttribute({attr.name})"))

    def _parameter_sizes(self) -> list[int] | None:
        """Byte size of each kernel parameter, or None where the driver (< 12.4) cannot say."""
        try:
            return [info.size for info in self._kernel.arguments_info]
        except (NotImplementedError, CUDAError):
            return None

    def set_max_dynamic_smem(self, nbytes: int) -> None:
        """Allow launches with up to `nbytes` of dynamic shared memory (needed above 48 KB)."""
        static = self._attribute(_STATIC_SMEM)
        optin = get_device(self.device).properties.max_shared_memory_per_block_optin
        if nbytes + static > optin:
            raise ArgumentError(
                f"kernel {self.name!r} asks for {nbytes} B of dynamic shared memory on top of "
                f"{static} B static; the device allows {optin} B per block"
            )
        result = driver.cuKernelSetAttribute(
            _MAX_DYNAMIC_SMEM, nbytes, self._cu_kernel, self._cu_device
        )
        _checked(result, f"setting {self.name}'s dynamic shared memory to {nbytes} B")
        # The whole carveout as shared memory: a kernel meant to run two blocks per SM
        # would otherwise be held to one by a carveout sized for a single block.
        result = driver.cuKernelSetAttribute(_CARVEOUT, _MAX_SHARED_CARVEOUT, self._cu_kernel, self._cu_device)
        _checked(result, f"setting {self.name}'s shared-memory carveout")
        self._smem_limit = nbytes

    def launch(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        smem_bytes: int,
        stream: object,
        *args: object,
    ) -> None:
        """Launch asynchronously on `stream` (see `current_stream` for what it may be).

        Raises the dynamic shared memory limit first when `smem_bytes` needs it.
        """
        if self._param_sizes is not None and len(args) != len(self._param_sizes):
            raise ArgumentError(
                f"kernel {self.name!r} takes {len(self._param_sizes)} arguments, got {len(args)}"
            )
        kernel_args = [self._kernel_arg(i, a) for i, a in enumerate(args)]
        if smem_bytes > self._smem_limit:
            self.set_max_dynamic_smem(smem_bytes)
        cuda_stream = current_stream(stream, device=self.device)
        try:
            config = LaunchConfig(grid=grid, block=block, shmem_size=smem_bytes)
        except ValueError as e:
            raise ArgumentError(f"bad launch configuration for {self.name}: {e}") from e
        try:
            _cuda_launch(cuda_stream, config, self._kernel, *kernel_args)
        except CUDAError as e:
            raise GemmspecError(
                f"launching {self.name} (grid={grid}, block={block}, smem={smem_bytes} B) "
                f"failed: {e}"
            ) from e

    def _kernel_arg(self, index: int, arg: object) -> object:
        """What cuda.core should pass for `arg`: an int is a pointer, a numpy scalar a value."""
        if arg is None:
            value, size = 0, _POINTER_SIZE
        elif isinstance(arg, (DeviceArray, DeviceBuffer)):
            if arg.device != self.device:
                raise ArgumentError(
                    f"argument {index} of {self.name!r} lives on device {arg.device}, "
                    f"the kernel on device {self.device}"
                )
            value, size = arg.ptr, _POINTER_SIZE
        elif isinstance(arg, np.generic) and arg.dtype.kind in "biuf":
            value, size = arg, arg.dtype.itemsize
        else:
            raise ArgumentError(
                f"argument {index} of {self.name!r} is a {type(arg).__qualname__}; pass a "
                "DeviceArray, DeviceBuffer, None (null pointer) or a numpy scalar such as "
                "np.int32 (a Python int or float has no fixed width)"
            )
        if self._param_sizes is not None and self._param_sizes[index] != size:
            raise ArgumentError(
                f"argument {index} of {self.name!r} is a {self._param_sizes[index]}-byte "
                f"parameter; got {size} bytes ({type(arg).__qualname__})"
            )
        return value

    def bind(
        self,
        grid: int | tuple[int, ...],
        block: int | tuple[int, ...],
        smem_bytes: int,
        stream: object,
        args: tuple | list,
        slots: dict[int, int],
        cells: ArgumentCells,
        programmatic: bool = False,
    ) -> BoundLaunch:
        """A launch whose arguments are checked and packed now, for launching many times.

        `slots` maps a parameter index to the cell of `cells` it reads: those parameters
        are pointers written into the cells before each launch, and what `args` holds for
        them (None) is a placeholder. Everything `launch` checks is checked here, once.
        `programmatic` launches it as a programmatic dependent of the kernel before it.
        """
        if self._param_sizes is not None and len(args) != len(self._param_sizes):
            raise ArgumentError(
                f"kernel {self.name!r} takes {len(self._param_sizes)} arguments, got {len(args)}"
            )
        for index, cell in slots.items():
            if args[index] is not None:
                raise ArgumentError(f"argument {index} of {self.name!r} is a slot; pass None there")
            if not 0 <= cell < len(cells):
                raise ArgumentError(f"argument {index} of {self.name!r} reads cell {cell} of {len(cells)}")
        values = [_cell(self._kernel_arg(i, a)) for i, a in enumerate(args)]
        if smem_bytes > self._smem_limit:
            self.set_max_dynamic_smem(smem_bytes)
        try:
            LaunchConfig(grid=grid, block=block, shmem_size=smem_bytes)  # checks the shape
        except ValueError as e:
            raise ArgumentError(f"bad launch configuration for {self.name}: {e}") from e
        handle = int(current_stream(stream, device=self.device).handle)
        return BoundLaunch(self, _dim3(grid), _dim3(block), smem_bytes, handle, values, slots, cells, programmatic)


def _dim3(dims: int | tuple[int, ...]) -> tuple[int, int, int]:
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    return (*(int(d) for d in dims), *(1,) * (3 - len(dims)))  # type: ignore[return-value]


def _cell(value: object) -> int:
    """A parameter's bytes as one little-endian 8-byte cell (the driver copies only the
    parameter's own size from its start)."""
    if isinstance(value, np.generic):
        return int.from_bytes(value.tobytes().ljust(8, b"\0"), "little")
    return int(value)  # a pointer


class ArgumentCells:
    """The pointers of a run's arguments, one 8-byte cell each, that every launch bound
    to them reads: a call writes each pointer once, however many kernels take it.

    Write and launch under `lock`: the driver copies the parameters when a launch is
    issued (or captured), so the cells are free again once the last launch returns,
    and the lock keeps two threads from interleaving their pointers.
    """

    __slots__ = ("_cells", "_written", "lock")

    def __init__(self, count: int):
        self._cells = array("Q", bytes(8 * count))  # never resized: launches hold addresses
        self._written: tuple[int, ...] | None = None
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._cells)

    def __getitem__(self, index: int) -> int:
        return self._cells[index]

    def address(self, index: int) -> int:
        return self._cells.buffer_info()[0] + 8 * index

    def write(self, pointers: tuple[int, ...]) -> None:
        """One pointer per cell; the same pointers as the last call's are already there."""
        if pointers != self._written:
            cells = self._cells
            for index, pointer in enumerate(pointers):
                cells[index] = pointer
            self._written = pointers


class BoundLaunch:
    """One kernel launch with its parameters packed: `launch()` calls the driver with
    the pointers its `ArgumentCells` hold, and does no other work."""

    __slots__ = (
        "kernel", "grid", "block", "smem", "stream", "programmatic", "_values", "_params", "_cells",
        "_config", "_driver", "_call",
    )

    def __init__(
        self, kernel, grid, block, smem: int, stream: int, values: list[int], slots, cells, programmatic=False
    ):
        self.kernel, self.grid, self.block, self.smem, self.stream = (
            kernel,
            grid,
            block,
            smem,
            stream,
        )
        self.programmatic = programmatic
        self._values = array("Q", values)  # one 8-byte cell per parameter
        base = self._values.buffer_info()[0]
        self._params = array(  # void*[]: this launch's own cells, or the shared ones
            "Q", (cells.address(slots[i]) if i in slots else base + 8 * i for i in range(len(values)))
        )
        self._cells = cells  # kept alive as long as the parameter block points into it
        address = self._params.buffer_info()[0] if values else 0
        self._config = None
        if programmatic:
            self._config = programmatic_config(grid, block, smem, stream)
            self._driver = _launch_kernel_ex
            self._call = (self._config, kernel._cu_function, address, 0)
        else:
            self._driver = _launch_kernel
            self._call = (kernel._cu_function, *grid, *block, smem, driver.CUstream(stream), address, 0)

    def launch(self) -> None:
        (err,) = self._driver(*self._call)
        if err:
            raise GemmspecError(
                f"launching {self.kernel.name} (grid={self.grid}, block={self.block}, "
                f"smem={self.smem} B) failed: {err.name}"
            )


def programmatic_config(grid, block, smem: int, stream: int) -> driver.CUlaunchConfig:
    """cuLaunchKernelEx's configuration of a programmatic dependent launch: the kernel may
    be scheduled before the one before it on `stream` completes (it waits for it with
    griddepcontrol.wait). CUDA graphs capture the edge as programmatic too."""
    attribute = driver.CUlaunchAttribute()
    attribute.id = _PROGRAMMATIC
    attribute.value.programmaticStreamSerializationAllowed = 1
    config = driver.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = block
    config.sharedMemBytes = smem
    config.hStream = driver.CUstream(stream)
    config.attrs = [attribute]
    config.numAttrs = 1
    return config
