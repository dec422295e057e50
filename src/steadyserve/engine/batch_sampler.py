"""A step's token choices: every row of the batch that picks a token, sampled on its own.

The runner hands each scheduled sequence its (V,) rows (model_runner.SeqResult): one when it decodes or
finishes its prompt, 1 + k when it verifies a speculative draft of k tokens. `BatchSampler.sample` picks a
token from each in order with the sequence's own generator, logits processors and grammar (sampler.py),
reading only that sequence's row and tokens, so a choice is as batch-invariant as its row.

A verification samples each position exactly as a plain decode step would (the same row bits, the same
generator draws, processors and grammar over the tokens chosen so far) and goes on while the token sampled
equals the draft token computed there. It stops at the first that differs, after the last draft token's
row, or at a token that ends the sequence by its id or its count (stop.stop_reason without text). A stop
string is the output processor's to find: it cuts the tokens there, and the sequence finishes, so
whatever was sampled after it is never seen. Which draft tokens were accepted follows from the tokens kept
(Scheduler.update).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model_runner import SeqResult
from .sampler import NumericalError, process_row, sample
from .scheduler import SchedulerOutput
from .sequence import Sequence
from .stop import stop_reason


@dataclass
class Sampled:
    """What the sampler chose for one scheduled sequence in one step."""

    tokens: list[int] = field(default_factory=list)  # chosen, in order: 0 (nothing to sample), 1, or 1 + accepted
    rows: list[torch.Tensor] = field(default_factory=list)  # the model's (V,) row each was chosen from (logprobs)
    # Why the position after `tokens` could not pick a token (NaN row, grammar): the request fails there,
    # after the tokens before it, unless one of them already stopped it.
    error: str | None = None


class BatchSampler:
    def __init__(self, max_model_len: int) -> None:
        self.max_model_len = max_model_len  # a sequence stops at this many tokens (stop_reason's length rule)

    def sample(self, batch: SchedulerOutput, results: list[SeqResult]) -> list[Sampled]:
        """One Sampled per scheduled sequence, in order, row by row."""
        return [self._choose(item.seq, result) for item, result in zip(batch.scheduled, results)]

    def _choose(self, seq: Sequence, result: SeqResult) -> Sampled:
        out = Sampled()
        if seq.embed or result.sample_row is None or seq.params.max_tokens == 0:
            return out  # an embedding, a prefill chunk, or a score: nothing to pick
        draft = seq.draft_token_ids
        try:
            for j, (row, argmax, has_nan) in enumerate(result.choice_rows()):
                tok = self._pick(seq, out.tokens, row, argmax, has_nan)
                out.tokens.append(tok)
                out.rows.append(row)
                n = len(out.tokens)
                if j == len(draft) or tok != draft[j] or stop_reason(
                        tok, seq.state.end_ids, False, seq.num_generated_tokens + n, seq.params.max_tokens,
                        seq.num_tokens + n, self.max_model_len):
                    break
        except Exception as e:  # NaN, grammar: this request fails alone, after what it chose before
            out.error = f"{type(e).__name__}: {e}"
        return out

    def _pick(self, seq: Sequence, chosen: list[int], row: torch.Tensor, argmax: int, has_nan: bool) -> int:
        """The token a position picks from its (V,) row: the model's, or after the logits processors, which
        see the sequence's tokens and those `chosen` before this position in the step."""
        st = seq.state
        if not seq.params.processes_row:
            return sample(row, seq.params, st.generator, argmax, has_nan)
        # Logits processors work on their own row; the reported logprobs stay the model's.
        if has_nan:
            raise NumericalError("the model produced NaN log-probabilities")
        row = process_row(row, seq.params, seq.token_ids + chosen, seq.num_prompt_tokens, st.end_ids)
        if st.matcher is not None:
            st.matcher.mask_(row)  # only what the grammar allows next
        tok = sample(row, seq.params, st.generator, has_nan=False)
        if st.matcher is not None:
            st.matcher.advance(tok)
        return tok
