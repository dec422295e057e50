"""KV blocks that fall out of every layer's sliding window are released, with the same bits.

On the tiny Phi-3 (a window of 24 on every layer) a long generation holds a bounded number of blocks
while an engine that keeps them all computes bitwise the same tokens and logprobs, prefix-cache hits
on released (cached) blocks included; releasing one block too early is caught. A model with a
global layer (the tiny Gemma 3) releases nothing.
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
    if keep_all:
        e.block_manager.window = 0  # the reference: every block held to the end
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


# Every KV storage format (--kv-cache-dtype) releases blocks the same way: the blocks are the format's.
@pytest.mark.parametrize("speculation, kv", [("off", "auto"), ("ngram", "auto"), ("off", "f16"), ("off", "bf16"),
                                             ("off", "q8_0"), ("ngram", "q8_0")])
def test_out_of_window_blocks_are_released_with_the_same_bits(request, speculation, kv):
    """Speculation off: the plain step's order of growing and releasing; ngram: verifications grow by drafts
    and truncate rejected ones as blocks leave the window. The reference keeps every block, without
    speculation (its peak needs both sequences alive at their longest, so one order of steps)."""
    phi3 = model_for(request, kv)
    assert engine(phi3).block_manager.window == 24
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

    def too_early(self, seq):  # TEST-ONLY fault: one block more than the window allows
        dead = max(0, seq.num_computed_tokens - self.window + 1) // self.block_size + 1
        for i in range(min(dead, len(seq.block_table) - 1)):
            if seq.block_table[i] != RELEASED:
                self._release(seq.block_table[i])
                seq.block_table[i] = RELEASED
        return 0

    ref, _ = run_tracking(engine(phi3, keep_all=True, kv=kv), requests(phi3.args.vocab_size))
    monkeypatch.setattr(BlockManager, "release_out_of_window", too_early)
    got, _ = run_tracking(engine(phi3, kv=kv), requests(phi3.args.vocab_size))
    assert not all(same(got[rid], ref[rid]) for rid in ref)


def test_a_model_with_a_global_layer_releases_nothing(models_dir: Path):
    d = models_dir / "tiny-gemma3"
    if not d.exists():
        build_tiny_model(d, arch="gemma3")
    loaded = load_model(str(d), max_model_len=512)
    assert 0 in loaded.args.layer_windows and engine(loaded).block_manager.window == 0


def test_block_manager_releases_only_whole_blocks_before_the_window():
    bm = BlockManager(8, BS, prefix_caching=False, window=24)
    seq = Sequence(0, Request("r", list(range(100)), SamplingParams(max_tokens=1)))
    bm.grow(seq, 100)
    seq.num_computed_tokens = 100
    assert bm.num_free_blocks == 4
    assert bm.release_out_of_window(seq) == 2  # keys from 100 - 24 + 1 = 77 on: blocks 0 and 1 are dead
    assert seq.block_table[:2] == [RELEASED, RELEASED] and bm.num_free_blocks == 6
    assert bm.release_out_of_window(seq) == 0
    bm.free(seq)
    assert bm.num_free_blocks == 8
