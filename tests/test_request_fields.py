"""Every field of the completion, chat, responses and embeddings request schemas, one row each: set to a non-default value, it must
change what it promises to change (or, for what is not supported, be refused with a 400 that names it).
Nothing is accepted and ignored. A field added to a schema without a row here fails the first test.

A top-level field no schema has is refused by name, as OpenAI refuses it (code unknown_field), on every
endpoint and the WebSocket; the only fields accepted without effect are OpenAI's that cannot change the result
(schemas.IGNORED_FIELDS), and the tests at the end show that they change nothing.
"""

from __future__ import annotations

import base64
import json
import math
import struct
from typing import Callable

import httpx
import openai
import pytest
from websockets.sync.client import connect

from http_util import parse_stream, sse_events
from steadyserve.api.http.embeddings_routes import EmbeddingRequest
from steadyserve.api.http.messages import MessagesRequest
from steadyserve.api.http.responses import ResponsesRequest
from steadyserve.api.http.schemas import IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest
from steadyserve.testing.server import ServerProcess

C, CH, R, E, M = "/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings", "/v1/messages"
BASE = {C: {"prompt": "The fox and the dog", "max_tokens": 6, "temperature": 0},
        CH: {"messages": [{"role": "user", "content": "Name a fox."}], "max_tokens": 6, "temperature": 0},
        R: {"input": "Name a fox.", "max_output_tokens": 6, "temperature": 0},
        E: {"input": "The fox and the dog"},
        M: {"messages": [{"role": "user", "content": "Name a fox."}], "max_tokens": 6, "temperature": 0}}
# Small tools: the generic format's prompt must fit the tiny model's 512-token context with a call after it.
ARG = {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": ARG}},
         {"type": "function", "function": {"name": "g", "parameters": ARG}}]
FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's shape


@pytest.fixture(scope="module")
def srv(long_model: str):  # the tiny model with 4096 positions: room for the tools' prompt and a call
    with ServerProcess(long_model, "--grpc-port", "-1", "--served-model-name", "tiny") as s:
        yield s


@pytest.fixture(scope="module")
def http(srv) -> httpx.Client:
    with httpx.Client(base_url=srv.http_url, timeout=60) as c:
        yield c


def post(http: httpx.Client, path: str, **fields) -> dict:
    r = http.post(path, json={**BASE[path], **fields})
    assert r.status_code == 200, r.text
    return r.json()


def refused(http: httpx.Client, path: str, name: str, value) -> None:
    r = http.post(path, json={**BASE[path], name: value})
    assert r.status_code == 400 and (r.json()["error"]["param"] == name or name in r.json()["error"]["message"]), r.text


def text(body: dict) -> str:
    ch = body["choices"][0]
    return ch["text"] if "text" in ch else ch["message"]["content"]


def token_id(http: httpx.Client, s: str) -> int:
    ids = http.post("/tokenize", json={"prompt": s, "add_special_tokens": False}).json()["tokens"]
    assert len(ids) == 1, ids
    return ids[0]


def eos_id(http: httpx.Client) -> int:
    return token_id(http, "<|im_end|>")  # the tiny test model's end-of-sequence token


# ---- one check per field, shared by both endpoints where the field means the same --------------------------------

def check_model(http, path):
    assert post(http, path, model="tiny")["model"] == "tiny"
    assert http.post(path, json={**BASE[path], "model": "other"}).status_code == 404


def check_max_tokens(http, path):
    assert post(http, path, max_tokens=2, ignore_eos=True)["usage"]["completion_tokens"] == 2


def check_temperature(http, path):
    greedy = text(post(http, path))
    assert any(text(post(http, path, temperature=2.0, seed=s)) != greedy for s in range(4))


def check_top_p(http, path):  # a tiny nucleus keeps only the likeliest token: sampling becomes greedy
    assert text(post(http, path, temperature=2.0, seed=1, top_p=1e-6)) == text(post(http, path))


