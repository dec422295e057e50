"""What flows through the engine: requests in, sequences inside, outputs out.

This module is pure Python (no torch): the scheduler and block manager work on
`Sequence` alone and are tested without a model.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, AbstractSet, Any

from ..limits import (MAX_BIAS, MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP_STRINGS,
                      MAX_TEMPERATURE, SEED_MAX, SEED_MIN, InvalidRequest, check_range)

from .ngram import SeqDrafter

if TYPE_CHECKING:  # annotations only: this module stays free of torch (the scheduler is tested without it)
    import torch

    from .detokenizer import IncrementalDetokenizer
    from .pooler import PoolState
    from .structured import Matcher

__all__ = ["MAX_LOGPROBS", "InvalidRequest"]  # re-exported: their home is steadyserve.limits


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. Immutable once built: a builder that derives a value (a resolved max_tokens, a
    choice's seed, a tools grammar) makes a new one with dataclasses.replace; per-sequence state that changes
    while it runs lives in the engine's Sequence, never here."""

    max_tokens: int = 16  # tokens to generate; 0 = score the prompt only
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0  # nucleus mass kept, (0, 1]
    top_k: int = 0  # keep the k most likely tokens; 0 = all
    seed: int | None = None  # per-request generator seed; None = a random one
    stop: list[str] = field(default_factory=list)  # stop strings, never part of the output
    stop_token_ids: list[int] = field(default_factory=list)  # stop on these tokens (besides EOS)
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    logprobs: int | None = None  # None = no logprobs; k = chosen token's + top k alternatives
    prompt_logprobs: int | None = None  # None = none; k = each prompt token's + top k
    # Logits processors (sampler.process_row), applied to this request's own row before sampling; the
    # logprobs reported stay the model's own. OpenAI's ranges.
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its log-probability
    presence_penalty: float = 0.0  # subtracted once from every token already generated, [-2, 2]
    frequency_penalty: float = 0.0  # subtracted per occurrence of every token already generated, [-2, 2]
    repetition_penalty: float = 1.0  # multiplies the (negative) log-probability of prompt and generated tokens
    min_tokens: int = 0  # end-of-sequence and stop token ids are masked until this many tokens are generated
    grammar: str | None = None  # llguidance grammar (structured output, engine/structured.py) sampling must follow
    # The output's text without the tokenizer's special tokens (as OpenAI's); off where they carry structure:
    # a harmony reply's channels (api/harmony.py), or a client's vLLM-style `skip_special_tokens: false`.
    skip_special_tokens: bool = True

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 0:
            raise InvalidRequest("max_tokens", "max_tokens must be an integer >= 0")
        check_range("temperature", self.temperature, 0.0, MAX_TEMPERATURE)  # also refuses NaN
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            raise InvalidRequest("seed", "seed must be in -2**63 .. 2**64-1")
        if not 0 < self.top_p <= 1:
            raise InvalidRequest("top_p", "top_p must be in (0, 1]")
        if self.top_k < 0:
            raise InvalidRequest("top_k", "top_k must be >= 0 (0 disables it)")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None:
                check_range(name, v, 0, MAX_LOGPROBS)
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequest("stop", f"stop: at most {MAX_STOP_STRINGS} stop strings")
        if any(not s for s in self.stop):
            raise InvalidRequest("stop", "stop strings must not be empty")
        for name in ("presence_penalty", "frequency_penalty"):
            check_range(name, getattr(self, name), -MAX_PENALTY, MAX_PENALTY)
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY):
            raise InvalidRequest("repetition_penalty",
                                 f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}]; 1 turns it off")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest("logit_bias", f"logit_bias: at most {MAX_LOGIT_BIAS} tokens")
        for tid, bias in self.logit_bias.items():
            if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
                raise InvalidRequest("logit_bias",
                                     f"logit_bias[{tid}]: the bias must be in -{MAX_BIAS:g}..{MAX_BIAS:g}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidRequest("min_tokens", "min_tokens must be in 0..max_tokens")
        if self.max_tokens == 0 and self.prompt_logprobs is None:
            raise InvalidRequest("max_tokens", "max_tokens=0 only makes sense with prompt logprobs (scoring)")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processes_row(self) -> bool:
        """Whether any logits processor changes the row before sampling."""
        return bool(self.logit_bias) or self.presence_penalty != 0 or self.frequency_penalty != 0 \
            or self.repetition_penalty != 1 or self.min_tokens > 0 or self.grammar is not None


@dataclass(frozen=True)
class Request:
    """What a front end submits: immutable once built (a new id for a retry is a new Request)."""

    request_id: str  # unique among in-flight requests
    prompt_token_ids: list[int]
    params: SamplingParams
    transport: str = "internal"  # http | ws | grpc | internal; for logs and metrics
    arrival_time: float = field(default_factory=time.monotonic)
    # An embedding (engine/pooler.py): the prompt is computed and its hidden states pooled; nothing is sampled,
    # params.max_tokens is 0. Its one output carries `embedding` and finish_reason "length", as a score's does.
    embed: bool = False
    # A receipt was asked for (api/receipts.py): the finishing output carries the seed the sampler ran with.
    # Off, the engine does nothing more than without receipts.
    receipt: bool = False
    # Whose request it is (--api-keys): the scheduler shares the engine between tenants by weight
    # (engine/fair_share.py). "" is one shared tenant (a server without a keys file).
    tenant: str = ""
    share: float = 1.0  # the tenant's weight: its share of admissions against other waiting tenants
    batch: bool = False  # a batch-priority tenant's: picked only when no interactive request is waiting


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float  # float32 value from the model, widened exactly to float
    top: list[tuple[int, float]]  # up to `logprobs` most likely (token_id, logprob), best first


@dataclass
class RequestTimings:
    """When the engine did what to one request, on its monotonic clock (time.monotonic()): the times it already
    takes for its own bookkeeping, copied off the Sequence onto the request's final output. The request path
    builds its trace from them after the fact (api/tracing.py); the engine thread never calls a tracer."""

    arrival: float  # Request.arrival_time: admitted on the event loop
    first_scheduled: float | None  # first step that scheduled it (the queue wait ends); None if never scheduled
    prefill_done: float | None  # the step that computed its last prompt token (and sampled the first token)
    first_token: float | None  # the step that emitted its first generated token
    preempted: list[float]  # each step that preempted it for KV space (its K/V recomputed later)
    finished: float  # when the engine produced the final output


@dataclass
class RequestOutput:
    """One engine step's news for one request; the last one has `finished`."""

    request_id: str
    new_token_ids: list[int]  # generated this step: 0, 1, or more when a speculative draft was accepted
    text_delta: str  # text to append; deltas concatenate exactly to the final text
    logprobs: list[TokenLogprob]  # one per new token, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # once, on the output that finishes the prompt
    finished: bool = False
    finish_reason: str | None = None  # stop | length | abort | error
    error: str | None = None  # set with finish_reason="error"
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0  # so far
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_batch_seqs: int = 0  # sequences in the step that produced this output (for validate)
    queue_wait: float | None = None  # seconds from arrival to first step; on the first output only
    timings: RequestTimings | None = None  # on the final output of a request the engine held (for traces)
    embedding: list[float] | None = None  # an embedding request's pooled vector (float32 values), on its last output
    seed: int | None = None  # on the finishing output of a Request with receipt: its generator's seed (drawn if none)


@dataclass
class Accumulated:
    """A request's outputs so far, merged: the one fold of RequestOutputs, for the API's encoders
    (api/events.py) and offline runs (engine/offline.py) alike."""

    text: str = ""  # the generated text
    token_ids: list[int] = field(default_factory=list)  # the generated token ids
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per generated token, if asked
    prompt_logprobs: list[TokenLogprob | None] | None = None  # one per prompt token (the first None), if asked
    finish_reason: str | None = None  # stop | length | abort | error, once finished
    error: str | None = None  # the engine's message with finish_reason error
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    max_batch_seqs: int = 0  # largest step this request shared (for `steadyserve validate`)
    queue_wait: float | None = None  # seconds from arrival to the first step
    num_outputs: int = 0  # RequestOutputs folded in
    embedding: list[float] | None = None  # an embedding request's pooled vector, once finished
    seed: int | None = None  # the seed the sampler ran with, when a receipt was asked for (RequestOutput.seed)

    def add(self, out: RequestOutput) -> None:
        self.num_outputs += 1
        if out.embedding is not None:
            self.embedding = out.embedding
        if out.seed is not None:
            self.seed = out.seed
        self.max_batch_seqs = max(self.max_batch_seqs, out.num_batch_seqs)
        if out.queue_wait is not None:
            self.queue_wait = out.queue_wait
        self.text += out.text_delta
        self.token_ids += out.new_token_ids
        self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error
        self.num_prompt_tokens = out.num_prompt_tokens
        self.num_generated_tokens = out.num_generated_tokens
        self.num_cached_tokens = out.num_cached_tokens

    def usage(self) -> dict[str, Any]:
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_generated_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_generated_tokens,
                "prompt_tokens_details": {"cached_tokens": self.num_cached_tokens}}


