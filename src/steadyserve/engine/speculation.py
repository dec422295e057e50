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

This module only guesses and keeps score: the draft (NgramIndex), how often a sequence's guesses are right
(Acceptance), how many draft tokens pay in this step (Speculator.draft), and counts for metrics.
"""

from __future__ import annotations

import bisect
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from .sequence import Sequence

MODES = ("off", "ngram")  # what --speculation resolves to (auto: engine.py _speculation_mode)
# Draft tokens per verification at most (fewer where the step's cheap rows are fewer, see Speculator).
MAX_DRAFT_TOKENS = 7
NGRAM_MAX = 4  # the longest suffix looked up; longer matches are tried first
NGRAM_MIN = 2  # the shortest: a single-token match guesses too often to pay...
RESYNC_WINDOW = 8  # ...except just ahead of the cursor (NgramIndex): at most this many positions past it
# What one more row costs a step, as a fraction of a one-row step, while the rows stay within the matrix
# kernels' register rows (each weight dequantized once for all of them). Measured on SmolLM2-135M, AMD EPYC,
# 2 threads, every matrix of the model: AVX-512 1 row 8.1 ms, 4 rows 13.4, 8 rows 18.6 (0.18 a row); AVX2
# 1 row 9.9 ms, 4 rows 14.5 (0.15 a row). Past them a row costs several times more and is never drafted.
ROW_COST = 0.2
FIRST_ACCEPTANCE = 0.5  # a new sequence's estimate of p, the chance that a draft token is accepted
EMA_WEIGHT = 0.5  # weight of the latest outcome in p's estimate: outputs switch between copying and not


class TokenKeys:
    """A lookup key per token id, from the token's text: tokens whose text differs only in case and in the
    whitespace around it share a key (" The" after a full stop, "the" after an opening quote and " the" in
    mid-sentence are one word to a summary that copies it). A token that is only whitespace keeps its own
    key: indentation is content.

    Computed the first time an id is looked up and kept (the engine's one table is shared by every
    sequence), so a vocabulary of 262k tokens costs nothing at start-up."""

    def __init__(self, text_of: Callable[[int], str]) -> None:
        self._text_of = text_of  # token id -> its text
        self._key_of: dict[int, int] = {}  # token id -> key, for the ids seen so far
        self._ids: dict[str, int] = {}  # normalized text -> key

    def __call__(self, token: int) -> int:
        key = self._key_of.get(token)
        if key is None:
            text = self._text_of(token)
            key = self._key_of[token] = self._ids.setdefault((text.strip() or text).lower(), len(self._ids))
        return key


class NgramIndex:
    """Where each n-gram of a token list occurred, kept up to date incrementally, and where the output last
    copied from.

    For n in [nmin, nmax], `_occ[n]` maps the keys (TokenKeys; the ids themselves without one) of the
    n tokens ending just before position i to every such i registered, ascending (the positions their
    continuations start at). Positions are registered up to len(tokens) - 1, so the list's own suffix never
    matches itself. Appending m tokens costs O(m * (nmax - nmin + 2)).

    The cursor is the position just after the last token the sequence copied: after each proposal, the
    tokens that were then added are compared with what followed the proposal's source. Output that copies
    its input (an edit, a summary, a list of quotations) goes through it in order, so of a suffix's
    occurrences the first at or after the cursor is the likeliest next source; without one, the latest.
    Where no suffix of nmin tokens or more occurred, the last token alone is looked up within
    RESYNC_WINDOW positions after the cursor: output that left its source for a word or two (a summary's
    own phrase, a reformatted line) tends to come back to it just ahead of where it left.
    """

    def __init__(self, nmin: int = NGRAM_MIN, nmax: int = NGRAM_MAX,
                 keys: Callable[[int], int] | None = None) -> None:
        self.nmin, self.nmax = nmin, nmax
        self._key = keys or (lambda token: token)  # token id -> lookup key (TokenKeys)
        # n-grams for n in [nmin, nmax], and single tokens (the resync)
        self._occ: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in {1, *range(nmin, nmax + 1)}}
        self._keyed: list[int] = []  # the key of each token seen so far
        self._next = 0  # the first position not yet registered
        self.cursor = -1  # just after the last copied token; -1: nothing copied yet
        self._source: tuple[int, int] | None = None  # (start, len(tokens)) of the last proposal

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens guessed to follow `tokens`: what followed an earlier occurrence of its longest
        suffix (nmax down to nmin tokens) found, the one the cursor chooses; [] if none. `tokens` must only
        ever grow between calls (a sequence's prompt + output).

        The continuation may run into the suffix itself (a repeating pattern): it is read from `tokens`
        extended by the draft so far, so a period-p loop drafts k tokens, not p."""
        self._follow(tokens)
        if k <= 0 or len(tokens) <= self.nmin:
            return []
        self._register_upto(tokens, len(tokens) - 1)
        keyed = self._keyed
        for n in range(min(self.nmax, len(tokens) - 1), self.nmin - 1, -1):
            starts = self._occ[n].get(tuple(keyed[-n:]))
            if not starts:
                continue
            i = bisect.bisect_left(starts, self.cursor)
            return self._copy(tokens, starts[i] if self.cursor >= 0 and i < len(starts) else starts[-1], k)
        if self.cursor >= 0:  # the resync: the last token alone, just ahead of the cursor
            starts = self._occ[1].get((keyed[-1],), [])
            i = bisect.bisect_left(starts, self.cursor)
            if i < len(starts) and starts[i] - self.cursor <= RESYNC_WINDOW:
                return self._copy(tokens, starts[i], k)
        return []

    def _copy(self, tokens: list[int], start: int, k: int) -> list[int]:
        """k tokens from `start` on, running into the draft itself past the end of `tokens`."""
        self._source = (start, len(tokens))
        draft: list[int] = []
        for j in range(k):
            p = start + j
            draft.append(tokens[p] if p < len(tokens) else draft[p - len(tokens)])
        return draft

    def _follow(self, tokens: list[int]) -> None:
        """Move the cursor past the tokens added since the last proposal that equal its source's."""
        if self._source is None:
            return
        start, end = self._source
        self._source = None
        j = 0
        while end + j < len(tokens) and tokens[end + j] == tokens[start + j]:
            j += 1
        if j:
            self.cursor = start + j

    def _register_upto(self, tokens: list[int], end: int) -> None:
        """Register positions [self._next, end]: each n-gram ending just before one of them."""
        keyed = self._keyed
        keyed.extend(self._key(t) for t in tokens[len(keyed):])
        for i in range(max(self._next, 1), end + 1):
            for n, table in self._occ.items():
                if i >= n:
                    table.setdefault(tuple(keyed[i - n:i]), []).append(i)
        self._next = max(self._next, end + 1)


