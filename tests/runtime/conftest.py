"""Fakes that let the executor plan launches with no GPU: buffers get fake addresses,
kernels are never compiled or loaded, and offsets are read from a host dict."""

from __future__ import annotations

import contextlib

import pytest

from gemmspec.runtime import executor, plan


class FakeBuffer:
    _next = 1 << 40

    def __init__(self, nbytes, **_):
        self.nbytes = nbytes
        self.ptr = FakeBuffer._next
        FakeBuffer._next += ((nbytes + 255) // 256 + 1) * 256

    @classmethod
    def from_numpy(cls, array, **_):
        return cls(array.nbytes)


class FakeKernel:
    """Records launches instead of making them (`launched`: every launch, all kernels;
    `programmatic`: for each, whether it was a programmatic dependent launch)."""

    launched: list = []
    programmatic: list = []

    def __init__(self, compiled, name, **_):
        self.name = name

    def launch(self, grid, block, smem, stream, *args):
        FakeKernel.launched.append((self.name, stream, args))
        FakeKernel.programmatic.append(False)

    def bind(self, grid, block, smem, stream, args, slots, cells, programmatic=False):
        return FakeLaunch(self.name, stream, args, slots, cells, programmatic)


class FakeLaunch:
    """A bound launch: each launch records the arguments with the pointers (ints) its
    argument cells hold in the slots."""

    def __init__(self, name, stream, args, slots, cells, programmatic=False):
        assert all(args[p] is None for p in slots)
        self.name, self.stream, self.args, self.slots = name, stream, tuple(args), dict(slots)
        self.cells, self.programmatic = cells, programmatic

    def launch(self):
        args = list(self.args)
        for param, cell in self.slots.items():
            args[param] = self.cells[cell]
        FakeKernel.launched.append((self.name, self.stream, tuple(args)))
        FakeKernel.programmatic.append(self.programmatic)


class NoStream:
    """A stream that must not be used: planning never waits, an empty call neither
    enqueues nor waits."""

    def sync(self):
        raise AssertionError("a call synchronised its stream")


@pytest.fixture
def offline(monkeypatch):
    """Executor planning without a device; returns {pointer: host values} for the
    offsets and counts tensors the test creates."""
    host = {}
    FakeKernel.launched = []
    FakeKernel.programmatic = []
    monkeypatch.setattr(executor, "DeviceBuffer", FakeBuffer)
    monkeypatch.setattr(executor, "LoadedKernel", FakeKernel)
    monkeypatch.setattr(executor, "compile_cubin", lambda source, **kw: None)
    monkeypatch.setattr(executor, "num_sms", lambda device=0: 132)
    # Tensor-map templates are encoded by the driver; their bytes do not matter here.
    monkeypatch.setattr(plan, "encode_tile_map", lambda dtype, rows, inner, address: bytes(128))
    monkeypatch.setattr(executor, "caller_stream", lambda s, objects, device: NoStream())
    monkeypatch.setattr(executor, "is_capturing", lambda s: False)
    monkeypatch.setattr(executor, "on_device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(executor, "copy_to_host", lambda a, shape: host[a.ptr].reshape(shape))
    return host
