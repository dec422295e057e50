"""TEST-ONLY: break batch invariance on purpose, to show the checks catch it.

`install_batch_drift(engine)` wraps the engine's model runner so that every log-prob row it returns (and
every hidden row it hands an embedding to pool) is shifted by (tokens in the step) x `scale`: a result then
depends on what shares its step (alone vs batched), and on how the sequence was computed (prefill vs decode, scored vs generated), which is exactly
what batch invariance rules out. A uniform shift of a row keeps its argmax and its softmax, so greedy and
seeded tokens stay the same and only the reported logprobs drift: the checks must catch it by the bits.

Servers started through steadyserve.testing.serve --test-drift install it after their self-test, so they
still claim to be batch-invariant (fingerprint ...-bi) while they are not.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

def install_batch_drift(engine: Any, scale: float = 2.0 ** -10) -> Callable[[], None]:
    """Wrap engine.runner.execute; returns a function that restores it."""
    runner = engine.runner
    real = runner.execute

    def execute(sched: Any) -> list:
        results = real(sched)
        bump = sched.num_tokens * scale
        for r in results:
            if r.sample_row is not None:
                r.sample_row = r.sample_row + bump
                r.draft_rows = [row + bump for row in r.draft_rows]
            r.prompt_logprobs = [replace(lp, logprob=lp.logprob + bump) for lp in r.prompt_logprobs]
            if r.hidden_rows is not None:  # an embedding's rows drift alike (engine/pooler.py)
                r.hidden_rows = r.hidden_rows + bump
        return results

    runner.execute = execute

    def restore() -> None:
        runner.execute = real

    return restore
