"""The tool formats without a server: each one's grammar takes exactly its own calls (so constrained decoding
can only produce calls that validate against the tools' schemas), its parser reads them back, and its stream
sends fragments that concatenate to what the whole response says, also for unfinished output.
"""

from __future__ import annotations

import json

import pytest

from steadyserve.api.tools import ToolCallStream, ToolChoice, ToolRequest, Tool, format_for
from steadyserve.api.tools.formats import ToolFormat
from steadyserve.api.tools.generic import GENERIC
from steadyserve.api.tools.hermes import HERMES
from steadyserve.api.tools.llama3 import LLAMA3
from steadyserve.api.tools.scan import scan_calls
from steadyserve.testing import build_tiny_model
from tool_templates import HERMES as HERMES_TEMPLATE, LLAMA3 as LLAMA3_TEMPLATE

WEATHER = Tool("get_weather", "the weather of a city", {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
    "additionalProperties": False})
ADD = Tool("add", "", {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                       "additionalProperties": False})
TOOLS = (WEATHER, ADD)

# Each format's text for the calls get_weather(city=Paris), add(a=3).
CALLS = {
    "generic": '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Paris"}},{"name":"add","arguments":{"a":3}}]}',
    "hermes": '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>\n'
              '<tool_call>\n{"name":"add","arguments":{"a":3}}\n</tool_call>',
    "llama3_json": '{"name":"get_weather","parameters":{"city":"Paris"}}; {"name":"add","parameters":{"a":3}}',
}
FORMATS = {"generic": GENERIC, "hermes": HERMES, "llama3_json": LLAMA3}
EXPECTED = [("get_weather", '{"city":"Paris"}'), ("add", '{"a":3}')]


@pytest.fixture(scope="module")
def tokenizer(tiny_model: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def ll_tokenizer(tokenizer):
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=len(tokenizer))


def accepts(ll_tokenizer, tokenizer, fmt: ToolFormat, req: ToolRequest, text: str) -> bool:
    """Whether the format's grammar for `req` takes all of `text` and is then complete."""
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_lark(fmt.grammar(req))
    assert not llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer)
    m = llguidance.LLMatcher(ll_tokenizer, grammar)
    return all(m.consume_token(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]) and m.is_accepting()


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_grammar_takes_the_formats_calls_and_nothing_off_schema(name, ll_tokenizer, tokenizer) -> None:
    fmt, calls = FORMATS[name], CALLS[name]
    required = ToolRequest(TOOLS, ToolChoice("required"), parallel=True)
    assert accepts(ll_tokenizer, tokenizer, fmt, required, calls)
    # Off the schema: a city not in the enum, an unknown function, an extra argument, a text answer.
    assert not accepts(ll_tokenizer, tokenizer, fmt, required, calls.replace("Paris", "Berlin"))
    assert not accepts(ll_tokenizer, tokenizer, fmt, required, calls.replace('"add"', '"sub"'))
    assert not accepts(ll_tokenizer, tokenizer, fmt, required, calls.replace('{"a":3}', '{"a":3,"b":1}'))
    assert not accepts(ll_tokenizer, tokenizer, fmt, required, "Sunny in Paris.")
    # One call only without parallel_tool_calls; only the named function under a named choice.
    single = ToolRequest(TOOLS, ToolChoice("required"), parallel=False)
    assert not accepts(ll_tokenizer, tokenizer, fmt, single, calls)
    named = ToolRequest(TOOLS, ToolChoice("function", "add"), parallel=True)
    assert not accepts(ll_tokenizer, tokenizer, fmt, named, calls)
    # auto: a call, or a text answer (which may not begin like a call).
    auto = ToolRequest(TOOLS, ToolChoice("auto"), parallel=True)
    assert accepts(ll_tokenizer, tokenizer, fmt, auto, calls)
    assert accepts(ll_tokenizer, tokenizer, fmt, auto, "Sunny in Paris.")
    assert accepts(ll_tokenizer, tokenizer, fmt, auto, "\n Sunny.")  # blanks first, then text
    bad = calls.replace("Paris", "Berlin")
    assert not accepts(ll_tokenizer, tokenizer, fmt, auto, " " + bad)  # no off-schema call behind a blank
    assert not accepts(ll_tokenizer, tokenizer, fmt, auto, calls.replace("Paris", "Berlin"))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_parse_and_stream_agree_token_by_token(name, tokenizer) -> None:
    fmt, text = FORMATS[name], CALLS[name]
    parsed = fmt.parse(text)
    assert parsed.calls == EXPECTED and parsed.content is None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    stream = ToolCallStream(fmt, "req-1", 0)
    order: list[tuple[int, str]] = []  # (call index, "header" | "args") as sent
    names, args, content = [], {}, ""
    for k, t in enumerate(ids):
        c, entries = stream.feed(tokenizer.decode([t]), finished=k == len(ids) - 1)
        content += c
        for e in entries:
            if "id" in e:
                assert e["function"]["arguments"] == "" and e["type"] == "function"
                names.append(e["function"]["name"])
                args[e["index"]] = ""
                order.append((e["index"], "header"))
            else:
                args[e["index"]] += e["function"]["arguments"]
                order.append((e["index"], "args"))
    assert [(n, args[i]) for i, n in enumerate(names)] == parsed.calls and content == ""
    # OpenAI's order: a call's header before its fragments, and call 0 done before call 1 starts.
    assert order[0] == (0, "header") and order.index((1, "header")) > max(i for i, o in enumerate(order) if o == (0, "args"))
    assert len([o for o in order if o == (0, "args")]) > 1  # fragments, not one piece at the end


