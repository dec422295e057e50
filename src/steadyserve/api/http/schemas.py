"""Request bodies of the OpenAI-compatible endpoints (pydantic, strict types).

A top-level field that no model declares is refused by name, as OpenAI refuses it ("Unrecognized request
argument supplied: ...", code `unknown_field`: RequestBody, inputs.validated). OpenAI's own fields are not
unknown: those that cannot change the result (`user`, `metadata`, ...: IGNORED_FIELDS) are accepted and have no
effect; those that would and that we do not implement (the deprecated `functions`, audio, predicted outputs) are
refused by name when set (UNSUPPORTED_FIELDS). Nested objects (messages, content parts, stream_options) keep
ignoring fields they do not use: clients send a response's message back with its `refusal`, `annotations`, ...
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, StrictBool, StrictInt, model_validator

from ...engine.sequence import SamplingParams
from ..tools import ToolRequest, parse_tool, parse_tool_choice, tool_request
from ...limits import (CHAT_ROLES, MAX_CHOICES, MAX_LOGPROBS, MAX_PENALTY, MAX_REPETITION_PENALTY, MAX_STOP_STRINGS,
                       MAX_TEMPERATURE, SEED_MAX, SEED_MIN, InvalidRequest, check_range)

# A JSON number (ints too), never a numeric string or a bool. NaN/Infinity fail the range checks.
Number = Annotated[float, Strict()]


def shared_range(minimum: float | None = None, maximum: float | None = None, exclusive_minimum: float | None = None,
                 **extra: object) -> dict:
    """A range the OpenAPI spec shows but pydantic does not enforce: SamplingParams.validate checks it (with
    the limits of steadyserve.limits), so HTTP and gRPC refuse it with the same message."""
    bounds = {"minimum": minimum, "maximum": maximum, "exclusiveMinimum": exclusive_minimum}
    return {**{k: v for k, v in bounds.items() if v is not None}, **extra}


# OpenAI request fields that would change the result and that steadyserve does not implement: refused by name
# when set (refuse_unsupported), never ignored.
UNSUPPORTED_FIELDS = {
    "functions": "the deprecated functions field is not supported: send tools",
    "function_call": "the deprecated function_call field is not supported: send tool_choice", "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported", "reasoning_effort": "this model has no reasoning effort",
    "web_search_options": "web search is not supported",
}


# OpenAI request fields that cannot change the result: accepted, with no effect (OpenAI clients send them).
IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier"})


class RequestBody(BaseModel):
    """A top-level request body: a field that is neither declared nor in `accepted_unused` is refused
    (extra="forbid"; inputs.validated names it, code `unknown_field`, as OpenAI's "Unrecognized request argument
    supplied"). `accepted_unused`: OpenAI fields that are accepted without effect (IGNORED_FIELDS), or that the
    endpoint refuses by value before validation (refuse_unsupported), so that their harmless values (`null`,
    `["text"]`) pass; a declared field of the same name (the Responses API's `store`, `metadata`) is validated."""
    model_config = ConfigDict(extra="forbid")
    accepted_unused: ClassVar[frozenset[str]] = frozenset()

    @model_validator(mode="before")
    @classmethod
    def _drop_accepted_unused(cls, data: Any) -> Any:
        if isinstance(data, dict) and not cls.accepted_unused.isdisjoint(data):
            return {k: v for k, v in data.items() if k not in cls.accepted_unused or k in cls.model_fields}
        return data


def refuse_unsupported(body: Any) -> None:
    """Raise InvalidRequest naming the first unsupported OpenAI field the body sets."""
    if not isinstance(body, dict):
        return
    for name, why in UNSUPPORTED_FIELDS.items():
        if body.get(name) is not None:
            raise InvalidRequest(name, f"{name}: {why}; leave it out")
    modalities = body.get("modalities")
    if modalities is not None and modalities != ["text"]:
        raise InvalidRequest("modalities", 'modalities: only ["text"] is supported')


def grammar_for(response_format: dict[str, Any] | None) -> str | None:
    """The llguidance grammar for OpenAI's response_format, None for plain text. Raises InvalidRequest."""
    if not response_format or response_format.get("type") == "text":
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        schema: Any = {"type": "object"}
    elif kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise InvalidRequest("response_format", 'response_format: json_schema needs {"json_schema": '
                                 '{"name": ..., "schema": {...}}}')
        schema = spec.get("schema", {})
    else:
        raise InvalidRequest("response_format", f"response_format: type must be text, json_object or json_schema, "
                             f"not {kind!r}")
    from ...engine.structured import json_schema_grammar

    return json_schema_grammar(schema)


class StreamOptions(BaseModel):
    """Options of a streamed response."""
    model_config = ConfigDict(extra="ignore")
    include_usage: StrictBool = Field(default=False, description="send a last chunk with the usage totals")


class _Common(RequestBody):
    accepted_unused: ClassVar[frozenset[str]] = IGNORED_FIELDS | {*UNSUPPORTED_FIELDS, "modalities"}

    model: str | None = Field(default=None, description="the served model's id (GET /v1/models); any other is a 404, "
                              "leaving it out means the served model")
    max_tokens: StrictInt | None = Field(default=None, description="most tokens to generate; default 16 for "
                                         "completions, 512 for chat, never more than the context leaves; at most "
                                         "--max-tokens-cap", json_schema_extra=shared_range(0))
    temperature: Number = Field(default=1.0, description="sampling temperature; 0 is greedy",
                                json_schema_extra=shared_range(0.0, MAX_TEMPERATURE))
    top_p: Number = Field(default=1.0, description="nucleus sampling: keep the most likely tokens "
                          "whose probabilities sum to top_p", json_schema_extra=shared_range(None, 1.0, 0.0))
    top_k: StrictInt = Field(default=0, description="keep only the k most likely tokens; 0 keeps all",
                             json_schema_extra=shared_range(0, **{"x-extension": True}))
    seed: StrictInt | None = Field(default=None, description="seeds this request's own "
                                   "sampler: equal seeds give equal tokens, whatever else is batched with it",
                                   json_schema_extra=shared_range(SEED_MIN, SEED_MAX))
    stop: str | list[str] | None = Field(default=None, description=f"up to {MAX_STOP_STRINGS} strings that end the "
                                         "completion; the text stops before the stop string")
    stop_token_ids: list[StrictInt] | None = Field(default=None, description="token ids that also end the "
                                                   "completion (besides end-of-sequence), as gRPC's stop_token_ids",
                                                   json_schema_extra={"x-extension": True})
    stream: StrictBool = Field(default=False, description="send server-sent events as tokens are generated")
    stream_options: StreamOptions | None = Field(default=None, description="options of a streamed response")
    n: StrictInt = Field(default=1, ge=1, le=MAX_CHOICES, description="choices per prompt, each its own sample; with "
                         "seed, choice j samples with seed + j, so choice 0 is the n=1 request and every choice "
                         "is reproducible")
    ignore_eos: StrictBool = Field(default=False, description="keep generating past end-of-sequence tokens (for "
                                   "benchmarks)", json_schema_extra={"x-extension": True})
    # Logits processors: applied to this request's own row before sampling (batch invariance holds); the
    # logprobs reported stay the model's own (as vLLM reports them by default).
    frequency_penalty: Number | None = Field(default=None, description="subtracted "
                                             "from a token's log-probability once per time it was generated so far",
                                             json_schema_extra=shared_range(-MAX_PENALTY, MAX_PENALTY))
    presence_penalty: Number | None = Field(default=None, description="subtracted "
                                            "from the log-probability of every token generated so far",
                                            json_schema_extra=shared_range(-MAX_PENALTY, MAX_PENALTY))
    logit_bias: dict[str, Number] | None = Field(default=None, description="token id (as a string) -> bias in "
                                                 "-100..100 added to its log-probability before sampling; "
                                                 "-100 bans a token, 100 all but forces it")
    repetition_penalty: Number = Field(default=1.0, description="multiplies "
                                       "the (negative) log-probability of every prompt and generated token: > 1 discourages "
                                       "repeats, 1 turns it off",
                                       json_schema_extra=shared_range(None, MAX_REPETITION_PENALTY, 0.0,
                                                                      **{"x-extension": True}))
    min_tokens: StrictInt = Field(default=0, description="end-of-sequence and stop tokens cannot be "
                                  "generated before this many tokens (at most max_tokens)",
                                  json_schema_extra=shared_range(0, **{"x-extension": True}))
    skip_special_tokens: StrictBool = Field(default=True, description="leave the tokenizer's special tokens out "
                                            "of the output text (vLLM's parameter); a chat reply of a harmony "
                                            "model (gpt-oss) is read with them, into reasoning_content and content",
                                            json_schema_extra={"x-extension": True})
    receipt: StrictBool = Field(default=False, description="return a receipt with each choice (a stream: in its "
                                "last chunk) that `steadyserve verify` replays bit for bit; the header "
                                "x-steadyserve-receipt: 1 asks too (docs/reference/receipts.md)",
                                json_schema_extra={"x-extension": True})

    def processors(self) -> dict[str, Any]:
        """The logits processors' SamplingParams fields."""
        bias: dict[int, float] = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise InvalidRequest("logit_bias", f"logit_bias: keys are token ids, not {key!r}")
            bias[int(key)] = float(value)
        return {"logit_bias": bias, "presence_penalty": self.presence_penalty or 0.0,
                "frequency_penalty": self.frequency_penalty or 0.0, "repetition_penalty": self.repetition_penalty,
                "min_tokens": self.min_tokens, "stop_token_ids": list(self.stop_token_ids or []),
                "skip_special_tokens": self.skip_special_tokens}

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)  # counted by SamplingParams.validate


class CompletionRequest(_Common):
    """Body of POST /v1/completions."""
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="the prompt: a string, a list of token ids, or a batch of either (a list of strings or of "
                    "token-id lists): one choice per prompt, in order, admitted all at once or refused")
    echo: StrictBool = Field(default=False, description="prepend the prompt to the completion; with logprobs, the "
                             "prompt's tokens get logprobs too (max_tokens 0 scores a prompt without generating)")
    logprobs: StrictInt | None = Field(default=None, description="return the chosen tokens' logprobs and this many "
                                       "most likely alternatives per position",
                                       json_schema_extra=shared_range(0, MAX_LOGPROBS))
    best_of: StrictInt | None = Field(default=None, ge=1, le=MAX_CHOICES, description="sample this many choices per prompt "
                                      "(seeds seed + j, as n) and return the n with the highest mean log-probability "
                                      "per token; usage counts all of them. Not with stream.")

    @model_validator(mode="after")
    def _best_of_covers_n(self) -> "CompletionRequest":
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError("best_of must be at least n")
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError("best_of cannot be used with stream: the best choices are known only at the end")
        return self

    @property
    def num_samples(self) -> int:
        """Choices generated per prompt: best_of, else n."""
        return self.best_of or self.n
    suffix: None = Field(default=None, description="not supported: must be absent or null")
    response_format: dict[str, Any] | None = Field(default=None, description="structured output, as in chat "
                                                   "completions: json_object or json_schema",
                                                   json_schema_extra={"x-extension": True})

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts, one per choice: a string or a token-id list alone is a batch of one."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]  # type: ignore[list-item]
        if not p:
            raise InvalidRequest("prompt", "prompt must not be empty")
        return list(p)  # type: ignore[arg-type]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        grammar = grammar_for(self.response_format)
        if grammar is not None and self.ignore_eos:
            raise InvalidRequest("ignore_eos", "ignore_eos cannot be combined with response_format: a finished "
                                 "structure ends with end-of-sequence")
        return SamplingParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=self.stop_list(), ignore_eos=self.ignore_eos, logprobs=self.logprobs,
            prompt_logprobs=self.logprobs if self.echo and self.logprobs is not None else
            (0 if self.echo and self.max_tokens == 0 else None), grammar=grammar, **self.processors(),
        )


