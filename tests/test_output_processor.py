"""The output processor alone (engine/output_processor.py), driven by the real scheduler and block manager
with a byte-level tokenizer written here: no model. Stop strings that span tokens (and a verification's
tokens past one), multi-byte characters split across tokens and steps, end tokens, logprob formatting, and a
sampling failure after a stop.

Each step: the real Scheduler schedules, a SeqResult stands for the runner's rows, a Sampled for the
sampler's choices, the OutputProcessor makes the outputs and Scheduler.update applies them."""

from __future__ import annotations

import torch

from steadyserve.engine.batch_sampler import Sampled
from steadyserve.engine.block_manager import BlockManager
from steadyserve.engine.detokenizer import IncrementalDetokenizer, token_text
from steadyserve.engine.model_runner import SeqResult
from steadyserve.engine.output_processor import OutputProcessor
from steadyserve.engine.scheduler import Scheduler
from steadyserve.engine.sequence import Request, RequestOutput, SamplingParams, Sequence, SeqState, TokenLogprob
from steadyserve.engine.speculation import Speculator

EOS = 300
VOCAB = 301


class ByteTokenizer:
    """A byte-level tokenizer like GPT-2's: ids 0..255 are single bytes (so a multi-byte UTF-8 character can
    be split across tokens), a few ids above are words, EOS is special."""

    WORDS = {256: b"hello", 257: b" wor", 258: b"ld", 259: b"lo w", 260: "é".encode(), 261: b" end"}

    def piece(self, i: int) -> bytes:
        return bytes([i]) if i < 256 else b"</s>" if i == EOS else self.WORDS.get(i, b"?")

    def decode(self, ids: list[int], skip_special_tokens: bool = False, clean_up_tokenization_spaces: bool = False
               ) -> str:
        data = b"".join(self.piece(i) for i in ids if not (skip_special_tokens and i == EOS))
        return data.decode("utf-8", errors="replace")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())


TOK = ByteTokenizer()


class Harness:
    """One request through the real scheduler, with chosen tokens in place of a model and a sampler."""

    def __init__(self, params: SamplingParams, prompt: list[int] | None = None, max_model_len: int = 64,
                 end_ids: frozenset[int] = frozenset({EOS}), block_size: int = 4,
                 speculator: Speculator | None = None) -> None:
        self.scheduler = Scheduler(BlockManager(64, block_size), max_num_seqs=4, max_num_batched_tokens=64,
                                   speculator=speculator)
        self.processor = OutputProcessor(max_model_len)
        self.seq = Sequence(0, Request("r", prompt or [104, 105, 33], params))
        self.seq.state = SeqState(end_ids=end_ids, generator=torch.Generator(), matcher=None,
                                  detok=IncrementalDetokenizer(TOK, params.stop))
        self.scheduler.add(self.seq)
        self.outputs: list[RequestOutput] = []

    def step(self, tokens: list[int], rows: list[torch.Tensor] | None = None, error: str | None = None,
             prompt_logprobs: list[TokenLogprob] | None = None, draft: list[int] | None = None
             ) -> RequestOutput | None:
        """One step whose row(s) picked `tokens` (several: a verification, by default of a draft that was
        exactly them)."""
        self.seq.draft_token_ids = list(tokens[:-1] if draft is None else draft)
        batch = self.scheduler.schedule()
        computing = 1 + len(self.seq.draft_token_ids) if self.seq.num_computed_tokens else 3
        assert batch.scheduled[0].num_new_tokens == computing
        rows = rows or [flat_row() for _ in tokens]
        result = SeqResult(sample_row=rows[0] if rows else flat_row(), prompt_logprobs=prompt_logprobs or [],
                           first_prompt_pos=1 if prompt_logprobs else 0)
        (out,) = self.processor.process(batch, [result], [Sampled(list(tokens), rows, error)])
        self.scheduler.update(batch, [out])
        if out is not None:
            self.outputs.append(out)
        return out

    @property
    def text(self) -> str:
        return "".join(o.text_delta for o in self.outputs)

    @property
    def tokens(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]


