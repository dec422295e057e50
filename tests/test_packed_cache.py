"""The int8 path's packed-weight cache (packed_cache.py, repack.py): the same panels as repacking, refused by
name and rebuilt when damaged or made by another packer, and repacking holds one matrix of the file at a time."""

from __future__ import annotations

import json
import logging
import struct
from pathlib import Path

import pytest
import torch

from steadyserve.kernels import load
from steadyserve.kernels.quant import QMatrix, QWeight
from steadyserve.models.loader import cache_root, load_model
from steadyserve.models.packed_cache import CacheRefused, cache_key, packed_plan, read_cache, write_cache
from steadyserve.testing.server import ServerProcess
from steadyserve.testing.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")


@pytest.fixture(scope="module")
def gguf(smolwidth_model, tmp_path_factory) -> str:
    return str(write_tiny_gguf(smolwidth_model, tmp_path_factory.mktemp("packed") / "smolwidth-q4_1.gguf",
                               quant="Q4_1"))


@pytest.fixture
def cache(tmp_path) -> Path:
    """A cache directory of its own for the packed weights, sharing the session's GGUF conversions (the config and
    tokenizer, which no test here is about: converted once, not once per test)."""
    shared = cache_root() / "gguf"
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "gguf").symlink_to(shared)
    return tmp_path / "cache"


def _load(gguf: str, cache: Path):
    return load_model(gguf, numerics="int8", cache_dir=str(cache))


def _panels(loaded) -> dict[str, list[tuple[str, int, int, torch.Tensor]]]:
    return {slot: [(p.name, p.fmt, p.k, p.data) for p in m.parts] for slot, m in loaded.model.int8_matrices().items()}


