"""The sha256 of a model file, read once per file version rather than at every start.

The digest names the weights in every fingerprint and keys the conversion and packed-weight caches, so it
must be the file's; but reading a multi-GB file at 1-2 GB/s is seconds of every start. As git's index does,
a digest is kept under the cache directory beside the file's identity as stat gives it (device, inode, size,
mtime and ctime in nanoseconds): changing the file's bytes changes its mtime and ctime (ctime cannot be set
from user space), replacing it changes the inode. A file modified within `RACY_SECONDS` of being hashed may
still be changing within the clock's granularity, so its digest is not kept (git's "racy" rule). A kept entry
that cannot be read or does not match is ignored and rewritten: the digest is recomputed, never trusted.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from pathlib import Path

from ..progress import Progress

RACY_SECONDS = 2.0  # a file modified this recently is hashed but its digest not kept
_CHUNK = 16 * 1024**2


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _entry(cache: Path, path: Path) -> Path:
    return cache / "digests" / (hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:32] + ".json")


def file_sha256(path: Path, cache: Path | None = None, progress_over: int = 256 * 1024**2) -> str:
    """The hex sha256 of `path`'s bytes: the digest kept under `cache` for this very file version, else read
    (with progress lines for files over `progress_over` bytes) and kept there (best effort: a read-only cache
    only costs the next start the read)."""
    st = path.stat()
    ident = _identity(st)
    entry = _entry(cache, path) if cache is not None else None
    if entry is not None:
        try:
            kept = json.loads(entry.read_text())
            digest = kept["sha256"]
            if kept["identity"] == ident and isinstance(digest, str) and len(digest) == 64 \
                    and all(c in "0123456789abcdef" for c in digest):
                return digest
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent, damaged or another version's: recomputed below
    digest = _read_digest(path, st.st_size, progress_over)
    if entry is not None and time.time() - st.st_mtime > RACY_SECONDS and _identity(path.stat()) == ident:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp = entry.with_name(entry.name + f".tmp{os.getpid()}")
            tmp.write_text(json.dumps({"path": str(path), "identity": ident, "sha256": digest}))
            os.replace(tmp, entry)
        except OSError:
            pass
    return digest


def _read_digest(path: Path, size: int, progress_over: int) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    progress = Progress(f"hashing {path.name}", size) if size > progress_over else None
    with progress if progress is not None else contextlib.nullcontext(), open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
            if progress is not None:
                progress.advance(n)
    return h.hexdigest()