def flat_row() -> torch.Tensor:
    return torch.full((VOCAB,), -5.0)


def gen(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


# ---- stop strings -----------------------------------------------------------------------------------------

def test_a_stop_string_spanning_tokens_is_held_back_then_cut():
    h = Harness(gen(stop=["lo wor"]))
    # "h", "e", then "l" may begin the stop string: held; a second "l" releases the first only.
    assert [h.step([t]).text_delta for t in (104, 101, 108, 108)] == ["h", "e", "", "l"]
    h = Harness(gen(stop=["lo wor"]))
    for t in (104, 101, 108):
        h.step([t])
    # A verification of 4 tokens: "lo w", "o", "r" complete the stop string "hel|lo wor"; "!" comes after it.
    out = h.step([259, 111, 114, 33])
    assert out.finished and out.finish_reason == "stop"
    assert h.text == "hel", h.text  # the held "l" was no part of the stop string; nothing of it, nothing after
    # The tokens past the one completing the stop are neither the output's nor the sequence's.
    assert out.new_token_ids == [259, 111, 114] and h.tokens == [104, 101, 108, 259, 111, 114]
    assert h.seq.token_ids[h.seq.num_prompt_tokens:] == h.tokens
    assert out.num_generated_tokens == 6 and not h.scheduler.has_work()


def test_a_held_back_prefix_that_does_not_become_the_stop_string_is_released():
    h = Harness(gen(max_tokens=4, stop=["lo wor"]))
    h.step([104])
    h.step([256])  # "hhello": "lo" held
    out = h.step([33])  # "!": no stop possible any more
    assert out.text_delta == "lo!" and h.text == "hhello!"
    out = h.step([108])  # the 4th token: length; the held "l" is flushed
    assert out.finish_reason == "length" and h.text == "hhello!l"


# ---- multi-byte characters --------------------------------------------------------------------------------

def test_a_multibyte_character_split_across_steps_is_emitted_whole():
    e1, e2 = "é".encode()  # 2 bytes
    j1, j2, j3 = "日".encode()  # 3 bytes
    h = Harness(gen(max_tokens=8))
    deltas = [h.step([t]).text_delta for t in (97, e1, e2, j1, j2, j3, 260)]
    assert deltas == ["a", "", "é", "", "", "日", "é"]
    assert all("\ufffd" not in d for d in deltas)
    out = h.step([98])
    assert out.finish_reason == "length" and h.text == "aé日éb" == TOK.decode(h.tokens)


def test_a_character_cut_by_the_end_is_flushed_as_the_tokenizer_decodes_it():
    e1, _ = "é".encode()
    h = Harness(gen(max_tokens=2))
    h.step([97])
    out = h.step([e1])  # the request ends inside a character: the final flush shows what decode shows
    assert out.finish_reason == "length" and h.text == "a\ufffd" == TOK.decode(h.tokens, skip_special_tokens=True)


# ---- end tokens -------------------------------------------------------------------------------------------

def test_an_end_token_stops_without_text_and_cuts_a_verification_there():
    h = Harness(gen())
    h.step([104])
    out = h.step([105, EOS, 106])
    assert out.finish_reason == "stop" and out.new_token_ids == [105, EOS] and h.text == "hi"
    assert "</s>" not in out.text_delta


def test_a_stop_token_ends_without_its_text():
    """stop_token_ids are ordinary tokens with text ("!" here): the end-token rule, not the tokenizer's
    skipping of special tokens, keeps it out."""
    h = Harness(gen(stop_token_ids=[33]), end_ids=frozenset({EOS, 33}))
    h.step([104])
    out = h.step([105, 33, 106])
    assert out.finish_reason == "stop" and out.new_token_ids == [105, 33] and h.text == "hi", h.text


# ---- logprobs ---------------------------------------------------------------------------------------------

def test_logprobs_are_the_models_row_formatted_best_first():
    row = torch.full((VOCAB,), -20.0)
    row[104], row[7], row[42], row[200] = -0.25, -1.5, -0.125, -3.0
    h = Harness(gen(logprobs=2))
    out = h.step([104], rows=[row])
    (lp,) = out.logprobs
    assert lp.token_id == 104 and lp.logprob == -0.25
    assert lp.top == [(42, -0.125), (104, -0.25)]  # the k most likely of the row, best first
    none = Harness(gen()).step([104], rows=[row])
    assert none.logprobs == []  # not asked: none


def test_prompt_logprobs_come_once_with_the_first_none():
    lps = [TokenLogprob(105, -1.0, []), TokenLogprob(33, -2.0, [])]
    h = Harness(gen(max_tokens=2, prompt_logprobs=0))
    out = h.step([120], prompt_logprobs=lps)
    assert out.prompt_logprobs == [None, *lps]
    assert h.step([121]).prompt_logprobs is None  # once


def test_a_lone_tokens_text_shows_special_tokens():
    assert token_text(TOK, 260) == "é" and token_text(TOK, EOS) == "</s>"  # special tokens shown, not skipped


# ---- failures ---------------------------------------------------------------------------------------------

def test_a_sampling_failure_fails_after_the_tokens_before_it():
    h = Harness(gen())
    h.step([104])
    out = h.step([105, 106], error="NumericalError: NaN")
    assert out.finish_reason == "error" and out.error == "NumericalError: NaN"
    assert out.new_token_ids == [105, 106] and h.text == "hij"
    assert h.scheduler.num_running == 0 and not h.scheduler.has_work()


def test_a_stop_before_the_failing_position_wins():
    h = Harness(gen(stop=["ij"]))
    h.step([104])
    out = h.step([105, 106, 107], error="NumericalError: NaN")  # "ij" completes at 106; 107's row failed after
    assert out.finish_reason == "stop" and out.error is None and out.new_token_ids == [105, 106]
    assert h.text == "h"


def test_the_first_output_carries_the_queue_wait_and_the_last_the_timings():
    h = Harness(gen(max_tokens=2))
    first = h.step([104])
    assert first.queue_wait is not None and first.queue_wait >= 0 and first.timings is None
    last = h.step([105])
    assert last.queue_wait is None and last.timings is not None and last.timings.first_token is not None


# ---- what the scheduler makes of it (Scheduler.update) ----------------------------------------------------

def test_a_verification_keeps_what_was_accepted_and_releases_the_rest():
    spec = Speculator("ngram")
    h = Harness(gen(), block_size=2, speculator=spec)
    h.seq.drafter = spec.new_drafter()
    spec.enabled = False  # the drafts are this test's, not the n-gram index's; outcomes are still recorded
    bm = h.scheduler.block_manager
    h.step([104])  # prompt (3) computed; tokens: 3 + 1
    out = h.step([8], draft=[5, 6, 7])  # the chunk computes positions 3..6; the first draft token is rejected
    assert out.new_token_ids == [8]
    assert h.seq.num_computed_tokens == 4 and h.seq.num_tokens == 5  # the last token only; 8 is next
    assert len(h.seq.block_table) == 3 and bm.num_free_blocks == bm.num_blocks - 3  # the 4th block released
    assert (spec.total_drafted, spec.total_accepted) == (3, 0)
    out = h.step([5, 6, 9], draft=[5, 6, 7])  # two accepted, the third rejected
    assert out.new_token_ids == [5, 6, 9] and h.seq.num_computed_tokens == 7 and h.seq.num_tokens == 8
    assert len(h.seq.block_table) == 4 and (spec.total_drafted, spec.total_accepted) == (6, 2)
    assert h.seq.draft_token_ids == []  # drafts live for one step
