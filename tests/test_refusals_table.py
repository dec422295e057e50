"""One table of bad requests, each sent over HTTP, WebSocket and gRPC to one real server: every transport refuses it
with the same reason and the same message (apart from the field's name: `temperature` over HTTP is
`params.temperature` in the proto), each with its own status (HTTP 400/404, WebSocket 1008, gRPC
INVALID_ARGUMENT). The refusals are built in one place (steadyserve.api.requests, steadyserve.limits); this
table is what keeps the transports from drifting apart again."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from steadyserve.api.grpc import ERROR_CODE_KEY, ERROR_FIELD_KEY
from steadyserve.client import Client, embed_request, generate_request, pb
from steadyserve.testing.server import ServerProcess

MAX_TOKENS_CAP = 64
CHAT = [{"role": "user", "content": "hi"}]


@dataclass
class Row:
    """One bad request: its HTTP body (also the WebSocket frame), its gRPC message, and the refusal expected."""

    name: str  # the test id
    body: dict[str, Any]  # /v1/completions body, or /v1/chat/completions when it has messages
    grpc_request: Any  # pb.GenerateRequest or pb.ScoreRequest
    reason: str  # the error code on every transport (HTTP `code`, WS `code`, gRPC steadyserve-error-code)
    param: str  # HTTP's and the WebSocket's `param`
    grpc_field: str  # the proto's name for it (steadyserve-error-field)
    http_status: int = 400
    headers: dict[str, str] = field(default_factory=dict)  # HTTP and WebSocket headers


def token_ids(n: int) -> list[int]:
    """n valid token ids of the tiny model (its vocabulary is smaller than its context)."""
    return [5 + i % 200 for i in range(n)]


BOGUS_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}
GOOD_TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def with_tools(msg: Any, tools: list[dict[str, Any]], function: str | None = None) -> Any:
    """A gRPC Generate request with the HTTP body's tools (and a named tool_choice)."""
    for t in tools:
        msg.tools.add(name=t["function"]["name"], parameters_json=json.dumps(t["function"]["parameters"]))
    if function is not None:
        msg.tool_choice.function = function
    return msg


def rows(vocab_size: int, context: int, filling_chat: list[dict[str, str]]) -> list[Row]:
    long_ids = token_ids(context + 10)
    near_full = token_ids(context - 10)  # room for 10 tokens, not MAX_TOKENS_CAP
    return [
        Row("temperature-3", {"prompt": "hi", "temperature": 3}, generate_request("hi", temperature=3.0),
            "invalid_value", "temperature", "params.temperature"),
        Row("top-p-1.5", {"prompt": "hi", "top_p": 1.5}, generate_request("hi", top_p=1.5),
            "invalid_value", "top_p", "params.top_p"),
        Row("5-stop-strings", {"prompt": "hi", "stop": list("abcde")}, generate_request("hi", stop=list("abcde")),
            "invalid_value", "stop", "params.stop"),
        Row("max-tokens-over-cap", {"prompt": "hi", "max_tokens": MAX_TOKENS_CAP + 1},
            generate_request("hi", max_tokens=MAX_TOKENS_CAP + 1), "invalid_value", "max_tokens", "params.max_tokens"),
        Row("chat-max-tokens-0", {"messages": CHAT, "max_tokens": 0}, generate_request(messages=CHAT, max_tokens=0),
            "invalid_value", "max_tokens", "params.max_tokens"),
        Row("logprobs-21", {"prompt": "hi", "logprobs": 21}, generate_request("hi", logprobs=21),
            "invalid_value", "logprobs", "params.logprobs"),
        Row("request-id-200-chars", {"prompt": "hi"}, generate_request("hi", request_id="x" * 200),
            "invalid_value", "request_id", "request_id", headers={"x-request-id": "x" * 200}),
        Row("wrong-model", {"prompt": "hi", "model": "gpt-4"}, generate_request("hi", model="gpt-4"),
            "model_not_found", "model", "model", http_status=404),
        Row("empty-prompt", {"prompt": ""}, generate_request(""), "invalid_value", "prompt", "text"),
        Row("empty-messages", {"messages": []}, generate_request(messages=[]), "invalid_value", "messages",
            "chat.messages"),
        Row("chat-role-robot", {"messages": [{"role": "robot", "content": "hi"}]},
            generate_request(messages=[{"role": "robot", "content": "hi"}]), "invalid_value", "messages[0].role",
            "chat.messages[0].role"),
        Row("prompt-token-out-of-vocab", {"prompt": [1, vocab_size]}, generate_request(token_ids=[1, vocab_size]),
            "invalid_value", "prompt[1]", "tokens.ids[1]"),
        Row("prompt-over-context", {"prompt": long_ids}, generate_request(token_ids=long_ids), "too_long", "prompt",
            "tokens.ids"),
        # A prompt that fills the whole context leaves no room for even one token.
        Row("chat-prompt-fills-the-context", {"messages": filling_chat}, generate_request(messages=filling_chat),
            "too_long", "messages", "chat.messages"),
        Row("prompt-plus-max-tokens-over-context", {"prompt": near_full, "max_tokens": MAX_TOKENS_CAP},
            generate_request(token_ids=near_full, max_tokens=MAX_TOKENS_CAP), "too_long", "max_tokens",
            "params.max_tokens"),
        Row("tool-schema-bogus", {"messages": CHAT, "tools": [BOGUS_TOOL]},
            with_tools(generate_request(messages=CHAT), [BOGUS_TOOL]), "invalid_value",
            "tools[0].function.parameters", "tools[0].parameters_json"),
        Row("tool-choice-unknown-function", {"messages": CHAT, "tools": [GOOD_TOOL], "tool_choice": {
            "type": "function", "function": {"name": "nope"}}},
            with_tools(generate_request(messages=CHAT), [GOOD_TOOL], "nope"), "invalid_value", "tool_choice",
            "tool_choice.function"),
        Row("tool-message-without-call-id", {"messages": [*CHAT, {"role": "tool", "content": "sunny"}]},
            generate_request(messages=[*CHAT, {"role": "tool", "content": "sunny"}]), "invalid_value",
            "messages[1].tool_call_id", "chat.messages[1].tool_call_id"),
        Row("stop-token-id-out-of-vocab", {"prompt": "hi", "stop_token_ids": [vocab_size]},
            generate_request("hi", stop_token_ids=[vocab_size]), "invalid_value", "stop_token_ids", "params.stop_token_ids"),
    ]


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    with ServerProcess(tiny_model, "--max-tokens-cap", str(MAX_TOKENS_CAP)) as s:
        yield s


