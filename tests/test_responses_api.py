"""POST /v1/responses against a real server, with the openai SDK: the input shapes, tools and their items,
text.format, the streamed events in their documented order (and an error that ends a stream with an
`error` event), previous_response_id and the bounded store (GET, DELETE, eviction answered with a 404).

The server runs with --responses-store-size 3, so eviction is seen after a few responses, and with the
TEST-ONLY fault hooks (steadyserve.testing.faults) so that a request can fail mid-stream on purpose.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
from openai import BadRequestError, NotFoundError, OpenAI

from http_util import sse_events
from steadyserve.testing.faults import FAIL_REQUEST_MARKER
from steadyserve.testing.server import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "forecast", "parameters": WEATHER}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}


@pytest.fixture(scope="module")
def srv(long_model: str):
    with ServerProcess(long_model, "--responses-store-size", "3", "--grpc-port", "-1", test_faults=True,
                       test_log_prompts=True) as s:  # prompt ids in the log: Responses' and chat's compared
        yield s


@pytest.fixture(scope="module")
def client(srv) -> OpenAI:
    return OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0)


def create(client: OpenAI, **kw):
    return client.responses.create(**{"model": "", "max_output_tokens": 8, "temperature": 0, **kw})


def test_string_input_and_instructions_are_a_chat_request(client, srv) -> None:
    r = create(client, input="Name a fox.", instructions="Be brief.", extra_headers={"x-request-id": "fox-responses"})
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"  # 8 tokens: cut
    assert r.incomplete_details.reason == "max_output_tokens" and r.usage.output_tokens == 8
    assert r.output[0].type == "message" and r.output[0].role == "assistant" and r.output_text
    chat = client.chat.completions.create(model="", max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}],
        extra_headers={"x-request-id": "fox-chat"})
    prompt = srv.prompt_ids("fox-responses")  # the ids the engine got, not only their count
    assert prompt == srv.prompt_ids("fox-chat")
    assert r.output_text == chat.choices[0].message.content  # the same prompt, the same greedy tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens == len(prompt)
    assert create(client, input="Name a fox.").usage.input_tokens < r.usage.input_tokens


def test_item_input_with_a_function_call_and_its_output(client) -> None:
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city":"Paris"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"}]
    r = create(client, input=items, tools=TOOLS)
    assert r.output[0].type == "message"
    assert r.usage.input_tokens > create(client, input=items[:1], tools=TOOLS).usage.input_tokens


def test_tools_required_give_valid_function_call_items(client) -> None:
    for seed_text in ("Weather?", "Forecast please", "Paris or Rome?"):
        r = create(client, input=seed_text, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_output_tokens=200, temperature=1.0)
        calls = [o for o in r.output if o.type == "function_call"]
        assert r.status == "completed" and len(calls) == 1 and calls[0].call_id.startswith("call_")
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER)


def test_text_format_json_schema(client) -> None:
    r = create(client, input="Is it ok?", max_output_tokens=40,
               text={"format": {"type": "json_schema", "name": "answer", "schema": SCHEMA}})
    jsonschema.validate(json.loads(r.output_text), SCHEMA)


def events(srv, body: dict) -> list[dict]:
    with httpx.stream("POST", srv.http_url + "/v1/responses", json={"max_output_tokens": 8, "temperature": 0,
                                                                      "stream": True, **body}, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    out = [json.loads(e) for e in sse_events(raw)]
    assert raw.count(b"event: ") == len(out)  # every data line has its event line
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def collapse(types: list[str]) -> list[str]:
    """Runs of one delta type as one."""
    return [t for i, t in enumerate(types) if not (t.endswith(".delta") and i and types[i - 1] == t)]


def test_text_stream_events_in_order_and_deltas_concatenate(srv, client) -> None:
    evs = events(srv, {"input": "Name a fox."})
    assert collapse([e["type"] for e in evs]) == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete"]
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    done = next(e for e in evs if e["type"] == "response.output_text.done")
    assert text == done["text"] == evs[-1]["response"]["output"][0]["content"][0]["text"]
    assert text == create(client, input="Name a fox.").output_text


def test_function_call_stream_and_the_sdk_stream_helper(srv, client) -> None:
    body = {"input": "Weather?", "tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": False,
            "max_output_tokens": 200}
    evs = events(srv, body)
    assert collapse([e["type"] for e in evs]) == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    args = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    done = next(e for e in evs if e["type"] == "response.function_call_arguments.done")
    whole = [o for o in create(client, **body).output if o.type == "function_call"][0]
    assert args == done["arguments"] == whole.arguments and done["name"] == whole.name == "get_weather"
    with client.responses.stream(model="", temperature=0, **body) as s:
        final = s.get_final_response()
    assert [o.arguments for o in final.output] == [whole.arguments]


def test_an_error_mid_stream_ends_with_an_error_event(srv) -> None:
    evs = events(srv, {"input": f"Fail {FAIL_REQUEST_MARKER} now", "max_output_tokens": 50})
    assert evs[0]["type"] == "response.created" and evs[-1]["type"] == "error"
    assert evs[-1]["code"] == "request_error" and evs[-1]["message"]
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in evs)


def test_previous_response_id_store_get_delete_and_eviction(srv, client) -> None:
    first = create(client, input="Name a fox.")
    second = create(client, input="And a dog?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens  # carries the turn
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    unstored = create(client, input="Name a fox.", store=False)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(unstored.id)
    client.responses.delete(second.id)
    with pytest.raises(NotFoundError):
        client.responses.retrieve(second.id)
    for _ in range(3):  # the store keeps 3: `first` is evicted, oldest first
        create(client, input="Filler")
    r = httpx.get(f"{srv.http_url}/v1/responses/{first.id}")
    assert r.status_code == 404 and "evicted" in r.json()["error"]["message"] and r.json()["error"]["code"] == "not_found"
    with pytest.raises(NotFoundError) as e:
        create(client, input="More", previous_response_id=first.id)
    assert e.value.body["param"] == "previous_response_id" and "evicted" in e.value.body["message"]
    assert httpx.delete(f"{srv.http_url}/v1/responses/resp_unknown").status_code == 404


@pytest.mark.parametrize("fields,param", [
    ({"input": [{"type": "image_generation_call"}]}, "input[0].type"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": []}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "bogus"}}]}, "tools[0].parameters"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "bogus"}}}}, "text.format"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"temperature": 9}, "temperature"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"model": "other"}, "model"),
])
def test_bad_fields_are_refused_by_name(srv, fields, param) -> None:
    r = httpx.post(srv.http_url + "/v1/responses", json={"input": "hi", **fields})
    assert r.status_code in (400, 404) and r.json()["error"]["param"] == param, r.text


def test_sdk_raises_bad_request(client) -> None:
    with pytest.raises(BadRequestError):
        create(client, input="hi", max_output_tokens=-1)
