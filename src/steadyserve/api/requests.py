"""One validated request, built in one place from any transport's input.

A transport parses its input (HTTP and WebSocket: a pydantic body; gRPC: a
proto message) into a `RequestSpec`, the request as sent, and calls `build`:
every check runs here, once, in the same order and with the same messages for
every transport: the request's own fields, and the engine's limits
(ServerState.limits, engine/admission.py: vocabulary, context, KV capacity,
grammars). The result is a `ValidatedRequest`: one engine request per choice,
immutable. `admit` then submits it (the engine only counts capacity there) and
opens its streams.

Refusals are `Refused` (steadyserve.limits) with the field named as the HTTP
API names it; gRPC renames the field (`params.temperature`), nothing else.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from ..engine.channel import RequestChannel
from ..engine.sequence import SamplingParams
from ..limits import DEFAULT_MAX_TOKENS, InvalidRequest, Refused, check_request_id
from .harmony import speaks_harmony
from .protocol import encode_prompt, render_chat
from .state import ServerState
from .tools import ToolFormat, ToolRequest, format_for
from .tracing import current as current_trace


@dataclass(frozen=True)
class OutputOptions:
    """What the encoders add around the generated tokens, read from the request by its spec builder, so that
    the transport's raw message never travels past it."""

    logprobs: bool = False  # the client asked for each token's logprob (best_of asks the engine anyway, to rank)
    top_logprobs: int = 0  # alternatives per token the client asked for (completions: logprobs N)
    echo: bool = False  # completion: the prompt prepended to the text (and its tokens' logprobs, if asked)
    include_usage: bool = False  # a stream ends with a usage chunk (stream_options.include_usage)


@dataclass
class RequestSpec:
    """A request as a transport parsed it, before any check: the same fields whichever transport it came by."""

    kind: str  # completion | chat | score: the default max_tokens, and whether the prompt may fill the context
    transport: str  # http | ws | grpc: for logs, metrics and the streams' bookkeeping
    request_id: str  # the client's request id; "" when it sent none (a new one is made)
    model: str | None  # the model the client named; None or "" means the served one
    params: SamplingParams  # the sampling fields as sent; max_tokens comes from requested_max_tokens
    prompts: list[str | list[int]] = dataclasses.field(default_factory=list)  # completion/score: text or ids each
    messages: list[dict[str, Any]] | None = None  # chat: the conversation, rendered with the chat template
    requested_max_tokens: int | None = None  # max_tokens as sent; None takes DEFAULT_MAX_TOKENS
    max_tokens_param: str = "max_tokens"  # the field max_tokens came in (chat: max_completion_tokens)
    num_samples: int = 1  # choices generated per prompt (best_of, else n)
    n: int = 1  # choices returned per prompt: the best n of num_samples by mean token logprob
    stream: bool = False  # the client asked for a stream of events rather than one response
    output: OutputOptions = OutputOptions()  # what the encoders add: logprobs, echo, usage
    tools: ToolRequest | None = None  # chat: tools, tool_choice, parallel_tool_calls; None when none were sent
    continue_final: bool = False  # chat: the last (assistant) message is continued, not answered (a prefill)
    receipt: bool = False  # a receipt per choice (api/receipts.py): the body's field, gRPC's, or the header
    reads_harmony: bool = False  # the encoder reads a harmony reply's channels (OpenAI chat: api/harmony.py)


@dataclass(frozen=True)
class ValidatedRequest:
    """A request that passed every check, the engine's limits included: one engine request per choice, in the
    order of the choices' indices (prompt i's choice j is index i * num_samples + j, as OpenAI numbers them).
    Immutable: admission submits exactly what was checked."""

    request_id: str  # the id responses carry: the client's, or a new one
    kind: str  # completion | chat | score
    transport: str  # http | ws | grpc
    prompts: list[list[int]]  # each choice's prompt token ids
    params: list[SamplingParams]  # each choice's sampling parameters (own seed; max_tokens default per prompt)
    echo_texts: list[str | None]  # each choice's prompt text for echo; None where it came as token ids
    num_samples: int = 1  # choices generated per prompt (best_of, else n)
    n: int = 1  # choices returned per prompt
    stream: bool = False  # the client asked for a stream
    output: OutputOptions = OutputOptions()  # what the encoders add: logprobs, echo, usage
    tools: ToolRequest | None = None  # the tools the model may call (None: none, or tool_choice none)
    tool_format: ToolFormat | None = None  # with tools: how this model writes calls, to parse its output
    receipt: bool = False  # each choice's final event carries its receipt (api/receipts.py)
    harmony: bool = False  # a chat reply in gpt-oss's harmony: read into reasoning and content (api/harmony.py)

    @property
    def engine_ids(self) -> list[str]:
        """The engine request id of each choice: the request id itself when there is one choice."""
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]


