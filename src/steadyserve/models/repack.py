"""The int8 path's panels for a loaded model: mapped from the packed-weight cache, or repacked and cached.

Repacking reads every matrix of the GGUF mapping once. Its pages are clean file pages, counted in the
process's RSS while mapped: left resident, the whole file would sit beside its packed copy at the end of
the pass (the peak RSS twice the weights). So each matrix's pages are dropped from the mapping as soon as its
panels exist (madvise MADV_DONTNEED: the page cache keeps them, an embedding lookup reads a row back), and
the peak holds one matrix twice, not the model. The pass shows progress in bytes (progress.py).
"""

from __future__ import annotations

import logging
import mmap
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..kernels.quant import QMatrix
from ..progress import Progress
from .packed_cache import CacheRefused, cache_key, cache_path, packed_plan, prune_older, read_cache, write_cache
from .transformer import Transformer

log = logging.getLogger("steadyserve.loader")


@dataclass(frozen=True)
class RepackResult:
    """How a model got its panels, for the load log."""

    source: str  # "cache" (mapped), "repacked" (and cached, or not: see cache_bytes), "repacked, no cache"
    cache_file: str  # the packed-weight cache file, "" where none applies
    cache_bytes: int  # its size on disk; 0 where it was not written or read
    seconds: float  # the whole step: reading and checking the cache, or repacking and writing it
    keepalive: Any  # the cache file's mapping, which the panels are views of (None when repacked in memory)


def release_pages(mapping: Any, tensor: torch.Tensor | None = None) -> None:
    """Drop this process's pages of a GGUF mapping (numpy.memmap of the whole file, as gguf_file.read_gguf
    makes it): all of them, or those under `tensor` where it is a view of the mapping (an owned copy, such as
    permuted q/k rows, is freed by dropping it instead)."""
    mm = getattr(mapping, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise"):
        return
    if tensor is None:
        mm.madvise(mmap.MADV_DONTNEED)
        return
    base, size = mapping.ctypes.data, len(mm)  # read_gguf maps from offset 0: the array starts at the mapping
    start = tensor.data_ptr() - base
    end = start + tensor.numel() * tensor.element_size()
    if start < 0 or end > size:
        return
    lo = start // mmap.PAGESIZE * mmap.PAGESIZE  # madvise takes whole pages; a neighbour's page is read back
    mm.madvise(mmap.MADV_DONTNEED, lo, min(end, size) - lo)


def repack_int8(model: Transformer, mapping: Any, src: Path | None, gguf_sha256: str,
                cache_root: Path | None) -> RepackResult:
    """Give `model` its int8 panels: from the cache file of (`src`, its digest) under `cache_root` where one
    matches, else by repacking (then written there). `cache_root` None, or a model not from a GGUF, repacks
    without a cache. A cache that cannot be read or written is logged and repacked around, never fatal."""
    t0 = time.perf_counter()
    sources: dict[str, QMatrix] = {k: m for k, m in model.int8_matrices().items() if isinstance(m, QMatrix)}
    path = cache_path(cache_root, src, cache_key(gguf_sha256)) if cache_root is not None and src is not None \
        and mapping is not None else None
    if path is not None and path.exists():
        try:
            packed, kept = read_cache(path, cache_key(gguf_sha256), {k: packed_plan(m) for k, m in sources.items()},
                                      sources, torch.get_num_threads())
        except CacheRefused as e:
            log.warning(f"packed-weight cache {path} refused: {e}; repacking and rewriting it",
                        extra={"fields": {"file": str(path), "reason": str(e)}})
        else:
            del sources
            model.use_int8_activations(lambda slot, _m: packed[slot])
            release_pages(mapping)
            return RepackResult("cache", str(path), path.stat().st_size, time.perf_counter() - t0, kept)
    made: dict[str, QMatrix] = {}
    total = sum(p.data.numel() for m in sources.values() for p in m.parts)
    del sources  # the model's own references go one by one as each matrix is replaced

    with Progress("repacking weights for the int8 kernels", total) as progress:
        def pack(slot: str, m: QMatrix) -> QMatrix:
            made[slot] = out = m.packed()
            for part in m.parts:
                release_pages(mapping, part.data)
                progress.advance(part.data.numel())
            return out

        model.use_int8_activations(pack)
    release_pages(mapping)  # what the embedding's lookups and the norms' copies touched
    written = 0
    if path is not None:
        try:
            written = write_cache(path, cache_key(gguf_sha256), made)
            for old in prune_older(path):
                log.info(f"packed-weight cache {old.name} removed: made by another kernel build",
                         extra={"fields": {"file": str(old)}})
        except OSError as e:
            log.warning(f"packed-weight cache {path} not written ({e}); the next start repacks again",
                        extra={"fields": {"file": str(path), "reason": str(e)}})
    source = "repacked" if path is not None else "repacked, no cache"
    return RepackResult(source, str(path or ""), written, time.perf_counter() - t0, None)