def test_hermes_text_before_a_call_and_a_held_back_tag() -> None:
    text = 'Let me look.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert HERMES.parse(text).content == "Let me look." and HERMES.parse(text).calls == [("add", '{"a": 1}')]
    stream = ToolCallStream(HERMES, "r", 0)
    first = stream.feed("Let me look.\n<tool_", False)
    assert first == ("Let me look.", [])  # "<tool_" may start a tag: held back, with the blank before it
    rest = stream.feed("x> ok", True)[0]  # it did not: sent once known
    assert first[0] + rest == HERMES.parse("Let me look.\n<tool_x> ok").content == "Let me look.\n<tool_x> ok"


def test_a_cut_output_keeps_its_named_calls_and_partial_arguments() -> None:
    cut = '{"tool_calls":[{"name":"get_weather","arguments":{"city":"Pa'
    assert GENERIC.parse(cut).calls == [("get_weather", '{"city":"Pa')]
    assert GENERIC.parse('{"tool_calls":[{"na').calls == []  # no complete name: no call
    assert [c.name for c in scan_calls('{"name":"f","parameters":{"x":"}{"}}', 1, "parameters")] == ["f"]


def test_text_answers_are_content_stripped_as_in_the_stream() -> None:
    for fmt in FORMATS.values():
        assert fmt.parse("  Sunny.  ").content == "Sunny." and fmt.parse("  Sunny.  ").calls == []
        s = ToolCallStream(fmt, "r", 0)
        sent = s.feed("  Sun", False)[0] + s.feed("ny.  ", False)[0] + s.feed("", True)[0]
        assert sent == "Sunny." and not s.called


def test_format_follows_the_chat_template(models_dir) -> None:
    from transformers import AutoTokenizer

    found = {}
    for name, template in (("hermes", HERMES_TEMPLATE), ("llama3", LLAMA3_TEMPLATE), ("chatml", None)):
        path = build_tiny_model(models_dir / f"fmt-{name}", chat_template=template)
        found[name] = format_for(AutoTokenizer.from_pretrained(path)).name
    assert found == {"hermes": "hermes", "llama3": "llama3_json", "chatml": "generic"}


def test_generic_prompt_lists_the_tools_and_renders_calls_and_results() -> None:
    req = ToolRequest(TOOLS, ToolChoice("auto"), parallel=True)
    msgs = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    out, kwargs = GENERIC.template_input(msgs, req)
    assert kwargs == {} and out[0]["role"] == "system" and '"name":"get_weather"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}
    assert out[3]["role"] == "user" and "get_weather" in out[3]["content"] and "sunny" in out[3]["content"]
    # tool_choice none: no tools in the prompt at all.
    none, _ = GENERIC.template_input(msgs[:1], ToolRequest(TOOLS, ToolChoice("none")))
    assert none == [{"role": "user", "content": "Weather?"}]
    # A native template gets the tools and the calls' arguments as objects.
    native, kw = HERMES.template_input(msgs, req)
    assert kw["tools"][0]["function"]["name"] == "get_weather"
    assert native[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Rome"} and native[2]["name"] == "get_weather"


# ---- parsing never crashes: any JSON in the tool fields is refused by name ------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from steadyserve.api.http.responses import ResponsesRequest, input_messages, tools_of  # noqa: E402
from steadyserve.api.http.schemas import ChatCompletionRequest  # noqa: E402
from steadyserve.limits import InvalidRequest  # noqa: E402

KEYS = ["type", "function", "name", "parameters", "description", "role", "content", "call_id", "arguments",
        "output", "text", "tool_calls", "id"]
values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=8) | st.sampled_from(
    ["function", "message", "function_call", "function_call_output", "auto", "required", "user", "input_text"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(KEYS), inner, max_size=4),
    max_leaves=10)


@settings(max_examples=300, deadline=None, database=None)
@given(tools=values, choice=values, items=values)
def test_tool_fields_are_refused_by_name_and_never_crash(tools, choice, items) -> None:
    body = {"messages": [{"role": "user", "content": "x"}], "tools": tools, "tool_choice": choice}
    try:
        ChatCompletionRequest.model_validate(body).tool_request()
    except InvalidRequest as e:
        assert e.param and e.param.startswith(("tools", "tool_choice")) and e.param in str(e), (e.param, str(e))
    except ValidationError:
        pass  # named by its location, as every field
    try:
        req = ResponsesRequest.model_validate({"input": items, "tools": tools, "tool_choice": choice})
        tools_of(req)
        input_messages(req.input)
    except InvalidRequest as e:
        assert e.param and e.param.startswith(("tools", "tool_choice", "input")) and e.param in str(e), e.param
    except ValidationError:
        pass
