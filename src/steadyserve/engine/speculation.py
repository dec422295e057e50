"""Prompt-lookup (n-gram) speculation: drafting and acceptance tracking, pure Python (no torch).

Each decode step of a sequence costs a full pass over the weights for one token. Much of what users ask
repeats its input (edit this code, fix this JSON, quote this document), so the next few tokens can often
be guessed by finding the sequence's last n tokens earlier in its own prompt and output, and copying what
followed them there. The engine then computes [last token + draft] as one small chunk, in the same
kernels and row order as a prefill chunk, and samples every position exactly as a plain decode step would
(engine.py `_verify`): a draft token counts only if it equals the token sampled there, and the first
position where it does not emits the sampled token and ends the verification. Batch-invariant numerics
make a chunk's rows bitwise the rows the plain path computes one step at a time (the prefill == decode
invariant), so the output is bitwise that of `--speculation off`, not merely equal in distribution.

This module only guesses and keeps score: the draft (NgramIndex), whether guessing still pays for a
sequence (Acceptance) and for the step (Speculator.draft), and counts for metrics.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .sequence import Sequence

MODES = ("off", "ngram")  # --speculation
# Draft tokens per verification at most (fewer where the step's cheap rows are fewer, see Speculator).
MAX_DRAFT_TOKENS = 7
NGRAM_MAX = 4  # the longest suffix looked up; longer matches are tried first
NGRAM_MIN = 2  # the shortest: a single-token match guesses too often to pay
# Acceptance below which a sequence stops drafting for a while (an EMA of accepted / drafted tokens). A
# rejected draft wastes only rows that were nearly free, so the bar is low: on SmolLM2-135M (AMD EPYC)
# a verification of 3 drafts costs 1.42 decode steps, and pays once it accepts 0.42 tokens on average
# (a ratio of 0.14). Pausing at divergence points costs more than the rows: raising this to 0.3 left
# 34 of 70 steps of a JSON correction undrafted instead of 13. A sequence whose output stops following
# its input stops paying even the rows.
MIN_ACCEPTANCE = 0.15
FIRST_ACCEPTANCE = 0.5  # a new sequence's EMA: two verifications that accept nothing pause it
EMA_WEIGHT = 0.5  # weight of the latest verification in the EMA
MIN_PAUSE, MAX_PAUSE = 4, 256  # decode steps without drafting after low acceptance; doubles while it stays low


class NgramIndex:
    """Where each n-gram of a token list last occurred, kept up to date incrementally.

    For n in [nmin, nmax], `_last[n]` maps the n tokens ending just before position i to the largest such
    i registered (the position its continuation starts at). Positions are registered up to len(tokens) - 1,
    so the list's own suffix never matches itself. Appending m tokens costs O(m * (nmax - nmin + 1)).
    """

    def __init__(self, nmin: int = NGRAM_MIN, nmax: int = NGRAM_MAX) -> None:
        self.nmin, self.nmax = nmin, nmax
        self._last: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(nmin, nmax + 1)}
        self._next = 0  # the first position not yet registered

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `tokens`: what followed the latest earlier occurrence of its
        longest suffix (nmax down to nmin tokens) found; [] if none. `tokens` must only ever grow between
        calls (a sequence's prompt + output).

        The continuation may run into the suffix itself (a repeating pattern): it is read from `tokens`
        extended by the draft so far, so a period-p loop drafts k tokens, not p."""
        if k <= 0 or len(tokens) <= self.nmin:
            return []
        self._register_upto(tokens, len(tokens) - 1)
        for n in range(min(self.nmax, len(tokens) - 1), self.nmin - 1, -1):
            start = self._last[n].get(tuple(tokens[-n:]))
            if start is None:
                continue
            draft: list[int] = []
            for j in range(k):
                p = start + j
                draft.append(tokens[p] if p < len(tokens) else draft[p - len(tokens)])
            return draft
        return []

    def _register_upto(self, tokens: list[int], end: int) -> None:
        """Register positions [self._next, end]: each n-gram ending just before one of them."""
        for i in range(max(self._next, self.nmin), end + 1):
            for n, table in self._last.items():
                if i >= n:
                    table[tuple(tokens[i - n:i])] = i
        self._next = max(self._next, end + 1)


