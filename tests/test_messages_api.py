"""POST /v1/messages (Anthropic's Messages API) against a real server, with the official `anthropic` SDK:
a plain message (the same prompt and tokens as the chat API), the SDK's stream helpers and the raw event order,
stop reasons, tools (forced, a two-tool loop with tool_result blocks rendered as OpenAI tool messages are),
errors in Anthropic's shape, an error that ends a stream with an `error` event, the API key as x-api-key, a
429 the SDK's retry honours, and a drain that answers 529 and ends a stream with an `error` event.
"""

from __future__ import annotations

import json
import signal
import threading

import anthropic
import httpx
import jsonschema
import pytest

from http_util import sse_events, wait_for
from steadyserve.testing.faults import FAIL_REQUEST_MARKER, SLOW_REQUEST_MARKER
from steadyserve.testing.server import ServerProcess

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
           "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"name": "get_weather", "description": "forecast", "input_schema": WEATHER},
         {"name": "get_time", "description": "clock", "input_schema": TIME}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]
USER = [{"role": "user", "content": "Name a fox."}]
KEY = "sk-ant-test-key"


@pytest.fixture(scope="module")
def srv(long_model: str):  # 4096 positions: room for the tools' prompt and calls
    with ServerProcess(long_model, "--grpc-port", "-1", test_faults=True) as s:
        yield s


@pytest.fixture(scope="module")
def client(srv) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=srv.http_url, api_key="unused", max_retries=0, timeout=120)


def create(client: anthropic.Anthropic, temperature: float = 0, **kw):
    """This SDK's create has no sampling fields (Anthropic dropped them): they go as extra_body, as clients send them."""
    extra = {"temperature": temperature, **kw.pop("extra_body", {})}
    return client.messages.create(**{"model": "", "max_tokens": 8, "messages": USER, **kw}, extra_body=extra)