@dataclass
class Acceptance:
    """One sequence's estimate of p: the chance that a draft token is accepted, given that the draft tokens
    before it were. Outcomes in a row of a copy are far from independent (the output copies a run of its
    input, then leaves it), so p is an EMA of recent outcomes, not a long-run mean.

    Verifications update it with each draft token up to the first rejection. Steps that do not draft update
    it too, with a guess that costs no row: the draft's first token is kept and compared with the token the
    step then samples (observe). So a sequence whose output turns to copying starts drafting again, and one
    that stops copying stops, without spending rows to find out."""

    p: float = FIRST_ACCEPTANCE
    guess: int = -1  # a draft's first token, not computed, for the token at guess_pos
    guess_pos: int = -1  # where in the sequence's tokens; -1: no guess pending
    drafted: int = 0  # draft tokens verified, in all
    accepted: int = 0  # of which accepted

    def _update(self, trials: int, hits: int) -> None:
        self.p = (1 - EMA_WEIGHT) * self.p + EMA_WEIGHT * (hits / trials)

    def record(self, drafted: int, accepted: int) -> None:
        """A verification: `accepted` of `drafted` draft tokens taken (the first rejection ends it, so the
        tokens after it tell nothing of p)."""
        self.drafted += drafted
        self.accepted += accepted
        self._update(accepted + (accepted < drafted), accepted)

    def guess_next(self, tokens: list[int], token: int) -> None:
        """Keep `token` as the guess for what follows `tokens` (a draft this step does not compute)."""
        self.guess, self.guess_pos = token, len(tokens)

    def observe(self, tokens: list[int]) -> None:
        """Score the pending guess once `tokens` (the sequence's, which only grow) reach its position."""
        if 0 <= self.guess_pos < len(tokens):
            self._update(1, int(tokens[self.guess_pos] == self.guess))
            self.guess_pos = -1


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

    def draft(self, running: list[tuple[Sequence, SeqDrafter | None]]) -> None:
        """Set each running sequence's draft_token_ids for this step ([] where it does not draft).

        A sequence may draft when it is decoding (exactly its last token left to compute, prompt logprobs
        done), at least 2 more tokens may be generated (the draft plus the token sampled after it stay
        within max_tokens), and its n-grams propose something; how many of those tokens it drafts is the
        allocation above."""
        rows = sum(seq.num_uncomputed_tokens for seq, _ in running)
        spare = self.cheap_rows - rows
        proposals: list[tuple[Sequence, Acceptance, list[int]]] = []
        for seq, drafter in running:
            seq.draft_token_ids = []
            if drafter is None:
                continue
            drafter.acceptance.observe(seq.token_ids)
            if spare < 1 or seq.num_uncomputed_tokens != 1 or not seq.prompt_logprobs_done:
                continue
            room = min(seq.params.max_tokens - seq.num_generated_tokens - 1, self.max_draft_tokens, spare)
            if room >= 1 and (proposal := drafter.index.propose(seq.token_ids, room)):
                proposals.append((seq, drafter.acceptance, proposal))
        granted = self._allocate([a.p for _, a, _ in proposals], [len(d) for _, _, d in proposals],
                                 max(sum(seq.num_uncomputed_tokens == 1 for seq, _ in running), 1), rows, spare)
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
