"""Tool calling in /v1/chat/completions and gRPC Generate, against real servers, with the openai SDK.

Tiny random models know nothing of tools, so whatever they call, they call because the grammar makes them:
under `required` and a named function every call must parse and validate against its schema (a model left
to itself, tool_choice none, writes no call at all: the control). The generic format is served by the
default ChatML template; the Hermes and Llama 3 formats by tiny models whose templates carry them, whose raw
output (gRPC batches) shows each format's own call syntax.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from steadyserve.api.protos.steadyserve.v1 import inference_pb2 as pb
from steadyserve.api.protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc
from steadyserve.testing import build_tiny_model
from steadyserve.testing.server import ServerProcess
from tool_templates import HERMES, LLAMA3

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "clock", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "Weather in Paris for 2 days?"}]
MAX = 200  # enough for a few calls of the tiny model's near-character tokens


@pytest.fixture(scope="module")
def srv(long_model: str):
    with ServerProcess(long_model, test_log_prompts=True) as s:  # prompt ids in the log: gRPC's and HTTP's compared
        yield s


@pytest.fixture(scope="module")
def client(srv) -> OpenAI:
    return OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0)


def chat(client: OpenAI, **kw):
    return client.chat.completions.create(**{"model": "", "messages": ASK, "tools": TOOLS, "max_tokens": MAX,
                                             "temperature": 0, **kw})


def check_valid(calls) -> None:
    """Every call names a tool and its arguments validate against that tool's schema."""
    assert calls
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


def test_required_calls_always_validate_and_finish_with_tool_calls(client) -> None:
    written = set()
    for seed in range(4):  # sampled, so each seed writes other calls: all valid
        r = chat(client, tool_choice="required", temperature=1.0, seed=seed)
        ch = r.choices[0]
        check_valid(ch.message.tool_calls)
        assert ch.finish_reason == "tool_calls" and ch.message.content is None
        written.add(tuple((c.function.name, c.function.arguments) for c in ch.message.tool_calls))
    # The seeds really sampled: not one call repeated four times (which a grammar ignoring the sampler would give).
    assert len(written) > 1, written
    assert {name for calls in written for name, _ in calls} <= set(SCHEMAS)
    # The control: the same model without the grammar (tool_choice none) writes no call, only text.
    free = chat(client, tool_choice="none", max_tokens=40, temperature=1.0, seed=0).choices[0]
    assert free.message.tool_calls is None and free.finish_reason in ("stop", "length")
    with pytest.raises((ValueError, KeyError, TypeError, jsonschema.ValidationError)):
        json.loads(free.message.content)["tool_calls"]


def test_named_function_and_parallel_tool_calls(client) -> None:
    for seed in range(3):
        calls = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
                     seed=seed).choices[0].message.tool_calls
        check_valid(calls)
        assert {c.function.name for c in calls} == {"get_time"}
        one = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
        assert len(one.choices[0].message.tool_calls) == 1


def test_auto_lets_the_model_choose(client, srv) -> None:
    text = chat(client).choices[0]  # the random model's greedy first token is no call: it answers in text
    assert text.message.tool_calls is None and text.message.content
    brace = httpx.post(srv.http_url + "/tokenize", json={"prompt": "{", "add_special_tokens": False}).json()["tokens"]
    called = chat(client, logit_bias={str(brace[0]): 100}).choices[0]  # pushed to open a call: held to the schema
    check_valid(called.message.tool_calls)
    assert called.finish_reason == "tool_calls"


def test_stream_sends_id_and_name_then_fragments_that_concatenate_to_the_whole_call(client) -> None:
    rid = {"x-request-id": "tools-stream-1"}  # the same request id: the same call ids
    whole = chat(client, tool_choice="required", extra_headers=rid).choices[0]
    chunks = list(chat(client, tool_choice="required", stream=True, extra_headers=rid))
    assert chunks[0].choices[0].delta.role == "assistant"
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in ch.choices[0].delta.tool_calls or []:
            if tc.id is not None:  # the first entry of a call: id, type and name, no arguments yet
                assert tc.index not in calls and tc.function.name and tc.function.arguments == ""
                assert tc.index == len(calls)  # calls come in order, one after another
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.index == max(calls)  # fragments of the call being written
                calls[tc.index]["arguments"] += tc.function.arguments
    assert [ch.choices[0].finish_reason for ch in chunks][-1] == "tool_calls"
    assert [c["arguments"] for c in calls.values()] == [c.function.arguments for c in whole.message.tool_calls]
    assert [(c["id"], c["name"]) for c in calls.values()] == [(c.id, c.function.name) for c in whole.message.tool_calls]
    assert sum(1 for ch in chunks for tc in ch.choices[0].delta.tool_calls or [] if tc.id is None) > len(calls)
    # The SDK's own accumulator reads the stream back into the same message.
    with client.chat.completions.stream(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                        max_tokens=MAX, temperature=0, extra_headers=rid) as s:
        final = s.get_final_completion().choices[0]
    assert [c.function.arguments for c in final.message.tool_calls] == [c.function.arguments
                                                                         for c in whole.message.tool_calls]