def events(srv, body: dict) -> list[dict]:
    """The raw events of a streamed message; every data line has its event line, naming its type."""
    with httpx.stream("POST", srv.http_url + "/v1/messages", json={"max_tokens": 8, "temperature": 0,
                                                                     "messages": USER, **body, "stream": True},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        raw = r.read()
    out = [json.loads(e) for e in sse_events(raw)]
    names = [line[7:] for line in raw.decode().split("\n") if line.startswith("event: ")]
    assert names == [e["type"] for e in out], (names, out)
    return out


def collapse(types: list[str]) -> list[str]:
    """Runs of one event type (content_block_delta) as one."""
    return [t for i, t in enumerate(types) if not (i and types[i - 1] == t)]


def chat(srv, **body) -> dict:
    r = httpx.post(srv.http_url + "/v1/chat/completions", json={"max_tokens": 8, "temperature": 0, **body},
                   timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_message_is_the_chat_request_in_anthropics_shape(srv, client) -> None:
    m = create(client, system="Be brief.")
    assert m.type == "message" and m.role == "assistant" and m.id.startswith("msg_")
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None and m.usage.output_tokens == 8
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    same = chat(srv, messages=[{"role": "system", "content": "Be brief."}, *USER])
    assert m.content[0].text == same["choices"][0]["message"]["content"]  # the same prompt, the same tokens
    assert m.usage.input_tokens == same["usage"]["prompt_tokens"]
    blocks = create(client, system=[{"type": "text", "text": "Be ", "cache_control": {"type": "ephemeral"}},
                                    {"type": "text", "text": "brief."}])
    assert blocks.content[0].text == m.content[0].text and blocks.usage.input_tokens == m.usage.input_tokens
    listed = create(client, messages=[{"role": "user", "content": [{"type": "text", "text": "Name a fox."}]}])
    assert listed.content[0].text == create(client).content[0].text
    assert create(client).usage.input_tokens < m.usage.input_tokens
    assert create(client, metadata={"user_id": "u-1"}).content == create(client).content  # accepted, no effect


def test_a_final_assistant_message_is_continued(srv, client) -> None:
    """A prefill: the prompt is the user's turn with the assistant's turn opened and the prefill written in it, so
    greedy decoding after a prefix of the greedy answer goes on with the rest of that answer."""
    go = [{"role": "user", "content": "Go"}]
    answer = create(client, max_tokens=64, messages=go).content[0].text  # the tiny model: "IIII...IIIoverover..."
    assert "Iover" in answer, answer
    prefix = answer[:answer.index("over") + 4]  # up to the first "over" (one token): the second comes next
    m = create(client, max_tokens=8, messages=[*go, {"role": "assistant", "content": prefix}])
    cont = m.content[0].text
    assert cont.startswith("over") and answer.startswith(prefix + cont[:8]), (answer, prefix, cont)
    # The prompt is exactly the answer's prompt (the assistant's turn opened) and the prefill's tokens: no end of
    # turn after the prefill, no new turn.
    prefill_ids = httpx.post(srv.http_url + "/tokenize", json={"prompt": prefix, "add_special_tokens": False}).json()
    assert m.usage.input_tokens == create(client, messages=go).usage.input_tokens + prefill_ids["count"]
    counted = httpx.post(srv.http_url + "/v1/messages/count_tokens",
                         json={"messages": [*go, {"role": "assistant", "content": prefix}]}).json()
    assert counted["input_tokens"] == m.usage.input_tokens


def test_output_config_format_is_structured_output(client) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    m = create(client, max_tokens=40, output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, output_config={"effort": "high"})
    assert e.value.body["error"]["message"].startswith("output_config.effort")


def first_new_pair(text: str) -> str:
    """Two characters of `text` that first occur after its start (a stop sequence that cuts it mid-way)."""
    return next(text[i:i + 2] for i in range(1, len(text) - 1) if text.find(text[i:i + 2]) == i)


def test_stop_sequences_and_end_of_turn(srv, client) -> None:
    text = create(client, max_tokens=16).content[0].text
    cut = first_new_pair(text)
    m = create(client, max_tokens=16, stop_sequences=["\u2603never", cut])
    assert (m.stop_reason, m.stop_sequence) == ("stop_sequence", cut)
    assert m.content[0].text == text[:text.index(cut)]
    evs = events(srv, {"max_tokens": 16, "stop_sequences": ["\u2603never", cut]})
    assert evs[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": cut}
    # The model's own end of sequence is end_turn, even with stop sequences that did not occur. The tiny random
    # model ends a sampled answer after ~200 tokens on average; three tries of 2000 all running out is ~e^-30.
    for _ in range(3):
        m = create(client, max_tokens=2000, temperature=1.0, stop_sequences=["\u2603never"])
        if m.stop_reason != "max_tokens":
            break
    assert (m.stop_reason, m.stop_sequence) == ("end_turn", None) and m.usage.output_tokens < 2000, m
    # A forced call ends on end-of-sequence too: that turn's reason is tool_use.
    called = create(client, max_tokens=200, tools=TOOLS[:1], tool_choice={"type": "any"})
    assert called.stop_reason == "tool_use" and called.stop_sequence is None


def test_stream_events_in_order_and_the_sdk_stream_helpers(srv, client) -> None:
    whole = create(client)
    evs = events(srv, {})
    assert collapse([e["type"] for e in evs]) == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    start = evs[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None
    assert start["usage"]["input_tokens"] == whole.usage.input_tokens
    assert evs[2]["content_block"] == {"type": "text", "text": ""} and evs[2]["index"] == 0
    text = "".join(e["delta"]["text"] for e in evs if e["type"] == "content_block_delta")
    assert all(e["delta"]["type"] == "text_delta" for e in evs if e["type"] == "content_block_delta")
    assert text == whole.content[0].text
    assert evs[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert evs[-2]["usage"]["output_tokens"] == 8
    with client.messages.stream(model="", max_tokens=8, messages=USER, extra_body={"temperature": 0}) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == final.content[0].text == whole.content[0].text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_forced_tool_use_whole_and_streamed(srv, client) -> None:
    kw = {"max_tokens": 200, "tools": TOOLS, "tool_choice": {"type": "tool", "name": "get_time",
                                                               "disable_parallel_tool_use": True}}
    m = create(client, **kw)
    assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["tool_use"]
    use = m.content[0]
    assert use.name == "get_time" and use.id.startswith("toolu_")
    jsonschema.validate(use.input, TIME)
    evs = events(srv, kw)
    assert collapse([e["type"] for e in evs]) == [
        "message_start", "ping", "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert evs[2]["content_block"]["type"] == "tool_use" and evs[2]["content_block"]["name"] == "get_time"
    assert evs[2]["content_block"]["input"] == {}
    deltas = [e["delta"] for e in evs if e["type"] == "content_block_delta"]
    assert all(d["type"] == "input_json_delta" for d in deltas)
    assert json.loads("".join(d["partial_json"] for d in deltas)) == use.input
    assert evs[-2]["delta"]["stop_reason"] == "tool_use"
    with client.messages.stream(model="", messages=USER, extra_body={"temperature": 0}, **kw) as s:
        final = s.get_final_message()
    assert [(b.type, b.name, b.input) for b in final.content] == [("tool_use", "get_time", use.input)]
    # any: a call of one of the tools, held to its schema whatever the sampling. Sampled, one call: its length is
    # bounded (a name and an enum, at most about 62 tokens however the sampler splits the text). With parallel calls
    # the grammar admits any number, and at temperature 1 (no seed in this API) 300 requests gave 1-4 calls of up
    # to 62 tokens each, so now and then more than max_tokens: an honest "max_tokens" stop, which failed a suite run.
    for _ in range(3):
        m = create(client, max_tokens=200, temperature=1.0, tools=TOOLS,
                   tool_choice={"type": "any", "disable_parallel_tool_use": True})
        assert m.stop_reason == "tool_use" and len(m.content) == 1 and m.content[0].type == "tool_use", m
        b = m.content[0]
        jsonschema.validate(b.input, WEATHER if b.name == "get_weather" else TIME)
    # Parallel calls allowed, greedy (the same output every run): calls only, each held to its schema.
    m = create(client, max_tokens=200, tools=TOOLS, tool_choice={"type": "any"})
    assert m.stop_reason == "tool_use" and m.content and all(b.type == "tool_use" for b in m.content), m
    for b in m.content:
        jsonschema.validate(b.input, WEATHER if b.name == "get_weather" else TIME)


def test_tool_choice_none_leaves_the_tools_out(client) -> None:
    offered = create(client, tools=TOOLS, tool_choice={"type": "auto"})
    none = create(client, tools=TOOLS, tool_choice={"type": "none"})
    assert none.usage.input_tokens == create(client).usage.input_tokens < offered.usage.input_tokens
    assert all(b.type == "text" for b in none.content)


def test_a_two_tool_loop_with_tool_results(srv, client) -> None:
    """Weather, then time, then an answer: each tool_use block goes back as the assistant's content, each
    result as a tool_result block; the prompt is the one the chat API renders for the same conversation."""
    messages: list[dict] = [{"role": "user", "content": "Weather in Paris, and the time?"}]
    openai_messages: list[dict] = [dict(messages[0])]
    for name, result in (("get_weather", "sunny, 21 C"), ("get_time", "14:05")):
        m = create(client, max_tokens=200, messages=messages, tools=TOOLS,
                   tool_choice={"type": "tool", "name": name, "disable_parallel_tool_use": True})
        assert m.stop_reason == "tool_use" and [b.name for b in m.content] == [name]
        use = m.content[0]
        messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                   "content": [{"type": "text", "text": result}]}]}]
        openai_messages += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": use.id, "type": "function", "function": {"name": name, "arguments": json.dumps(use.input)}}]},
            {"role": "tool", "tool_call_id": use.id, "content": result}]
    final = create(client, max_tokens=8, messages=messages, tools=TOOLS, tool_choice={"type": "none"})
    same = chat(srv, messages=openai_messages, tools=OPENAI_TOOLS, tool_choice="none")
    assert final.usage.input_tokens == same["usage"]["prompt_tokens"]
    assert final.content[0].text == same["choices"][0]["message"]["content"]
    # The results are in the prompt: another result is another prompt.
    other = json.loads(json.dumps(messages))
    other[-1]["content"][0]["content"] = [{"type": "text", "text": "a much longer answer about the time of day"}]
    assert create(client, messages=other, tools=TOOLS, tool_choice={"type": "none"}).usage.input_tokens > \
        final.usage.input_tokens
    counted = httpx.post(srv.http_url + "/v1/messages/count_tokens", json={"messages": messages, "tools": TOOLS,
                                                                             "tool_choice": {"type": "none"}})
    assert counted.status_code == 200 and counted.json() == {"input_tokens": final.usage.input_tokens}


def error_of(r: httpx.Response, status: int, type_: str) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"} and body["error"]["type"] == type_
    return body["error"]["message"]


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": None}, "max_tokens"),
    ({"bogus_field": 1}, "bogus_field"),
    ({"temprature": 0.5}, "temprature"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "system", "content": "hi"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "base64"}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [*USER, {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f",
                                                              "input": {}}]}]}, "messages[1].content"),
    ({"messages": [*USER, {"role": "assistant", "content": ""}]}, "messages[1].content"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "bogus"}}]}, "tools[0].input_schema"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice.name"),
    ({"tools": TOOLS, "tool_choice": {"type": "required"}}, "tool_choice.type"),
    ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ({"stop_sequences": ["a", "b", "c", "d", "e"]}, "stop_sequences"),
    ({"temperature": 9}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"metadata": {"user_id": "u", "other": 1}}, "metadata.other"),
    ({"system": [{"type": "image"}]}, "system[0]"),
])
def test_bad_requests_are_refused_in_anthropics_shape_naming_the_field(srv, fields, param) -> None:
    body = {"max_tokens": 8, "messages": USER, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    msg = error_of(httpx.post(srv.http_url + "/v1/messages", json=body, timeout=60), 400, "invalid_request_error")
    assert msg.startswith(param) or f": {param}" in msg, msg


def test_other_errors_in_anthropics_shape(srv, client) -> None:
    url = srv.http_url + "/v1/messages"
    assert "does not exist" in error_of(httpx.post(url, json={"model": "claude-x", "max_tokens": 8, "messages": USER}),
                                        404, "not_found_error")
    error_of(httpx.get(url), 405, "invalid_request_error")
    error_of(httpx.post(url + "/nope", json={}), 404, "not_found_error")
    error_of(httpx.post(url, content=b"{nope"), 400, "invalid_request_error")
    big = {"max_tokens": 8, "messages": [{"role": "user", "content": "x" * (2 << 20)}]}  # > --max-request-bytes
    assert "--max-request-bytes" in error_of(httpx.post(url, json=big, timeout=60), 413, "request_too_large")
    with pytest.raises(anthropic.BadRequestError) as e:
        create(client, extra_body={"bogus_field": 1})
    assert e.value.status_code == 400 and "bogus_field" in e.value.message
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "Unrecognized request argument supplied: bogus_field"}}
    with pytest.raises(anthropic.NotFoundError):
        create(client, model="claude-x")


