"""Issue 8, bad input: schemathesis over the server's own OpenAPI spec, hypothesis on request parsing,
raw-bytes gRPC messages, and a huge WebSocket frame. One real server on 127.0.0.1 (the tiny model).

Incremental detokenization is property-tested in tests/test_detokenizer.py; WebSocket non-JSON, binary and
second-request frames in tests/test_websocket.py. Example counts are bounded so the file runs in about a minute.
"""

from __future__ import annotations

import json
import os

import grpc
import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from http_util import five_xx, status_counts
from steadyserve.api.http.embeddings_routes import EmbeddingRequest
from steadyserve.api.http.inputs import validation_refusal
from steadyserve.api.http.messages import MessagesRequest, messages_spec
from steadyserve.api.http.schemas import ChatCompletionRequest, CompletionRequest
from steadyserve.engine.sequence import InvalidRequest
from steadyserve.client import Client
from steadyserve.testing.server import ServerProcess

MAX_EXAMPLES = int(os.environ.get("STEADYSERVE_FUZZ_EXAMPLES", "40"))  # per operation


@pytest.fixture(scope="module")
def fz(tiny_model: str):
    with ServerProcess(tiny_model, "--max-num-seqs", "8", "--max-tokens-cap", "64", "--stall-timeout", "5",
                       threads=1) as s:
        yield s


# ---- schemathesis -----------------------------------------------------------------------------------------

def test_openapi_spec_describes_the_request_bodies(fz):
    spec = httpx.get(fz.http_url + "/openapi.json").json()
    for path, field in (("/v1/completions", "max_tokens"), ("/v1/chat/completions", "max_tokens"),
                        ("/v1/embeddings", "input"), ("/v1/messages", "max_tokens")):
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        name = body["$ref"].rsplit("/", 1)[1]
        assert field in spec["components"]["schemas"][name]["properties"]


def test_schemathesis_every_http_operation_no_5xx(fz):
    schema = schemathesis.openapi.from_url(fz.http_url + "/openapi.json")
    seen: dict[str, dict[int, int]] = {}
    for result in schema.get_all_operations():
        op = result.ok()
        label = f"{op.method.upper()} {op.path}"
        counts = seen.setdefault(label, {})

        @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=op.as_strategy())
        def run(case) -> None:
            if isinstance(case.body, dict) and isinstance(case.body.get("max_tokens"), int):
                case.body["max_tokens"] = min(case.body["max_tokens"], 8)  # bounded work per example
            r = case.call(base_url=fz.http_url, timeout=60)
            counts[r.status_code] = counts.get(r.status_code, 0) + 1
            assert r.status_code < 500, (label, case.body, r.status_code, r.text[:500])
            ctype = r.headers.get("content-type") or [""]
            ctype = ctype[0] if isinstance(ctype, list) else ctype
            if r.status_code >= 400 and ctype.startswith("application/json"):
                if op.path.startswith("/v1/messages"):  # Anthropic's error shape
                    assert r.json()["type"] == "error" and set(r.json()["error"]) == {"type", "message"}
                else:
                    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

        run()
    print(f"\nschemathesis: {sum(sum(c.values()) for c in seen.values())} requests over {len(seen)} operations: "
          f"{seen}")
    assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/embeddings", "POST /v1/messages",
            "GET /v1/models", "GET /healthz", "GET /readyz", "GET /metrics"} <= set(seen)
    assert sum(seen["POST /v1/completions"].values()) >= 10 and sum(seen["POST /v1/embeddings"].values()) >= 10
    assert sum(seen["POST /v1/messages"].values()) >= 10
    assert fz.proc.poll() is None and five_xx(fz) == 0, status_counts(fz)
    assert httpx.get(fz.http_url + "/readyz").status_code == 200


# ---- hypothesis on request parsing (in process) -------------------------------------------------------------

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "logprobs", "top_logprobs", "echo", "best_of",
          "suffix", "frequency_penalty", "presence_penalty", "logit_bias", "repetition_penalty", "min_tokens",
          "ignore_eos", "response_format",
          "tools", "role", "content", "type", "text", "include_usage"]
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=5),
                                                                inner, max_size=5),
    max_leaves=12)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8)


@settings(max_examples=400, deadline=None, database=None)
@given(body=bodies, chat=st.booleans())
def test_request_parsing_refuses_by_name_and_never_crashes(body, chat):
    model = ChatCompletionRequest if chat else CompletionRequest
    fields = set(model.model_fields)
    try:
        req = model.model_validate(body)
        params = req.sampling_params(16)
        params.validate()
    except ValidationError as e:
        # Refused: the HTTP layer answers 400 with this message and param. A top-level key the model does not
        # know (a chat field sent to completions) is refused as unknown_field, every such key named. Else either
        # the param is a field of the request (its first element), or, for a check across fields (no location),
        # the message names one.
        r = validation_refusal(e)
        msg, param = str(r), r.param
        if r.reason == "unknown_field":
            unknown = set(body) - fields
            assert unknown and param in unknown and all(k in msg for k in unknown), (msg, body)
            return
        assert r.reason == "invalid_value" and set(body) <= fields, (r.reason, msg, body)
        if param:
            assert param.split(".")[0] in fields, (param, msg, body)
        else:
            assert any(f in msg for f in fields), (msg, body)
        return
    except InvalidRequest as e:  # refused by a range check: param is the request's field, and the message says it
        assert e.param in fields and e.param in str(e), (e.param, str(e), body)
        return
    assert set(body) <= fields, body  # nothing unknown is accepted
    assert params.max_tokens >= 0 and 0 <= params.temperature <= 2 and 0 < params.top_p <= 1
    assert params.logprobs is None or 0 <= params.logprobs <= 20


