"""gRPC request messages -> (prompt token ids, SamplingParams), with errors that name the field.

The checks are the HTTP API's (protocol.encode_prompt, render_chat,
SamplingParams.validate, the same caps), so a value means the same thing and
is refused with the same message on both; only the field names are the
proto's (`params.temperature`, `text`, `tokens`, `chat.messages[0].role`).
"""

from __future__ import annotations

from typing import Any

from ...engine.sequence import MAX_LOGPROBS, InvalidRequest, SamplingParams
from ..protocol import encode_prompt, render_chat
from ..state import ServerState

MAX_STOP_STRINGS = 4  # as the HTTP API
MAX_TEMPERATURE = 2.0  # as the HTTP API (and OpenAI)
DEFAULT_MAX_TOKENS = 16


class BadInput(Exception):
    """Invalid request content: INVALID_ARGUMENT. `field` is the proto field path."""

    def __init__(self, field: str, message: str) -> None:
        if not message.startswith(field):
            message = f"{field}: {message}"
        super().__init__(message)
        self.field = field


def check_common(state: ServerState, model: str, request_id: str) -> str:
    """Validate `model` and `request_id`; returns the request id to use."""
    if model and model != state.model_name:
        raise BadInput("model", f"model {model!r} does not exist; this server serves {state.model_name!r}")
    if request_id and (len(request_id) > 128 or not request_id.isprintable()):
        raise BadInput("request_id", "request_id must be at most 128 printable characters")
    return state.new_request_id(request_id or None)


def prompt_ids(state: ServerState, msg: Any) -> tuple[list[int], str]:
    """The prompt's token ids from the `input` oneof, and the name of the field that was set."""
    which = msg.WhichOneof("input")
    tok, limit = state.loaded.tokenizer, state.loaded.max_model_len
    try:
        if which == "text":
            return encode_prompt(tok, msg.text, limit, param="text"), "text"
        if which == "tokens":
            ids = list(msg.tokens.ids)
            vocab = state.loaded.args.vocab_size
            bad = next((i for i, t in enumerate(ids) if t >= vocab), None)
            if bad is not None:  # refused here too so the message can point at the index
                raise BadInput(f"tokens.ids[{bad}]", f"token id {ids[bad]} is out of range 0..{vocab - 1}")
            return encode_prompt(tok, ids, limit, param="tokens.ids"), "tokens"
        if which == "chat":
            messages = [{"role": m.role, "content": m.content} for m in msg.chat.messages]
            ids = render_chat(tok, messages)
            if len(ids) > limit:
                raise BadInput("chat.messages", f"messages render to {len(ids)} tokens; the context length is {limit}")
            return ids, "chat"
    except InvalidRequest as e:
        raise BadInput(_chat_field(e.param), str(e)) from None
    raise BadInput("input", "one of " + ", ".join(f.name for f in msg.DESCRIPTOR.oneofs_by_name["input"].fields)
                   + " must be set")


def _chat_field(param: str) -> str:
    return "chat." + param if param.startswith("messages") else param


def score_params(msg: Any) -> SamplingParams:
    """Scoring: generate nothing, return every prompt token's logprob (and top-k)."""
    if msg.top_logprobs > MAX_LOGPROBS:
        raise BadInput("top_logprobs", f"top_logprobs must be in 0..{MAX_LOGPROBS}")
    return SamplingParams(max_tokens=0, prompt_logprobs=msg.top_logprobs)


def generate_params(state: ServerState, msg: Any) -> SamplingParams:
    """SamplingParams from `params`, range-checked as the HTTP API does."""
    p = msg.params
    cap = state.config.server.max_tokens_cap
    max_tokens = p.max_tokens if p.HasField("max_tokens") else min(DEFAULT_MAX_TOKENS, cap)
    if not 1 <= max_tokens <= cap:
        raise BadInput("params.max_tokens", f"max_tokens must be in 1..{cap} (--max-tokens-cap)")
    temperature = p.temperature if p.HasField("temperature") else 1.0
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # also refuses NaN
        raise BadInput("params.temperature", f"temperature must be in 0..{MAX_TEMPERATURE}")
    if len(p.stop) > MAX_STOP_STRINGS:
        raise BadInput("params.stop", f"at most {MAX_STOP_STRINGS} stop strings")
    if p.HasField("logprobs") and p.logprobs > MAX_LOGPROBS:
        raise BadInput("params.logprobs", f"logprobs must be in 0..{MAX_LOGPROBS}")
    vocab = state.loaded.args.vocab_size
    if any(t >= vocab for t in p.stop_token_ids):
        raise BadInput("params.stop_token_ids", f"stop token ids must be in 0..{vocab - 1}")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=p.top_p if p.HasField("top_p") else 1.0,
        top_k=p.top_k, seed=p.seed if p.HasField("seed") else None, stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None)
    try:
        params.validate()
    except InvalidRequest as e:
        raise BadInput("params." + e.param, str(e)) from None
    return params


def admission_field(param: str | None, input_field: str, scoring: bool = False) -> str:
    """The proto field an engine AdmissionError's `param` refers to."""
    if param in (None, "prompt") or (scoring and param == "max_tokens"):  # a Score's only length is its input
        return input_field
    if param == "request_id":
        return param
    return "params." + param
