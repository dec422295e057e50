"""Helpers shared by the speculation test files: engines with and without speculation, requests whose drafts
get accepted and rejected, and the comparison of everything a request returns."""

from __future__ import annotations

import os

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.scheduler import SchedulerOutput
from steadyserve.engine.sequence import Request, RequestOutput, SamplingParams

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))
PROMPTS = [[5, 17, 42, 99, 3] * 4, list(range(10, 50)) * 2, [7] * 12, [250, 11, 64, 64, 1], [100, 200, 300],
           [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3]


def make(loaded, mode: str, cheap_rows: int | None = None, **kw) -> LLMEngine:
    cfg = dict(kv_cache_memory=8 * 1024**2, threads=THREADS, max_num_batched_tokens=256, max_num_seqs=16,
               speculation=mode)
    cfg.update(kw)
    engine = LLMEngine(loaded, EngineConfig(**cfg))
    if cheap_rows is not None:  # every spare row drafts, in batches too (the tiny model's costs are not the point)
        engine.speculator.cheap_rows = cheap_rows
        engine.speculator.row_cost = 0.0
    return engine


def requests(temperature: float = 0.0, max_tokens: int = 40, prompts=PROMPTS, **kw) -> list[Request]:
    kw.setdefault("ignore_eos", True)
    return [Request(f"r{i}", p, SamplingParams(max_tokens=max_tokens, temperature=temperature, logprobs=3,
                                               seed=1000 + i if temperature else None, **kw))
            for i, p in enumerate(prompts)]


def summary(c: Completed, cached: bool = True) -> tuple:
    usage = c.usage()
    if not cached:
        del usage["prompt_tokens_details"]
    return (c.token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs], c.text, c.finish_reason,
            c.error, usage)


def differences(a: dict[str, Completed], b: dict[str, Completed], cached: bool = True) -> list[str]:
    """Requests whose results differ. `cached=False` leaves out usage's cached_tokens: what the prefix cache
    held at a request's latest admission, which depends on scheduling (preemption, what else ran, evictions),
    with or without speculation, and is no bit of what the model computed."""
    assert a.keys() == b.keys()
    return [rid for rid in a if summary(a[rid], cached) != summary(b[rid], cached)]


def one_by_one(engine: LLMEngine, reqs: list[Request]) -> dict[str, Completed]:
    done: dict[str, Completed] = {}
    for r in reqs:
        done.update(run_requests(engine, [r]))
    return done


def counts(engine: LLMEngine) -> tuple[int, int]:
    return engine.speculator.total_drafted, engine.speculator.total_accepted


def assert_speculated(engine: LLMEngine, rejections: bool = True) -> None:
    drafted, accepted = counts(engine)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    if rejections:
        assert accepted < drafted, "no draft was rejected: the rejection path went untested"


def greedy_and_seeded() -> list[Request]:
    """Greedy, seeded at a low temperature (drafts accepted) and at 1.0 with top-k/top-p (mostly rejected)."""
    reqs = requests(0.0) + requests(0.3) + requests(1.0, top_k=20, top_p=0.9)
    return [Request(f"{r.request_id}-{i // len(PROMPTS)}", r.prompt_token_ids, r.params) for i, r in enumerate(reqs)]


def record_verifications(engine: LLMEngine) -> list[tuple[str, int, int, int, str | None]]:
    """Wrap engine.scheduler.update, which settles each verification: each one's (request id, tokens generated
    before it, draft tokens, tokens emitted, finish reason if it finished the request)."""
    seen: list[tuple[str, int, int, int, str | None]] = []
    real = engine.scheduler.update

    def update(batch: SchedulerOutput, outputs: list[RequestOutput | None]) -> None:
        for item, out in zip(batch.scheduled, outputs):
            if item.seq.draft_token_ids:
                seen.append((item.seq.request_id, item.seq.num_generated_tokens, len(item.seq.draft_token_ids),
                             len(out.new_token_ids) if out is not None else 0,
                             out.finish_reason if out is not None else None))
        real(batch, outputs)

    engine.scheduler.update = update  # type: ignore[method-assign]
    return seen
