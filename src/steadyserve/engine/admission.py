"""What a request must fit to run on this engine: the model's limits, and the checks against them.

`ModelLimits` is built once by the engine at start-up (LLMEngine.limits) and handed to whoever builds requests:
the API's request builders (api/requests.py, api/embeddings.py, for HTTP, WebSocket and gRPC alike) through
ServerState.limits, and offline callers (engine/offline.py, receipts' replay, the golden and conformance tools)
through LLMEngine.add_request / LLMEngine.check. A request is checked once, by its builder; the engine's
submission (AsyncEngine.submit_all) then only counts capacity.

Each limit has one owner: the vocabulary, the context and the grammar compiler are the model's (LoadedModel,
read here once); the KV capacity is the cache the engine allocated; the sampling ranges are
SamplingParams.validate's (steadyserve.limits); how many requests may be in flight is AsyncEngine.capacity's.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..limits import Refused, check_token_ids
from .sequence import Request, SamplingParams
from .structured import Grammars


@dataclass(frozen=True)
class ModelLimits:
    """The engine's limits, fixed at start-up: a request within them can run (given a free slot)."""

    vocab_size: int  # rows of the model's LM head: every token id a request names must be below it
    context: int  # max_model_len: prompt + max_tokens of one request, in tokens
    kv_blocks: int  # KV cache blocks allocated at start-up (one request must fit in all of them)
    block_size: int  # tokens per KV block (--block-size)
    kv_tokens: int  # the longest sequence the cache holds alone (BlockManager.token_capacity; at most context)
    grammars: Grammars  # the grammar compiler (structured output): whether a grammar compiles for this model
    eos_token_ids: frozenset[int]  # the model's end-of-sequence tokens (what ends a turn, for the encoders)

    # ---- the checks, one per limit; `check` runs them all, in the order clients have always seen --------------
    def check_prompt_ids(self, ids: list[int], param: str = "prompt") -> None:
        """Client-sent token ids are ids of this model (O(prompt): a builder runs it once, on ids only)."""
        check_token_ids(ids, self.vocab_size, param)

    def check_grammar(self, grammar: str | None) -> None:
        """A grammar this model can follow (compiled once, remembered by Grammars)."""
        if grammar is not None:
            self.grammars.check(grammar)

    def check_token_params(self, p: SamplingParams) -> None:
        """The token ids inside the sampling parameters (logit_bias, stop_token_ids) are this model's."""
        vocab = self.vocab_size
        bad_bias = next((t for t in p.logit_bias if not 0 <= t < vocab), None)
        if bad_bias is not None:
            raise Refused("invalid_value", f"logit_bias: {bad_bias} is not a token id of this model "
                          f"(0..{vocab - 1})", "logit_bias")
        bad_stop = next((t for t in p.stop_token_ids if not 0 <= t < vocab), None)
        if bad_stop is not None:
            raise Refused("invalid_value", f"stop_token_ids: {bad_stop} is not a token id of this model "
                          f"(0..{vocab - 1})", "stop_token_ids")

    def check_fit(self, num_prompt_tokens: int, max_tokens: int) -> None:
        """A prompt of this length, plus max_tokens, fits the context and the KV cache (O(1))."""
        n = num_prompt_tokens
        if n == 0:
            raise Refused("invalid_value", "the prompt is empty", "prompt")
        total = n + max_tokens
        if total > self.context:
            raise Refused("too_long", f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {total} "
                          f"exceeds the context length of {self.context} tokens", "max_tokens")
        if total > self.kv_tokens:
            raise Refused("too_long", f"prompt ({n} tokens) + max_tokens ({max_tokens}) = {total} "
                          f"exceeds the KV cache of {self.kv_tokens} tokens", "max_tokens")

    def check(self, request: Request) -> None:
        """Every check, for a request built without the API's builder (offline callers, LLMEngine.add_request).
        Raises Refused with the builder's reason, field and message for each, so both paths refuse alike."""
        p = request.params
        if request.embed:  # prefill only: no sampling fields apply
            if p.max_tokens != 0:
                raise Refused("invalid_value", "an embedding request generates nothing: max_tokens must be 0",
                              "max_tokens")
        else:
            p.validate()  # InvalidRequest: a Refused with the builder's reason, invalid_value
        if not request.prompt_token_ids:
            raise Refused("invalid_value", "the prompt is empty", "prompt")
        self.check_prompt_ids(request.prompt_token_ids)
        self.check_grammar(p.grammar)
        self.check_token_params(p)
        self.check_fit(len(request.prompt_token_ids), p.max_tokens)
