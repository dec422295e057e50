"""KV blocks that fall out of a sliding window are released, with the same bits.

On the tiny Phi-3 (a window of 24 on every layer) a long generation holds a bounded number of blocks
while an engine that keeps them all computes bitwise the same tokens and logprobs, prefix-cache hits
on released (cached) blocks included; releasing one block too early is caught. A hybrid model (the
tiny Gemma 3 and gpt-oss: windowed and global layers) keeps its windowed layers in groups of their
own (kv_layout.py) and releases their blocks the same way, while its global layers keep every block.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from steadyserve.config import EngineConfig
from steadyserve.engine.block_manager import RELEASED, BlockManager
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.kv_cache import resolve_kv_dtype
from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.sequence import Request, SamplingParams, Sequence
from steadyserve.models.loader import load_model
from steadyserve.testing import build_tiny_model

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))
BS = 32


@pytest.fixture(scope="module")
def phi3(models_dir: Path):
    d = models_dir / "tiny-phi3"
    if not d.exists():
        build_tiny_model(d, arch="phi3")
    return load_model(str(d), max_model_len=512)


@pytest.fixture(scope="module")
def phi3_d64(models_dir: Path):
    """The tiny Phi-3 at SmolLM2's widths: a head dim of 64, which q8_0's blocks of 32 need (tiny's is 16)."""
    d = models_dir / "smolwidth-phi3"
    if not d.exists():
        build_tiny_model(d, arch="phi3", size="smolwidth")
    return load_model(str(d), max_model_len=512)


def model_for(request, kv: str):
    return request.getfixturevalue("phi3_d64" if kv == "q8_0" else "phi3")


def engine(loaded, keep_all: bool = False, budget: int = 512, speculation: str = "off", kv: str = "auto") -> LLMEngine:
    e = LLMEngine(loaded, EngineConfig(kv_cache_memory=16 * 1024**2, threads=THREADS, block_size=BS,
                                       max_num_batched_tokens=budget, max_num_seqs=16, speculation=speculation,
                                       kv_cache_dtype=kv))
    if keep_all:  # the reference: every block held to the end
        e.block_manager.windows = (0,) * e.block_manager.num_groups
    return e


def run_tracking(e: LLMEngine, reqs: list[Request]) -> tuple[dict[str, Completed], int]:
    """Run to completion; also the most blocks held at once."""
    done = {r.request_id: Completed() for r in reqs}
    for r in reqs:
        e.add_request(r)
    peak = 0
    while e.has_work():
        outs, _ = e.step()
        peak = max(peak, e.block_manager.num_blocks - e.block_manager.num_free_blocks)
        for o in outs:
            done[o.request_id].add(o)
    return done, peak


def requests(vocab: int) -> list[Request]:
    rng = random.Random(4)
    shared = [rng.randrange(vocab) for _ in range(70)]
    p = SamplingParams(max_tokens=120, temperature=0, logprobs=1, prompt_logprobs=0, ignore_eos=True)
    return [Request("a", shared, p), Request("b", [rng.randrange(vocab) for _ in range(9)], p)]


def same(a: Completed, b: Completed) -> bool:
    return (a.token_ids == b.token_ids and a.logprob_values == b.logprob_values
            and a.prompt_logprob_values == b.prompt_logprob_values)


def too_early(self, seq):  # TEST-ONLY fault: one block more than a windowed group's window allows
    for g, table in enumerate(seq.block_tables):
        if self.windows[g]:
            dead = max(0, seq.num_computed_tokens - self.windows[g] + 1) // self.block_size + 1
            for i in range(min(dead, len(table) - 1)):  # the last block stays: the next token's K/V go there
                if table[i] != RELEASED:
                    self._release(table[i])
                    table[i] = RELEASED
    return 0


# Every KV storage format (--kv-cache-dtype) releases blocks the same way: the blocks are the format's.
@pytest.mark.parametrize("speculation, kv", [("off", "auto"), ("ngram", "auto"), ("off", "f16"), ("off", "bf16"),
                                             ("off", "q8_0"), ("ngram", "q8_0")])
def test_out_of_window_blocks_are_released_with_the_same_bits(request, speculation, kv):
    """Speculation off: the plain step's order of growing and releasing; ngram: verifications grow by drafts
    and truncate rejected ones as blocks leave the window. The reference keeps every block, without
    speculation (its peak needs both sequences alive at their longest, so one order of steps)."""
    phi3 = model_for(request, kv)
    assert engine(phi3).block_manager.windows == (24,)
    ref, ref_peak = run_tracking(engine(phi3, keep_all=True, kv=kv), requests(phi3.args.vocab_size))
    e = engine(phi3, speculation=speculation, kv=kv)
    assert e.kv.fmt == resolve_kv_dtype(kv, phi3.dtype, phi3.numerics.mode)  # auto: the path's own cache
    got, peak = run_tracking(e, requests(phi3.args.vocab_size))
    if speculation == "ngram":
        assert e.speculator.total_accepted > 0, "no draft accepted: the ngram case would be the off case"
    for rid in ref:
        assert same(got[rid], ref[rid]), rid
    print(f"\nblocks held at most: {peak} released vs {ref_peak} kept")
    # Kept: 190 + 129 tokens need 6 + 5 blocks; released: a window of 24 spans at most 2 blocks per sequence.
    assert ref_peak >= 10 and peak <= 4, (peak, ref_peak)
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks  # nothing leaked, nothing freed twice
    # The shared prompt's released blocks were published; a new request takes them from the cache.
    again = Request("c", requests(phi3.args.vocab_size)[0].prompt_token_ids,
                    SamplingParams(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True))
    hit = run_requests(e, [again])["c"]
    alone = run_requests(engine(phi3, keep_all=True, kv=kv), [again])["c"]
    assert hit.num_cached_tokens == 64 and same(hit, alone)


@pytest.mark.parametrize("kv", ["auto", "q8_0"])
def test_releasing_a_block_still_in_the_window_is_caught(request, monkeypatch, kv):
    phi3 = model_for(request, kv)

    ref, _ = run_tracking(engine(phi3, keep_all=True, kv=kv), requests(phi3.args.vocab_size))
    monkeypatch.setattr(BlockManager, "release_out_of_window", too_early)
    got, _ = run_tracking(engine(phi3, kv=kv), requests(phi3.args.vocab_size))
    assert not all(same(got[rid], ref[rid]) for rid in ref)


def tiny(models_dir: Path, arch: str):
    d = models_dir / f"tiny-{arch}"
    if not d.exists():
        build_tiny_model(d, arch=arch)
    return load_model(str(d), max_model_len=512)


def test_a_hybrid_models_windowed_layers_get_groups_of_their_own(models_dir: Path):
    """The tiny Gemma 3 (a global layer among windowed ones) and gpt-oss (alternating): their cache tensors hold
    one group's layers, and the engine has one block table per group, full attention first."""
    for arch in ("gemma3", "gptoss"):
        loaded = tiny(models_dir, arch)
        e = engine(loaded)
        windows = loaded.args.layer_windows
        layout = e.kv.layout
        assert 0 in windows and any(windows)
        assert layout.num_groups > 1 and layout.windows[0] == 0 and e.block_manager.windows == layout.windows
        assert e.kv.k.shape[0] == layout.group_size < loaded.args.num_layers
        assert [layout.windows[layout.group[i]] for i in range(len(windows))] == list(windows)


def long_requests(vocab: int) -> list[Request]:
    """Two prompts longer than the tiny models' windows (16 and 32 keys), generating past several blocks."""
    rng = random.Random(7)
    shared = [rng.randrange(vocab) for _ in range(100)]
    p = SamplingParams(max_tokens=90, temperature=0, logprobs=1, prompt_logprobs=0, ignore_eos=True)
    return [Request("a", shared, p), Request("b", [rng.randrange(vocab) for _ in range(40)], p)]


@pytest.mark.parametrize("arch", ["gemma3", "gptoss"])
@pytest.mark.parametrize("speculation", ["off", "ngram"])
def test_a_hybrid_model_releases_its_windowed_blocks_with_the_same_bits(models_dir: Path, arch, speculation):
    loaded = tiny(models_dir, arch)
    reqs = long_requests(loaded.args.vocab_size)
    ref, ref_peak = run_tracking(engine(loaded, keep_all=True), reqs)
    e = engine(loaded, speculation=speculation, budget=64)
    got, peak = run_tracking(e, reqs)
    for rid in ref:
        assert same(got[rid], ref[rid]), rid
    print(f"\nblocks held at most: {peak} released vs {ref_peak} kept")
    assert peak < ref_peak, (peak, ref_peak)
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks  # nothing leaked, nothing freed twice
    again = Request("c", reqs[0].prompt_token_ids, SamplingParams(max_tokens=8, temperature=0, logprobs=1,
                                                                  ignore_eos=True))
    hit = run_requests(e, [again])["c"]  # the windowed groups' blocks found by hash, released or not
    alone = run_requests(engine(loaded, keep_all=True), [again])["c"]
    assert hit.num_cached_tokens == 96 and same(hit, alone)


def test_a_hybrid_model_releasing_a_block_too_early_is_caught(models_dir: Path, monkeypatch):
    loaded = tiny(models_dir, "gptoss")
    reqs = long_requests(loaded.args.vocab_size)
    ref, _ = run_tracking(engine(loaded, keep_all=True), reqs)

    monkeypatch.setattr(BlockManager, "release_out_of_window", too_early)
    got, _ = run_tracking(engine(loaded), reqs)
    assert not all(same(got[rid], ref[rid]) for rid in ref)


def test_block_manager_releases_only_whole_blocks_before_the_window():
    bm = BlockManager(8, BS, prefix_caching=False, windows=(24,))
    seq = Sequence(0, Request("r", list(range(100)), SamplingParams(max_tokens=1)))
    bm.grow(seq, 100)
    seq.num_computed_tokens = 100
    assert bm.num_free_blocks == 4
    assert bm.release_out_of_window(seq) == 2  # keys from 100 - 24 + 1 = 77 on: blocks 0 and 1 are dead
    assert seq.block_table[:2] == [RELEASED, RELEASED] and bm.num_free_blocks == 6
    assert bm.release_out_of_window(seq) == 0
    bm.free(seq)
    assert bm.num_free_blocks == 8
