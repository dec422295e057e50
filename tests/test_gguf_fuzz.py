"""Issue 58: a GGUF file is untrusted input. Damaged copies of a tiny Llama GGUF (written here by the project's
writer, testing/tiny_gguf.py) either load or end in ONE LoadError that names the file (and, for the listed damage
kinds, the field or tensor at fault), before anything is written to the conversion cache: never another
exception, a hang, a MemoryError from a huge count, nor a kernel's shape check.

The named cases are the damage kinds tried by hand on the default GGUF with `steadyserve info` (issue 58), run
through the CLI in-process; the fuzzer (hypothesis) changes one to three fields of the header, the metadata and
the tensor infos (testing/gguf_layout.py says where each lies), or cuts the file, or changes a byte before the
tensor data, and loads each result with load_model as `steadyserve info` does (default numerics; max_model_len
64, so that a context length the checks allow does not build RoPE tables of millions of rows per case). It is
derandomized (the same cases on every run, in CI too) and prints the count of cases tried. The conversion cache is
a temporary directory (load_model's cache_dir, not STEADYSERVE_CACHE: that variable also moves the native
kernels' build cache, a rebuild of minutes).
"""

from __future__ import annotations

import gc
import os
import re
import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers

from steadyserve import cli
from steadyserve.models.loader import LoadError, load_model
from steadyserve.testing.gguf_layout import GgufLayout, Slot, layout, patch, read
from steadyserve.testing.tiny_gguf import write_tiny_gguf
from test_loader_errors import check_error

# ~0.06 s a case on the 2-core machine (a refusal is faster, a load slower): 200 keep the file well under a minute;
# a longer search: STEADYSERVE_GGUF_FUZZ_CASES=5000
FUZZ_CASES = int(os.environ.get("STEADYSERVE_GGUF_FUZZ_CASES", "200"))

Damage = Callable[[bytes, GgufLayout], tuple[bytes, list[str]]]  # -> (damaged bytes, what the error line names)


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """The tiny Llama (tests/conftest.py) as a Q8_0 GGUF: 2 layers, hidden 64, 4 heads of 16, 2 KV heads."""
    return write_tiny_gguf(tiny_model, tmp_path_factory.mktemp("gguf") / "tiny.gguf").read_bytes()


def _cache_entries(cache: Path) -> list[str]:
    return sorted(p.name for p in (cache / "gguf").iterdir()) if (cache / "gguf").is_dir() else []


# ---- the damage kinds tried by hand (issue 58) -------------------------------------------------------------------

def _truncated(where: str) -> Damage:
    def damage(raw: bytes, lay: GgufLayout) -> tuple[bytes, list[str]]:
        merges = lay.kvs["tokenizer.ggml.merges"]
        cut = {"header": 20, "metadata": (merges.key_length.offset + merges.end) // 2,
               "tensor-infos": (lay.infos_start + lay.infos_end) // 2, "data": (lay.data_start + len(raw)) // 2,
               "last-bytes": len(raw) - 8}[where]
        needles = {"header": ["the header"], "metadata": ["metadata key 'tokenizer.ggml.merges'"],
                   "tensor-infos": ["tensor '"], "data": ["tensor '", "runs past the end of the file"],
                   "last-bytes": ["tensor 'output_norm.weight'", "runs past the end of the file"]}[where]
        return raw[:cut], ["not a readable GGUF model", "truncated", *needles]
    return damage


def _tensor_field(tensor: str, field: str, value: Callable[[int], int], needles: list[str]) -> Damage:
    def damage(raw: bytes, lay: GgufLayout) -> tuple[bytes, list[str]]:
        t = lay.tensors[tensor]
        slot = {"dim0": t.dims[0], "dim1": t.dims[-1], "type": t.tensor_type, "offset": t.data_offset}[field]
        return patch(raw, slot, value(int(read(raw, slot)))), needles
    return damage


def _header(field: str, value: int, needles: list[str]) -> Damage:
    return lambda raw, lay: (patch(raw, getattr(lay, field), value), needles)


def _metadata(key: str, value: int, needles: list[str]) -> Damage:
    return lambda raw, lay: (patch(raw, lay.kvs[key].value, value), needles)  # type: ignore[arg-type]


def _array_count(key: str, count: int, needles: list[str]) -> Damage:
    return lambda raw, lay: (patch(raw, lay.kvs[key].count, count), needles)  # type: ignore[arg-type]


def _past_end(raw: bytes, lay: GgufLayout) -> tuple[bytes, list[str]]:
    last = list(lay.tensors.values())[-1]
    return patch(raw, last.data_offset, len(raw) - lay.data_start + 4096), \
        ["tensor 'output_norm.weight'", "runs past the end of the file"]