def check_model(state: ServerState, name: str | None) -> None:
    """`name` must be the served model's (or absent). HTTP answers 404, gRPC INVALID_ARGUMENT."""
    if name not in (None, "", state.model_name):
        raise Refused("model_not_found", f"model {name!r} does not exist; this server serves "
                      f"{state.model_name!r}", "model")


def check_context(num_tokens: int, param: str, context: int, scoring: bool, verb: str = "has") -> None:
    """A prompt that fills the whole context leaves no room to generate: only a score (max_tokens 0) may."""
    limit = context if scoring else context - 1
    if num_tokens > limit:
        room = "" if scoring else ", prompt and completion together"
        raise Refused("too_long", f"{param} {verb} {num_tokens} tokens; the context length is {context} tokens{room}",
                      param)


def prompt_ids(state: ServerState, spec: RequestSpec) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids (chat: the rendered conversation) and its text for echo, context-checked."""
    tok, limits = state.loaded.tokenizer, state.limits
    context = limits.context
    scoring = spec.kind == "score" or spec.requested_max_tokens == 0
    if spec.messages is not None:
        ids = render_chat(tok, spec.messages, spec.tools, spec.continue_final)
        check_context(len(ids), "messages", context, scoring, verb="render to")
        return [ids], [""]
    if not spec.prompts:
        raise InvalidRequest("prompt", "prompt must not be empty")
    prompts: list[list[int]] = []
    for i, item in enumerate(spec.prompts):
        param = "prompt" if len(spec.prompts) == 1 else f"prompt[{i}]"
        ids = encode_prompt(tok, item, param)
        if not isinstance(item, str):
            limits.check_prompt_ids(ids, param)
        check_context(len(ids), param, context, scoring)
        prompts.append(ids)
    return prompts, [item if isinstance(item, str) else None for item in spec.prompts]


def resolve_max_tokens(state: ServerState, spec: RequestSpec) -> int:
    """max_tokens as sent, range-checked against --max-tokens-cap; else the kind's default (under the cap)."""
    cap = state.config.server.max_tokens_cap
    name, asked = spec.max_tokens_param, spec.requested_max_tokens
    if asked is None:
        return min(cap, DEFAULT_MAX_TOKENS.get(spec.kind, DEFAULT_MAX_TOKENS["completion"]))
    if asked < 0:
        raise InvalidRequest(name, f"{name} must be an integer >= 0")
    if asked == 0 and spec.kind == "chat":
        raise InvalidRequest(name, f"{name} must be at least 1 for chat completions")
    if asked > cap:
        raise InvalidRequest(name, f"{name} must be at most {cap} (--max-tokens-cap)")
    return asked


