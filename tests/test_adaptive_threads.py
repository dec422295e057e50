"""--adaptive-threads in the engine: the thread count changes between steps and not one bit of output does.

* A scripted policy switches 2 -> 1 -> 2 threads every step or two in the middle of generation; greedy
  generation, seeded sampling and scoring (prompt logprobs) give every token and logprob bitwise equal to
  runs at a fixed 1 and a fixed 2 threads. The same comparison run with a TEST-ONLY drift that shifts each
  logprob row by the thread count must see a difference (the check has teeth on any machine).
* The real policy, fed starved waits through a fake signal source, makes the engine set torch's thread count
  and report it in StepStats; --no-adaptive-threads and a budget of 1 thread keep no policy at all (the waits
  are still measured, for the metrics).
"""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch
from test_engine_invariance import engine_for, greedy, max_diff

from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.selftest import run_selftest
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.engine.threads import REASON_PROBE, REASON_RUN_DELAY, ThreadChange, ThreadPolicy
from steadyserve.models.loader import load_model


@pytest.fixture(scope="module")
def engine(smolwidth_model):
    loaded = load_model(smolwidth_model, batch_invariant=True, row_tile=64)
    e = engine_for(loaded, threads=2)  # adaptive_threads is on by default
    assert e.thread_policy is not None and e.cpu_signals is not None and e.thread_budget == 2
    result = run_selftest(e)
    assert result.passed, result.detail
    real_policy = e.thread_policy
    yield e
    e.thread_policy = real_policy


class Scripted:
    """A policy that flips between 2 and 1 threads every `every` steps, whatever the waits."""

    def __init__(self, every: int) -> None:
        self.every, self.steps, self.threads, self.budget = every, 0, 2, 2

    def observe(self, wall_s: float, run_delay_s: float, throttled_s: float = 0.0) -> ThreadChange | None:
        self.steps += 1
        if self.steps % self.every:
            return None
        prev, self.threads = self.threads, 3 - self.threads
        return ThreadChange(self.threads, prev, REASON_PROBE if self.threads == 2 else REASON_RUN_DELAY, 0.5)


def requests(vocab: int, seed: int = 3) -> list[Request]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (7, 41, 19)]
    sampled = [Request(f"s{i}", p, SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=100 + i,
                                                   logprobs=0, prompt_logprobs=0, ignore_eos=True))
               for i, p in enumerate(prompts)]
    return [greedy(f"g{i}", p, 14) for i, p in enumerate(prompts)] + sampled


def run_all(engine, vocab: int) -> dict[str, Completed]:
    """Generation (greedy and seeded, batched together), then scoring of the greedy completions."""
    done = run_requests(engine, requests(vocab))
    scores = [Request(f"score-{rid}", c_prompt + done[rid].token_ids, SamplingParams(max_tokens=0, prompt_logprobs=0))
              for rid, c_prompt in ((r.request_id, r.prompt_token_ids) for r in requests(vocab)) if rid.startswith("g")]
    done.update(run_requests(engine, scores))
    return done


def fixed(engine, n: int, vocab: int) -> dict[str, Completed]:
    engine.thread_policy = None
    engine.num_threads = n
    torch.set_num_threads(n)
    return run_all(engine, vocab)


def switching(engine, vocab: int, every: int) -> tuple[dict[str, Completed], list[int]]:
    seen: list[int] = []
    real = engine.runner.execute

    def execute(sched):
        seen.append(torch.get_num_threads())
        return real(sched)

    engine.runner.execute = execute
    engine.thread_policy = Scripted(every)
    engine.num_threads = 2
    torch.set_num_threads(2)
    try:
        return run_all(engine, vocab), seen
    finally:
        engine.runner.execute = real


def diffs(a: dict[str, Completed], b: dict[str, Completed]) -> dict[str, float]:
    assert a.keys() == b.keys()
    out = {}
    for rid in a:
        assert a[rid].token_ids == b[rid].token_ids, rid
        out[rid] = max(max_diff(a[rid].logprob_values, b[rid].logprob_values),
                       max_diff(a[rid].prompt_logprob_values, b[rid].prompt_logprob_values))
        assert len(a[rid].logprob_values) == len(b[rid].logprob_values)
        assert len(a[rid].prompt_logprob_values) == len(b[rid].prompt_logprob_values)
    return out