def check_top_k(http, path):
    assert text(post(http, path, temperature=2.0, seed=1, top_k=1)) == text(post(http, path))


def check_seed(http, path):
    a, b = (text(post(http, path, temperature=1.5, seed=7)) for _ in range(2))
    assert a == b and any(text(post(http, path, temperature=1.5, seed=s)) != a for s in (8, 9, 10))


def check_stop(http, path):
    full = text(post(http, path, ignore_eos=True))
    stop = full[2:4]
    cut = post(http, path, ignore_eos=True, stop=[stop])
    assert text(cut) == full[:full.index(stop)] and cut["choices"][0]["finish_reason"] == "stop"


def check_stop_token_ids(http, path):  # as gRPC's stop_token_ids: the first generated token's id stops it at once
    with connect(str(http.base_url).replace("http://", "ws://").rstrip("/") + "/v1/stream", open_timeout=30) as ws:
        ws.send(json.dumps({**BASE[path], "ignore_eos": True}))
        first = json.loads(ws.recv(timeout=60))["token_ids"][0]  # the same greedy request's first token
    cut = post(http, path, ignore_eos=True, stop_token_ids=[first])
    assert cut["usage"]["completion_tokens"] == 1 and cut["choices"][0]["finish_reason"] == "stop"


def check_stream(http, path):
    with http.stream("POST", path, json={**BASE[path], "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        chunks, done = parse_stream(r.read())
    assert done and chunks


def check_stream_options(http, path):
    with http.stream("POST", path, json={**BASE[path], "stream": True, "stream_options": {"include_usage": True}}) as r:
        chunks, _ = parse_stream(r.read())
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] > 0


def check_n(http, path):
    assert len(post(http, path, n=3, temperature=1.0, seed=1)["choices"]) == 3


def check_ignore_eos(http, path):
    bias = {str(eos_id(http)): 100}
    assert post(http, path, logit_bias=bias)["usage"]["completion_tokens"] <= 1  # EOS forced: stops at once
    assert post(http, path, logit_bias=bias, ignore_eos=True)["usage"]["completion_tokens"] == 6


def check_frequency_penalty(http, path):
    assert text(post(http, path, frequency_penalty=2.0)) != text(post(http, path))


def check_presence_penalty(http, path):
    assert text(post(http, path, presence_penalty=2.0)) != text(post(http, path))


def check_logit_bias(http, path):
    forced = 42  # a token id of the tiny model, not the one greedy decoding picks first
    assert not text(post(http, path)).startswith(http.post("/detokenize", json={"tokens": [forced]}).json()["prompt"])
    body = post(http, path, logit_bias={str(forced): 100}, max_tokens=3, ignore_eos=True)
    assert text(body) == http.post("/detokenize", json={"tokens": [forced] * 3}).json()["prompt"]


def check_repetition_penalty(http, path):
    assert text(post(http, path, repetition_penalty=5.0)) != text(post(http, path))


def check_min_tokens(http, path):
    bias = {str(eos_id(http)): 100}
    assert post(http, path, logit_bias=bias, min_tokens=4)["usage"]["completion_tokens"] >= 4


def check_skip_special_tokens(http, path):
    special = {"logit_bias": {"1": 100}, "max_tokens": 3, "ignore_eos": True}  # <|im_start|>: special, not the EOS
    assert text(post(http, path, **special)) == ""
    assert text(post(http, path, skip_special_tokens=False, **special)) == "<|im_start|>" * 3
    refused(http, path, "skip_special_tokens", "yes")


def check_response_format(http, path):
    import json

    fmt = {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "required": ["a"],
                                                                          "properties": {"a": {"type": "boolean"}},
                                                                          "additionalProperties": False}}}
    assert json.loads(text(post(http, path, response_format=fmt, max_tokens=20)))["a"] in (True, False)


def check_prompt(http, path):
    assert text(post(http, path, prompt="Something else")) != text(post(http, path)) or \
        post(http, path, prompt="Something else")["usage"]["prompt_tokens"] != post(http, path)["usage"]["prompt_tokens"]


