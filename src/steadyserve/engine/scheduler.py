"""Continuous-batching scheduler, pure Python.

Each step gets a token budget (`max_num_batched_tokens`). Running sequences go
first, in admission order, each taking what it still has to compute (1 token
when decoding, a chunk of its prompt while prefilling), so a long prompt is
spread over several steps and never stalls running decodes. Waiting sequences
are admitted into what budget and cache are left, picked across tenants by weight (deficit round-robin over
tokens, fair_share.py; one tenant: first come, first served). When several tenants have prompt tokens to
compute, the step's prompt tokens are divided among them by weight too (fair_share.split_step), and what they
leave goes back to the running prompts in order (_top_up); with every seat taken, a tenant below its weighted
share of the seats is seated at once in place of a batch tenant's or an over-share tenant's newest sequence
(seating.py: preempted, recomputed later, bitwise the same), its prompt in a step of its own; while tenants share
the server, a step computes at most a weighted few prompts of each tenant, and a light tenant's prompt with no other
tenant's (seating.Sharing), so the step a light tenant's request waits out is short; a prompt's cached prefix
blocks (see block_manager.py) cost neither budget nor new blocks. When the cache runs out,
the most recently admitted running sequence is preempted (a `batch`-priority one first, if any): its blocks are freed
and it is recomputed later (batch-invariant numerics make the recomputed K/V
bitwise identical, so preemption cannot change a result). A decoding sequence
with a speculative draft (speculation.py) computes the draft after its last
token, from budget and blocks no other sequence needs this step.

`update` settles a step once its outputs are known: the tokens it computed are counted (and the blocks
they fill published to the prefix cache), a verification keeps only what was accepted, and finished
sequences leave the batch.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .block_manager import BlockManager
from .fair_share import FairShare, split_step
from .seating import Sharing, seat_for_waiting
from .sequence import RequestOutput, Sequence, SequenceStatus
from .speculation import Speculator


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # tokens computed for it this step, starting at seq.num_computed_tokens (drafts included)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 speculator: Speculator | None = None) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # Drafts for the running sequences before each step is sized, and keeps score of what they got
        # accepted (speculation.py); None or disabled: no drafts.
        self.speculator = speculator
        self.waiting: deque[Sequence] = deque()
        # Which waiting sequence goes next when several tenants wait (fair_share.py).
        self.fair_share = FairShare()
        # Whether tenants share the server now: then a step holds a few prompts at most of each tenant (by weight,
        # seating.prompt_limits), and a light tenant's prompt none of the other tenants' (seating.py).
        self.sharing = Sharing()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # total, for metrics

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)
        self.sharing.saw(seq.request.tenant, seq.request.share)

    def abort(self, request_id: str) -> Sequence | None:
        """Remove a request wherever it is and free its blocks. Returns it, or None."""
        for seq in self.running:
            if seq.request_id == request_id:
                self.running.remove(seq)
                self.finish(seq)
                return seq
        for seq in self.waiting:
            if seq.request_id == request_id:
                self.waiting.remove(seq)
                self.finish(seq)
                return seq
        return None

    def finish(self, seq: Sequence) -> None:
        """Mark finished and release its cache blocks (it must already be out of the queues)."""
        seq.status = SequenceStatus.FINISHED
        self.block_manager.free(seq)

    def retire(self, seq: Sequence) -> None:
        """Take a finished running sequence out of the batch."""
        if seq in self.running:
            self.running.remove(seq)
        self.finish(seq)

    def _fit_draft(self, seq: Sequence, n: int, budget: int, num_after: int) -> int:
        """How many of seq's draft tokens this step computes after its n tokens; trims the draft to that.

        A draft is a guess: it never takes a token of budget or a block that a running sequence after
        this one may need this step (one token each, at most one new block each), so it can neither delay
        nor preempt anyone."""
        bm = self.block_manager
        keep = max(0, min(len(seq.draft_token_ids), budget - n - num_after))
        if keep and bm.num_missing_blocks(seq, n + keep) + num_after > bm.num_free_blocks:
            keep = 0
        del seq.draft_token_ids[keep:]
        return keep

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        seq.draft_token_ids = []
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _victim(self, scheduled_ids: set[int]) -> Sequence:
        """Whom to preempt for KV space: the most recently admitted `batch`-priority sequence not yet planned
        this step (Request.batch: an interactive request is never the one to wait while batch work could),
        else the most recently admitted one."""
        for seq in reversed(self.running):
            if seq.request.batch and id(seq) not in scheduled_ids:
                return seq
        return self.running[-1]

    def _twin_in_prefill(self, seq: Sequence, num_hits: int) -> bool:
        """Whether a running sequence is still computing prompt blocks that `seq` could take from the prefix cache
        once they are done (n samples of one prompt, or requests sharing a system prompt that arrive together).

        Then `seq` waits a step or a few at the head of the queue, and is admitted with those blocks as cache
        hits instead of recomputing them: the bits are the same either way (equal prefixes give equal K/V).
        """
        bm = self.block_manager
        if not bm.prefix_caching or seq.num_computed_tokens or not seq.prompt_logprobs_done or seq.needs_prompt_rows:
            return False
        bs = bm.block_size
        limit = (seq.num_tokens - 1) // bs  # blocks match_prefix could ever return for it
        if num_hits >= limit:
            return False
        end = (num_hits + 1) * bs  # through the first block it would compute itself
        prefix = seq.token_ids[:end]
        return any(other.num_computed_tokens < end <= other.num_tokens and other.token_ids[:end] == prefix
                   for other in self.running)

    def schedule(self) -> SchedulerOutput:
        """This step's sequences and how many tokens each computes (drafts first: they are sized here too)."""
        if self.speculator is not None and self.speculator.enabled:
            self.speculator.draft(self.running)
        out = self._schedule()
        now = time.monotonic()
        for item in out.scheduled:  # queue wait ends when a request is first scheduled, not computed
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        for seq in out.preempted:  # the step's time, kept for the request's trace (RequestTimings)
            seq.preempted_times.append(now)
        return out

    def update(self, out: SchedulerOutput, outputs: list[RequestOutput | None]) -> None:
        """Settle a computed step: `outputs[i]` is what scheduled sequence i emitted (None: nothing yet).

        Its new tokens join the sequence. What counts as computed: the step's tokens, or for a verification
        only the last token and the accepted draft tokens (the row after the last of them picked the final
        token); the full blocks they complete are published to the prefix cache, and blocks behind every
        layer's window released. A verification's blocks past what its tokens need hold rejected draft
        tokens' K/V only and are released unhashed (BlockManager.truncate), and its outcome is recorded.
        Finished sequences leave the batch."""
        bm = self.block_manager
        for item, output in zip(out.scheduled, outputs):
            seq = item.seq
            draft, seq.draft_token_ids = seq.draft_token_ids, []  # drafts live for one step
            new = output.new_token_ids if output is not None else []
            seq.token_ids += new
            computed = len(new) if draft else item.num_new_tokens
            seq.num_computed_tokens += computed
            bm.cache_full_blocks(seq, computed)
            bm.release_out_of_window(seq)
            if draft:
                bm.truncate(seq)
                if self.speculator is not None:
                    self.speculator.record(seq.drafter, len(draft), _accepted(new, draft))
            if output is not None and output.finished:
                self.retire(seq)

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()
        # 1. Running sequences, oldest first. Preempt from the newest end when out of blocks.
        running = list(self.running)
        caps = self._prefill_caps(budget)  # tenant -> prompt tokens it may compute this step; None: no sharing
        # While tenants share the server, the prompts each may start in this step (seating.StepPrompts); None: any.
        prompts = self.sharing.step(self.running, self.waiting, self.max_num_seqs)
        for pos, seq in enumerate(running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted earlier in this loop
                continue
            if prompts is not None and seq.num_uncomputed_tokens > 1 and not prompts.start(seq.request.tenant):
                continue  # its tenant's prompts of this step are planned: this one goes on next step
            n = min(seq.num_uncomputed_tokens, budget)
            if caps is not None and seq.num_uncomputed_tokens > 1:  # a prompt chunk (decode rows stay out of it)
                n = min(n, caps[seq.request.tenant])
                if n == 0:
                    continue  # its tenant's share is spent: it goes on next step, or with what others leave
                caps[seq.request.tenant] -= n
            while not self.block_manager.can_grow(seq, n):
                victim = self._victim(scheduled_ids)
                if id(victim) in scheduled_ids:  # never undo work already planned this step
                    victim = seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            if seq.draft_token_ids:
                n += self._fit_draft(seq, n, budget, len(running) - pos - 1)
            self.block_manager.grow(seq, n)
            out.scheduled.append(ScheduledSeq(seq, n))
            scheduled_ids.add(id(seq))
            budget -= n
        # 2. Admit waiting sequences while budget, seats and blocks last: first come first served within a
        # tenant, tenants by weight (fair_share.py).
        while self.waiting and budget > 0 and not out.preempted:
            if len(self.running) >= self.max_num_seqs:
                found = seat_for_waiting(self.waiting, self.running, self.max_num_seqs)
                if found is None:
                    break
                seq, victim = found
                budget += self._unplan(victim, out)
                self._preempt(victim, out)  # the loop ends after this admission: one seat a step
                # The seated prompt runs in a step of its own: its first token then waits for a one-row step, not
                # for a full batch's (a light tenant's TTFT under a flood stays near its TTFT on a quiet server);
                # the batch's rows lose one short step, and a row's bits do not depend on who shares its step.
                budget = self._unplan_all(out, budget)
            else:
                seq = self.fair_share.pick(self.waiting)
                assert seq is not None
                if prompts is not None and not prompts.start(seq.request.tenant):
                    # Its tenant's prompts for this step are planned (or a light one's step): a light tenant's
                    # waiting prompt may still come in ahead of the turn, or nobody.
                    seq = next((s for s in self.waiting if prompts.start_light(s.request.tenant)), None)
                    if seq is None:
                        break
                if prompts is not None and prompts.opens_light_step(seq.request.tenant):
                    # A light tenant's prompt, e.g. its request arriving with a flood's seats freeing: its first
                    # token waits for the batch's decode rows only, not for the flood's prompts, which go next step.
                    budget += self._unplan_prompts(out, prompts.light)
            hits = self.block_manager.match_prefix(seq)
            if self._twin_in_prefill(seq, len(hits[0])):
                break  # wait for the twin's blocks rather than compute them twice
            n = min(seq.num_tokens - len(hits[0]) * self.block_manager.block_size, budget)
            if caps is not None:  # at least a token: admitted, it holds its seat and competes in the next split
                n = min(n, max(1, caps[seq.request.tenant]))
                caps[seq.request.tenant] = max(0, caps[seq.request.tenant] - n)
            if not self.block_manager.can_admit(seq, hits, n):
                break
            if seq is self.waiting[0]:
                self.waiting.popleft()
            else:
                self.waiting.remove(seq)
            self.fair_share.charge(seq)
            self.block_manager.admit(seq, hits, n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        if caps is not None and budget > 0 and not out.preempted:
            self._top_up(out, budget, None if prompts is None else prompts.start)
        return out

    @staticmethod
    def _unplan_all(out: SchedulerOutput, budget: int) -> int:
        """Take every sequence out of this step's plan (their blocks stay theirs, for the next step; their drafts
        are dropped, as a step would have): the budget with theirs given back."""
        for item in out.scheduled:
            item.seq.draft_token_ids = []
            budget += item.num_new_tokens
        out.scheduled.clear()
        return budget

    @staticmethod
    def _unplan_prompts(out: SchedulerOutput, light: set[str]) -> int:
        """Take the prompt chunks of tenants not in `light` out of this step's plan (blocks stay theirs; decode rows
        stay): the budget they held."""
        keep, freed = [], 0
        for item in out.scheduled:
            if item.seq.request.tenant not in light and item.seq.num_uncomputed_tokens > 1:
                freed += item.num_new_tokens
            else:
                keep.append(item)
        out.scheduled[:] = keep
        return freed

    @staticmethod
    def _unplan(seq: Sequence, out: SchedulerOutput) -> int:
        """Take `seq` out of this step's plan (nothing of the step has run yet); returns the budget it held."""
        for i, item in enumerate(out.scheduled):
            if item.seq is seq:
                del out.scheduled[i]
                return item.num_new_tokens
        return 0

    def _prefill_caps(self, budget: int) -> dict[str, int] | None:
        """Each tenant's share of this step's prompt tokens (fair_share.split_step) when two or more tenants have
        prompt tokens to compute, running or waiting; None otherwise (one tenant: nothing to share, and every
        server without a keys file schedules exactly as before)."""
        wants: dict[str, int] = {}
        shares: dict[str, float] = {}
        batch: dict[str, bool] = {}
        decode_rows = 0
        for seq in [*self.running, *self.waiting]:
            left = seq.num_uncomputed_tokens if seq.status is SequenceStatus.RUNNING else seq.num_tokens
            if seq.status is SequenceStatus.RUNNING and left <= 1:
                decode_rows += 1
                continue
            t = seq.request.tenant
            wants[t] = min(budget, wants.get(t, 0) + left)
            shares[t], batch[t] = seq.request.share, seq.request.batch
        if len(wants) < 2:
            return None
        return split_step(wants, shares, batch, max(0, budget - decode_rows))

    def _top_up(self, out: SchedulerOutput, budget: int, may_start: Callable[[str], bool] | None = None) -> None:
        """Give the budget the split left unused (a tenant short of seats or blocks, rounding) to the running
        prompts in admission order, from free blocks only: sharing never idles budget that someone could use.
        `may_start(tenant)`: whether a prompt not planned yet may join the step, counting it if so (None: any)."""
        planned = {id(item.seq): item for item in out.scheduled}
        for seq in self.running:
            if budget == 0:
                break
            item = planned.get(id(seq))
            done = item.num_new_tokens if item is not None else 0
            extra = min(seq.num_uncomputed_tokens - done, budget)
            if extra <= 0 or seq.draft_token_ids or seq.num_uncomputed_tokens <= 1:
                continue
            if not self.block_manager.can_grow(seq, done + extra):
                continue
            if item is None and may_start is not None and not may_start(seq.request.tenant):
                continue
            self.block_manager.grow(seq, done + extra)
            if item is not None:
                item.num_new_tokens += extra
            else:
                out.scheduled.append(ScheduledSeq(seq, extra))
            budget -= extra


def _accepted(tokens: list[int], draft: list[int]) -> int:
    """Draft tokens a verification accepted: those equal to the tokens sampled at their positions, up to the
    first that differs (the sampler stops there, so every token before the last matched)."""
    n = 0
    while n < min(len(tokens), len(draft)) and tokens[n] == draft[n]:
        n += 1
    return n
