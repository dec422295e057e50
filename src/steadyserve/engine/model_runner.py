"""Turns a scheduled step into tensors, runs the model, returns log-prob rows.

Memory: full-vocabulary rows exist for at most one LM-head tile of prompt rows
at a time (reduced at once to each token's logprob and top alternatives) plus
one row per position that picks a token (each sampling sequence's next token,
and each draft token of a speculative verification: a few per step at most).
A step scoring 512 prompt tokens of a 49k vocabulary would otherwise hold
100 MB of log-probs, and a burst of scoring requests would push RSS past the
model + KV + 500 MiB bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.transformer import MAX_HEAD_TILE, ForwardBatch, Transformer
from .kv_cache import KVCache
from .sampler import token_logprob
from .scheduler import SchedulerOutput
from .sequence import TokenLogprob


@dataclass
class SeqResult:
    """What one sequence gets from a step: the next token's distribution and its prompt tokens' logprobs."""

    sample_row: torch.Tensor | None  # (V,) distribution of the next token, if its chunk reached the end
    prompt_logprobs: list[TokenLogprob]  # prompt tokens first_prompt_pos .. , each with its top alternatives
    first_prompt_pos: int  # position of the prompt token the first entry scores
    sample_argmax: int = -1  # argmax of sample_row (first maximum), computed for the whole step at once
    sample_has_nan: bool = False  # sample_row contains NaN
    # A speculative verification (speculation.py): the distribution after each draft token, the same bits a
    # plain decode step would give it if the tokens before it are the ones sampled.
    draft_rows: list[torch.Tensor] = field(default_factory=list)  # (V,) each, one per draft token
    draft_argmax: list[int] = field(default_factory=list)  # argmax of each draft row
    draft_has_nan: list[bool] = field(default_factory=list)  # whether each draft row contains NaN
    # An embedding sequence (Request.embed): its chunk's final-norm hidden rows, for the engine to pool
    # (engine/pooler.py), instead of any LM-head row; views of the step's hidden states, valid in this step.
    hidden_rows: torch.Tensor | None = None  # (n, hidden)
    hidden_pos: int = 0  # the position of its first row

    def choice_rows(self) -> list[tuple[torch.Tensor, int, bool]]:
        """(row, argmax, has_nan) of each position that picks a token: the next one, then one per draft token."""
        assert self.sample_row is not None
        return [(self.sample_row, self.sample_argmax, self.sample_has_nan),
                *zip(self.draft_rows, self.draft_argmax, self.draft_has_nan)]


class ModelRunner:
    def __init__(self, model: Transformer, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device
        # (R, V) log-probabilities of one LM-head call, reused by every step (grown to the most rows seen).
        # Rows handed out in a step's SeqResults are views of it: valid until the next execute().
        self._logprob_buf = torch.empty(0, model.args.vocab_size, dtype=torch.float32, device=self.device)

    def _logprobs(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        """(len(rows), V) log-probabilities of the given hidden rows, in the reused buffer."""
        if self._logprob_buf.shape[0] < len(rows):
            self._logprob_buf = torch.empty(len(rows), self.model.args.vocab_size, dtype=torch.float32,
                                            device=self.device)
        out = self._logprob_buf[:len(rows)]
        return self.model.logprobs(hidden[torch.tensor(rows, device=self.device)], out=out).cpu()

    def _prepare(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[tuple[int, int, int]]]:
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        seq_of: list[int] = []
        tables: list[list[int]] = []
        spans = []  # per seq: (its first row in the batch, its n new tokens, the position of the first of them)
        layout = self.kv.layout
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)  # every group's table has this length
        for i, sched in enumerate(out.scheduled):
            seq, n = sched.seq, sched.num_new_tokens
            start = seq.num_computed_tokens
            row0 = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            if start + n > seq.num_tokens:  # a verification: the draft follows the last token
                assert start + n - seq.num_tokens <= len(seq.draft_token_ids), seq
                ids.extend(seq.draft_token_ids[:start + n - seq.num_tokens])
            positions.extend(range(start, start + n))
            seq_of.extend([i] * n)
            # a block released out of the window (RELEASED, -1) is read as block 0: no kernel attends to it
            pad = [0] * (max_blocks - len(seq.block_table))
            tables.append([[max(b, 0) for b in t] + pad for t in seq.block_tables])
            spans.append((row0, n, start))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64)
        tab = torch.tensor(tables, dtype=torch.int64).transpose(0, 1).contiguous()  # (G, S, NBmax)
        of = torch.tensor(seq_of, dtype=torch.int64)  # (T,)
        blocks = tab[:, of, pos // bs].contiguous()  # (G, T)
        batch = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
                             positions=pos.to(dev), slot_blocks=blocks.to(dev),
                             slot_offsets=(pos % bs).to(dev), block_tables=tab.to(dev), seq_of=of.to(dev),
                             kv_group=layout.group, kv_slot=layout.slot)
        return batch, spans

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SeqResult]:
        """Run one step. Returns one SeqResult per scheduled sequence, in order."""
        if out.is_empty:
            return []
        batch, spans = self._prepare(out)
        hidden = self.model.forward(batch, self.kv.k, self.kv.v)  # (T, hidden)
        # Only rows that score a prompt token or pick the next token need the LM head.
        sample_rows: list[int] = []  # hidden rows that pick a token: each sequence's last token (and its drafts)
        prompt_rows: list[tuple[int, int, int]] = []  # (hidden row, index of seq, position of the token it scores)
        plans = []
        pooled: dict[int, tuple[torch.Tensor, int]] = {}  # embedding sequences: index -> (hidden rows, first pos)
        for i, (sched, (row0, n, start)) in enumerate(zip(out.scheduled, spans)):
            seq = sched.seq
            if seq.embed:  # no LM head: the engine pools the rows (no prompt logprobs, nothing to sample)
                pooled[i] = (hidden[row0:row0 + n], start)
                plans.append((0, -1, 0))
                continue
            first_pp = last_pp = 0
            if not seq.prompt_logprobs_done:
                # The row at position p scores prompt token p + 1.
                first_pp = start + 1
                last_pp = min(start + n + 1, seq.num_prompt_tokens)
            prompt_rows += [(row0 + pp - first_pp, i, pp) for pp in range(first_pp, last_pp)]
            sample_index = -1
            num_choices = start + n - seq.num_tokens + 1  # 1 at the end of the tokens, 1 + k verifying k drafts
            if num_choices > 0:
                sample_index = len(sample_rows)
                sample_rows.extend(range(row0 + n - num_choices, row0 + n))
            plans.append((first_pp, sample_index, num_choices))
        prompt_lps: list[list[TokenLogprob]] = [[] for _ in out.scheduled]
        # Row counts are verified (RowTiler), so splitting rows over calls leaves every row's bits unchanged.
        for c in range(0, len(prompt_rows), MAX_HEAD_TILE):
            chunk = prompt_rows[c:c + MAX_HEAD_TILE]
            lp = self._logprobs(hidden, [r for r, _, _ in chunk])  # consumed before the next chunk overwrites it
            for row, (_, i, pp) in zip(lp, chunk):  # row: (V,)
                seq = out.scheduled[i].seq
                prompt_lps[i].append(token_logprob(row, seq.token_ids[pp], seq.params.prompt_logprobs))
        argmax: list[int] = []
        has_nan: list[bool] = []
        sample_lp = None
        if sample_rows:
            sample_lp = self._logprobs(hidden, sample_rows)  # (S, V)
            # Row-wise selections (exact, so batch-invariant), once per step rather than once per sequence:
            # the first maximum, a NaN counting as the largest (so a row with a NaN picks one, and the value
            # there says so). NumPy's argmax defines it; the native kernel computes the same on every thread,
            # where NumPy ran on the engine thread alone while the other waited (64 rows of 49152, Intel Xeon:
            # 0.49 ms on the engine thread, 0.28-0.31 ms on two; one row 2.8 against 7.3 us).
            lp = sample_lp.numpy()  # (S, V), the same memory
            if self.model.native:
                best_ids = torch.ops.steadyserve.qargmax(sample_lp, -1).numpy()  # (S,)
            else:
                best_ids = lp.argmax(axis=1)  # (S,)
            argmax = best_ids.tolist()
            has_nan = np.isnan(lp[np.arange(len(best_ids)), best_ids]).tolist()
        results = []
        for i, (first_pp, si, num_choices) in enumerate(plans):
            r = SeqResult(sample_row=None, prompt_logprobs=prompt_lps[i], first_prompt_pos=first_pp)
            if i in pooled:
                r.hidden_rows, r.hidden_pos = pooled[i]
            if si >= 0 and sample_lp is not None:
                r.sample_row, r.sample_argmax, r.sample_has_nan = sample_lp[si], argmax[si], bool(has_nan[si])
                drafts = range(si + 1, si + num_choices)
                r.draft_rows = [sample_lp[d] for d in drafts]
                r.draft_argmax = [argmax[d] for d in drafts]
                r.draft_has_nan = [bool(has_nan[d]) for d in drafts]
            results.append(r)
        return results
