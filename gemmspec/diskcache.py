"""Crash-safe entries in gemmspec's on-disk cache: compiled cubins, the spec parser.

An entry is its payload followed by an 80-byte trailer: an 8-byte magic (what the
entry holds, in which format), the full 32-byte cache key, the payload's length and a
sha256 of everything before it. An entry is read only when it is a regular file of
bounded size owned by this user, its trailer checks and it records this very key;
anything else is ignored (and rewritten by the caller). Entries are written through a
temporary file and os.replace, so a reader never sees a partial one, and the cache
folder is created private (0700). No GPU and no CUDA import is needed here.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
import tempfile
import warnings

__all__ = ["cache_enabled", "default_cache_dir", "read_entry", "write_entry"]

TRAILER_LEN = 8 + 32 + 8 + 32  # magic, key, payload length, sha256
# Cubins are at most a few tens of MB; anything larger is not ours.
MAX_ENTRY_BYTES = 256 << 20


def default_cache_dir() -> str:
    """$GEMMSPEC_CACHE_DIR, else ~/.cache/gemmspec."""
    return os.environ.get("GEMMSPEC_CACHE_DIR") or os.path.expanduser("~/.cache/gemmspec")


def cache_enabled() -> bool:
    """False when $GEMMSPEC_NO_CACHE is set (to anything but 0, false or no)."""
    return os.environ.get("GEMMSPEC_NO_CACHE", "").strip().lower() in ("", "0", "false", "no")


def _open_entry(path: str) -> tuple[int, int] | None:
    """(descriptor, size) of `path` if it is a regular file we own, of a size an entry can have."""
    # O_NOFOLLOW: a symlink is never an entry. O_NONBLOCK: opening a FIFO does not wait.
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
    try:
        fd = os.open(path, flags | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
    except OSError:
        os.close(fd)
        return None
    owned = not hasattr(os, "geteuid") or st.st_uid == os.geteuid()
    if not (stat.S_ISREG(st.st_mode) and owned and TRAILER_LEN < st.st_size <= MAX_ENTRY_BYTES):
        os.close(fd)
        return None
    return fd, st.st_size


def read_entry(path: str, key: str, magic: bytes) -> bytes | None:
    """The payload of the `magic` entry for `key` (64 hex digits) at `path`; None if
    absent, foreign, damaged, of another kind or of another key."""
    opened = _open_entry(path)
    if opened is None:
        return None
    fd, size = opened
    chunks: list[bytes] = []
    try:
        while size > 0:
            chunk = os.read(fd, size)
            if not chunk:
                break
            chunks.append(chunk)
            size -= len(chunk)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse_entry(b"".join(chunks), key, magic)


def _parse_entry(blob: bytes, key: str, magic: bytes) -> bytes | None:
    if len(blob) <= TRAILER_LEN:
        return None
    body, digest = blob[:-32], blob[-32:]
    trailer = body[-(TRAILER_LEN - 32) :]
    payload = body[: -len(trailer)]
    stored_magic, stored_key, length = trailer[:8], trailer[8:40], trailer[40:48]
    if stored_magic != magic or int.from_bytes(length, "little") != len(payload):
        return None
    if stored_key != bytes.fromhex(key) or hashlib.sha256(body).digest() != digest:
        return None
    return payload


def entry_bytes(payload: bytes, key: str, magic: bytes) -> bytes:
    """The bytes of an entry (payload and trailer)."""
    assert len(magic) == 8, magic
    body = payload + magic + bytes.fromhex(key) + len(payload).to_bytes(8, "little")
    return body + hashlib.sha256(body).digest()


def write_entry(path: str, payload: bytes, key: str, magic: bytes, what: str) -> None:
    """Write the entry via a temporary file and os.replace; on failure warn (saying
    why, naming `what` is cached) and carry on uncached."""
    directory = os.path.dirname(path)
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        _warn_not_caching(f"cannot create the {what} cache folder {directory}", e)
        return
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".entry")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(entry_bytes(payload, key, magic))
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as e:
        _warn_not_caching(f"cannot write the {what} cache entry {path}", e)


def _warn_not_caching(what: str, e: OSError) -> None:
    # Say what went wrong (permission, disk full, ...), not just that it did.
    warnings.warn(f"gemmspec: {what}: {e.strerror or e}; not caching", RuntimeWarning, stacklevel=4)