@dataclass
class Acceptance:
    """One sequence's record: whether drafting still pays for it, and its counts."""

    rate: float = FIRST_ACCEPTANCE  # EMA of accepted / drafted over its verifications
    pause: int = 0  # decode steps left without drafting
    next_pause: int = MIN_PAUSE  # the pause the next low acceptance imposes (doubles, up to MAX_PAUSE)
    drafted: int = 0  # draft tokens verified, in all
    accepted: int = 0  # of which accepted

    def allows(self) -> bool:
        """Whether to draft this decode step (counts a paused step down)."""
        if self.pause > 0:
            self.pause -= 1
            if self.pause == 0:
                self.rate = MIN_ACCEPTANCE  # a fresh chance: one good verification keeps it drafting
            return False
        return True

    def record(self, drafted: int, accepted: int) -> None:
        self.drafted += drafted
        self.accepted += accepted
        self.rate = (1 - EMA_WEIGHT) * self.rate + EMA_WEIGHT * (accepted / drafted)
        if self.rate < MIN_ACCEPTANCE:
            self.pause, self.next_pause = self.next_pause, min(2 * self.next_pause, MAX_PAUSE)
        elif accepted == drafted:
            self.next_pause = MIN_PAUSE


@dataclass
class SeqDrafter:
    """Per-sequence speculation state (kept in the engine's per-request state)."""

    index: NgramIndex = field(default_factory=NgramIndex)  # the sequence's n-grams
    acceptance: Acceptance = field(default_factory=Acceptance)  # whether drafting still pays


@dataclass
class SpeculationCounts:
    """What one step's verifications did, for StepStats and the metrics."""

    drafted: int = 0  # draft tokens verified
    accepted: int = 0  # of which accepted
    ratios: list[float] = field(default_factory=list)  # accepted / drafted of each verification


class Speculator:
    """Drafts for the running sequences before the scheduler sizes a step, and records the outcomes.

    Never slower: a step computes up to `cheap_rows` rows (tokens) for little more than the cost of one,
    because the matrix kernels dequantize each weight tile in registers once for that many rows (kSmallM of
    kernels/csrc/qmm_avx512.cpp: 4; on SmolLM2-135M, AMD EPYC, 2 threads, 1 row 4.4 ms, 4 rows 6.5 ms,
    5 rows 11.4 ms). Drafts only fill
    the rows the step leaves spare below that, oldest sequence first: one stream drafts cheap_rows - 1
    tokens, a busy batch none, so large batches run exactly as without speculation."""

    def __init__(self, mode: str, cheap_rows: int = 4, max_draft_tokens: int = MAX_DRAFT_TOKENS) -> None:
        if mode not in MODES:
            raise ValueError(f"speculation mode must be one of {MODES}, not {mode!r}")
        self.enabled = mode == "ngram"
        self.cheap_rows = cheap_rows  # rows a step may reach with its drafts
        self.max_draft_tokens = max_draft_tokens  # k, per sequence
        self.counts = SpeculationCounts()  # of the current step; reset by take_counts
        self.total_drafted = 0  # since start
        self.total_accepted = 0

    def new_drafter(self) -> SeqDrafter | None:
        return SeqDrafter() if self.enabled else None

    def draft(self, running: list[tuple[Sequence, SeqDrafter | None]]) -> None:
        """Set each running sequence's draft_token_ids for this step ([] where it does not draft).

        A sequence drafts when it is decoding (exactly its last token left to compute, prompt logprobs
        done), its acceptance allows, at least 2 more tokens may be generated (the draft plus the token
        sampled after it stay within max_tokens), and the step has spare cheap rows."""
        spare = self.cheap_rows - sum(seq.num_uncomputed_tokens for seq, _ in running)
        for seq, drafter in running:
            seq.draft_token_ids = []
            if spare < 1 or drafter is None or seq.num_uncomputed_tokens != 1 or not seq.prompt_logprobs_done:
                continue
            room = min(seq.params.max_tokens - seq.num_generated_tokens - 1, self.max_draft_tokens, spare)
            if room < 1 or not drafter.acceptance.allows():
                continue
            seq.draft_token_ids = drafter.index.propose(seq.token_ids, room)
            spare -= len(seq.draft_token_ids)

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