def test_an_error_mid_stream_ends_with_an_error_event(srv, client) -> None:
    fail = [{"role": "user", "content": f"Fail {FAIL_REQUEST_MARKER} now"}]
    evs = events(srv, {"messages": fail, "max_tokens": 50})
    assert evs[0]["type"] == "message_start" and evs[-1]["type"] == "error"
    assert evs[-1]["error"]["type"] == "invalid_request_error" and evs[-1]["error"]["message"]
    assert not any(e["type"] in ("message_delta", "message_stop") for e in evs)
    # Greedy, as above: the fault fires after the second generated token, and a sampled answer may end before it
    # (the default temperature 1 did once: the stream ended with end_turn and nothing was raised).
    with pytest.raises(anthropic.APIStatusError) as e:  # the SDK raises the error event
        with client.messages.stream(model="", max_tokens=50, messages=fail, extra_body={"temperature": 0}) as s:
            for _ in s:
                pass
    assert e.value.body["error"]["type"] == "invalid_request_error"
    r = httpx.post(srv.http_url + "/v1/messages", json={"max_tokens": 50, "temperature": 0, "messages": fail},
                   timeout=60)
    error_of(r, 400, "invalid_request_error")


# ---- a server with an API key and one seat: authentication, 429 and the SDK's retry --------------------------