def test_a_conversation_with_calls_and_results(client) -> None:
    first = chat(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    turns = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    after = chat(client, messages=turns, tool_choice="none", max_tokens=8)
    assert after.choices[0].message.content is not None
    assert after.usage.prompt_tokens > chat(client, tool_choice="none", max_tokens=8).usage.prompt_tokens
    with pytest.raises(BadRequestError) as e:  # a tool result must name its call
        chat(client, messages=turns[:2] + [{"role": "tool", "content": "sunny"}])
    assert e.value.body["param"] == "messages[2].tool_call_id"


@pytest.mark.parametrize("fields,param", [
    ({"tools": [TOOLS[0], {"type": "function", "function": {"name": "bad", "parameters": {"type": "bogus"}}}]},
     "tools[1].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1]"),
    ({"tools": [{"type": "function", "function": {"name": "no spaces"}}]}, "tools[0].function.name"),
    ({"tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"functions": [{"name": "f"}]}, "functions"),
])
def test_bad_tool_fields_are_400s_naming_the_field(srv, fields, param) -> None:
    body = {"messages": ASK, "tools": TOOLS, "max_tokens": 4, **fields}
    r = httpx.post(srv.http_url + "/v1/chat/completions", json={k: v for k, v in body.items() if v is not None})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tool_calls_are_batch_invariant(client) -> None:
    def alone():
        r = chat(client, tool_choice="required", temperature=1.0, seed=5, logprobs=True)
        return ([c.function.model_dump() for c in r.choices[0].message.tool_calls],
                [t.logprob for t in r.choices[0].logprobs.content])

    solo = alone()
    others = [{"messages": [{"role": "user", "content": f"Noise {i} " * (i + 1)}], "tools": TOOLS,
               "tool_choice": "required" if i % 2 else "auto", "max_tokens": MAX, "temperature": 1.0, "seed": i}
              for i in range(6)]
    with ThreadPoolExecutor(8) as pool:
        noise = [pool.submit(client.chat.completions.create, model="", **o) for o in others]
        mixed = [pool.submit(alone) for _ in range(2)]
        [f.result() for f in noise]
        for f in mixed:
            calls, lps = f.result()
            assert calls == solo[0] and lps == solo[1]  # bitwise: the same calls, the same logprobs


def test_n_choices_each_call(client) -> None:
    r = chat(client, tool_choice="required", n=2, temperature=1.0, seed=3)
    assert len(r.choices) == 2
    for ch in r.choices:
        check_valid(ch.message.tool_calls)
    assert r.choices[0].message.tool_calls[0].id != r.choices[1].message.tool_calls[0].id


def grpc_generate(addr: str, **fields) -> list[pb.GenerateResponse]:
    with grpc.insecure_channel(addr) as ch:
        return list(pb_grpc.InferenceStub(ch).Generate(pb.GenerateRequest(**fields), timeout=60))


def grpc_tools() -> list[pb.Tool]:
    return [pb.Tool(name=t["function"]["name"], description=t["function"]["description"],
                    parameters_json=json.dumps(t["function"]["parameters"])) for t in TOOLS]


def test_grpc_takes_the_same_tools_and_parses_the_same_calls(srv, client) -> None:
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])])
    out = grpc_generate(srv.grpc_addr, chat=msgs, tools=grpc_tools(), tool_choice=pb.ToolChoice(mode="required"),
                        params=pb.SamplingParameters(max_tokens=MAX, temperature=0))
    final = out[-1].final
    http = chat(client, tool_choice="required").choices[0].message.tool_calls
    assert final.finish_reason == pb.FINISH_REASON_TOOL_CALLS and not final.HasField("content")
    assert [(c.name, c.arguments) for c in final.tool_calls] == [(c.function.name, c.function.arguments) for c in http]
    raw = "".join(m.batch.text for m in out if m.HasField("batch"))
    assert raw.startswith('{"tool_calls":[{"name":')  # the generic format's text, streamed as generated
    # A conversation with the call and its result: the same prompt as over HTTP.
    c = final.tool_calls[0]
    turns = pb.ChatMessages(messages=[msgs.messages[0], pb.ChatMessage(role="assistant", tool_calls=[c]),
                                      pb.ChatMessage(role="tool", tool_call_id=c.id, content="sunny")])
    after = grpc_generate(srv.grpc_addr, chat=turns, tools=grpc_tools(), params=pb.SamplingParameters(max_tokens=4),
                          request_id="tools-grpc-after")
    http_after = chat(client, max_tokens=4, extra_headers={"x-request-id": "tools-http-after"}, messages=ASK + [
        {"role": "assistant", "tool_calls": [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": c.arguments}}]}, {"role": "tool", "tool_call_id": c.id, "content": "sunny"}])
    prompt = srv.prompt_ids("tools-grpc-after")  # the ids the engine got, not only their count
    assert prompt == srv.prompt_ids("tools-http-after")
    assert after[-1].final.usage.prompt_tokens == http_after.usage.prompt_tokens == len(prompt)
    bad = pb.Tool(name="f", parameters_json='{"type": "bogus"}')
    with pytest.raises(grpc.RpcError) as e:
        grpc_generate(srv.grpc_addr, chat=msgs, tools=[bad])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(e.value.trailing_metadata())["steadyserve-error-field"] == "tools[0].parameters_json"
    with pytest.raises(grpc.RpcError) as e:  # tools need chat input
        grpc_generate(srv.grpc_addr, text="hi", tools=grpc_tools())
    assert dict(e.value.trailing_metadata())["steadyserve-error-field"] == "tools"


# ---- the models' own formats ---------------------------------------------------------------------------------

NATIVE = {"hermes": (HERMES, '<tool_call>\n{"name":', "<tool_response>"),
          "llama3": (LLAMA3, '{"name":', "ipython")}


@pytest.fixture(scope="module", params=sorted(NATIVE))
def native(request, models_dir):
    template, raw_start, result_tag = NATIVE[request.param]
    path = build_tiny_model(models_dir / f"tools-{request.param}", max_position_embeddings=4096,
                            chat_template=template)
    with ServerProcess(str(path)) as s:
        yield s, raw_start, result_tag


def test_native_formats_render_and_parse_their_own_calls(native) -> None:
    s, raw_start, result_tag = native
    client = OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0)
    for seed in range(2):
        r = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=seed)
        check_valid(r.choices[0].message.tool_calls)
        assert r.choices[0].finish_reason == "tool_calls"
    msgs = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=ASK[0]["content"])])
    out = grpc_generate(s.grpc_addr, chat=msgs, tools=grpc_tools(), tool_choice=pb.ToolChoice(function="get_time"),
                        params=pb.SamplingParameters(max_tokens=MAX, temperature=0))
    raw = "".join(m.batch.text for m in out if m.HasField("batch"))
    assert raw.startswith(raw_start), raw  # the model's own call syntax
    assert [c.name for c in out[-1].final.tool_calls] == ["get_time"]
    # The template renders the conversation's calls and results itself.
    call = r.choices[0].message.tool_calls[0]
    turns = ASK + [{"role": "assistant", "tool_calls": [call.model_dump()]},
                   {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    ids = httpx.post(s.http_url + "/tokenize", json={"messages": turns}).json()["tokens"]
    prompt = httpx.post(s.http_url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert result_tag in prompt and call.function.name in prompt
    streamed = list(chat(client, tool_choice="required", stream=True))
    args = "".join(tc.function.arguments or "" for ch in streamed for tc in ch.choices[0].delta.tool_calls or [])
    assert args == "".join(c.function.arguments for c in chat(client, tool_choice="required").choices[0].message.tool_calls)


def test_websocket_streams_the_raw_output_and_parses_it_at_the_end(srv, client) -> None:
    from websockets.sync.client import connect

    body = {"messages": ASK, "tools": TOOLS, "tool_choice": "required", "max_tokens": MAX, "temperature": 0}
    with connect(f"ws://127.0.0.1:{srv.http_port}/v1/stream", open_timeout=30) as ws:
        ws.send(json.dumps(body))
        msgs = []
        while not msgs or msgs[-1]["type"] == "delta":
            msgs.append(json.loads(ws.recv(timeout=60)))
    final, raw = msgs[-1], "".join(m["text"] for m in msgs[:-1])
    http = chat(client, tool_choice="required").choices[0].message.tool_calls
    assert final["type"] == "final" and final["finish_reason"] == "tool_calls" and final["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in final["tool_calls"]] == \
        [(c.function.name, c.function.arguments) for c in http]
    assert raw.startswith('{"tool_calls":')