EMBED_FIELDS = ["input", "model", "encoding_format", "dimensions", "user", "prompt", "max_tokens"]
embed_bodies = st.dictionaries(st.sampled_from(EMBED_FIELDS), json_values, max_size=5)


@settings(max_examples=300, deadline=None, database=None)
@given(body=embed_bodies)
def test_embedding_body_parsing_refuses_by_name_and_never_crashes(body):
    """/v1/embeddings bodies: refused naming an unknown field or a field of the body, or parsed into inputs
    that are strings or token-id lists."""
    fields = set(EmbeddingRequest.model_fields) | {"user"}
    try:
        req = EmbeddingRequest.model_validate(body)
    except ValidationError as e:
        r = validation_refusal(e)
        if r.reason == "unknown_field":
            assert r.param in set(body) - fields, (r.param, body)
            return
        assert r.reason == "invalid_value" and set(body) <= fields and (r.param or "").split(".")[0] in fields, \
            (r.reason, str(r), body)
        return
    assert set(body) <= fields, body
    for item in req.inputs():
        assert isinstance(item, str) or all(isinstance(t, int) for t in item), body
    assert req.encoding_format in ("float", "base64")
# The Messages API's body: its fields, content blocks and tool shapes, nested at random.
M_FIELDS = ["model", "messages", "max_tokens", "system", "stop_sequences", "temperature", "top_p", "top_k",
            "metadata", "stream", "tools", "tool_choice", "thinking", "service_tier", "user_id"]
M_KEYS = ["role", "content", "type", "text", "id", "name", "input", "tool_use_id", "is_error", "input_schema",
          "disable_parallel_tool_use", "cache_control"]
M_STRINGS = ["user", "assistant", "system", "text", "tool_use", "tool_result", "image", "thinking", "auto", "any",
             "tool", "none", "custom", "web_search_20250305", "disabled", "f", "object"]
m_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**40, max_value=2**40) | st.floats(allow_nan=True)
    | st.sampled_from(M_STRINGS) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(M_KEYS), inner, max_size=5),
    max_leaves=14)
m_blocks = st.fixed_dictionaries({"type": st.sampled_from(M_STRINGS)}, optional={
    "text": st.text(max_size=8) | m_values, "id": st.sampled_from(["t1", "t2"]) | m_values,
    "tool_use_id": st.sampled_from(["t1", "t2"]) | m_values, "name": st.sampled_from(["f", "g"]) | m_values,
    "input": st.just({"x": 1}) | m_values, "content": st.text(max_size=8) | m_values, "is_error": m_values})
m_messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant"]) | m_values,
                                             "content": st.text(max_size=8) | st.lists(m_blocks, max_size=3)}),
                      max_size=4)
m_tools = st.lists(st.fixed_dictionaries({"name": st.sampled_from(["f", "g"]) | m_values}, optional={
    "type": st.sampled_from(["custom", "web_search_20250305"]), "input_schema": st.just({"type": "object"}) | m_values,
    "description": m_values}), max_size=3)
m_bodies = st.fixed_dictionaries({"messages": m_messages | m_values, "max_tokens": st.integers(-1, 8) | m_values},
                                 optional={"tools": m_tools, "tool_choice": st.dictionaries(
                                     st.sampled_from(["type", "name", "disable_parallel_tool_use"]),
                                     st.sampled_from(M_STRINGS) | m_values, max_size=3)}) \
    .flatmap(lambda b: st.dictionaries(st.sampled_from(M_FIELDS), m_values, max_size=4).map(lambda x: {**x, **b}))


@settings(max_examples=400, deadline=None, database=None)
@given(body=m_bodies)
# Found by this test (a TypeError, so a 500): a tool_choice type or name that is a list is not hashable.
@example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1, "tool_choice": {"type": []}})
@example(body={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
               "tool_choice": {"type": "tool", "name": ["x"]}})
def test_messages_parsing_refuses_by_name_and_never_crashes(body):
    """The Messages body to its chat RequestSpec: refused with a field named, or a spec, never another error."""
    fields = set(MessagesRequest.model_fields)
    try:
        spec = messages_spec(body, MessagesRequest.model_validate(body), "")
        spec.params.validate()
    except ValidationError as e:
        r = validation_refusal(e)
        if r.reason == "unknown_field":
            assert r.param in set(body) - fields - {"thinking", "service_tier"}, (str(r), body)
        else:
            assert r.param is None or r.param.split(".")[0] in fields, (r.param, str(r), body)
        return
    except InvalidRequest as e:
        root = e.param.split(".")[0].split("[")[0]
        assert root in fields | {"thinking"} and str(e).startswith(root), (e.param, str(e), body)
        return
    assert set(body) <= fields | {"thinking", "service_tier"}, body
    assert spec.messages and all(m["role"] in ("system", "user", "assistant", "tool") for m in spec.messages)


