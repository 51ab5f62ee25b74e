"""NVRTC compilation, the cubin disk cache and SASS disassembly (no GPU needed)."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from gemmspec import diskcache
from gemmspec.errors import CompileError
from gemmspec.runtime import nvrtc
from gemmspec.runtime.nvrtc import compile_cubin, cuda_include_dirs, disassemble, nvrtc_version

REPO = Path(__file__).resolve().parents[2]

# One FP8 wgmma (m64n16k32, e4m3 x e4m3 -> f32); on sm_90a it must become a QGMMA.
WGMMA_SRC = r"""
#include <cuda_fp8.h>
#include <cuda_bf16.h>
extern "C" __global__ void wgmma_probe(float* out, unsigned long long da, unsigned long long db) {
  float d[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %10, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 "
      "{%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]),
        "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(da), "l"(db), "r"(1));
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
  for (int i = 0; i < 8; ++i) out[threadIdx.x * 8 + i] = d[i];
}
"""

BF16_SRC = r"""
#include <cuda_fp8.h>
#include <cuda_bf16.h>
extern "C" __global__ void widen(const __nv_fp8_e4m3* a, __nv_bfloat16* b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) b[i] = __float2bfloat16(float(a[i]) * 2.0f);
}
"""


def _have_sass_tools() -> bool:
    return all(nvrtc._binary_utility(t) for t in ("cuobjdump", "nvdisasm"))


needs_sass_tools = pytest.mark.skipif(
    not _have_sass_tools(), reason="cuobjdump/nvdisasm not installed"
)


@pytest.fixture(autouse=True)
def _cache_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GEMMSPEC_NO_CACHE", raising=False)
    monkeypatch.delenv("GEMMSPEC_CACHE_DIR", raising=False)


def _entries(cache: Path) -> list[Path]:
    return sorted(cache.iterdir()) if cache.exists() else []


def test_toolkit_headers_found() -> None:
    dirs = cuda_include_dirs()
    assert dirs and os.path.isfile(os.path.join(dirs[0], "cuda_fp8.h"))


def test_nvrtc_version() -> None:
    major, minor = nvrtc_version()
    assert major >= 12 and minor >= 0


@needs_sass_tools
def test_fp8_wgmma_becomes_qgmma(tmp_path: Path) -> None:
    result = compile_cubin(WGMMA_SRC, name="wgmma_probe", cache_dir=str(tmp_path))
    assert result.cubin.startswith(b"\x7fELF")
    sass = disassemble(result.cubin)
    assert "QGMMA.64x16x32.F32.E4M3.E4M3" in sass


def test_fp8_bf16_headers_compile(tmp_path: Path) -> None:
    result = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    assert result.cubin.startswith(b"\x7fELF") and result.name == "widen"


def test_second_compile_hits_cache(tmp_path: Path) -> None:
    first = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    second = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    assert not first.from_cache and second.from_cache
    assert second.cubin == first.cubin and second.key == first.key
    assert [p.name for p in _entries(tmp_path)] == [f"widen-{first.key[:16]}.cubin"]


def test_key_covers_included_header_content(tmp_path: Path) -> None:
    include = tmp_path / "include"
    include.mkdir()
    header = include / "gs_scale.cuh"
    header.write_text("#define GS_SCALE 2.0f\n")
    src = '#include "gs_scale.cuh"\nextern "C" __global__ void k(float* p) { *p *= GS_SCALE; }\n'
    cache = str(tmp_path / "cache")
    first = compile_cubin(src, name="k", include_dirs=[str(include)], cache_dir=cache)
    header.write_text("#define GS_SCALE 3.0f\n")
    second = compile_cubin(src, name="k", include_dirs=[str(include)], cache_dir=cache)
    assert not second.from_cache and second.key != first.key


def test_key_covers_arch_and_options(tmp_path: Path) -> None:
    cache = str(tmp_path)
    base = compile_cubin(BF16_SRC, name="widen", cache_dir=cache)
    other_arch = compile_cubin(BF16_SRC, name="widen", arch="sm_90", cache_dir=cache)
    with_opts = compile_cubin(
        BF16_SRC, name="widen", extra_options=["-lineinfo", "-DGS_X=1"], cache_dir=cache
    )
    assert len({base.key, other_arch.key, with_opts.key}) == 3
    assert not other_arch.from_cache and not with_opts.from_cache


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty"])
def test_corrupt_entry_is_recompiled(tmp_path: Path, damage: str) -> None:
    good = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    (entry,) = _entries(tmp_path)
    blob = bytearray(entry.read_bytes())
    if damage == "flip":
        blob[len(blob) // 2] ^= 0xFF
    elif damage == "truncate":
        del blob[len(blob) // 2 :]
    else:
        blob.clear()
    entry.write_bytes(bytes(blob))

    again = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    assert not again.from_cache and again.cubin == good.cubin
    healed = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    assert healed.from_cache and healed.cubin == good.cubin


def test_no_cache_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMMSPEC_NO_CACHE", "1")
    cache = tmp_path / "cache"
    compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    again = compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    assert not again.from_cache and _entries(cache) == []


def test_cache_dir_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GEMMSPEC_CACHE_DIR", str(tmp_path))
    compile_cubin(BF16_SRC, name="widen")
    assert compile_cubin(BF16_SRC, name="widen").from_cache
    assert len(_entries(tmp_path)) == 1


def test_unwritable_cache_dir_degrades(tmp_path: Path) -> None:
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where the cache directory should be")
    cache = blocker / "cache"
    with pytest.warns(RuntimeWarning, match="cannot create the cubin cache folder") as record:
        result = compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    assert result.cubin.startswith(b"\x7fELF") and not result.from_cache
    message = str(record[0].message)
    assert str(cache) in message and os.strerror(errno.ENOTDIR) in message


def test_disk_full_warning_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def disk_full(src: str, dst: str) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(nvrtc.os, "replace", disk_full)
    with pytest.warns(RuntimeWarning, match="No space left on device") as record:
        result = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    message = str(record[0].message)
    assert str(tmp_path / f"widen-{result.key[:16]}.cubin") in message
    assert "not writable" not in message
    assert result.cubin.startswith(b"\x7fELF") and not result.from_cache
    assert _entries(tmp_path) == []  # the temporary file is gone too


def test_new_cache_dir_is_private(tmp_path: Path) -> None:
    cache = tmp_path / "fresh" / "cache"
    compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700


def _entry(cache: Path, result: nvrtc.CompiledCubin) -> Path:
    return cache / f"{result.name}-{result.key[:16]}.cubin"


def test_foreign_entry_under_our_name_is_recompiled(tmp_path: Path) -> None:
    """A well-formed entry of other source, put under our key's file name, is never loaded."""
    cache, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    ours = compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    other = compile_cubin(BF16_SRC.replace("2.0f", "3.0f"), name="widen", cache_dir=str(elsewhere))
    assert other.cubin != ours.cubin
    shutil.copyfile(_entry(elsewhere, other), _entry(cache, ours))

    again = compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    assert not again.from_cache and again.cubin == ours.cubin
    healed = compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    assert healed.from_cache and healed.cubin == ours.cubin