@dataclass
class SeqState:
    """One generation's sampling and text state, made at admission (LLMEngine.add_checked) and owned by the
    engine thread: the sampler (batch_sampler.py) draws with its generator, limits and grammar; the output
    processor (output_processor.py) turns its tokens into text, stops and logprobs."""

    # The tokens that end this sequence (stop.end_token_ids): the stop rule and min_tokens' mask both use them.
    end_ids: AbstractSet[int]
    generator: torch.Generator  # the request's own (sampler.make_generator): seeded, or a drawn seed receipts read back
    matcher: Matcher | None  # its position in its grammar (structured output); None without one
    detok: IncrementalDetokenizer  # its text so far, held back where a stop string may still begin
    # An embedding's fold of its hidden rows (pooler.py); None for a generation.
    pool: PoolState | None = None
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. so far, in order
    first_output: bool = True  # no output sent yet: the next one carries queue_wait


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """A request's state inside the engine."""

    # Sampling and text state (SeqState), set by the engine at admission; a Sequence the scheduler alone
    # handles (its tests) has none.
    state: SeqState

    def __init__(self, seq_id: int, request: Request) -> None:
        self.seq_id = seq_id
        self.request_id = request.request_id
        self.request = request
        self.params = request.params
        self.token_ids: list[int] = list(request.prompt_token_ids)
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # of those, taken from the prefix cache at the latest admission
        # One block table per group of layers (engine/kv_layout.py); empty while the sequence holds no blocks.
        self.block_tables: list[list[int]] = []
        # Tokens guessed to follow token_ids (engine/speculation.py), computed after them this step and kept
        # only where sampling agrees; set before each step's scheduling, empty outside it.
        self.draft_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # prefix hash of each full block of token_ids, as far as computed
        self.status = SequenceStatus.WAITING
        self.prompt_logprobs_done = request.params.prompt_logprobs is None
        self.embed = request.embed  # prefill only, pooled (Request.embed)
        # Every prompt position's hidden row is needed (mean pooling): no prefix-cache hits, whose rows a cache
        # does not keep. Set by the engine at admission.
        self.needs_prompt_rows = False
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.prefill_done_time: float | None = None  # the step that computed the last prompt token, first time
        self.preempted_times: list[float] = []  # the steps that preempted it (RequestTimings)
        self.drafter: SeqDrafter | None = None  # speculative drafting state (ngram.py); None without speculation

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.params.max_tokens

    def __repr__(self) -> str:
        return (f"Sequence({self.request_id}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={len(self.block_table)}, {self.status.value})")

    @property
    def block_table(self) -> list[int]:
        """The first group's block table (a model with one group: the only one); [] when holding none."""
        return self.block_tables[0] if self.block_tables else []
