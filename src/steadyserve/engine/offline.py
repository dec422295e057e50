"""Run requests through an LLMEngine synchronously (self-test, tests, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass

from .engine import LLMEngine
from .sequence import Accumulated, Request


@dataclass
class Completed(Accumulated):
    """Everything one request produced, gathered from its outputs (Accumulated's fold), with its logprobs as
    plain values for comparisons."""

    @property
    def logprob_values(self) -> list[float]:
        return [lp.logprob for lp in self.logprobs]

    @property
    def prompt_logprob_values(self) -> list[float]:
        return [lp.logprob for lp in (self.prompt_logprobs or []) if lp is not None]


def run_requests(engine: LLMEngine, requests: list[Request],
                 arrivals: dict[int, list[Request]] | None = None, max_steps: int = 100_000) -> dict[str, Completed]:
    """Run `requests` (added at once) plus `arrivals` (added before step k) to completion."""
    done: dict[str, Completed] = {}
    for r in requests:
        engine.add_request(r)
        done[r.request_id] = Completed()
    pending = dict(arrivals or {})
    step = 0
    while engine.has_work() or pending:
        for r in pending.pop(step, []):
            engine.add_request(r)
            done[r.request_id] = Completed()
        outputs, _ = engine.step()
        for out in outputs:
            done[out.request_id].add(out)
        step += 1
        if step > max_steps:
            raise RuntimeError("run_requests: too many steps")
    return done