def _messages(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_a_second_start_maps_the_panels_the_first_repacked(gguf, cache, caplog):
    caplog.set_level(logging.INFO)
    first = _load(gguf, cache)
    assert "int8 panels: repacked" in _messages(caplog)
    assert "repacking weights for the int8 kernels: done" in _messages(caplog)
    (cached,) = (cache / "packed").glob("*.q8p")
    caplog.clear()
    second = _load(gguf, cache)
    assert "int8 panels: cache" in _messages(caplog) and "repacking" not in _messages(caplog)
    a, b = _panels(first), _panels(second)
    assert a.keys() == b.keys()
    for slot in a:
        assert [x[:3] for x in a[slot]] == [x[:3] for x in b[slot]], slot
        assert all(torch.equal(x[3], y[3]) for x, y in zip(a[slot], b[slot])), slot
    hidden = torch.randn(3, first.args.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(first.model.logprobs(hidden), second.model.logprobs(hidden))
    assert second.weights_hash == first.weights_hash and cached.stat().st_size > 0


def _flip(path: Path, at: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[at] ^= 0x40
    path.write_bytes(bytes(raw))


def _rekey(path: Path) -> None:
    raw = path.read_bytes()
    n, magic = struct.unpack("<Q8s", raw[-16:])
    header = json.loads(raw[-16 - n:-16])
    header["key"]["int8"] = "q8a0"
    blob = json.dumps(header).encode()
    path.write_bytes(raw[:-16 - n] + blob + struct.pack("<Q8s", len(blob), magic))


@pytest.mark.parametrize("damage, reason", [
    (lambda p: _flip(p, 200_000), "CRC-32"),  # inside the first part's panels, past its first panel
    (lambda p: p.write_bytes(p.read_bytes()[:-5000]), "truncated"),
    (lambda p: p.write_bytes(b"\0" * 10), "too short"),
    (_rekey, "made for"),
])
def test_a_damaged_or_mismatched_cache_is_refused_by_name_and_rebuilt(gguf, cache, caplog, damage, reason):
    want = _panels(_load(gguf, cache))
    (cached,) = (cache / "packed").glob("*.q8p")
    damage(cached)
    caplog.set_level(logging.INFO)
    got = _panels(_load(gguf, cache))  # serves, repacked
    refused = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "refused" in r.getMessage()]
    assert len(refused) == 1 and str(cached) in refused[0] and reason in refused[0], refused
    assert all(torch.equal(x[3], y[3]) for s in want for x, y in zip(want[s], got[s]))
    caplog.clear()
    _load(gguf, cache)  # the rewritten file is taken again
    assert "int8 panels: cache" in _messages(caplog) and "refused" not in _messages(caplog)


def test_panels_this_builds_packer_would_not_make_are_refused(gguf, cache, tmp_path):
    """The CRC only says the file is as written; the first panel of every part, repacked from the GGUF at each
    load, says it was written by this packer from this file."""
    loaded = load_model(gguf, numerics="portable", cache_dir=str(cache))
    sources = {k: m for k, m in loaded.model.int8_matrices().items()}
    packed = {k: m.packed() for k, m in sources.items()}
    slot = "layers.0.w_down"  # the first of its kind: the one checked
    (part,) = packed[slot].parts
    bad = part.data.clone()
    bad[3, 7] ^= 1  # a consistent file (its CRC is computed on these bytes) of other panels
    packed[slot] = QMatrix([QWeight(bad, part.fmt, part.k, part.name)])
    key = cache_key("ab" * 32)
    write_cache(tmp_path / "x.q8p", key, packed)
    plans = {k: packed_plan(m) for k, m in sources.items()}
    with pytest.raises(CacheRefused, match=r"layers\.0\.w_down: .*panels differ from what this build's q8pack"):
        read_cache(tmp_path / "x.q8p", key, plans, sources)
    packed[slot] = QMatrix([part])
    write_cache(tmp_path / "x.q8p", key, packed)
    read_cache(tmp_path / "x.q8p", key, plans, sources)  # the same file with the packer's panels is taken
    assert [packed_plan(m) for m in sources.values()] == [
        [(p.name, p.fmt, p.k, p.n) for p in m.packed().parts] for m in sources.values()]


def _resident(path: str) -> int:
    """Bytes of `path`'s mappings resident in this process (/proc/self/smaps)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and not line.endswith(":"):
            inside = line.rstrip().endswith(path)
        elif inside and line.startswith("Rss:"):
            total += int(line.split()[1]) * 1024
    return total


def test_repacking_holds_one_matrix_of_the_file_at_a_time(gguf, cache, monkeypatch):
    seen: list[tuple[int, int]] = []  # (the file's resident bytes just after a matrix was packed, its bytes)
    real = QMatrix.packed

    def packed(self: QMatrix) -> QMatrix:
        out = real(self)
        seen.append((_resident(gguf), self.nbytes))
        return out

    monkeypatch.setattr(QMatrix, "packed", packed)
    _load(gguf, cache)
    total = sum(n for _, n in seen)
    assert len(seen) == 9 and max(r for r, _ in seen) > 0
    # Without the per-matrix release the file's pages pile up to every matrix's (the last reading is ~total).
    largest = max(n for _, n in seen)
    assert max(r for r, _ in seen) <= largest + 0.25 * total, (seen, total)


def test_serve_shows_repacking_progress_in_bytes_when_stderr_is_not_a_terminal(gguf, cache):
    with ServerProcess(gguf, "--kv-cache-memory", "16MiB", "--cache-dir", str(cache)) as s:
        logs = s.logs()
    lines = [ln for ln in logs.splitlines() if "steadyserve.progress" in ln]
    assert any("repacking weights for the int8 kernels: " in ln and "MiB" in ln for ln in lines), logs
    assert any("repacking weights for the int8 kernels: done" in ln and "total_bytes=" in ln for ln in lines), lines
    assert any("writing packed-weight cache" in ln and "done" in ln for ln in lines), lines
    assert "\r" not in logs  # no bar drawn into a pipe


def test_a_new_kernel_builds_cache_replaces_the_files_older_builds_made_for_the_same_gguf(tmp_path):
    from steadyserve.models.packed_cache import prune_older

    d = tmp_path / "packed"
    d.mkdir()
    names = ["m-0123456789abcdef-q8a1-aaaaaaaaaaaa.q8p", "m-0123456789abcdef-q8a2-bbbbbbbbbbbb.q8p",  # older builds
             "m-fedcba9876543210-q8a2-cccccccccccc.q8p", "m-x-0123456789abcdef-q8a2-cccccccccccc.q8p",  # other files
             "m-0123456789abcdef-q8a2-cccccccccccc.q8p.tmp123"]  # another process's write in progress
    for n in names:
        (d / n).write_bytes(b"x")
    new = d / "m-0123456789abcdef-q8a2-cccccccccccc.q8p"
    new.write_bytes(b"x")
    assert sorted(p.name for p in prune_older(new)) == names[:2]
    assert sorted(p.name for p in d.iterdir()) == sorted(names[2:] + [new.name])