def test_entry_of_the_keyless_format_is_recompiled(tmp_path: Path) -> None:
    good = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    old_trailer = b"GSCUBIN1" + hashlib.sha256(good.cubin).digest() + len(good.cubin).to_bytes(8, "little")
    _entry(tmp_path, good).write_bytes(good.cubin + old_trailer)
    again = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    assert not again.from_cache and again.cubin == good.cubin


def test_entry_owned_by_another_user_is_ignored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    good = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    entry = _entry(tmp_path, good)
    if os.geteuid() == 0:
        os.chown(entry, 65534, 65534)
    else:  # seen from another user, the entry is theirs
        monkeypatch.setattr(nvrtc.os, "geteuid", lambda: entry.stat().st_uid + 1)
    again = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    assert not again.from_cache and again.cubin == good.cubin


def test_oversized_entry_is_not_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    monkeypatch.setattr(diskcache, "MAX_ENTRY_BYTES", len(good.cubin))
    assert not compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path)).from_cache


def _compile_within(seconds: float, cache: Path, release: Path) -> nvrtc.CompiledCubin:
    """compile_cubin in a thread that must finish in time; a FIFO at `release` is unblocked if not."""
    done: list[nvrtc.CompiledCubin] = []
    worker = threading.Thread(
        target=lambda: done.append(compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))),
        daemon=True,
    )
    worker.start()
    worker.join(seconds)
    if worker.is_alive():
        if stat.S_ISFIFO(os.lstat(release).st_mode):
            os.close(os.open(release, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"compile_cubin did not return within {seconds} s")
    assert done, "compile_cubin raised in its thread"
    return done[0]


def test_fifo_at_entry_path_does_not_hang(tmp_path: Path) -> None:
    good = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    entry = _entry(tmp_path, good)
    entry.unlink()
    os.mkfifo(entry)
    again = _compile_within(120, tmp_path, entry)
    assert not again.from_cache and again.cubin == good.cubin
    assert stat.S_ISREG(os.lstat(entry).st_mode)  # replaced by a real entry


@pytest.mark.parametrize("target", ["/dev/zero", "valid entry"])
def test_symlink_at_entry_path_is_not_followed(tmp_path: Path, target: str) -> None:
    good = compile_cubin(BF16_SRC, name="widen", cache_dir=str(tmp_path))
    entry = _entry(tmp_path, good)
    if target == "/dev/zero":
        entry.unlink()
        entry.symlink_to("/dev/zero")
    else:
        entry.rename(tmp_path / "elsewhere.cubin")
        entry.symlink_to(tmp_path / "elsewhere.cubin")
    again = _compile_within(120, tmp_path, entry)
    assert not again.from_cache and again.cubin == good.cubin
    assert stat.S_ISREG(os.lstat(entry).st_mode)


_WORKER = """
import hashlib, sys
from gemmspec.runtime.nvrtc import compile_cubin
src = open(sys.argv[1]).read()
r = compile_cubin(src, name="widen", cache_dir=sys.argv[2])
print(hashlib.sha256(r.cubin).hexdigest())
"""


def test_two_processes_share_an_empty_cache(tmp_path: Path) -> None:
    """Both compile at once into the same empty directory; both succeed, bytes identical."""
    src_file = tmp_path / "widen.cu"
    src_file.write_text(BF16_SRC)
    cache = tmp_path / "cache"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _WORKER, str(src_file), str(cache)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in outputs]
    digests = {out.strip() for out, _ in outputs}
    assert len(digests) == 1
    (entry,) = _entries(cache)  # one entry, no temp files left behind
    cached = compile_cubin(BF16_SRC, name="widen", cache_dir=str(cache))
    assert cached.from_cache and hashlib.sha256(cached.cubin).hexdigest() in digests
    assert entry.name == f"widen-{cached.key[:16]}.cubin"


def test_syntax_error_carries_nvrtc_log(tmp_path: Path) -> None:
    src = 'extern "C" __global__ void bad(float* p) {\n  float x = ;\n  *p = x;\n}\n'
    with pytest.raises(CompileError) as info:
        compile_cubin(src, name="bad", cache_dir=str(tmp_path))
    assert "bad.cu(2): error: expected an expression" in info.value.log
    assert "expected an expression" in str(info.value)
    assert _entries(tmp_path) == []


def test_unsupported_option_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(CompileError, match="unsupported NVRTC option"):
        compile_cubin(BF16_SRC, name="widen", extra_options=["--bogus"], cache_dir=str(tmp_path))


def test_bad_program_name(tmp_path: Path) -> None:
    with pytest.raises(ValueError):
        compile_cubin(BF16_SRC, name="../escape", cache_dir=str(tmp_path))
