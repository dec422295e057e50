"""The int8 path's packed weights on disk, so that a start after the first maps them instead of repacking.

Repacking a GGUF's matrices into the int8 family's 16-row panels reads and rewrites every weight (about 8 s
per GB on 2 cores): most of a large model's start. The panels are written once, after the first start's
repacking, to `<cache>/packed/<stem>-<sha16>-<int8>-<packer>.q8p`, and later starts memory-map that file.
Its pages are the page cache's, so several servers of one model on a host share them, and a start after a
reboot reads them from disk at its speed.

Keyed by what makes the panels: the GGUF's sha256, the int8 family's version (kernel_versions.KERNELS) and
a hash of the kernels' C++ sources (q8pack's layout is theirs; a change to any source costs one repack).
The file is input like any other: a file whose key, layout or any part's CRC-32 does not match, or that is
truncated or not ours, is refused by name (CacheRefused) and the loader repacks and rewrites it. The first 16
rows of one part of each (format, K) are also repacked from the GGUF at every load and compared bitwise with the
cached panels, so a packer that lays panels out differently on this CPU is caught however the key came to match.

Layout: the parts' bytes, each at a 4096-aligned offset, then a JSON header, then its length (u64 LE) and
MAGIC. The header lists each slot's parts (name, GGML type id, K, rows, row bytes, offset, CRC-32).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..kernel_versions import KERNELS
from ..kernels.quant import PACKED, QMatrix, QWeight
from ..progress import Progress

MAGIC = b"SSQ8PCK1"  # the last 8 bytes of a cache file; the 1 is the layout's version
_TAIL = struct.Struct("<Q8s")  # header length, MAGIC
_ALIGN = 4096
_SPOT_ROWS = 16  # one panel


class CacheRefused(Exception):
    """A cache file that cannot be used; str() says why (the caller names the file)."""


@dataclass(frozen=True)
class CacheKey:
    """What the panels in a cache file were made from and by."""

    gguf_sha256: str  # the GGUF's full hex digest
    int8: str  # the int8 family's version (kernel_versions.KERNELS["int8"])
    packer: str  # sha256 (16 hex) of the kernels' C++ sources, which define q8pack's panel layout


def packer_id() -> str:
    from ..kernels.build import HEADERS, SOURCES

    h = hashlib.sha256()
    for src in sorted(SOURCES + HEADERS):
        h.update(src.name.encode() + b"\0" + src.read_bytes())
    return h.hexdigest()[:16]


def cache_key(gguf_sha256: str) -> CacheKey:
    return CacheKey(gguf_sha256, KERNELS["int8"], packer_id())


def cache_path(root: Path, src: Path, key: CacheKey) -> Path:
    return root / "packed" / f"{src.stem}-{key.gguf_sha256[:16]}-{key.int8}-{key.packer[:12]}.q8p"


def prune_older(path: Path) -> list[Path]:
    """Remove the cache files of the same GGUF (name and digest) made by another int8 version or packer, which no
    start of this build can use: a kernel update leaves one file per model, not one per update. Returns them."""
    prefix = path.name[:path.name.rindex("-", 0, path.name.rindex("-"))] + "-"  # <stem>-<sha16>-
    gone = []
    for other in path.parent.iterdir():
        if other != path and other.name.startswith(prefix) and other.suffix == ".q8p" \
                and other.name.count("-") == path.name.count("-"):
            other.unlink(missing_ok=True)
            gone.append(other)
    return gone


def packed_plan(m: QMatrix) -> list[tuple[str, int, int, int]]:
    """(name, format id, K, rows) of each part QMatrix.packed() makes of `m`, without packing: what a cache
    file must hold for it."""
    out: list[tuple[str, int, int, int]] = []
    for p in m.parts:
        packs = p.packed or p.packs
        fmt = p.fmt if p.packed or not packs else PACKED + p.fmt
        if out and packs and out[-1][1] == fmt:
            name, _, k, n = out[-1]
            out[-1] = (f"{name}|{p.name}", fmt, k, n + p.n)
        else:
            out.append((p.name, fmt, p.k, p.n))
    return out


def _crc(a: np.ndarray) -> int:
    return zlib.crc32(memoryview(a).cast("B")) & 0xFFFFFFFF


def write_cache(path: Path, key: CacheKey, slots: dict[str, QMatrix]) -> int:
    """Write `slots` (slot name -> packed matrix) under `path` (a temporary name, then renamed: a reader never
    sees half a file). Returns the file's size. OSError (disk full, read-only) reaches the caller."""
    total = sum(p.data.numel() for m in slots.values() for p in m.parts)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    header: dict[str, Any] = {"key": asdict(key), "slots": {}}
    try:
        with Progress("writing packed-weight cache", total) as progress, open(tmp, "wb") as f:
            offset = 0
            for slot, m in slots.items():
                parts = []
                for p in m.parts:
                    raw = p.data.contiguous().numpy()
                    f.write(b"\0" * (-offset % _ALIGN))
                    offset += -offset % _ALIGN
                    parts.append({"name": p.name, "fmt": p.fmt, "k": p.k, "rows": p.n, "row_bytes": raw.shape[1],
                                  "offset": offset, "crc32": _crc(raw)})
                    f.write(memoryview(raw).cast("B"))
                    offset += raw.nbytes
                    progress.advance(raw.nbytes)
                header["slots"][slot] = parts
            blob = json.dumps(header).encode()
            f.write(blob + _TAIL.pack(len(blob), MAGIC))
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path.stat().st_size