HUGE = 1 << 62
DAMAGE: dict[str, Damage] = {
    "truncated-in-header": _truncated("header"),
    "truncated-in-metadata": _truncated("metadata"),
    "truncated-in-tensor-infos": _truncated("tensor-infos"),
    "truncated-in-data": _truncated("data"),
    "truncated-last-bytes": _truncated("last-bytes"),
    # the kernel error (qrms_norm: weight must be (D,) float32) came from this one
    "dim-off-by-32-norm": _tensor_field("blk.0.attn_norm.weight", "dim0", lambda d: d - 32, [
        "tensor 'blk.0.attn_norm.weight' has shape (32,), expected (64,) for hidden_size 64 from "
        "'llama.embedding_length'"]),
    "dim-off-by-32-matrix": _tensor_field("blk.1.ffn_gate.weight", "dim1", lambda d: d - 32, [
        "tensor 'blk.1.ffn_gate.weight' has shape (64, 96), expected (64, 128)", "'llama.feed_forward_length'"]),
    "type-changed-matrix": _tensor_field("blk.0.ffn_down.weight", "type", lambda t: 3, [  # Q8_0 -> Q4_1
        "tensor 'blk.0.ffn_down.weight' (Q4_1", "the type, shape or offset of one of them is wrong"]),
    "type-changed-last-vector": _tensor_field("output_norm.weight", "type", lambda t: 1, [  # F32 -> F16: no layout
        "output_norm.weight: 1-D tensors must be F32, not F16"]),  # change after it; the native path refuses it
    "unknown-type": _tensor_field("blk.0.attn_q.weight", "type", lambda t: 99, [
        "tensor 'blk.0.attn_q.weight' has unknown GGML type 99"]),
    "offset-past-end": _past_end,
    "offset-misaligned": _tensor_field("blk.1.attn_v.weight", "offset", lambda o: o + 1, [
        "tensor 'blk.1.attn_v.weight' has data offset", "not a multiple of the alignment 32"]),
    "huge-tensor-count": _header("n_tensors", HUGE, [f"the tensor count {HUGE} cannot fit"]),
    "huge-key-count": _header("n_kv", HUGE, [f"the metadata key count {HUGE} cannot fit"]),
    "huge-array-count": _array_count("tokenizer.ggml.tokens", HUGE, [
        "metadata key 'tokenizer.ggml.tokens'", f"count {HUGE} cannot fit"]),
    "huge-numeric-array-count": _array_count("tokenizer.ggml.token_type", HUGE, [
        "metadata key 'tokenizer.ggml.token_type'", f"count {HUGE} cannot fit"]),
    "wrong-magic": lambda raw, lay: (b"GGUX" + raw[4:], ["GGUF magic invalid: b'GGUX'"]),
    "wrong-version": _header("version", 7, ["GGUF version 7"]),
    "heads-not-dividing-hidden": _metadata("llama.attention.head_count", 6, [
        "metadata key 'llama.attention.head_count' is 6: it does not divide 'llama.embedding_length' 64"]),
    "heads-disagree-with-tensors": _metadata("llama.attention.head_count", 8, [
        "tensor 'blk.0.attn_output.weight' has shape (64, 64), expected (128, 64)", "num_heads 8 from "
        "'llama.attention.head_count'"]),
    "block-count-disagrees": _metadata("llama.block_count", 3, ["tensor 'blk.2.", "is missing",
                                                                "'llama.block_count'"]),
    "hidden-size-disagrees": _metadata("llama.embedding_length", 96, [
        "tensor 'token_embd.weight' has shape (64, 384), expected (96, 384)", "'llama.embedding_length'"]),
    "context-length-huge": _metadata("llama.context_length", (1 << 31) - 1, [
        "metadata key 'llama.context_length' is 2147483647"]),
}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_each_damage_kind_is_one_line_naming_the_file_and_field(kind, tiny_gguf, tmp_path, capsys):
    bad, needles = DAMAGE[kind](tiny_gguf, layout(tiny_gguf))
    path, cache = tmp_path / "model.gguf", tmp_path / "cache"
    path.write_bytes(bad)
    capsys.readouterr()
    rc = cli.main(["info", "--model", str(path), "--cache-dir", str(cache)])
    out = capsys.readouterr()
    check_error(rc, out.out, out.err, [str(path), *needles])
    assert _cache_entries(cache) == [], "a refused file left a conversion cache entry"


def test_the_undamaged_file_loads(tiny_gguf, tmp_path):
    """The control: the fuzzer's starting point loads (and is cached)."""
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_gguf)
    loaded = load_model(str(path), cache_dir=str(tmp_path / "cache"), max_model_len=64)
    assert loaded.args.hidden_size == 64 and len(_cache_entries(tmp_path / "cache")) == 1


# ---- the fuzzer ----------------------------------------------------------------------------------------------

def _slots(lay: GgufLayout) -> dict[str, list[Slot]]:
    """Every fixed-width field the fuzzer may change, by region."""
    kv: list[Slot] = []
    for e in lay.kvs.values():
        kv += [s for s in (e.key_length, e.value_type, e.value, e.item_type, e.count) if s is not None]
    tensors: list[Slot] = []
    for t in lay.tensors.values():
        tensors += [t.name_length, t.n_dims, *t.dims, t.tensor_type, t.data_offset]
    values = [e.value for e in lay.kvs.values() if e.value is not None]  # what the config is made of
    # the magic last: hypothesis favours a list's first items, and a changed magic ends every case the same way
    return {"header": [lay.n_tensors, lay.n_kv, lay.version, lay.magic], "metadata": kv, "values": values,
            "tensors": tensors}


