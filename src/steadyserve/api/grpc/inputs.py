"""gRPC request messages as the transport-neutral RequestSpec, and refusals' fields as the proto names them.

Every check is requests.build's, the HTTP API's too, so a value means the same
thing and is refused with the same reason and message on both; only the field
names are the proto's (`params.temperature`, `text`, `tokens.ids[1]`,
`chat.messages[0].role`): `field_name` maps them.
"""

from __future__ import annotations

from typing import Any

import json

from ...engine.sequence import SamplingParams
from ...limits import InvalidRequest
from .. import json_input
from ..embeddings import EmbedSpec
from ..requests import OutputOptions, RequestSpec
from ..tools import ToolChoice, ToolRequest, parse_tool_choice, tool_from_fields, tool_request

# The proto field each kind of `input` oneof arrives in; the HTTP API calls them prompt and messages.
INPUT_FIELDS = {"text": "text", "tokens": "tokens.ids", "chat": "chat.messages"}
# A Score's fields that are not sampling parameters: named as they are, without the `params.` prefix.
SCORE_FIELDS = {"prompt_logprobs": "top_logprobs"}


def input_kind(msg: Any) -> str | None:
    """Which member of the `input` oneof is set: text, tokens, chat, or None."""
    return msg.WhichOneof("input")


def input_spec(msg: Any) -> dict[str, Any]:
    """RequestSpec's prompt fields from the `input` oneof. Raises InvalidRequest when none is set."""
    which = input_kind(msg)
    if which == "text":
        return {"prompts": [msg.text]}
    if which == "tokens":
        return {"prompts": [list(msg.tokens.ids)]}
    if which == "chat":
        return {"messages": [chat_message(m) for m in msg.chat.messages]}
    names = ", ".join(f.name for f in msg.DESCRIPTOR.oneofs_by_name["input"].fields)
    raise InvalidRequest("input", f"input: one of {names} must be set")


def chat_message(m: Any) -> dict[str, Any]:
    """A ChatMessage in the HTTP API's (OpenAI's) shape: calls and the call a tool turn answers, when set."""
    d: dict[str, Any] = {"role": m.role, "content": m.content if m.content or not m.tool_calls else None}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id:
        d["tool_call_id"] = m.tool_call_id
    return d


def tools_spec(msg: Any) -> ToolRequest | None:
    """tools, tool_choice and parallel_tool_calls as the HTTP API's ToolRequest (fields named as the proto's)."""
    tools = []
    for i, t in enumerate(msg.tools):
        param = f"tools[{i}].parameters_json"
        try:
            schema = json_input.loads(t.parameters_json, param, param) if t.parameters_json else None
        except json.JSONDecodeError as e:
            raise InvalidRequest(param, f"{param} is not valid JSON: {e.msg}") from None
        tools.append(tool_from_fields({"name": t.name, "description": t.description, "parameters": schema},
                                      f"tools[{i}]"))
    if tools and input_kind(msg) != "chat":
        raise InvalidRequest("tools", "tools: only with chat input")
    which = msg.tool_choice.WhichOneof("choice") if msg.HasField("tool_choice") else None
    choice: ToolChoice | None = None
    if which == "mode":
        choice = parse_tool_choice(msg.tool_choice.mode, set(), "tool_choice.mode")
    elif which == "function":
        choice = parse_tool_choice({"type": "function", "name": msg.tool_choice.function}, {t.name for t in tools},
                                   "tool_choice.function")
    parallel = msg.parallel_tool_calls if msg.HasField("parallel_tool_calls") else None
    return tool_request(tools, choice, parallel, "tool_choice", "tools[{i}].parameters_json")


def score_spec(msg: Any) -> RequestSpec:
    """Score: generate nothing, return every prompt token's logprob (and top-k). The prompt may fill the context."""
    return RequestSpec(kind="score", transport="grpc", request_id=msg.request_id, model=msg.model,
                       params=SamplingParams(max_tokens=0, prompt_logprobs=msg.top_logprobs),
                       requested_max_tokens=0, receipt=msg.receipt, **input_spec(msg))


def generate_spec(msg: Any) -> RequestSpec:
    """Generate: `params` as SamplingParams; unset optional fields take the HTTP API's defaults."""
    p = msg.params
    params = SamplingParams(
        temperature=p.temperature if p.HasField("temperature") else 1.0,
        top_p=p.top_p if p.HasField("top_p") else 1.0, top_k=p.top_k, seed=p.seed if p.HasField("seed") else None,
        stop=list(p.stop), stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None)
    return RequestSpec(kind="chat" if input_kind(msg) == "chat" else "completion", transport="grpc",
                       request_id=msg.request_id, model=msg.model, params=params,
                       requested_max_tokens=p.max_tokens if p.HasField("max_tokens") else None, stream=True,
                       output=OutputOptions(logprobs=p.HasField("logprobs"),
                                            top_logprobs=p.logprobs if p.HasField("logprobs") else 0),
                       tools=tools_spec(msg), receipt=msg.receipt, **input_spec(msg))


def tokenize_spec(msg: Any) -> RequestSpec:
    """Tokenize: the input as Score sees it (it may fill the context)."""
    return RequestSpec(kind="score", transport="grpc", request_id="", model="", params=SamplingParams(),
                       requested_max_tokens=0, **input_spec(msg))


def embed_spec(msg: Any) -> EmbedSpec:
    """Embed: each EmbedInput's text or token ids; dimensions 0 means all."""
    inputs: list[str | list[int]] = []
    for i, item in enumerate(msg.inputs):
        which = item.WhichOneof("input")
        if which is None:
            raise InvalidRequest("input", f"input: inputs[{i}] sets neither text nor tokens")
        inputs.append(item.text if which == "text" else list(item.tokens.ids))
    return EmbedSpec(transport="grpc", request_id=msg.request_id, model=msg.model, inputs=inputs,
                     dimensions=msg.dimensions or None)


def embed_field_name(param: str | None, msg: Any) -> str:
    """The EmbedRequest field a refusal's `param` refers to. The HTTP API names an input `input` when it is
    alone (its token k `input[k]`) and `input[i]` in a batch (token k `input[i][k]`); the proto always names
    the input by its index and its member: `inputs[0].text`, `inputs[2].tokens.ids[5]`."""
    if param is None or not param.startswith("input"):
        return param or "inputs"
    parts = [int(x) for x in param[len("input"):].strip("[]").split("][") if x]  # indices after `input`
    single = len(msg.inputs) == 1
    if not single and not parts:  # the batch itself: empty, or too many inputs
        return "inputs"
    i = 0 if single else parts.pop(0)
    which = msg.inputs[i].WhichOneof("input") if i < len(msg.inputs) else None
    member = {"text": ".text", "tokens": ".tokens.ids"}.get(which or "", "")
    return f"inputs[{i}]{member}" + "".join(f"[{k}]" for k in parts)


def field_name(param: str | None, msg: Any, scoring: bool = False) -> str:
    """The proto field a refusal's `param` (the HTTP API's name for it) refers to."""
    which = input_kind(msg)
    input_field = INPUT_FIELDS.get(which or "", "input")
    if param is None or (scoring and param == "max_tokens"):  # a Score's only length is its input
        return input_field
    if param.startswith("prompt") and not param.startswith("prompt_"):  # prompt, prompt[1]
        return input_field + param[len("prompt"):]
    if param.startswith("messages"):
        return "chat." + param
    if param in ("model", "request_id", "input") or param.startswith(("tools", "tool_choice", "parallel_tool_calls")):
        return param
    if scoring:
        return SCORE_FIELDS.get(param, param)
    return "params." + param