# ---- gRPC: raw bytes --------------------------------------------------------------------------------------

def _raw(ch: grpc.Channel, method: str):
    return ch.unary_unary(method, request_serializer=None, response_deserializer=None)


RAW_SCORE = [
    ("garbage", b"\xff\xff\xff\xff\x0f", "bad"),
    ("truncated-length", b"\x0a\x10abc", "bad"),  # field 1, length 16, 3 bytes follow
    ("wrong-wire-type", b"\x08\x96\x01", "any"),  # field 1 as a varint instead of a string
    ("group-tags", b"\x0b\x0c", "any"),
    ("unknown-field-only", b"\xa0\x1f\x01", "invalid"),  # field 500; no input given
    ("huge-tag", b"\xf8\xff\xff\xff\x0f\x01", "any"),
    ("invalid-utf8-string", b"\x0a\x02\xc3\x28", "bad"),
    ("empty", b"", "invalid"),
]
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OK}  # never UNKNOWN / INTERNAL


def test_grpc_raw_bytes_get_clean_status_codes(fz):
    seen = {}
    with grpc.insecure_channel(fz.grpc_addr) as ch:
        score = _raw(ch, "/steadyserve.v1.Inference/Score")
        for name, payload, _ in RAW_SCORE:
            try:
                score(payload, timeout=10)
                seen[name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                seen[name] = e.code()
        # A valid request with an unknown field appended: unknown fields are ignored.
        from steadyserve.client import pb
        ok = pb.ScoreRequest(text="hello").SerializeToString() + b"\xa0\x1f\x01"
        assert pb.ScoreResponse.FromString(score(ok, timeout=10)).usage.prompt_tokens > 0
        # Over-size message: refused by gRPC before we parse it.
        with pytest.raises(grpc.RpcError) as e:
            score(b"\x0a" + b"\x80\x80\x80\x01" + b"x" * (2 * 1024 * 1024), timeout=10)
        seen["over-size"] = e.value.code()
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        # Unknown method: UNIMPLEMENTED.
        with pytest.raises(grpc.RpcError) as e:
            _raw(ch, "/steadyserve.v1.Inference/Nope")(b"", timeout=10)
        assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
        gen = ch.unary_stream("/steadyserve.v1.Inference/Generate", request_serializer=None,
                              response_deserializer=None)
        for name, payload, _ in RAW_SCORE:
            try:
                list(gen(payload, timeout=10))
                seen["gen-" + name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                seen["gen-" + name] = e.code()
        embed = _raw(ch, "/steadyserve.v1.Inference/Embed")
        for name, payload, _ in RAW_SCORE:
            try:
                embed(payload, timeout=10)
                seen["embed-" + name] = grpc.StatusCode.OK
            except grpc.RpcError as e:
                seen["embed-" + name] = e.code()
    print(f"\ngRPC raw bytes: { {k: v.name for k, v in seen.items()} }")
    for name, _, kind in RAW_SCORE:
        for key in (name, "gen-" + name, "embed-" + name):
            assert seen[key] in CLEAN, (key, seen[key])
            if kind == "bad":
                assert seen[key] != grpc.StatusCode.OK, key
            if kind == "invalid":
                assert seen[key] == grpc.StatusCode.INVALID_ARGUMENT, key
    with Client(fz.grpc_addr, timeout=30, retries=False) as c:  # unaffected
        assert c.score("still serving").usage.prompt_tokens > 0 and c.health() == "SERVING"
    assert fz.metric("steadyserve_engine_alive") == 1
    bad = [k for k, v in fz.metrics().items() if k[0] == "grpc_server_handled_total" and v
           and dict(k[1])["grpc_code"] in ("UNKNOWN", "INTERNAL")]
    assert not bad, bad


# ---- WebSocket: huge frame --------------------------------------------------------------------------------

def test_ws_huge_frame_is_closed_1009_and_nothing_else_breaks(fz):
    url = f"ws://127.0.0.1:{fz.http_port}/v1/stream"
    huge = json.dumps({"prompt": "x" * (2 * 1024 * 1024), "max_tokens": 1})  # > --max-request-bytes (1 MiB)
    with connect(url, open_timeout=30, max_size=None) as ws:
        try:
            ws.send(huge)
            ws.recv(timeout=30)
        except ConnectionClosed:
            pass
        code = ws.close_code
    print(f"\nWS 2 MiB frame: close code {code}")
    assert code == 1009  # message too big
    with connect(url, open_timeout=30) as ws:
        ws.send(json.dumps({"prompt": "after", "max_tokens": 2}))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("final", "error"):
            msgs.append(json.loads(ws.recv(timeout=30)))
        assert msgs[-1]["type"] == "final"
