"""Prefix caching keeps the bits: on SmolLM2-width layers, a request whose prefix came from the cache
gets bitwise the tokens and logprobs it gets from an engine without the cache.

Runs two ways, like the invariance suite:
* invariant: the engine as served (prefix caching on);
* broken: its block hash made to forget the prefix before each block (a TEST-ONLY fault), so a block
  computed at one position serves another. The same checks must then see a difference.
Each case also asserts that the cache was hit, so that equality is not the absence of caching.
"""

from __future__ import annotations

import os
import random

import pytest

from steadyserve.config import EngineConfig
from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.selftest import run_selftest
from steadyserve.engine.sequence import Request, SamplingParams, Sequence
from steadyserve.models.loader import load_model

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))
BS = 32


@pytest.fixture(scope="module")
def loaded(smolwidth_model):
    return load_model(smolwidth_model, batch_invariant=True, row_tile=64)


def make_engine(loaded, caching: bool, kv: int = 64 * 1024**2) -> LLMEngine:
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=kv, threads=THREADS, max_num_batched_tokens=512,
                                            max_num_seqs=64, block_size=BS, prefix_caching=caching))
    assert run_selftest(engine).passed
    return engine


@pytest.fixture(scope="module")
def reference(loaded):
    return make_engine(loaded, caching=False)


def _block_only(self, seq, num_blocks):  # TEST-ONLY fault: a block's hash without its prefix
    return [bytes(repr(seq.token_ids[i * BS:(i + 1) * BS]), "ascii") for i in range(num_blocks)]


@pytest.fixture(params=["invariant", "broken"])
def mode(request, loaded, monkeypatch):
    if request.param == "broken":
        monkeypatch.setattr(BlockManager, "_prefix_hashes", _block_only)
    return request.param, make_engine(loaded, caching=True)


def req(rid: str, prompt: list[int], n: int = 6, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=n, temperature=0, logprobs=2, ignore_eos=True, **kw))


def alone(engine: LLMEngine, r: Request) -> Completed:
    return run_requests(engine, [r])[r.request_id]


def diff(a: Completed, b: Completed) -> float:
    """0.0 when bitwise the same tokens and logprobs, else the largest logprob difference (inf for other tokens)."""
    if a.token_ids != b.token_ids or len(a.prompt_logprob_values) != len(b.prompt_logprob_values):
        return float("inf")
    pairs = list(zip(a.logprob_values + a.prompt_logprob_values, b.logprob_values + b.prompt_logprob_values))
    return max((abs(x - y) for x, y in pairs), default=0.0)


def expect(mode: str, diffs: dict[str, float]) -> None:
    print(f"\n{mode}: max |logprob diff| per case: " + ", ".join(f"{k}={v:.3g}" for k, v in diffs.items()))
    if mode == "invariant":
        assert all(v == 0.0 for v in diffs.values()), diffs
    else:
        assert any(v != 0.0 for v in diffs.values()), f"cache broken on purpose, yet no difference: {diffs}"


def tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(n)]


def test_shared_prefixes_give_the_uncached_bits(mode, reference):
    """A system prompt ending mid-block, shared by requests in one step; a prompt wholly cached; a prompt
    whose blocks repeat a cached prompt's blocks at other positions (what a hash without position confuses)."""
    name, engine = mode
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(3)
    system = tokens(rng, vocab, 2 * BS + 7)  # two full blocks, then 7 tokens into the third
    x, y = tokens(rng, vocab, BS), tokens(rng, vocab, BS)
    reqs = [req(f"chat{i}", system + tokens(rng, vocab, 5 + 9 * i)) for i in range(5)]
    reqs.append(req("again", list(reqs[0].prompt_token_ids)))  # the whole prompt cached
    warm = req("xy", x + y + tokens(rng, vocab, 3))
    moved = req("yx", y + x + tokens(rng, vocab, 3))  # the same blocks, each at the other's position

    run_requests(engine, [reqs[0], warm])  # fills the cache
    got = run_requests(engine, reqs[1:] + [moved])  # five requests share the cached blocks in one step
    diffs = {}
    for r in reqs[1:] + [moved]:
        ref = alone(reference, r)
        diffs[r.request_id] = diff(got[r.request_id], ref)
        assert ref.num_cached_tokens == 0
    hits = {r.request_id: got[r.request_id].num_cached_tokens for r in reqs[1:]}
    assert all(h == 2 * BS for h in hits.values()), hits  # the mid-block tail was computed, not taken
    if name == "invariant":
        assert got["yx"].num_cached_tokens == 0
    expect(name, diffs)


def test_multi_turn_reuses_generated_tokens_and_scoring_still_computes_every_token(loaded, reference):
    """Turn 2 resends turn 1's prompt and answer: blocks holding generated tokens are hit too. A request
    asking for prompt logprobs takes no hits (they come from hidden states the cache does not keep).
    The engine as served only: the broken hash cannot confuse these requests (no block repeats at another
    position), so a broken run would assert nothing the shared-prefix test above does not."""
    engine = make_engine(loaded, caching=True)
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(5)
    turn1 = req("t1", tokens(rng, vocab, 50), n=40)
    out1 = alone(engine, turn1)
    turn2 = req("t2", turn1.prompt_token_ids + out1.token_ids + tokens(rng, vocab, 11))
    scored = req("score", list(turn2.prompt_token_ids), prompt_logprobs=1)
    got = run_requests(engine, [turn2])
    got.update(run_requests(engine, [scored]))
    assert got["t2"].num_cached_tokens == 2 * BS  # 90 tokens computed in turn 1 -> two full blocks
    assert got["score"].num_cached_tokens == 0 and got["score"].prompt_logprob_values
    for rid, r in (("t2", turn2), ("score", scored)):
        assert diff(got[rid], alone(reference, r)) == 0.0, rid


def test_an_evicted_prefix_is_recomputed_to_the_same_bits(loaded, reference):
    engine = make_engine(loaded, caching=True, kv=2 * 1024**2)  # a few dozen blocks
    vocab = engine.loaded.args.vocab_size
    rng = random.Random(9)
    shared = tokens(rng, vocab, 3 * BS)
    partly = req("partly", shared + [4, 5])

    def num_hits() -> int:
        return len(engine.block_manager.match_prefix(Sequence(-1, partly))[0])

    run_requests(engine, [req("first", shared + [1, 2, 3])])
    assert num_hits() == 3
    filler = 0
    while num_hits() == 3:  # other prompts take the free blocks, then evict cached ones, tail first
        run_requests(engine, [req(f"fill{filler}", tokens(rng, vocab, 2 * BS), n=1)])
        filler += 1
        assert filler < 500, "the shared prefix was never evicted"
    got = alone(engine, partly)
    assert got.num_cached_tokens < 3 * BS
    assert diff(got, alone(reference, partly)) == 0.0


def test_caching_off_takes_nothing_from_the_cache(reference):
    vocab = reference.loaded.args.vocab_size
    p = tokens(random.Random(1), vocab, 3 * BS)
    run_requests(reference, [req("a", p)])
    assert alone(reference, req("b", p)).num_cached_tokens == 0
    assert reference.block_manager.num_cached_blocks == 0