def thread_drift(engine, scale: float = 2.0 ** -10):
    """TEST-ONLY: each logprob row shifted by the thread count the step ran with (what a thread-dependent
    kernel would do); returns the restore function."""
    real = engine.runner.execute

    def execute(sched):
        bump = torch.get_num_threads() * scale
        results = real(sched)
        for r in results:
            if r.sample_row is not None:
                r.sample_row = r.sample_row + bump
                r.draft_rows = [row + bump for row in r.draft_rows]
            r.prompt_logprobs = [replace(lp, logprob=lp.logprob + bump) for lp in r.prompt_logprobs]
        return results

    engine.runner.execute = execute
    return lambda: setattr(engine.runner, "execute", real)


@pytest.mark.parametrize("mode", ["invariant", "broken"])
def test_thread_changes_mid_generation_leave_every_logprob_bitwise_equal(engine, mode):
    vocab = engine.loaded.args.vocab_size
    restore = thread_drift(engine) if mode == "broken" else (lambda: None)
    try:
        two, one = fixed(engine, 2, vocab), fixed(engine, 1, vocab)
        flips = {every: switching(engine, vocab, every) for every in (1, 3)}
    finally:
        restore()
        torch.set_num_threads(2)
    for every, (_, seen) in flips.items():
        assert {1, 2} <= set(seen), (every, seen)  # the count really changed between steps, both ways
    assert all(len(c.token_ids) == 14 for rid, c in two.items() if not rid.startswith("score"))
    assert all(len(c.prompt_logprob_values) > 0 for c in two.values())
    found = {"fixed 1 vs fixed 2": diffs(one, two)}
    found.update({f"switching every {every} vs fixed 2": diffs(done, two) for every, (done, _) in flips.items()})
    worst = {k: max(v.values()) for k, v in found.items()}
    print(f"\n{mode}: max |logprob diff|: {worst}")
    if mode == "invariant":
        assert all(d == 0.0 for d in worst.values()), found
    else:  # the same comparison sees a thread-dependent shift
        assert all(d > 0 for d in worst.values()), found


class FakeSignals:
    """Cumulative waits that grow by `fraction` of each step's wall time (the policy's input, scripted)."""

    def __init__(self) -> None:
        self.fraction, self.delay = 0.0, 0.0

    def read(self) -> tuple[float, float]:
        self.delay += self.fraction * 0.05
        return self.delay, 0.0


def test_the_real_policy_sets_torch_threads_and_the_stats_say_so(engine):
    vocab = engine.loaded.args.vocab_size
    fake, real_signals = FakeSignals(), engine.cpu_signals
    engine.cpu_signals = fake
    engine.thread_policy = ThreadPolicy(2, window_s=0.0, window_steps=1, confirm=2, hold_s=0.0)
    engine.num_threads = 2
    torch.set_num_threads(2)
    try:
        fake.fraction = 100.0  # every step waits longer than it ran: starved
        engine.add_request(greedy("a", list(range(5, 30)), 20))
        stats = [engine.step()[1] for _ in range(3)]
        assert [s.thread_change for s in stats] == ["", REASON_RUN_DELAY, ""]
        assert [s.threads for s in stats] == [2, 1, 1] and torch.get_num_threads() == 1
        assert all(s.run_delay > 0 for s in stats)
        fake.fraction = 0.0  # quiet: the next window probes back up to the budget, never above
        stats = [engine.step()[1] for _ in range(3)]
        assert stats[0].thread_change == REASON_PROBE and stats[0].threads == 2 and torch.get_num_threads() == 2
        assert max(s.threads for s in stats) == 2
        while engine.has_work():
            engine.step()
    finally:
        engine.cpu_signals = real_signals
        torch.set_num_threads(2)
        engine.num_threads = 2


def test_no_policy_without_the_flag_or_with_one_thread(smolwidth_model):
    loaded = load_model(smolwidth_model, batch_invariant=True, row_tile=64)
    try:
        off = engine_for(loaded, threads=2, adaptive_threads=False)
        assert off.thread_policy is None and off.cpu_signals is not None  # the waits are still measured
        one = engine_for(loaded, threads=1)
        assert one.thread_policy is None
        out, stats = None, None
        one.add_request(greedy("x", [5, 6, 7], 2))
        while one.has_work():
            out, stats = one.step()
        assert stats is not None and stats.threads == 1 and stats.thread_change == "" and stats.run_delay >= 0.0
    finally:
        torch.set_num_threads(2)