def read_cache(path: Path, key: CacheKey, plans: dict[str, list[tuple[str, int, int, int]]],
               sources: dict[str, QMatrix], threads: int = 2) -> tuple[dict[str, QMatrix], Any]:
    """The packed matrices of `plans`' slots as views of the file's mapping, and the mapping. `sources`: the
    unpacked matrices by slot, for the spot check. Raises CacheRefused saying what does not match."""
    try:
        data = np.memmap(str(path), mode="r")
    except (OSError, ValueError) as e:
        raise CacheRefused(f"cannot be mapped ({e})") from None
    header = _header(data)
    if header.get("key") != asdict(key):
        raise CacheRefused(f"made for {header.get('key')}, not {asdict(key)}")
    slots = header.get("slots")
    if not isinstance(slots, dict) or set(slots) != set(plans):
        raise CacheRefused("holds other matrices than this model's")
    views: dict[str, list[tuple[dict[str, Any], np.ndarray]]] = {}
    for slot, plan in plans.items():
        parts = slots[slot]
        try:
            got = [(str(p["name"]), int(p["fmt"]), int(p["k"]), int(p["rows"])) for p in parts]
        except (KeyError, TypeError, ValueError):
            raise CacheRefused(f"{slot}: a part's entry is incomplete: damaged") from None
        if got != plan:
            raise CacheRefused(f"{slot}: holds {got}, but repacking makes {plan}")
        views[slot] = [(p, _view(data, slot, p)) for p in parts]
    every = [pv for pvs in views.values() for pv in pvs]
    total = sum(v.nbytes for _, v in every)
    with Progress("checking packed-weight cache", total) as progress, \
            ThreadPoolExecutor(max(threads, 1)) as pool:  # zlib.crc32 lets go of the GIL: one part per thread
        for (p, v), crc in zip(every, pool.map(lambda pv: _crc(pv[1]), every)):
            if crc != p["crc32"]:
                raise CacheRefused(f"{p['name']}: CRC-32 {crc:08x}, the header says {p['crc32']:08x}: damaged")
            progress.advance(v.nbytes)
    out, checked = {}, set()
    for slot, pvs in views.items():
        parts = [QWeight(_tensor(v), p["fmt"], p["k"], p["name"]) for p, v in pvs]
        _spot_check(slot, parts, sources[slot], checked)
        out[slot] = QMatrix(parts)
    return out, data


def _header(data: np.ndarray) -> dict[str, Any]:
    if data.size < _TAIL.size:
        raise CacheRefused("too short to be a packed-weight cache: truncated")
    n, magic = _TAIL.unpack(bytes(data[-_TAIL.size:]))
    if magic != MAGIC:
        raise CacheRefused(f"ends in {magic!r}, not {MAGIC!r}: not a packed-weight cache of this version, or truncated")
    if n > data.size - _TAIL.size:
        raise CacheRefused(f"a header of {n} bytes cannot fit: damaged")
    try:
        header = json.loads(bytes(data[data.size - _TAIL.size - n:data.size - _TAIL.size]))
    except ValueError as e:
        raise CacheRefused(f"its header is not JSON ({e}): damaged") from None
    if not isinstance(header, dict):
        raise CacheRefused("its header is not an object: damaged")
    return header


def _view(data: np.ndarray, slot: str, p: dict[str, Any]) -> np.ndarray:
    try:
        rows, row_bytes, offset = int(p["rows"]), int(p["row_bytes"]), int(p["offset"])
        int(p["crc32"])
    except (KeyError, TypeError, ValueError):
        raise CacheRefused(f"{slot}: a part's entry is incomplete: damaged") from None
    end = offset + rows * row_bytes
    if rows <= 0 or row_bytes <= 0 or offset < 0 or offset % _ALIGN or end > data.size - _TAIL.size:
        raise CacheRefused(f"{slot}: part {p.get('name')!r} lies outside the file: truncated or damaged")
    return data[offset:end].reshape(rows, row_bytes)


def _tensor(v: np.ndarray) -> torch.Tensor:
    """A tensor over the read-only mapping: torch warns that writes would be undefined; nothing writes."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(v)


def _spot_check(slot: str, parts: list[QWeight], source: QMatrix, checked: set[tuple[int, int]]) -> None:
    """The first cached part of each (format, K) against the same rows of its first source matrix repacked now:
    a packer that lays out that kind of panel differently is caught (the CRC and the header already say each part
    is as written, and where). `checked` collects the kinds checked so far."""
    src = iter(source.parts)
    for part in parts:
        first = next(src)
        for _ in range(part.name.count("|")):  # the sources joined into this part
            next(src)
        if (part.fmt, part.k) in checked:
            continue
        checked.add((part.fmt, part.k))
        if not part.packed:
            if not torch.equal(part.data[:_SPOT_ROWS], first.data[:_SPOT_ROWS]):
                raise CacheRefused(f"{slot}: {part.name}'s rows differ from the GGUF's")
            continue
        fresh = QWeight(first.data[:_SPOT_ROWS].contiguous(), first.fmt, first.k, first.name).pack().data
        if fresh.shape[1] != part.data.shape[1] or not torch.equal(fresh, part.data[:_SPOT_ROWS]):
            raise CacheRefused(f"{slot}: {part.name}'s panels differ from what this build's q8pack makes of the "
                               "GGUF's rows")