_EDGES = [0, 1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 31, 32, 33, 63, 64, 99, 255, 256, 4096, (1 << 31) - 1, 1 << 31,
          (1 << 32) - 1, 1 << 62, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


Edit = tuple  # ("cut", n) | ("byte", position, value) | ("field", slot, value): small, for hypothesis's report


def _edits(raw: bytes, lay: GgufLayout) -> st.SearchStrategy[list[Edit]]:
    """One to three changes to the file. A field gets a value near its old one (off by a little, by 32, doubled,
    halved), an edge value, or any value of its width. The strategy closes over the bytes, so that hypothesis
    neither prints nor hashes them."""
    slots = _slots(lay)
    regions = ["header", "metadata", "values", "values", "tensors", "tensors", "tensors", "cut", "byte"]

    def value(draw: st.DrawFn, slot: Slot) -> int | float:
        old = read(raw, slot)
        if slot.fmt[-1] in "fd":
            return draw(st.one_of(st.sampled_from([0.0, -old, old * 2, old / 2, old + 1]),
                                  st.floats(width=32 if slot.fmt[-1] == "f" else 64)))
        old, bits = int(old), 8 * slot.size
        return draw(st.one_of(st.integers(-64, 64).map(lambda d: old + d),
                              st.sampled_from([old + 32, old - 32, old * 2, old // 2]),
                              st.sampled_from(_EDGES), st.integers(0, (1 << bits) - 1)))

    @st.composite
    def edit(draw: st.DrawFn) -> Edit:
        region = draw(st.sampled_from(regions))
        if region == "cut":
            return ("cut", draw(st.integers(0, len(raw) - 1)))
        if region == "byte":  # a key's or a name's text, an array's item, a padding byte ...
            return ("byte", draw(st.integers(0, lay.data_start - 1)), draw(st.integers(0, 255)))
        slot = draw(st.sampled_from(slots[region]))
        return ("field", slot, value(draw, slot))

    return st.lists(edit(), min_size=1, max_size=3)


def _apply(raw: bytes, edits: list[Edit]) -> bytes:
    for e in edits:
        if e[0] == "cut":
            raw = raw[:e[1]]
        elif e[0] == "byte" and e[1] < len(raw):
            raw = raw[:e[1]] + bytes([e[2]]) + raw[e[1] + 1:]
        elif e[0] == "field" and e[1].offset + e[1].size <= len(raw):
            raw = patch(raw, e[1], e[2])
    return raw


def test_fuzzed_ggufs_load_or_fail_with_one_clear_error(tiny_gguf, tmp_path, record_property, monkeypatch):
    """Every case: loaded, or one LoadError naming the file, with nothing left in the conversion cache."""
    work = tmp_path / "work"
    outcomes: Counter[str] = Counter()
    # Hypothesis also draws literals found in the project's modules imported so far, which depend on the test files
    # that ran before in this process (pytest-xdist): without them, derandomize gives the same cases in every run.
    if hasattr(providers, "_get_local_constants") and hasattr(providers, "Constants"):  # hypothesis internals
        monkeypatch.setattr(providers, "_get_local_constants", providers.Constants)

    @settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(edits=_edits(tiny_gguf, layout(tiny_gguf)))
    def one(edits: list[Edit]) -> None:
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir()
        path, cache = work / "model.gguf", work / "cache"
        path.write_bytes(_apply(tiny_gguf, edits))
        try:
            loaded = load_model(str(path), cache_dir=str(cache), max_model_len=64)
        except LoadError as e:
            msg = str(e)
            assert str(path) in msg and "\n" not in msg, msg
            assert _cache_entries(cache) == [], f"{msg}: left {_cache_entries(cache)} in the conversion cache"
            outcomes["refused: " + _kind(msg, str(path))] += 1
            return
        outcomes["loaded"] += 1
        del loaded
        gc.collect()  # the model's memory mapping of a file the next case overwrites

    one()
    tried = sum(outcomes.values())
    record_property("gguf_fuzz_cases", tried)
    print(f"\ngguf fuzz: {tried} cases tried: " + ", ".join(f"{k} {v}" for k, v in outcomes.most_common()))
    assert tried >= FUZZ_CASES // 2 and outcomes["loaded"] and tried - outcomes["loaded"] > tried // 2, outcomes


def _kind(msg: str, path: str) -> str:
    """A refusal's kind for the summary: its first words, with names and numbers left out."""
    rest = msg.removeprefix(path + ": ").removeprefix("not a readable GGUF model: ")
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'.'", rest)).split(":")[0].split(", expected")[0][:50]
