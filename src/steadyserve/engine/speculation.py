"""Prompt-lookup (n-gram) speculation: drafting and acceptance tracking, pure Python (no torch).

Each decode step of a sequence costs a full pass over the weights for one token. Much of what users ask
repeats its input (edit this code, fix this JSON, quote this document), so the next few tokens can often
be guessed by finding the sequence's last n tokens earlier in its own prompt and output, and copying what
followed them there. The engine then computes [last token + draft] as one small chunk, in the same
kernels and row order as a prefill chunk, and samples every position exactly as a plain decode step would
(batch_sampler.py `BatchSampler._choose`): a draft token counts only if it equals the token sampled there, and the first
position where it does not emits the sampled token and ends the verification. Batch-invariant numerics
make a chunk's rows bitwise the rows the plain path computes one step at a time (the prefill == decode
invariant), so the output is bitwise that of `--speculation off`, not merely equal in distribution.

This module only guesses and keeps score: the draft (NgramIndex), how often a sequence's guesses are right
(Acceptance), how many draft tokens pay in this step (Speculator.draft), and counts for metrics.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from .ngram import (EMA_WEIGHT, FIRST_ACCEPTANCE, NGRAM_MAX, NGRAM_MIN, RESYNC_WINDOW, Acceptance, NgramIndex,
                    SeqDrafter, TokenKeys)
from .sequence import Sequence

__all__ = ["EMA_WEIGHT", "FIRST_ACCEPTANCE", "NGRAM_MAX", "NGRAM_MIN", "RESYNC_WINDOW", "Acceptance", "NgramIndex",
           "SeqDrafter", "TokenKeys"]  # re-exported: their home is ngram.py

MODES = ("off", "ngram")  # what --speculation resolves to (auto: engine.py _speculation_mode)
# Draft tokens per verification at most (fewer where the step's cheap rows are fewer, see Speculator).
MAX_DRAFT_TOKENS = 7
# What one more row costs a step, as a fraction of a one-row step, while the rows stay within the matrix
# kernels' register rows (each weight dequantized once for all of them). Measured on SmolLM2-135M, AMD EPYC,
# 2 threads, every matrix of the model: AVX-512 1 row 8.1 ms, 4 rows 13.4, 8 rows 18.6 (0.18 a row); AVX2
# 1 row 9.9 ms, 4 rows 14.5 (0.15 a row). Past them a row costs several times more and is never drafted.
ROW_COST = 0.2


@dataclass
class SpeculationCounts:
    """What one step's verifications did, for StepStats and the metrics."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    ratios: list[float] = field(default_factory=list)  # accepted / drafted of each verification


class Speculator:
    """Drafts for the running sequences before the scheduler sizes a step, and records the outcomes.

    Never slower, by expected tokens per unit of step time. A step of r rows, up to `cheap_rows` (the
    matrix kernels' register rows: kSmallM of kernels/csrc/qmm_avx512.cpp, 8), costs about
    1 + row_cost * (r - 1) one-row steps; past them, far more, and drafts never go there. The j-th draft
    token of a sequence adds p^j expected tokens (its p: Acceptance). Draft rows are handed out by
    expected tokens, highest first (oldest sequence first among equals), while one adds more tokens than
    its cost at the step's current rate: gain > row_cost * tokens / cost. So one stream that copies drafts
    up to 7 tokens, one that does not copy drafts none, and a busy batch none: large batches run exactly
    as without speculation. row_cost 0 drafts every cheap row (tests)."""

    def __init__(self, mode: str, cheap_rows: int = 8, max_draft_tokens: int = MAX_DRAFT_TOKENS,
                 row_cost: float = ROW_COST, keys: Callable[[int], int] | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"speculation mode must be one of {MODES}, not {mode!r}")
        self.enabled = mode == "ngram"
        self.cheap_rows = cheap_rows  # rows a step may reach with its drafts
        self.max_draft_tokens = max_draft_tokens  # k, per sequence
        self.row_cost = row_cost  # one more row's cost, in one-row steps
        self.keys = keys  # the n-gram lookup's key per token id (TokenKeys); None: the ids themselves
        self.counts = SpeculationCounts()  # of the current step; reset by take_counts
        self.total_drafted = 0  # since start
        self.total_accepted = 0

    def new_drafter(self) -> SeqDrafter | None:
        return SeqDrafter(NgramIndex(keys=self.keys)) if self.enabled else None

    def draft(self, running: list[Sequence]) -> None:
        """Set each running sequence's draft_token_ids for this step ([] where it does not draft).

        A sequence may draft when it is decoding (exactly its last token left to compute, prompt logprobs
        done), at least 2 more tokens may be generated (the draft plus the token sampled after it stay
        within max_tokens), and its n-grams propose something; how many of those tokens it drafts is the
        allocation above."""
        rows = sum(seq.num_uncomputed_tokens for seq in running)
        spare = self.cheap_rows - rows
        proposals: list[tuple[Sequence, Acceptance, list[int]]] = []
        for seq in running:
            seq.draft_token_ids = []
            drafter = seq.drafter
            if drafter is None:
                continue
            drafter.acceptance.observe(seq.token_ids)
            if spare < 1 or seq.num_uncomputed_tokens != 1 or not seq.prompt_logprobs_done:
                continue
            room = min(seq.params.max_tokens - seq.num_generated_tokens - 1, self.max_draft_tokens, spare)
            if room >= 1 and (proposal := drafter.index.propose(seq.token_ids, room)):
                proposals.append((seq, drafter.acceptance, proposal))
        granted = self._allocate([a.p for _, a, _ in proposals], [len(d) for _, _, d in proposals],
                                 max(sum(seq.num_uncomputed_tokens == 1 for seq in running), 1), rows, spare)
        for (seq, acceptance, proposal), n in zip(proposals, granted):
            seq.draft_token_ids = proposal[:n]
            if n == 0:
                acceptance.guess_next(seq.token_ids, proposal[0])

    def _allocate(self, ps: list[float], lengths: list[int], tokens: float, rows: int, spare: int) -> list[int]:
        """Draft tokens per proposal: rows one at a time to the highest expected gain (p^j for a sequence's
        j-th), while the gain beats the step's rate (tokens / cost) times a row's cost."""
        granted = [0] * len(ps)
        heap = [(-p, i) for i, p in enumerate(ps) if lengths[i] > 0]
        heapq.heapify(heap)
        cost = 1 + self.row_cost * (rows - 1)  # of the step, in one-row steps
        while heap and spare > 0:
            neg_gain, i = heapq.heappop(heap)
            gain = -neg_gain
            if self.row_cost > 0 and gain <= self.row_cost * tokens / cost:
                break  # every gain left is smaller
            granted[i] += 1
            tokens, cost, spare = tokens + gain, cost + self.row_cost, spare - 1
            if granted[i] < lengths[i]:
                heapq.heappush(heap, (-gain * ps[i], i))
        return granted

    def record(self, drafter: SeqDrafter | None, drafted: int, accepted: int) -> None:
        """One verification's outcome: `drafted` draft tokens computed, the first `accepted` taken."""
        if drafter is None or drafted == 0:
            return
        drafter.acceptance.record(drafted, accepted)
        self.counts.drafted += drafted
        self.counts.accepted += accepted
        self.counts.ratios.append(accepted / drafted)
        self.total_drafted += drafted
        self.total_accepted += accepted

    def take_counts(self) -> SpeculationCounts:
        """This step's counts, and a fresh record for the next."""
        counts, self.counts = self.counts, SpeculationCounts()
        return counts