def build(state: ServerState, spec: RequestSpec) -> ValidatedRequest:
    """Every check a request passes, for every transport, the engine's limits (state.limits) included: the only
    one (AsyncEngine.submit_all then counts capacity). Raises Refused. `spec` is left as it came: each value
    derived from its parameters is a new SamplingParams.

    Runs on the tokenizer thread (ServerState.run_tokenizer) for long inputs: it tokenizes and compiles grammars.
    """
    state.refuse_if_closed()
    check_model(state, spec.model)
    if spec.request_id:
        check_request_id(spec.request_id)
    limits = state.limits
    params = dataclasses.replace(spec.params, max_tokens=resolve_max_tokens(state, spec))
    try:
        params.validate()
    except InvalidRequest as e:  # name max_tokens as the client sent it
        if e.param == "max_tokens" and spec.max_tokens_param != "max_tokens":
            raise InvalidRequest(spec.max_tokens_param, str(e).replace("max_tokens", spec.max_tokens_param)) from None
        raise
    capacity = state.engine.capacity
    if len(spec.prompts) > capacity:
        raise InvalidRequest("prompt", f"prompt: at most {capacity} prompts per request "
                             "(--max-num-seqs + --max-queue), all admitted at once")
    prompts, texts = prompt_ids(state, spec)
    limits.check_grammar(params.grammar)  # compiled here, off the event loop
    tools = spec.tools if spec.tools is not None and spec.tools.active else None
    tool_format = None
    if tools is not None:
        tool_format, grammar = tool_grammar(state, tools, params)
        params = dataclasses.replace(params, grammar=grammar)
    harmony = spec.reads_harmony and tools is None and speaks_harmony(state.loaded.tokenizer)
    if harmony:  # its channels are special tokens: the reader needs them in the text
        params = dataclasses.replace(params, skip_special_tokens=False)
    k = spec.num_samples
    if len(prompts) * k > capacity:
        name = "best_of" if k > spec.n else "n"
        raise InvalidRequest(name, f"{name}: {len(prompts)} prompt(s) x {k} choices is more than the "
                             f"{capacity} requests this server admits at once")
    if k > spec.n and params.logprobs is None:
        params = dataclasses.replace(params, logprobs=0)  # ranking needs each token's logprob; not returned
    context = limits.context
    choices, choice_params, choice_texts = [], [], []
    for ids, text in zip(prompts, texts):
        for j in range(k):  # choice j of a prompt samples with seed + j: choice 0 is the n=1 request
            max_tokens = params.max_tokens
            if spec.requested_max_tokens is None:
                # No max_tokens given: the default, but never more than the context leaves.
                max_tokens = max(1, min(max_tokens, context - len(ids)))
            p = dataclasses.replace(params, stop=list(params.stop), logit_bias=dict(params.logit_bias),
                                    seed=derived_seed(params.seed, j), max_tokens=max_tokens)
            if max_tokens != params.max_tokens:
                p.validate()  # a new value: min_tokens may now exceed the max_tokens the context leaves
            if not choices:  # the same for every choice: checked once
                limits.check_token_params(params)
            limits.check_fit(len(ids), max_tokens)
            choices.append(ids)
            choice_params.append(p)
            choice_texts.append(text)
    return ValidatedRequest(state.new_request_id(spec.request_id or None), spec.kind, spec.transport, choices,
                            choice_params, choice_texts, k, spec.n, spec.stream, spec.output, tools, tool_format,
                            spec.receipt, harmony)


def tool_grammar(state: ServerState, tools: ToolRequest, params: SamplingParams) -> tuple[ToolFormat, str]:
    """Constrain the output to this model's call format (api/tools): each tool's schema must compile (else a
    400 naming that tool), then the whole grammar. Returns the format, for the encoders to parse the output,
    and the grammar the choices sample under."""
    from ..engine.structured import json_schema_grammar

    if params.grammar is not None:
        raise InvalidRequest("response_format", "response_format cannot be combined with tools (unless "
                             "tool_choice is none): the output follows the tools' grammar")
    if params.ignore_eos:
        raise InvalidRequest("ignore_eos", "ignore_eos cannot be combined with tools: a finished call ends with "
                             "end-of-sequence")
    grammars = state.limits.grammars
    for i, tool in enumerate(tools.tools):
        param = tools.schema_param.format(i=i)
        try:
            why = grammars.error(json_schema_grammar(tool.parameters))
        except Exception as e:  # the compiler's own message: a schema it cannot read at all
            why = str(e) or type(e).__name__
        if why:
            raise InvalidRequest(param, f"{param}: tool {tool.name!r} has a schema this server cannot compile: {why}")
    fmt = format_for(state.loaded.tokenizer)
    grammar = fmt.grammar(tools)
    why = grammars.error(grammar)
    if why:
        raise InvalidRequest("tools", f"tools: cannot compile the tools' grammar: {why}")
    return fmt, grammar


def derived_seed(seed: int | None, j: int) -> int | None:
    """The seed of a prompt's choice j: seed + j, wrapped into the range torch.Generator takes."""
    if seed is None or j == 0:
        return seed
    s = seed + j
    return s - 2**64 if s > 2**64 - 1 else s


def admit(state: ServerState, req: ValidatedRequest) -> RequestChannel:
    """Submit every choice at once, or none (Refused); returns their channel (choice i is engine request i),
    held by the server's open channels until the transport closes it.

    A request id already in flight (a client or proxy reusing ids) gets suffixed engine ids, while the client
    still sees its own."""
    ids = req.engine_ids
    items = list(zip(ids, req.prompts, req.params))
    try:
        channel = state.submit_all(items, req.transport, receipt=req.receipt)
    except Refused as e:
        if e.reason != "invalid" or e.param != "request_id":
            raise
        tag = uuid.uuid4().hex[:8]
        ids = [f"{rid}.{tag}" for rid in ids]
        channel = state.submit_all([(rid, p, sp) for rid, (_, p, sp) in zip(ids, items)], req.transport,
                                   receipt=req.receipt)
    trace = current_trace()
    if trace is not None:  # tracing on: the span notes what was asked and the engine's times when each ends
        trace.admitted(req, channel)
    return state.streams.add(channel)