@pytest.fixture(scope="module")
def seat(long_model: str):  # 4096 positions: a stream long enough to hold the seat
    with ServerProcess(long_model, "--grpc-port", "-1", "--max-num-seqs", "1", "--max-queue", "0",
                       "--api-key", KEY) as s:
        yield s


def hold_seat(srv, out: dict) -> threading.Thread:
    """A long OpenAI stream that holds the server's one seat until `out["stop"]` is set."""
    out["stop"] = threading.Event()

    def run() -> None:
        body = {"prompt": "forever", "max_tokens": 4000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.http_url + "/v1/completions", json=body, timeout=120,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            for _ in r.iter_bytes():
                if out["stop"].is_set():
                    break

    t = threading.Thread(target=run, daemon=True)
    t.start()
    wait_for(lambda: srv.metric("steadyserve_requests_running") == 1, 60, what="the seat taken")
    return t


def test_the_api_key_as_x_api_key_or_bearer(seat) -> None:
    url = seat.http_url + "/v1/messages"
    body = {"max_tokens": 2, "messages": USER}
    for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
        error_of(httpx.post(url, json=body, headers=headers, timeout=60), 401, "authentication_error")
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        assert httpx.post(url, json=body, headers=headers, timeout=60).status_code == 200
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=seat.http_url, api_key="wrong", max_retries=0).messages.create(
            model="", max_tokens=2, messages=USER)
    ok = anthropic.Anthropic(base_url=seat.http_url, api_key=KEY, max_retries=0).messages.create(
        model="", max_tokens=2, messages=USER)
    assert ok.usage.output_tokens == 2