def check_echo(http, path):
    assert text(post(http, path, echo=True)) == BASE[C]["prompt"] + text(post(http, path))


def check_completion_logprobs(http, path):
    lp = post(http, path, logprobs=2)["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 6 and all(len(t) == 2 for t in lp["top_logprobs"])


def check_best_of(http, path):
    body = post(http, path, best_of=3, temperature=1.0, seed=2)
    assert len(body["choices"]) == 1 and body["usage"]["completion_tokens"] > post(
        http, path, temperature=1.0, seed=2)["usage"]["completion_tokens"]


def check_suffix(http, path):
    refused(http, path, "suffix", "tail")


def check_messages(http, path):
    other = post(http, path, messages=[{"role": "user", "content": "Something else entirely."}])
    assert other["usage"]["prompt_tokens"] != post(http, path)["usage"]["prompt_tokens"]


def check_chat_logprobs(http, path):
    content = post(http, path, logprobs=True)["choices"][0]["logprobs"]["content"]
    assert len(content) == 6 and all("logprob" in c for c in content)


def check_top_logprobs(http, path):
    content = post(http, path, logprobs=True, top_logprobs=3)["choices"][0]["logprobs"]["content"]
    assert all(len(c["top_logprobs"]) == 3 for c in content)


def check_max_completion_tokens(http, path):
    assert post(http, path, max_completion_tokens=2, max_tokens=5, ignore_eos=True)["usage"]["completion_tokens"] == 2


def calls(body: dict) -> list[tuple[str, str]]:
    """(name, arguments) of a chat message's or a response's calls."""
    if "choices" in body:
        return [(c["function"]["name"], c["function"]["arguments"])
                for c in body["choices"][0]["message"].get("tool_calls") or []]
    return [(o["name"], o["arguments"]) for o in body["output"] if o["type"] == "function_call"]


def tools_of(path: str) -> list[dict]:
    return FLAT_TOOLS if path == R else TOOLS


def max_of(path: str, n: int) -> dict:
    return {"max_output_tokens" if path == R else "max_tokens": n}


def check_tools(http, path):
    body = post(http, path, tools=tools_of(path), tool_choice="required", **max_of(path, 120))
    assert calls(body) and all(json.loads(a)["x"] in (True, False) for _, a in calls(body))
    assert not calls(post(http, path))
    refused(http, path, "tools", [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
            if path == CH else [{"type": "function", "name": "f", "parameters": {"type": "bogus"}}])


def check_tool_choice(http, path):
    t = tools_of(path)
    named = {"type": "function", "function": {"name": "g"}} if path == CH else {"type": "function", "name": "g"}
    assert {n for n, _ in calls(post(http, path, tools=t, tool_choice=named, **max_of(path, 120)))} == {"g"}
    none = post(http, path, tools=t, tool_choice="none")
    usage = none["usage"]
    assert not calls(none) and (usage.get("prompt_tokens") or usage.get("input_tokens")) < (
        post(http, path, tools=t)["usage"].get("prompt_tokens") or post(http, path, tools=t)["usage"]["input_tokens"])
    refused(http, path, "tool_choice", "sometimes")


def check_parallel_tool_calls(http, path):
    t = tools_of(path)
    one = post(http, path, tools=t, tool_choice="required", parallel_tool_calls=False, **max_of(path, 120))
    assert len(calls(one)) == 1
    if path == CH:  # forcing "," after a call: a second call where parallel calls are allowed, else none
        comma = {str(token_id(http, ",")): 100}
        assert len(calls(post(http, path, tools=t, tool_choice="required", logit_bias=comma, max_tokens=200))) >= 2
        assert len(calls(post(http, path, tools=t, tool_choice="required", logit_bias=comma, max_tokens=200,
                              parallel_tool_calls=False))) == 1
    else:
        assert one["parallel_tool_calls"] is False


# ---- the Responses API's own fields ------------------------------------------------------------------------------

def output_text(body: dict) -> str:
    return "".join(p["text"] for o in body["output"] if o["type"] == "message" for p in o["content"])


def check_r_model(http, path):
    assert post(http, path, model="tiny")["model"] == "tiny"
    assert http.post(path, json={**BASE[path], "model": "other"}).status_code == 404


def check_r_input(http, path):
    other = post(http, path, input=[{"role": "user", "content": "Something else entirely."}])
    assert other["usage"]["input_tokens"] != post(http, path)["usage"]["input_tokens"]


def check_instructions(http, path):
    assert post(http, path, instructions="Be brief.")["usage"]["input_tokens"] > post(http, path)["usage"]["input_tokens"]


def check_max_output_tokens(http, path):
    assert post(http, path, max_output_tokens=2)["usage"]["output_tokens"] == 2
    refused(http, path, "max_output_tokens", 0)


def check_r_temperature(http, path):
    greedy = output_text(post(http, path))
    assert any(output_text(post(http, path, temperature=2.0)) != greedy for _ in range(4))


def check_r_top_p(http, path):
    assert output_text(post(http, path, temperature=2.0, top_p=1e-6)) == output_text(post(http, path))


def check_text(http, path):
    fmt = {"format": {"type": "json_schema", "name": "t", "schema": ARG}}
    assert json.loads(output_text(post(http, path, text=fmt, max_output_tokens=20)))["x"] in (True, False)


def check_r_stream(http, path):
    with http.stream("POST", path, json={**BASE[path], "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        types = [json.loads(e)["type"] for e in sse_events(r.read())]
    assert types[0] == "response.created" and types[-1] in ("response.completed", "response.incomplete")


def check_store(http, path):
    kept, not_kept = post(http, path), post(http, path, store=False)
    assert http.get(f"{path}/{kept['id']}").status_code == 200
    assert http.get(f"{path}/{not_kept['id']}").status_code == 404


def check_previous_response_id(http, path):
    first = post(http, path)
    assert post(http, path, previous_response_id=first["id"])["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    assert http.post(path, json={**BASE[path], "previous_response_id": "resp_none"}).status_code == 404


def check_metadata(http, path):
    assert post(http, path, metadata={"k": "v"})["metadata"] == {"k": "v"}


def vectors(body: dict) -> list[list[float]]:
    assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(body["data"]))), body
    return [d["embedding"] for d in body["data"]]


def check_e_input(http, path):  # a string, a batch of strings, token ids, a batch of token-id lists: one vector each
    one = vectors(post(http, path, input="a fox"))
    batch = vectors(post(http, path, input=["the dog", "a fox", "and"]))
    assert len(one) == 1 and len(batch) == 3 and batch[1] == one[0] and batch[0] != batch[1]
    ids = http.post("/tokenize", json={"prompt": "a fox"}).json()["tokens"]  # with BOS, as the input is tokenized
    assert vectors(post(http, path, input=ids)) == one
    assert vectors(post(http, path, input=[ids, ids[:2]]))[0] == one[0]
    assert post(http, path, input=[ids, ids[:2]])["usage"] == {"prompt_tokens": len(ids) + 2,
                                                              "total_tokens": len(ids) + 2}


def check_e_model(http, path):
    assert post(http, path, model="tiny")["model"] == "tiny"
    assert http.post(path, json={**BASE[path], "model": "other"}).status_code == 404


def check_encoding_format(http, path):  # base64: the very float32 values, little-endian
    floats = vectors(post(http, path))[0]
    raw = base64.b64decode(vectors(post(http, path, encoding_format="base64"))[0])
    assert list(struct.unpack(f"<{len(raw) // 4}f", raw)) == floats


def check_dimensions(http, path):  # truncated, then re-normalised: a unit vector along the full one's first k
    full = vectors(post(http, path))[0]
    short = vectors(post(http, path, dimensions=8))[0]
    norm = math.sqrt(sum(x * x for x in full[:8]))
    assert len(short) == 8 and abs(math.sqrt(sum(x * x for x in short)) - 1) < 1e-6
    assert max(abs(a - b / norm) for a, b in zip(short, full)) < 1e-6
    refused(http, path, "dimensions", len(full) + 1)
# ---- the Messages API's fields (Anthropic's shapes: content blocks, its own error body) ---------------------------

def m_text(body: dict) -> str:
    return "".join(b["text"] for b in body["content"] if b["type"] == "text")


def m_calls(body: dict) -> list[tuple[str, dict]]:
    return [(b["name"], b["input"]) for b in body["content"] if b["type"] == "tool_use"]


def m_refused(http: httpx.Client, name: str, value, status: int = 400) -> None:
    r = http.post(M, json={**BASE[M], name: value})
    assert r.status_code == status and r.json()["type"] == "error" and name in r.json()["error"]["message"], r.text


M_TOOLS = [{"name": t["function"]["name"], "input_schema": ARG} for t in TOOLS]


def check_m_model(http, path):
    assert post(http, path, model="tiny")["model"] == "tiny"
    assert http.post(path, json={**BASE[path], "model": "other"}).json()["error"]["type"] == "not_found_error"


def check_m_messages(http, path):
    other = post(http, path, messages=[{"role": "user", "content": "Something else entirely."}])
    assert other["usage"]["input_tokens"] != post(http, path)["usage"]["input_tokens"]


def check_m_max_tokens(http, path):
    assert post(http, path, max_tokens=2)["usage"]["output_tokens"] == 2
    r = http.post(path, json={k: v for k, v in BASE[path].items() if k != "max_tokens"})
    assert r.status_code == 400 and r.json()["error"]["message"] == "max_tokens: field required", r.text


def check_system(http, path):
    assert post(http, path, system="Be brief.")["usage"]["input_tokens"] > post(http, path)["usage"]["input_tokens"]


def check_stop_sequences(http, path):
    full = m_text(post(http, path, max_tokens=16))
    stop = next(full[i:i + 2] for i in range(1, len(full) - 1) if full.find(full[i:i + 2]) == i)  # cuts mid-way
    cut = post(http, path, max_tokens=16, stop_sequences=[stop])
    assert m_text(cut) == full[:full.index(stop)] and (cut["stop_reason"], cut["stop_sequence"]) == (
        "stop_sequence", stop)


def check_m_temperature(http, path):
    greedy = m_text(post(http, path))
    assert any(m_text(post(http, path, temperature=2.0)) != greedy for _ in range(4))


def check_m_top_p(http, path):
    assert m_text(post(http, path, temperature=2.0, top_p=1e-6)) == m_text(post(http, path))


def check_m_top_k(http, path):
    assert m_text(post(http, path, temperature=2.0, top_k=1)) == m_text(post(http, path))


def check_m_metadata(http, path):  # Anthropic's metadata.user_id: accepted, no effect; any other key refused
    assert post(http, path, metadata={"user_id": "u-1"})["content"] == post(http, path)["content"]
    m_refused(http, "metadata", {"user": "u-1"})


def check_m_stream(http, path):
    with http.stream("POST", path, json={**BASE[path], "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        types = [json.loads(e)["type"] for e in sse_events(r.read())]
    assert types[0] == "message_start" and types[-1] == "message_stop"


def check_m_tools(http, path):
    body = post(http, path, tools=M_TOOLS, tool_choice={"type": "any"}, max_tokens=120)
    assert m_calls(body) and all(a["x"] in (True, False) for _, a in m_calls(body))
    assert not m_calls(post(http, path))
    m_refused(http, "tools", [{"name": "f", "input_schema": {"type": "bogus"}}])


def check_m_tool_choice(http, path):
    named = post(http, path, tools=M_TOOLS, tool_choice={"type": "tool", "name": "g"}, max_tokens=120)
    assert {n for n, _ in m_calls(named)} == {"g"}
    one = post(http, path, tools=M_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
               max_tokens=120)
    assert len(m_calls(one)) == 1
    none = post(http, path, tools=M_TOOLS, tool_choice={"type": "none"})
    assert not m_calls(none) and none["usage"]["input_tokens"] < post(http, path, tools=M_TOOLS)["usage"]["input_tokens"]
    m_refused(http, "tool_choice", {"type": "sometimes"})


def check_output_config(http, path):
    fmt = {"format": {"type": "json_schema", "schema": ARG}}
    assert json.loads(m_text(post(http, path, output_config=fmt, max_tokens=20)))["x"] in (True, False)
    m_refused(http, "output_config", {"effort": "high"})
def check_receipt(http, path):
    """A receipt beside the answer when asked (its output ids are the response's), none otherwise; a non-bool
    is refused by name. What a receipt proves is tests/test_receipts.py's."""
    def receipt_of(body: dict) -> dict | None:
        return body.get("receipt") if path == R else body["choices"][0].get("receipt")

    plain, asked = post(http, path), post(http, path, receipt=True)
    assert receipt_of(plain) is None
    rec = receipt_of(asked)
    assert rec["receipt_version"] == 1 and rec["finish_reason"] in ("stop", "length")
    n = asked["usage"]["output_tokens"] if path == R else asked["usage"]["completion_tokens"]
    assert len(rec["output_token_ids"]) == n and rec["sampling"]["temperature"] == 0
    refused(http, path, "receipt", "yes")


CHECKS: dict[tuple[str, str], Callable] = {
    **{(p, f): fn for p in (C, CH) for f, fn in (
        ("model", check_model), ("max_tokens", check_max_tokens), ("temperature", check_temperature),
        ("top_p", check_top_p), ("top_k", check_top_k), ("seed", check_seed), ("stop", check_stop),
        ("stop_token_ids", check_stop_token_ids),
        ("stream", check_stream), ("stream_options", check_stream_options), ("n", check_n),
        ("ignore_eos", check_ignore_eos), ("frequency_penalty", check_frequency_penalty),
        ("presence_penalty", check_presence_penalty), ("logit_bias", check_logit_bias),
        ("repetition_penalty", check_repetition_penalty), ("min_tokens", check_min_tokens),
        ("skip_special_tokens", check_skip_special_tokens), ("response_format", check_response_format),
        ("receipt", check_receipt))},
    (C, "prompt"): check_prompt, (C, "echo"): check_echo, (C, "logprobs"): check_completion_logprobs,
    (C, "best_of"): check_best_of, (C, "suffix"): check_suffix,
    (CH, "messages"): check_messages, (CH, "logprobs"): check_chat_logprobs, (CH, "top_logprobs"): check_top_logprobs,
    (CH, "max_completion_tokens"): check_max_completion_tokens, (CH, "tools"): check_tools,
    (CH, "tool_choice"): check_tool_choice, (CH, "parallel_tool_calls"): check_parallel_tool_calls,
    (R, "model"): check_r_model, (R, "input"): check_r_input, (R, "instructions"): check_instructions,
    (R, "max_output_tokens"): check_max_output_tokens, (R, "temperature"): check_r_temperature,
    (R, "top_p"): check_r_top_p, (R, "text"): check_text, (R, "tools"): check_tools,
    (R, "tool_choice"): check_tool_choice, (R, "parallel_tool_calls"): check_parallel_tool_calls,
    (R, "stream"): check_r_stream, (R, "store"): check_store, (R, "previous_response_id"): check_previous_response_id,
    (R, "metadata"): check_metadata, (R, "receipt"): check_receipt,
    (E, "input"): check_e_input, (E, "model"): check_e_model, (E, "encoding_format"): check_encoding_format,
    (E, "dimensions"): check_dimensions,
    (M, "model"): check_m_model, (M, "messages"): check_m_messages, (M, "max_tokens"): check_m_max_tokens,
    (M, "system"): check_system, (M, "stop_sequences"): check_stop_sequences, (M, "temperature"): check_m_temperature,
    (M, "top_p"): check_m_top_p, (M, "top_k"): check_m_top_k, (M, "metadata"): check_m_metadata,
    (M, "stream"): check_m_stream, (M, "tools"): check_m_tools, (M, "tool_choice"): check_m_tool_choice,
    (M, "output_config"): check_output_config,
}


def test_every_schema_field_has_a_row() -> None:
    fields = {(C, f) for f in CompletionRequest.model_fields} | {(CH, f) for f in ChatCompletionRequest.model_fields} | \
        {(R, f) for f in ResponsesRequest.model_fields} | {(E, f) for f in EmbeddingRequest.model_fields} | \
        {(M, f) for f in MessagesRequest.model_fields}
    assert fields - set(CHECKS) == set(), "fields without a row: give each a check in CHECKS"
    assert set(CHECKS) - fields == set(), "rows for fields the schemas no longer have"


NAMES = {C: "completions", CH: "chat", R: "responses", E: "embeddings", M: "messages"}


@pytest.mark.parametrize("path,field", sorted(CHECKS), ids=[f"{NAMES[p]}-{f}" for p, f in sorted(CHECKS)])
def test_field_does_what_it_says(http, path, field) -> None:
    CHECKS[(path, field)](http, path)


# ---- fields no schema has ------------------------------------------------------------------------------------

def ws_first(http: httpx.Client, body: dict) -> dict:
    with connect(str(http.base_url).replace("http://", "ws://").rstrip("/") + "/v1/stream", open_timeout=30) as ws:
        ws.send(json.dumps(body))
        return json.loads(ws.recv(timeout=60))


def assert_unknown(r: httpx.Response, *names: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    s = "s" if len(names) > 1 else ""
    assert err["message"] == f"Unrecognized request argument{s} supplied: {', '.join(names)}", err
    assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "unknown_field", names[0]), err


def test_the_reported_unknown_field_is_refused(http) -> None:
    """The body of issue 41: it was answered 200, the field silently ignored."""
    assert_unknown(http.post(C, json={"prompt": "x", "max_tokens": 2, "bogus_field": 1}), "bogus_field")


@pytest.mark.parametrize("path", [C, CH, R], ids=["completions", "chat", "responses"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_unknown_fields_are_refused_by_name(http, path, stream) -> None:
    assert_unknown(http.post(path, json={**BASE[path], "stream": stream, "bogus_field": 1}), "bogus_field")
    # Every unknown field named, in the body's order; before any other error of the same body.
    assert_unknown(http.post(path, json={**BASE[path], "stream": stream, "zeta": None, "temperature": "hot",
                                         "alpha": {}}), "zeta", "alpha")
    # A real field misspelt is unknown, not ignored (its default would have been used).
    assert_unknown(http.post(path, json={**BASE[path], "stream": stream, "temprature": 0.5}), "temprature")


def test_unknown_fields_are_refused_on_embeddings(http) -> None:
    assert_unknown(http.post(E, json={**BASE[E], "bogus_field": 1}), "bogus_field")
    assert_unknown(http.post(E, json={**BASE[E], "zeta": None, "dimensions": "8", "alpha": {}}), "zeta", "alpha")
    assert_unknown(http.post(E, json={**BASE[E], "max_tokens": 3}), "max_tokens")  # a completion's field
    # OpenAI's `user` is accepted and changes nothing.
    assert vectors(post(http, E, user="u-1")) == vectors(post(http, E))


def test_the_openai_sdk_embeds(srv) -> None:
    """The SDK asks for base64 by default and decodes it itself: its floats are the server's float values."""
    client = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    res = client.embeddings.create(model="tiny", input=["The fox and the dog", "a fox"])
    plain = httpx.post(srv.http_url + E, json={"input": ["The fox and the dog", "a fox"]}, timeout=60).json()
    assert [d.embedding for d in res.data] == vectors(plain) and res.usage.prompt_tokens == plain["usage"]["prompt_tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="x", extra_body={"bogus_field": 1})
    assert e.value.code == "unknown_field"
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_unknown_fields_are_refused_by_name_on_the_messages_api(http, stream) -> None:
    """In Anthropic's error shape, with the same words as every endpoint's unknown_field refusal."""
    for extra, names in (({"bogus_field": 1}, ["bogus_field"]), ({"zeta": None, "temperature": "hot", "alpha": {}},
                                                                  ["zeta", "alpha"]), ({"stop": ["x"]}, ["stop"])):
        r = http.post(M, json={**BASE[M], "stream": stream, **extra})
        s = "s" if len(names) > 1 else ""
        assert r.status_code == 400 and r.json() == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": f"Unrecognized request argument{s} supplied: {', '.join(names)}"}}, r.text


def test_a_field_of_another_endpoint_is_unknown(http) -> None:
    assert_unknown(http.post(C, json={**BASE[C], "messages": BASE[CH]["messages"]}), "messages")
    assert_unknown(http.post(CH, json={**BASE[CH], "echo": True}), "echo")
    assert_unknown(http.post(R, json={**BASE[R], "max_tokens": 3}), "max_tokens")
    assert_unknown(http.post("/tokenize", json={"prompt": "a", "user": "u"}), "user")  # no OpenAI endpoint


def test_unknown_fields_are_refused_on_the_websocket(http) -> None:
    for path in (C, CH):
        msg = ws_first(http, {**BASE[path], "bogus_field": 1})
        assert msg["type"] == "error" and msg["status"] == 400, msg
        assert (msg["error"]["code"], msg["error"]["param"]) == ("unknown_field", "bogus_field"), msg
        assert "bogus_field" in msg["error"]["message"], msg


def test_the_openai_sdk_gets_the_refusal(srv) -> None:
    client = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, extra_body={"bogus_field": 1})
    assert e.value.status_code == 400 and e.value.code == "unknown_field" and "bogus_field" in e.value.message


# OpenAI's fields that cannot change the result, and the refused-by-value ones at values that ask for nothing.
HARMLESS = {"user": "u-1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "k", "safety_identifier": "s"}
assert set(HARMLESS) == IGNORED_FIELDS
NOTHING_ASKED = {C: {"functions": None, "function_call": None, "audio": None, "prediction": None},
                 CH: {"modalities": ["text"], "reasoning_effort": None, "web_search_options": None,
                      "functions": None},
                 R: {"reasoning": None, "background": False, "include": [], "truncation": "disabled",
                     "stream_options": {"include_obfuscation": False}}}


def answer(body: dict) -> str:
    if "output" in body:
        return output_text(body)
    return text(body)


@pytest.mark.parametrize("path", [C, CH, R], ids=["completions", "chat", "responses"])
def test_openai_fields_without_effect_are_accepted_and_change_nothing(http, path) -> None:
    plain = answer(post(http, path))
    # The Responses API's own store and metadata are checked in its rows (they do something there).
    harmless = {k: v for k, v in HARMLESS.items() if not (path == R and k in ("store", "metadata"))}
    assert answer(post(http, path, **harmless, **NOTHING_ASKED[path])) == plain
    msg = ws_first(http, {**BASE[path], **harmless, **NOTHING_ASKED[path]}) if path != R else None
    assert msg is None or msg["type"] == "delta", msg


def test_anthropic_fields_without_effect_are_accepted_and_change_nothing(http) -> None:
    """The Messages API's fields that ask for nothing here: one service tier, thinking disabled, null server-side
    features, cache_control marks (the prefix cache is automatic)."""
    plain = post(http, M)
    marked = [{"role": "user", "content": [{"type": "text", "text": "Name a fox.",
                                            "cache_control": {"type": "ephemeral"}}]}]
    same = post(http, M, service_tier="auto", thinking={"type": "disabled"}, mcp_servers=None, container=None,
                context_management=None, messages=marked)
    assert same["content"] == plain["content"] and same["usage"] == plain["usage"]
