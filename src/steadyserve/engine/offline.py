"""Run requests through an LLMEngine synchronously (self-test, tests, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .engine import LLMEngine
from .sequence import Request, RequestOutput, TokenLogprob


@dataclass
class Completed:
    """Everything one request produced, gathered from its outputs."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    num_outputs: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache

    def add(self, out: RequestOutput) -> None:
        self.num_outputs += 1
        self.num_cached_tokens = out.num_cached_tokens
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        self.text += out.text_delta
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error

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