def _answered(m, max_tokens: int) -> bool:  # noqa: ANN001 - an anthropic Message
    """A whole answer: max_tokens tokens, or up to max_tokens when the model ended its turn (an unseeded sample
    can end it; an end-of-turn token sampled last counts among the output tokens)."""
    n = m.usage.output_tokens
    return (m.stop_reason == "max_tokens" and n == max_tokens) or (m.stop_reason == "end_turn" and n <= max_tokens)


def test_a_429_is_honoured_by_the_sdk_retry(seat) -> None:
    before = seat.metric("steadyserve_requests_rejected_total", reason="overloaded")
    held: dict = {}
    t = hold_seat(seat, held)
    r = httpx.post(seat.http_url + "/v1/messages", json={"max_tokens": 2, "messages": USER}, headers={"x-api-key": KEY})
    assert "capacity" in error_of(r, 429, "rate_limit_error") and int(r.headers["retry-after"]) >= 1
    # The SDK retries the 429 after retry-after; the seat frees meanwhile, and its retry succeeds.
    done: dict = {}
    sdk = anthropic.Anthropic(base_url=seat.http_url, api_key=KEY, max_retries=8, timeout=120)
    waiter = threading.Thread(target=lambda: done.setdefault("m", sdk.messages.create(
        model="", max_tokens=2, messages=USER)), daemon=True)
    waiter.start()
    wait_for(lambda: seat.metric("steadyserve_requests_rejected_total", reason="overloaded") >= before + 2, 60,
             what="the SDK's first try refused")
    held["stop"].set()
    t.join(60)
    waiter.join(120)
    # Sampled at the API's default temperature 1: the tiny model may end its turn early; what counts is an answer.
    assert _answered(done["m"], 2)
    # Many at once on one seat and no queue: most tries are refused, every request still succeeds by retrying.
    mid = seat.metric("steadyserve_requests_rejected_total", reason="overloaded")
    results: list = []

    def one(i: int) -> None:
        m = sdk.messages.create(model="", max_tokens=4, messages=[{"role": "user", "content": f"n{i}"}])
        results.append(_answered(m, 4))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(300)
    assert results == [True] * 6
    assert seat.metric("steadyserve_requests_rejected_total", reason="overloaded") > mid


def test_a_drain_answers_529_and_ends_a_stream_with_an_error_event(long_model: str) -> None:
    """Draining: a new request gets 529 overloaded_error with retry-after (the SDK would retry elsewhere); a
    stream the drain timeout cuts ends with Anthropic's `error` event, not a message_stop."""
    # 4000 tokens cannot finish in 0.5 s on any CPU: the prompt's SLOW_REQUEST_MARKER adds 5 ms to each step that
    # computes it, and a step yields at most 8 of its tokens (a token and 7 drafts), so at least 2.5 s. Without the
    # marker, greedy n-gram drafts on the tiny model finished all 4000 inside the drain once (a clean-clone CI run).
    with ServerProcess(long_model, "--grpc-port", "-1", "--drain-timeout", "0.5", threads=1, test_faults=True) as s:
        out: dict = {}

        def stream() -> None:
            body = {"max_tokens": 4000, "temperature": 0, "stream": True,
                    "messages": [{"role": "user", "content": f"forever {SLOW_REQUEST_MARKER}"}]}
            with httpx.stream("POST", s.http_url + "/v1/messages", json=body, timeout=120) as r:
                out["raw"] = r.read()

        t = threading.Thread(target=stream, daemon=True)
        t.start()
        wait_for(lambda: s.metric("steadyserve_requests_running") == 1, 60, what="the stream running")
        s.signal(signal.SIGTERM)
        with httpx.Client(base_url=s.http_url, timeout=10) as c:
            wait_for(lambda: c.get("/readyz").status_code == 503, 2, interval=0.01, what="/readyz 503")
            r = c.post("/v1/messages", json={"max_tokens": 2, "messages": USER})
        assert "draining" in error_of(r, 529, "overloaded_error")
        assert int(r.headers["retry-after"]) >= 1
        assert s.wait(60) == 0
        t.join(30)
    evs = [json.loads(e) for e in sse_events(out["raw"])]
    assert evs[0]["type"] == "message_start" and evs[-1]["type"] == "error", evs[-3:]
    assert evs[-1]["error"]["type"] == "overloaded_error" and not any(e["type"] == "message_stop" for e in evs)
