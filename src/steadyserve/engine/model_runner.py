"""Turns a scheduled step into tensors, runs the model, returns log-prob rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..models.transformer import ForwardBatch, Transformer
from .kv_cache import KVCache
from .scheduler import SchedulerOutput


@dataclass
class SeqResult:
    """The log-prob rows one sequence gets from a step."""

    sample_row: torch.Tensor | None  # (V,) distribution of the next token, if its chunk reached the end
    prompt_rows: torch.Tensor | None  # (n, V): distributions of prompt tokens first_prompt_pos .. +n-1
    first_prompt_pos: int  # position of the prompt token the first prompt row scores
    sample_argmax: int = -1  # argmax of sample_row (first maximum), computed for the whole step at once
    sample_has_nan: bool = False  # sample_row contains NaN


class ModelRunner:
    def __init__(self, model: Transformer, kv: KVCache) -> None:
        self.model = model
        self.kv = kv
        self.device = model.device

    def _prepare(self, out: SchedulerOutput) -> tuple[ForwardBatch, list[tuple[int, int, int, int]]]:
        bs = self.kv.block_size
        ids: list[int] = []
        positions: list[int] = []
        seq_of: list[int] = []
        tables: list[list[int]] = []
        spans = []  # per seq: (row of first token, n, first needed logits row, number of rows)
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)
        for i, sched in enumerate(out.scheduled):
            seq, n = sched.seq, sched.num_new_tokens
            start = seq.num_computed_tokens
            row0 = len(ids)
            ids.extend(seq.token_ids[start:start + n])
            positions.extend(range(start, start + n))
            seq_of.extend([i] * n)
            tables.append(seq.block_table + [0] * (max_blocks - len(seq.block_table)))
            spans.append((row0, n, start, 0))
        dev = self.device
        pos = torch.tensor(positions, dtype=torch.int64)
        tab = torch.tensor(tables, dtype=torch.int64)  # (S, NBmax)
        of = torch.tensor(seq_of, dtype=torch.int64)  # (T,)
        blocks = tab[of, pos // bs]
        batch = ForwardBatch(input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
                             positions=pos.to(dev), slot_blocks=blocks.to(dev),
                             slot_offsets=(pos % bs).to(dev), block_tables=tab.to(dev), seq_of=of.to(dev))
        return batch, spans

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> list[SeqResult]:
        """Run one step. Returns one SeqResult per scheduled sequence, in order."""
        batch, spans = self._prepare(out)
        hidden = self.model.forward(batch, self.kv.k, self.kv.v)  # (T, hidden)
        # Only rows that score a prompt token or pick the next token need the LM head.
        rows: list[int] = []
        plans = []
        for sched, (row0, n, start, _) in zip(out.scheduled, spans):
            seq = sched.seq
            first_pp = last_pp = 0
            if not seq.prompt_logprobs_done:
                # The row at position p scores prompt token p + 1.
                first_pp = start + 1
                last_pp = min(start + n + 1, seq.num_prompt_tokens)
            num_pp = max(0, last_pp - first_pp)
            pp_index = len(rows)
            rows.extend(range(row0, row0 + num_pp))
            sample_index = -1
            if start + n == seq.num_tokens:
                sample_index = len(rows)
                rows.append(row0 + n - 1)
            plans.append((pp_index, num_pp, first_pp, sample_index))
        if not rows:
            return [SeqResult(None, None, 0) for _ in out.scheduled]
        lp = self.model.logprobs(hidden[torch.tensor(rows, device=self.device)]).cpu()  # (R, V) float32
        # Row-wise selections (exact, so batch-invariant), once per step rather than once per sequence.
        argmax = lp.argmax(dim=1).tolist()  # (R,)
        has_nan = lp.isnan().any(dim=1).tolist()  # (R,)
        results = []
        for pp_index, num_pp, first_pp, sample_index in plans:
            results.append(SeqResult(
                sample_row=lp[sample_index] if sample_index >= 0 else None,
                prompt_rows=lp[pp_index:pp_index + num_pp] if num_pp else None,
                first_prompt_pos=first_pp,
                sample_argmax=argmax[sample_index] if sample_index >= 0 else -1,
                sample_has_nan=bool(has_nan[sample_index]) if sample_index >= 0 else False,
            ))
        return results
