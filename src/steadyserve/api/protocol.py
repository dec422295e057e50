"""Transport-neutral tokenizer work: prompts to token ids, chat templates (a lone token's text is
engine/detokenizer.py's token_text, imported here for the transports).

Called by the request builder (requests.py) for every transport, so a prompt
means the same thing on all of them and a bad one gets the same message.
"""

from __future__ import annotations

from typing import Any

from ..engine.detokenizer import token_text  # noqa: F401 - the transports' import; its owner is the detokenizer
from ..limits import CHAT_ROLES, InvalidRequest
from .tools import ToolRequest, format_for


def encode_prompt(tokenizer: Any, prompt: str | list[int], param: str = "prompt", *,
                  add_special_tokens: bool = True, allow_empty: bool = False) -> list[int]:
    """The one text -> token ids path (generation, Score, gRPC Tokenize and HTTP /tokenize). A string is
    tokenized (with the model's BOS policy, unless add_special_tokens=False); a list is taken as token ids
    (range-checked by the caller, ModelLimits.check_prompt_ids, as is the length). Only /tokenize allows an empty
    string: it answers what the text encodes to, and generation needs at least one token."""
    if isinstance(prompt, str):
        if not prompt and not allow_empty:
            raise InvalidRequest(param, f"{param} must not be empty")
        ids = list(tokenizer(prompt, add_special_tokens=add_special_tokens)["input_ids"])
    else:
        if not prompt:
            raise InvalidRequest(param, f"{param} must not be empty")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            raise InvalidRequest(param, f"{param} must be a string or a list of token ids")
        ids = list(prompt)
    return ids


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], tools: ToolRequest | None = None,
                continue_final: bool = False) -> list[int]:
    """Render messages with the model's chat template, ready for the assistant's turn. With tools, the model's
    tool format (api/tools) decides how they and the conversation's calls are shown: through the template
    (Hermes, Llama 3) or in the system prompt (the generic format). `continue_final`: the last message is an
    assistant's to be continued, not answered (Anthropic's prefill): no new turn is opened after it."""
    if not messages:
        raise InvalidRequest("messages", "messages must not be empty")
    for i, m in enumerate(messages):
        check_message(m, f"messages[{i}]")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest("messages", "this model has no chat template; use /v1/completions")
    rendered, kwargs = format_for(tokenizer).template_input(messages, tools)
    if continue_final:
        kwargs["continue_final_message"] = True
    try:
        text = tokenizer.apply_chat_template(rendered, tokenize=False, add_generation_prompt=not continue_final,
                                             **kwargs)
    except Exception as e:  # template errors are the caller's messages' fault
        raise InvalidRequest("messages", f"cannot render messages with the chat template: {e}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def check_message(m: dict[str, Any], param: str) -> None:
    """One message in OpenAI's shapes: a role and text content; an assistant's may carry `tool_calls` instead
    of content, and a `tool` message answers a call by its `tool_call_id`."""
    if m.get("role") not in CHAT_ROLES:
        raise InvalidRequest(f"{param}.role", f"{param}.role must be one of {', '.join(CHAT_ROLES)}")
    calls = m.get("tool_calls")
    if calls and m["role"] != "assistant":
        raise InvalidRequest(f"{param}.tool_calls", f"{param}.tool_calls: only assistant messages carry calls")
    content = m.get("content")
    if not isinstance(content, str) and not (content is None and calls):
        raise InvalidRequest(f"{param}.content", f"{param}.content must be a string")
    for j, tc in enumerate(calls or []):
        fn = tc.get("function") if isinstance(tc, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), str):
            raise InvalidRequest(f"{param}.tool_calls[{j}]", f"{param}.tool_calls[{j}] must be "
                                 '{"id", "type": "function", "function": {"name", "arguments"}}')
    if m["role"] == "tool" and not isinstance(m.get("tool_call_id"), str):
        raise InvalidRequest(f"{param}.tool_call_id", f"{param}.tool_call_id: a tool message names the call it "
                             "answers")
