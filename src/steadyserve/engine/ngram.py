"""Speculation's per-sequence half, pure Python (no torch): the n-gram index that guesses a draft, and the
acceptance estimate that says whether drafting still pays (engine/speculation.py decides how many draft tokens a
step computes; the sampler verifies them).

It imports nothing of the engine, so a Sequence can carry its own drafter (Sequence.drafter).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass, field

NGRAM_MAX = 4  # the longest suffix looked up; longer matches are tried first
NGRAM_MIN = 2  # the shortest: a single-token match guesses too often to pay...
RESYNC_WINDOW = 8  # ...except just ahead of the cursor (NgramIndex): at most this many positions past it
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
    """Per-sequence speculation state (Sequence.drafter)."""

    index: NgramIndex = field(default_factory=NgramIndex)  # the sequence's n-grams
    acceptance: Acceptance = field(default_factory=Acceptance)  # whether drafting still pays