@pytest.fixture(scope="module")
def grpc_client(srv):
    with Client(srv.grpc_addr, timeout=30, retries=False) as c:
        yield c


def filling_chat(srv, context: int) -> list[dict[str, str]]:
    """Chat messages that render to exactly `context` tokens (found with /tokenize, as the server renders them)."""
    def count(content: str) -> int:
        r = httpx.post(srv.http_url + "/tokenize", json={"messages": [{"role": "user", "content": content}]})
        return r.json()["count"]

    for unit in ("a ", "ab ", "a", "b c "):
        base, per = count(""), count(unit * 8) - count("")
        k = max(1, (context - base) * 8 // max(per, 1))
        for _ in range(200):  # walk to the exact length
            n = count(unit * k)
            if n == context:
                return [{"role": "user", "content": unit * k}]
            k += 1 if n < context else -1
            if k < 1:
                break
    raise AssertionError("no chat content renders to exactly the context length")


@pytest.fixture(scope="module")
def table(srv, grpc_client) -> list[Row]:
    info = grpc_client.model_info()
    return rows(info.vocab_size, info.context_length, filling_chat(srv, info.context_length))


ROW_NAMES = [r.name for r in rows(1000, 16, CHAT)]


def _row(table: list[Row], name: str) -> Row:
    return next(r for r in table if r.name == name)


def http_refusal(srv, row: Row) -> tuple[int, dict]:
    path = "/v1/chat/completions" if "messages" in row.body else "/v1/completions"
    r = httpx.post(srv.http_url + path, json=row.body, headers=row.headers, timeout=60)
    return r.status_code, r.json()["error"]


def ws_refusal(srv, row: Row) -> tuple[int | None, dict]:
    msgs = []
    with connect(f"ws://127.0.0.1:{srv.http_port}/v1/stream", additional_headers=row.headers,
                 open_timeout=30) as ws:
        ws.send(json.dumps(row.body))
        try:
            while True:
                msgs.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed:
            pass
        assert len(msgs) == 1 and msgs[0]["type"] == "error", msgs
        return ws.close_code, msgs[0]


def grpc_refusal(client: Client, row: Row) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        if isinstance(row.grpc_request, pb.ScoreRequest):
            client.stub.Score(row.grpc_request, timeout=30)
        else:
            list(client.stub.Generate(row.grpc_request, timeout=30))
    return e.value


def grpc_details(http_message: str, param: str, grpc_field: str) -> str:
    """The gRPC status message that says what `http_message` says: the field named as the proto names it, where
    the HTTP message names it first, else as a `field: ` prefix (the rule of Refused.message_for)."""
    if http_message.startswith(param):
        return grpc_field + http_message[len(param):]
    return f"{grpc_field}: {http_message}"


@pytest.mark.parametrize("name", ROW_NAMES)
def test_every_transport_refuses_alike(srv, grpc_client, table, name):
    row = _row(table, name)
    status, err = http_refusal(srv, row)
    assert status == row.http_status, err
    assert (err["code"], err["param"]) == (row.reason, row.param), err

    close_code, ws_msg = ws_refusal(srv, row)
    assert close_code == 1008 and ws_msg["status"] == row.http_status, ws_msg
    assert ws_msg["error"] == err  # message, type, param and code: the HTTP body's, word for word

    e = grpc_refusal(grpc_client, row)
    trailers = dict(e.trailing_metadata())
    assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert (trailers[ERROR_CODE_KEY], trailers[ERROR_FIELD_KEY]) == (row.reason, row.grpc_field), trailers
    assert e.details() == grpc_details(err["message"], row.param, row.grpc_field), (e.details(), err)


def test_a_score_may_fill_the_context(srv, grpc_client):
    """Scoring generates nothing: a prompt of exactly the context length is accepted on both transports, one
    token more is refused on both with the same reason."""
    context = grpc_client.model_info().context_length
    ids = token_ids(context)
    assert len(grpc_client.score(token_ids=ids).tokens) == context
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = httpx.post(srv.http_url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == context, r.text
    r = httpx.post(srv.http_url + "/v1/completions", json={**body, "prompt": ids + [5]}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["code"] == "too_long"
    e = grpc_refusal(grpc_client, Row("", {}, pb.ScoreRequest(tokens=pb.TokenIds(ids=ids + [5])), "", "", ""))
    assert dict(e.trailing_metadata())[ERROR_CODE_KEY] == "too_long"
    assert e.details() == grpc_details(r.json()["error"]["message"], "prompt", "tokens.ids")


def test_refusals_are_counted_and_disturb_nothing(srv, grpc_client):
    """Each refusal is counted under its reason. The refusals are made here (pytest-randomly may run this test
    before the table's), one of each reason the engine-side checks give."""
    info = grpc_client.model_info()
    before = {r: srv.metric("steadyserve_requests_rejected_total", reason=r) for r in ("invalid", "too_long")}
    for body in ({"prompt": "hi", "max_tokens": 2, "stop_token_ids": [info.vocab_size]},
                 {"prompt": token_ids(info.context_length + 10), "max_tokens": 2}):
        assert httpx.post(srv.http_url + "/v1/completions", json=body, timeout=60).status_code == 400
    for reason, n in before.items():
        assert srv.metric("steadyserve_requests_rejected_total", reason=reason) == n + 1, reason
    assert grpc_client.score("still fine").usage.prompt_tokens > 0
    r = httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


# ---- /v1/embeddings and gRPC Embed: the same table, two transports (embeddings have no WebSocket form) --------

@dataclass
class EmbedRow:
    """One bad embedding request: its /v1/embeddings body, its pb.EmbedRequest, and the refusal expected."""

    name: str  # the test id
    body: dict[str, Any]  # /v1/embeddings body
    grpc_request: Any  # pb.EmbedRequest
    reason: str  # the error code on both transports
    param: str  # HTTP's `param`
    grpc_field: str  # the proto's name for it (steadyserve-error-field)
    http_status: int = 400
    headers: dict[str, str] = field(default_factory=dict)


def embed_rows(vocab_size: int, context: int, width: int) -> list[EmbedRow]:
    long_ids = token_ids(context + 1)  # one token over: an embedding may fill the context, not more
    return [
        EmbedRow("empty-input-list", {"input": []}, embed_request([]), "invalid_value", "input", "inputs"),
        EmbedRow("empty-string", {"input": ""}, embed_request([""]), "invalid_value", "input", "inputs[0].text"),
        EmbedRow("second-input-empty", {"input": ["a", ""]}, embed_request(["a", ""]), "invalid_value", "input[1]",
                 "inputs[1].text"),
        EmbedRow("token-out-of-vocab", {"input": [1, vocab_size]}, embed_request([[1, vocab_size]]), "invalid_value",
                 "input[1]", "inputs[0].tokens.ids[1]"),
        EmbedRow("batch-token-out-of-vocab", {"input": [[1], [2, vocab_size]]}, embed_request([[1], [2, vocab_size]]),
                 "invalid_value", "input[1][1]", "inputs[1].tokens.ids[1]"),
        EmbedRow("input-over-context", {"input": long_ids}, embed_request([long_ids]), "too_long", "input",
                 "inputs[0].tokens.ids"),
        EmbedRow("dimensions-over-width", {"input": "hi", "dimensions": width + 1},
                 embed_request(["hi"], dimensions=width + 1), "invalid_value", "dimensions", "dimensions"),
        EmbedRow("wrong-model", {"input": "hi", "model": "text-embedding-3-small"},
                 embed_request(["hi"], model="text-embedding-3-small"), "model_not_found", "model", "model",
                 http_status=404),
        EmbedRow("request-id-200-chars", {"input": "hi"}, embed_request(["hi"], request_id="x" * 200),
                 "invalid_value", "request_id", "request_id", headers={"x-request-id": "x" * 200}),
    ]


EMBED_ROW_NAMES = [r.name for r in embed_rows(1000, 16, 8)]


@pytest.fixture(scope="module")
def embed_table(srv, grpc_client) -> list[EmbedRow]:
    info = grpc_client.model_info()
    width = len(grpc_client.embed(["width"]).embeddings[0].values)
    return embed_rows(info.vocab_size, info.context_length, width)


@pytest.mark.parametrize("name", EMBED_ROW_NAMES)
def test_embeddings_refused_alike_over_http_and_grpc(srv, grpc_client, embed_table, name):
    row = next(r for r in embed_table if r.name == name)
    r = httpx.post(srv.http_url + "/v1/embeddings", json=row.body, headers=row.headers, timeout=60)
    err = r.json()["error"]
    assert r.status_code == row.http_status, err
    assert (err["code"], err["param"]) == (row.reason, row.param), err
    with pytest.raises(grpc.RpcError) as e:
        grpc_client.stub.Embed(row.grpc_request, timeout=30)
    trailers = dict(e.value.trailing_metadata())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.value.code(), e.value.details())
    assert (trailers[ERROR_CODE_KEY], trailers[ERROR_FIELD_KEY]) == (row.reason, row.grpc_field), trailers
    assert e.value.details() == grpc_details(err["message"], row.param, row.grpc_field), (e.value.details(), err)


def test_an_embedding_may_fill_the_context(srv, grpc_client):
    """An embedding generates nothing: an input of exactly the context length is embedded on both transports."""
    context = grpc_client.model_info().context_length
    ids = token_ids(context)
    assert grpc_client.embed([ids]).usage.prompt_tokens == context
    r = httpx.post(srv.http_url + "/v1/embeddings", json={"input": ids}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == context, r.text
# ---- /v1/messages (Anthropic's shape): the same refusal, the same words, its own status and error type --------

# Rows whose request the Messages API can state, and the name it gives the field (None: the same name).
MESSAGES_ROWS = {"temperature-3": None, "top-p-1.5": None, "5-stop-strings": "stop_sequences",
                 "max-tokens-over-cap": None, "chat-max-tokens-0": None, "request-id-200-chars": None,
                 "wrong-model": None, "empty-messages": None, "chat-prompt-fills-the-context": None,
                 "tool-schema-bogus": "tools[0].input_schema", "tool-choice-unknown-function": "tool_choice.name"}
ANTHROPIC_TYPE = {400: "invalid_request_error", 404: "not_found_error"}


def as_messages_body(body: dict[str, Any]) -> dict[str, Any]:
    """A completion or chat row's body as a /v1/messages body."""
    out: dict[str, Any] = {"max_tokens": 8, "messages": body.get("messages", CHAT)}
    for key in ("temperature", "top_p", "max_tokens", "model"):
        if key in body:
            out[key] = body[key]
    if "stop" in body:
        out["stop_sequences"] = body["stop"]
    if "tools" in body:
        out["tools"] = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
                        for t in body["tools"]]
    if "tool_choice" in body:
        out["tool_choice"] = {"type": "tool", "name": body["tool_choice"]["function"]["name"]}
    return out


@pytest.mark.parametrize("name", sorted(MESSAGES_ROWS))
def test_the_messages_api_refuses_alike_in_its_own_shape(srv, table, name):
    row = _row(table, name)
    status, err = http_refusal(srv, row)
    r = httpx.post(srv.http_url + "/v1/messages", json=as_messages_body(row.body), headers=row.headers, timeout=60)
    assert r.status_code == row.http_status, r.text
    field = MESSAGES_ROWS[name] or row.param
    message = grpc_details(err["message"], row.param, field) if field != row.param else err["message"]
    assert r.json() == {"type": "error", "error": {"type": ANTHROPIC_TYPE[status], "message": message}}
