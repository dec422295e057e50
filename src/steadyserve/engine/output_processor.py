"""From a step's chosen tokens to what each request is told: text, stops, logprobs (RequestOutput).

`OutputProcessor.process` walks each scheduled sequence's sampled tokens in order: each one's logprobs
(the model's row, sampler.token_logprob), its text (the sequence's incremental detokenizer, which holds back
what may still become a stop string; an end token never becomes text) and whether the sequence stops there
(stop.py: an end token, a stop string completed in the text, the length limit). The first stop cuts the
tokens; a sampling failure after them fails the request with what came before it. A prefill chunk reports
its prompt logprobs once the whole prompt is scored; an embedding folds its hidden rows and finishes with
the pooled vector.

It decides, and the scheduler applies (Scheduler.update): the output's `new_token_ids` are the tokens the
sequence keeps, and `finished` takes it out of the batch. Nothing here touches the scheduler, the block
manager or a tensor other than to read a row.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .batch_sampler import Sampled
from .model_runner import SeqResult
from .sampler import token_logprob
from .scheduler import SchedulerOutput
from .sequence import RequestOutput, RequestTimings, Sequence, TokenLogprob
from .stop import final_reason, stop_reason


@dataclass
class Emitted:
    """What one step emits for one sequence so far: one token, or several when a draft is accepted."""

    tokens: list[int] = field(default_factory=list)  # token ids, in order
    text: str = ""  # their text delta
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked


class OutputProcessor:
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len  # a sequence stops at this many tokens (stop_reason's length rule)
        # TEST-ONLY fault injection (LLMEngine.fault_hook): called with each sequence a step computed, before
        # its output is made; what it raises fails that request alone.
        self.fault_hook: Callable[[Sequence], None] | None = None

    def process(self, batch: SchedulerOutput, results: list[SeqResult],
                sampled: list[Sampled]) -> list[RequestOutput | None]:
        """One output per scheduled sequence, in order; None where it has nothing to say yet."""
        n = len(batch.scheduled)
        outputs = []
        for item, result, chosen in zip(batch.scheduled, results, sampled):
            # The tokens whose K/V this step leaves computed, once the scheduler counts them (a verifying
            # sequence has its whole prompt computed already).
            computed = item.seq.num_computed_tokens + item.num_new_tokens
            out = self._process(item.seq, result, chosen, computed, n)
            if out is not None and item.seq.state.first_output:
                item.seq.state.first_output = False
                out.queue_wait = item.seq.first_scheduled_time - item.seq.request.arrival_time  # type: ignore[operator]
            outputs.append(out)
        return outputs

    def abort(self, seq: Sequence) -> RequestOutput:
        """The last output of a request aborted by its client."""
        return self._output(seq, Emitted(), finish_reason="abort")

    def _process(self, seq: Sequence, result: SeqResult, chosen: Sampled, computed: int,
                 num_batch_seqs: int) -> RequestOutput | None:
        """count -> stop -> output; one request's failure fails that request only."""
        now = time.monotonic()
        if seq.prefill_done_time is None and result.sample_row is not None:  # the prompt's last token computed
            seq.prefill_done_time = now
        emitted = Emitted()
        try:
            if self.fault_hook is not None:
                self.fault_hook(seq)
            if seq.embed:
                return self._pool(seq, result, num_batch_seqs)
            prompt_lps = self._collect_prompt_logprobs(seq, result, computed)
            if result.sample_row is None:  # a prefill chunk: nothing sampled yet
                if prompt_lps is None:
                    return None
                return self._output(seq, emitted, prompt_lps, num_batch_seqs=num_batch_seqs)
            if seq.params.max_tokens == 0:  # scoring only
                return self._finish(seq, emitted, prompt_lps, "length", num_batch_seqs)
            reason = None
            for tok, row in zip(chosen.tokens, chosen.rows):
                reason = self._emit(seq, tok, row, emitted)
                if reason:
                    break
            if reason is None and chosen.error is not None:
                return self._fail(seq, emitted, chosen.error, num_batch_seqs)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if reason:
                return self._finish(seq, emitted, prompt_lps, reason, num_batch_seqs)
            return self._output(seq, emitted, prompt_lps, num_batch_seqs=num_batch_seqs)
        except Exception as e:  # tokenizer, hook
            return self._fail(seq, emitted, f"{type(e).__name__}: {e}", num_batch_seqs)

    def _emit(self, seq: Sequence, tok: int, row: torch.Tensor, emitted: Emitted) -> str | None:
        """Add one chosen token to `emitted`; returns why the sequence stops there, if it does."""
        st = seq.state
        lp = token_logprob(row, tok, seq.params.logprobs) if seq.params.logprobs is not None else None
        text = "" if tok in st.end_ids else st.detok.add(tok)  # an end token never becomes text
        emitted.tokens.append(tok)  # only once nothing about it can fail: an error output carries what came before
        emitted.text += text
        if lp is not None:
            emitted.logprobs.append(lp)
        n = len(emitted.tokens)  # not yet in seq.token_ids: Scheduler.update appends what is kept
        return stop_reason(tok, st.end_ids, st.detok.stopped, seq.num_generated_tokens + n, seq.params.max_tokens,
                           seq.num_tokens + n, self.max_model_len)

    def _pool(self, seq: Sequence, result: SeqResult, num_batch_seqs: int) -> RequestOutput | None:
        """An embedding's step: fold the chunk's hidden rows; once the prompt is computed, finish with the vector."""
        pool = seq.state.pool
        assert pool is not None and result.hidden_rows is not None
        pool.add(result.hidden_rows, result.hidden_pos)
        if not pool.done:
            return None
        out = self._output(seq, Emitted(), finish_reason="length", num_batch_seqs=num_batch_seqs)
        out.embedding = pool.vector()
        return out

    def _collect_prompt_logprobs(self, seq: Sequence, result: SeqResult,
                                 computed: int) -> list[TokenLogprob | None] | None:
        """The prompt's logprobs, once, on the step that computes its last token; None before and after."""
        st = seq.state
        if seq.prompt_logprobs_done:
            return None
        for i, lp in enumerate(result.prompt_logprobs):
            pos = result.first_prompt_pos + i
            if pos == len(st.prompt_logprobs) + 1:  # skip rows recomputed after a preemption
                st.prompt_logprobs.append(lp)
        if computed < seq.num_prompt_tokens:
            return None
        seq.prompt_logprobs_done = True
        return [None, *st.prompt_logprobs]

    def _finish(self, seq: Sequence, emitted: Emitted, prompt_lps: list[TokenLogprob | None] | None, reason: str,
                num_batch_seqs: int) -> RequestOutput:
        emitted.text += seq.state.detok.finish()
        reason = final_reason(reason, seq.state.detok.stopped)  # type: ignore[arg-type]
        return self._output(seq, emitted, prompt_lps, reason, num_batch_seqs=num_batch_seqs)

    def _fail(self, seq: Sequence, emitted: Emitted, error: str, num_batch_seqs: int) -> RequestOutput:
        """A failed request's last output: the tokens emitted before the failing position are its own, as they
        would have been in the steps before it without speculation."""
        return self._output(seq, emitted, finish_reason="error", error=error, num_batch_seqs=num_batch_seqs)

    def _output(self, seq: Sequence, emitted: Emitted, prompt_lps: list[TokenLogprob | None] | None = None,
                finish_reason: str | None = None, error: str | None = None, num_batch_seqs: int = 0) -> RequestOutput:
        out = RequestOutput(request_id=seq.request_id, new_token_ids=emitted.tokens, text_delta=emitted.text,
                            logprobs=emitted.logprobs, prompt_logprobs=prompt_lps, finished=finish_reason is not None,
                            finish_reason=finish_reason, error=error, num_prompt_tokens=seq.num_prompt_tokens,
                            num_generated_tokens=seq.num_generated_tokens + len(emitted.tokens),
                            num_batch_seqs=num_batch_seqs,
                            num_cached_tokens=min(seq.num_cached_tokens, seq.num_prompt_tokens),
                            timings=None if finish_reason is None else _timings(seq))
        if finish_reason is not None and seq.request.receipt:
            # The seed the generator was made with: the request's, or the one make_generator drew for it.
            out.seed = seq.state.generator.initial_seed()
        return out


def _timings(seq: Sequence) -> RequestTimings:
    """The times the engine kept for `seq`, copied for its final output (the engine thread calls no tracer)."""
    return RequestTimings(seq.request.arrival_time, seq.first_scheduled_time, seq.prefill_done_time,
                          seq.first_token_time, list(seq.preempted_times), time.monotonic())