class TextPart(BaseModel):
    """A content part, as the SDK sends `content=[{"type": "text", "text": ...}]`; text only."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"] = Field(description="only text parts are supported")
    text: str = Field(description="the text")


class FunctionCall(BaseModel):
    """The function an assistant message called."""
    model_config = ConfigDict(extra="ignore")
    name: str = Field(description="the function's name")
    arguments: str = Field(description="its arguments, a JSON object as a string (as the model wrote them)")


class ToolCall(BaseModel):
    """One call of an earlier assistant turn, as a response's `message.tool_calls` gave it."""
    model_config = ConfigDict(extra="ignore")
    id: str = Field(description="the call's id; the `tool` message with its result names it")
    type: Literal["function"] = Field(default="function", description="only function calls exist")
    function: FunctionCall = Field(description="the function called and its arguments")


class ChatMessage(BaseModel):
    """One message of a conversation."""
    model_config = ConfigDict(extra="ignore")
    # Checked where gRPC's is (api/protocol.render_chat), so both refuse a role with the same message; the
    # schema still lists the roles.
    role: str = Field(description="who speaks", json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[TextPart] | None = Field(default=None, description="a string, or a list of text parts "
                                                 "that are joined; an assistant message with tool_calls may omit it")
    tool_calls: list[ToolCall] | None = Field(default=None, description="assistant: the calls it made")
    tool_call_id: str | None = Field(default=None, description="tool: the id of the call this message answers")
    name: str | None = Field(default=None, description="tool: the function's name (found from the call when "
                             "absent); ignored on other roles")

    def text(self) -> str | None:
        if self.content is None:
            return None
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)

    def as_dict(self) -> dict[str, Any]:
        """The message as requests.build and the chat template take it (OpenAI's shape)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            d["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        if self.name is not None and self.role == "tool":
            d["name"] = self.name
        return d


class ChatCompletionRequest(_Common):
    """Body of POST /v1/chat/completions."""
    messages: list[ChatMessage] = Field(description="the conversation, rendered with the model's chat template",
                                        json_schema_extra={"minItems": 1})  # checked by requests.build
    logprobs: StrictBool = Field(default=False, description="return the logprob of each generated token")
    top_logprobs: StrictInt | None = Field(default=None, description="with logprobs: this many most likely "
                                           "alternatives per position",
                                           json_schema_extra=shared_range(0, MAX_LOGPROBS))
    max_completion_tokens: StrictInt | None = Field(default=None, description="the newer name of max_tokens; "
                                                    "wins when both are given", json_schema_extra=shared_range(0))
    tools: list[dict[str, Any]] | None = Field(default=None, description='functions the model may call: '
                                               '[{"type": "function", "function": {"name", "description", '
                                               '"parameters": JSON schema}}]; a call\'s arguments follow its '
                                               'schema by constrained decoding')
    tool_choice: str | dict[str, Any] | None = Field(default=None, description='"none", "auto" (the default '
                                                     'with tools), "required", or {"type": "function", '
                                                     '"function": {"name"}}')
    parallel_tool_calls: StrictBool | None = Field(default=None, description="allow more than one call in a "
                                                   "turn (default true)")
    response_format: dict[str, Any] | None = Field(default=None, description='structured output: {"type": '
                                                   '"json_object"}, or {"type": "json_schema", "json_schema": '
                                                   '{"name": ..., "schema": {...}}}: sampling follows the schema '
                                                   '(constrained decoding); {"type": "text"} is the default')

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs: true")
        return self

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        grammar = grammar_for(self.response_format)
        if grammar is not None and self.ignore_eos:
            raise InvalidRequest("ignore_eos", "ignore_eos cannot be combined with response_format: a finished "
                                 "structure ends with end-of-sequence")
        mt = self.requested_max_tokens
        if self.top_logprobs is not None:  # its one check, the completions' logprobs range, named as sent
            check_range("top_logprobs", self.top_logprobs, 0, MAX_LOGPROBS)
        return SamplingParams(
            max_tokens=mt if mt is not None else default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
            stop=self.stop_list(), ignore_eos=self.ignore_eos,
            logprobs=(self.top_logprobs or 0) if self.logprobs else None, grammar=grammar, **self.processors(),
        )

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_samples(self) -> int:
        """Choices generated per prompt."""
        return self.n

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages]

    def tool_request(self) -> ToolRequest | None:
        """tools, tool_choice and parallel_tool_calls, validated. Raises InvalidRequest naming the field."""
        tools = [parse_tool(t, f"tools[{i}]") for i, t in enumerate(self.tools or [])]
        choice = parse_tool_choice(self.tool_choice, {t.name for t in tools})
        return tool_request(tools, choice, self.parallel_tool_calls)


class TokenizeRequest(RequestBody):
    """Body of POST /tokenize: a text prompt or chat messages, as the completion endpoints would see them."""
    model: str | None = Field(default=None, description="the served model's id; leaving it out means the served model")
    prompt: str | None = Field(default=None, description="a text prompt, tokenized as /v1/completions does")
    messages: list[ChatMessage] | None = Field(default=None, description="chat messages, rendered with the model's "
                                                "chat template as /v1/chat/completions does (ready for the "
                                                "assistant's turn)")
    add_special_tokens: StrictBool = Field(default=True, description="with prompt: add the model's special tokens "
                                           "(BOS), as /v1/completions does")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("send exactly one of prompt and messages")
        return self

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.as_dict() for m in self.messages or []]


class DetokenizeRequest(RequestBody):
    """Body of POST /detokenize."""
    model: str | None = Field(default=None, description="the served model's id; leaving it out means the served model")
    tokens: list[StrictInt] = Field(description="token ids of this model, decoded to text as the completion "
                                    "endpoints decode generated tokens")
