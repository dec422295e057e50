"""HTTP front end against a real server: the OpenAI SDK, fingerprints, health, and every bad input.

One real `steadyserve serve` process (tiny random model, 512-token context) on
127.0.0.1 with ephemeral ports serves the whole module.
"""

from __future__ import annotations

import asyncio
import json
import math

import httpx
import openai
import pytest

from http_util import FP_HEADER, five_xx, parse_stream, post_request, raw_http, status_counts, stream_completion
from steadyserve.kernel_versions import KV_FORMATS
from steadyserve.testing.server import ServerProcess

MAX_REQUEST_BYTES = 65536


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    with ServerProcess(tiny_model, "--grpc-port", "-1", "--served-model-name", "tiny", "--stall-timeout", "5", "--drain-timeout", "30",
                       "--max-request-bytes", str(MAX_REQUEST_BYTES), "--max-tokens-cap", "1000",
                       threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def oai(srv) -> openai.OpenAI:
    c = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http(srv) -> httpx.Client:
    with httpx.Client(base_url=srv.http_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def fingerprint(http) -> str:
    fp = http.get("/readyz").json()["system_fingerprint"]
    h, dtype, device, numerics, kernel, *kv, bi = fp.split("-")  # kv: the cache format where it is not float32
    assert len(h) == 12 and dtype == "float32" and device == "cpu" and kernel in ("nat1", "py") and bi in ("bi", "nbi")
    assert numerics[0] in "hpi" and len(numerics) == 7  # the numerics path (steadyserve/numerics.py)
    assert len(kv) <= 1 and set(kv) <= set(KV_FORMATS.values()), fp
    return fp


MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a fox."}]


# ---- the openai SDK -----------------------------------------------------------------------------------------

def test_sdk_models(oai, srv, fingerprint):
    models = oai.models.list()
    ids = [m.id for m in models.data]
    assert ids == ["tiny"]


def same_usage(later, earlier) -> None:
    """Equal usage, except that a later request may find more of the same prompt in the prefix cache."""
    a, b = later.model_dump(), earlier.model_dump()
    cached_a, cached_b = a.pop("prompt_tokens_details")["cached_tokens"], b.pop("prompt_tokens_details")["cached_tokens"]
    assert a == b and cached_a >= cached_b


def test_a_repeated_prompt_is_served_from_the_prefix_cache_with_the_same_logprobs(oai):
    prompt = [5 + (i * 11) % 300 for i in range(80)]  # two full 32-token blocks and 16 tokens more
    kw = dict(model="tiny", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    first, second = oai.completions.create(**kw), oai.completions.create(**kw)
    assert second.usage.prompt_tokens_details.cached_tokens == 64  # full blocks, leaving tokens to compute
    assert second.choices[0].logprobs.token_logprobs == first.choices[0].logprobs.token_logprobs
    assert second.choices[0].logprobs.top_logprobs == first.choices[0].logprobs.top_logprobs


def test_sdk_completion_roundtrip_and_stream_equals_whole(oai, fingerprint):
    kw = dict(model="tiny", prompt="The quick brown fox", max_tokens=24, temperature=0.9, seed=1234)
    whole = oai.completions.create(**kw)
    assert whole.system_fingerprint == fingerprint
    assert whole.object == "text_completion"
    ch = whole.choices[0]
    assert ch.finish_reason in ("length", "stop")
    assert whole.usage.completion_tokens >= 1 and whole.usage.prompt_tokens >= 1
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens
    # Seeded: the same request gives the same text.
    assert oai.completions.create(**kw).choices[0].text == ch.text

    chunks = list(oai.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.system_fingerprint == fingerprint for c in chunks)
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == ch.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == ch.finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    same_usage(chunks[-1].usage, whole.usage)


def test_sdk_completion_logprobs_stream_and_whole_agree(oai):
    kw = dict(model="tiny", prompt="Streams end with", max_tokens=12, temperature=0.7, seed=99, logprobs=5)
    whole = oai.completions.create(**kw)
    lp = whole.choices[0].logprobs
    n = whole.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for v, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert v <= 0.0 and math.isfinite(v)
        assert 1 <= len(top) <= 5
        assert max(top.values()) >= v - 1e-6  # the best alternative is at least as likely as the pick
        assert list(top.values()) == sorted(top.values(), reverse=True)
    streamed_lps: list[float] = []
    streamed_tokens: list[str] = []
    for c in oai.completions.create(**kw, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed_lps += c.choices[0].logprobs.token_logprobs
            streamed_tokens += c.choices[0].logprobs.tokens
    assert streamed_lps == lp.token_logprobs  # bitwise: same seed, batch-invariant engine
    assert streamed_tokens == lp.tokens


def test_sdk_scoring_echo_logprobs_matches_generation(oai):
    """lm-eval-harness style: echo + logprobs + max_tokens 0 scores the prompt; it agrees with generation."""
    prompt_ids = [10, 52, 77, 101, 33, 250, 8, 19]
    gen = oai.completions.create(model="tiny", prompt=prompt_ids, max_tokens=1, temperature=0, logprobs=1)
    gen_lp = gen.choices[0].logprobs.token_logprobs[0]
    # The generated token's id, via a second greedy call returning the ids isn't in the schema; score by text.
    scored = oai.completions.create(model="tiny", prompt=prompt_ids, max_tokens=0, echo=True, logprobs=1,
                                    temperature=0)
    ch = scored.choices[0]
    assert scored.usage.completion_tokens == 0
    lp = ch.logprobs
    assert len(lp.tokens) == len(prompt_ids) == scored.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert ch.text == "".join(lp.tokens) or len(ch.text) > 0
    # Echo with generation: the prompt part equals the scoring call, then the generated token follows.
    both = oai.completions.create(model="tiny", prompt=prompt_ids, max_tokens=1, echo=True, logprobs=1,
                                  temperature=0)
    blp = both.choices[0].logprobs
    assert blp.token_logprobs[:len(prompt_ids)] == lp.token_logprobs
    assert blp.token_logprobs[len(prompt_ids)] == gen_lp
    assert len(blp.tokens) == len(prompt_ids) + 1


def test_sdk_logits_processors_take_effect(oai):
    """logit_bias, presence/frequency penalties (OpenAI's) and repetition_penalty (extension, via extra_body)
    each change a greedy completion; the reported logprobs stay the model's own."""
    def tokens(**kw) -> list[str]:
        r = oai.completions.create(model="tiny", prompt="the fox and the dog", max_tokens=8, temperature=0,
                                   logprobs=0, **kw)
        return r.choices[0].logprobs.tokens

    base = tokens()
    assert len(set(base)) < len(base), base  # the tiny model repeats itself: penalties have work to do
    forced = tokens(logit_bias={"42": 100})
    assert len(set(forced)) == 1 and forced != base
    assert oai.completions.create(model="tiny", prompt="x", max_tokens=1, temperature=0,
                                  logit_bias={"42": 100}).choices[0].text == forced[0]
    for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 3.0}}):
        penalized = tokens(**kw)
        assert penalized != base, kw
        assert len(set(penalized)) >= len(set(base)), kw  # no more repetitive than without


def test_sdk_n_best_of_min_tokens_and_batched_prompts(oai):
    many = oai.completions.create(model="tiny", prompt="the fox", n=3, max_tokens=4, seed=3, temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    best = oai.completions.create(model="tiny", prompt="the fox", n=2, best_of=4, max_tokens=4, seed=3,
                                  temperature=1.0)
    assert [c.index for c in best.choices] == [0, 1] and best.usage.completion_tokens > many.usage.completion_tokens
    assert oai.completions.create(model="tiny", prompt="the fox", max_tokens=6, temperature=0,
                                  extra_body={"min_tokens": 5}).usage.completion_tokens >= 5
    batch = oai.completions.create(model="tiny", prompt=["the fox", "a dog"], max_tokens=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]


def test_sdk_chat_roundtrip_stream_equals_whole(oai, fingerprint):
    kw = dict(model="tiny", messages=MESSAGES, max_tokens=20, temperature=0.8, seed=5)
    whole = oai.chat.completions.create(**kw)
    assert whole.object == "chat.completion" and whole.system_fingerprint == fingerprint
    msg = whole.choices[0].message
    assert msg.role == "assistant" and isinstance(msg.content, str)
    chunks = list(oai.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" and c.system_fingerprint == fingerprint for c in chunks)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == msg.content
    assert with_choices[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    same_usage(chunks[-1].usage, whole.usage)


def test_sdk_chat_default_max_tokens_fits_context(oai):
    """No max_tokens: the default must fit what the context leaves, not fail on a small model."""
    r = oai.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, stop=["\n"])
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.total_tokens <= 512
    r = oai.completions.create(model="tiny", prompt=LONG_IDS[:500])  # 500 of 512 positions
    assert r.usage.completion_tokens <= 12


def test_sdk_chat_logprobs_and_max_completion_tokens(oai):
    kw = dict(model="tiny", messages=MESSAGES, max_completion_tokens=8, temperature=0, logprobs=True,
              top_logprobs=3)
    whole = oai.chat.completions.create(**kw)
    assert whole.usage.completion_tokens == 8 or whole.choices[0].finish_reason == "stop"
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 3 and e.logprob <= 0
        assert e.top_logprobs[0].logprob >= e.logprob - 1e-6  # greedy picks the best
        assert e.bytes is not None
    # bytes are the token's raw bytes: they concatenate to the UTF-8 of the whole text (byte-level BPE).
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == \
        whole.choices[0].message.content
    # A token that is part of a UTF-8 character shows as U+FFFD, but its bytes are its own, not EF BF BD.
    sampled = oai.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3,
                                          logprobs=True, top_logprobs=5)
    entries = [e for c in sampled.choices[0].logprobs.content for e in [c, *c.top_logprobs]]
    partial = [e for e in entries if e.token == "\ufffd"]
    assert partial, "expected some partial-character tokens from the random model"
    for e in partial:
        assert bytes(e.bytes) != "\ufffd".encode() and len(e.bytes) >= 1
        with pytest.raises(UnicodeDecodeError):
            bytes(e.bytes).decode("utf-8")
    streamed = []
    for c in oai.chat.completions.create(**kw, stream=True):
        if c.choices and c.choices[0].logprobs:
            streamed += [(e.token, e.logprob) for e in c.choices[0].logprobs.content]
    assert streamed == [(e.token, e.logprob) for e in content]


def test_sdk_chat_text_content_parts(oai):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Name "}, {"type": "text", "text": "a fox."}]}]
    plain = [{"role": "user", "content": "Name a fox."}]
    a = oai.chat.completions.create(model="tiny", messages=parts, max_tokens=6, temperature=0)
    b = oai.chat.completions.create(model="tiny", messages=plain, max_tokens=6, temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_sdk_streamed_scoring_equals_whole(oai):
    kw = dict(model="tiny", prompt="The quick brown fox jumps", max_tokens=0, echo=True, logprobs=3)
    whole = oai.completions.create(**kw).choices[0]
    chunks = [c for c in oai.completions.create(**kw, stream=True) if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    lps = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert lps == whole.logprobs.token_logprobs and lps[0] is None
    assert chunks[-1].choices[0].finish_reason == "length"


def test_sdk_stop_strings(oai):
    base = oai.completions.create(model="tiny", prompt="The quick", max_tokens=30, temperature=0)
    text = base.choices[0].text
    assert len(text) >= 4
    stop = text[2:4]
    r = oai.completions.create(model="tiny", prompt="The quick", max_tokens=30, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert stop not in r.choices[0].text and text.startswith(r.choices[0].text)


def test_sdk_headers_request_id_echo(oai, fingerprint):
    raw = oai.completions.with_raw_response.create(model="tiny", prompt="hi", max_tokens=2,
                                                   extra_headers={"x-request-id": "client-id-42"})
    assert raw.headers["x-request-id"] == "client-id-42"
    assert raw.headers[FP_HEADER] == fingerprint
    assert raw.parse().id.endswith("client-id-42")
    raw = oai.chat.completions.with_raw_response.create(model="tiny", messages=MESSAGES, max_tokens=2)
    rid = raw.headers["x-request-id"]
    assert rid and raw.parse().id.endswith(rid) and raw.headers[FP_HEADER] == fingerprint
    # Streams carry the headers too.
    with oai.completions.with_streaming_response.create(model="tiny", prompt="hi", max_tokens=2, stream=True,
                                                        extra_headers={"x-request-id": "s-1"}) as r:
        assert r.headers["x-request-id"] == "s-1" and r.headers[FP_HEADER] == fingerprint
        list(r.iter_lines())


def test_same_client_request_id_twice_concurrently(srv):
    """Two requests in flight under one x-request-id both run, and both get their id back."""
    async def main():
        async with httpx.AsyncClient(base_url=srv.http_url, timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json={"prompt": "dup", "max_tokens": 40,
                                                                          "ignore_eos": True},
                                                 headers={"x-request-id": "same-id"}) for _ in range(3)))

    for r in asyncio.run(main()):
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == "same-id" and r.json()["usage"]["completion_tokens"] == 40


def test_sdk_errors_map_to_sdk_exceptions(oai):
    with pytest.raises(openai.NotFoundError) as ei:
        oai.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
    assert isinstance(ei.value.body, dict) and ei.value.body["code"] == "model_not_found", ei.value.body
    assert ei.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as ei:
        oai.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=-1)
    assert "temperature" in str(ei.value)
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="tiny", messages=[], max_tokens=2)


# ---- headers, health, metrics ---------------------------------------------------------------------------

def test_every_response_has_fingerprint_and_request_id(http, fingerprint):
    for method, path, body in [("GET", "/healthz", None), ("GET", "/readyz", None), ("GET", "/v1/models", None),
                               ("GET", "/metrics", None), ("POST", "/v1/completions", {"prompt": "x", "max_tokens": 1}),
                               ("POST", "/v1/completions", {"prompt": "", "max_tokens": 1}),
                               ("GET", "/no/such/route", None)]:
        r = http.request(method, path, json=body)
        assert r.headers[FP_HEADER] == fingerprint, path
        assert r.headers["x-request-id"], path
        if r.headers["content-type"].startswith("application/json") and r.status_code == 200 \
                and path.startswith("/v1/"):
            body_json = r.json()
            fp = body_json.get("system_fingerprint") or body_json["data"][0]["system_fingerprint"]
            assert fp == fingerprint
    # Every SSE chunk carries the fingerprint.
    r, chunks, done = stream_completion(http, "/v1/completions", {"prompt": "ab", "max_tokens": 4,
                                                                  "stream_options": {"include_usage": True}})
    assert done and all(c["system_fingerprint"] == fingerprint for c in chunks)
    # Bad request ids are replaced, not echoed.
    r = http.get("/healthz", headers={"x-request-id": "x" * 200})
    assert r.headers["x-request-id"] != "x" * 200


def test_health_ready_metrics(http, srv):
    assert http.get("/healthz").json() == {"status": "alive"}
    r = http.get("/readyz")
    assert r.status_code == 200 and r.json()["status"] == "ready"
    text = http.get("/metrics").text
    for name in ("steadyserve_requests_running", "steadyserve_streams_aborted_total", "http_requests_total",
                 "steadyserve_event_loop_lag_seconds_bucket", "steadyserve_requests_rejected_total"):
        assert name in text
    assert srv.metric("steadyserve_engine_alive") == 1.0


def test_sse_wire_format(srv):
    """One `data:` event per batch, blank-line separated, finish_reason on the last chunk, then [DONE]."""
    body = json.dumps({"prompt": "The", "max_tokens": 6, "stream": True, "temperature": 0}).encode()
    raw = raw_http(srv.http_port, post_request(srv.http_port, "/v1/completions", body))
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b" 200 " in head.split(b"\r\n")[0]
    assert b"text/event-stream" in head.lower()
    # de-chunk
    body_bytes, rest2 = b"", rest
    while rest2:
        size_line, _, rest2 = rest2.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        body_bytes += rest2[:size]
        rest2 = rest2[size + 2:]
    assert body_bytes.endswith(b"data: [DONE]\n\n")
    chunks, done = parse_stream(body_bytes)
    assert done and chunks[-1]["choices"][0]["finish_reason"] == "length"


# ---- bad input --------------------------------------------------------------------------------------------

LONG_IDS = [5 + (i % 300) for i in range(600)]
C, CH = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]

# (id, path, body: dict | bytes, expected status, substring expected in message or param)
BAD_INPUTS = [
    ("malformed-json", C, b'{"prompt": "hi", ', 400, "not valid JSON"),
    ("json-array", C, b'[1, 2]', 400, "JSON object"),
    ("empty-body", C, b"", 400, "JSON"),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe hi"}', 400, "UTF-8"),
    ("lone-surrogate", C, b'{"prompt": "\\ud800 hi", "max_tokens": 2}', 400, "prompt"),
    ("prompt-wrong-type", C, {"prompt": 123}, 400, "prompt"),
    ("prompt-missing", C, {"max_tokens": 3}, 400, "prompt"),
    ("prompt-float-ids", C, {"prompt": [1.5, 2]}, 400, "prompt"),
    ("prompt-bool-ids", C, {"prompt": [True, 2]}, 400, "prompt"),
    ("prompt-negative-id", C, {"prompt": [-1, 2]}, 400, "prompt"),
    ("prompt-id-out-of-vocab", C, {"prompt": [1, 10 ** 6]}, 400, "prompt"),
    ("prompt-empty-string", C, {"prompt": ""}, 400, "empty"),
    ("prompt-empty-list", C, {"prompt": []}, 400, "empty"),
    ("prompt-batch-mixed", C, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    ("prompt-batch-empty-string", C, {"prompt": ["a", ""]}, 400, "prompt[1] must not be empty"),
    ("prompt-batch-empty-ids", C, {"prompt": [[1, 2], []]}, 400, "prompt[1] must not be empty"),
    ("prompt-batch-item-too-long", C, {"prompt": [[1, 2], LONG_IDS]}, 400, "prompt[1] has"),
    ("prompt-batch-nested-deeper", C, {"prompt": [[[1]]]}, 400, "prompt"),
    ("prompt-too-long", C, {"prompt": LONG_IDS}, 400, "512"),
    ("prompt-text-too-long", C, {"prompt": "fox " * 400}, 400, "512"),
    ("prompt-plus-max-tokens-too-long", C, {"prompt": LONG_IDS[:500], "max_tokens": 100}, 400, "512"),
    ("max-tokens-string", C, {"prompt": "hi", "max_tokens": "10"}, 400, "max_tokens"),
    ("max-tokens-float", C, {"prompt": "hi", "max_tokens": 10.5}, 400, "max_tokens"),
    ("max-tokens-negative", C, {"prompt": "hi", "max_tokens": -1}, 400, "max_tokens"),
    ("max-tokens-over-cap", C, {"prompt": "hi", "max_tokens": 10 ** 30}, 400, "max_tokens"),
    ("max-tokens-0-without-echo", C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("temperature-negative", C, {"prompt": "hi", "temperature": -0.5}, 400, "temperature"),
    ("temperature-string", C, {"prompt": "hi", "temperature": "hot"}, 400, "temperature"),
    ("temperature-numeric-string", C, {"prompt": "hi", "temperature": "0.5"}, 400, "temperature"),
    ("temperature-nan", C, b'{"prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("temperature-inf", C, b'{"prompt": "hi", "temperature": Infinity}', 400, "temperature"),
    ("top-p-zero", C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("top-p-over-one", C, {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("top-k-negative", C, {"prompt": "hi", "top_k": -1}, 400, "top_k"),
    ("logprobs-over-20", C, {"prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("logprobs-negative", C, {"prompt": "hi", "logprobs": -1}, 400, "logprobs"),
    ("logprobs-bool", C, {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    ("seed-string", C, {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("seed-huge", C, {"prompt": "hi", "seed": 2 ** 70}, 400, "seed"),
    ("seed-very-negative", C, {"prompt": "hi", "seed": -(2 ** 70)}, 400, "seed"),
    ("stop-wrong-type", C, {"prompt": "hi", "stop": 5}, 400, "stop"),
    ("stop-too-many", C, {"prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("stop-empty-string", C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("stream-not-bool", C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("stream-options-wrong", C, {"prompt": "hi", "stream": True, "stream_options": {"include_usage": "y"}}, 400,
     "include_usage"),
    ("n-0", C, {"prompt": "hi", "n": 0}, 400, "n"),
    ("n-129", C, {"prompt": "hi", "n": 129}, 400, "n"),
    ("n-string", C, {"prompt": "hi", "n": "2"}, 400, "n"),
    ("best-of-below-n", C, {"prompt": "hi", "best_of": 1, "n": 2}, 400, "best_of must be at least n"),
    ("best-of-with-stream", C, {"prompt": "hi", "best_of": 3, "stream": True}, 400, "stream"),
    ("best-of-0", C, {"prompt": "hi", "best_of": 0}, 400, "best_of"),
    ("suffix", C, {"prompt": "hi", "suffix": "x"}, 400, "suffix"),
    ("frequency-penalty-over-2", C, {"prompt": "hi", "frequency_penalty": 2.5}, 400, "frequency_penalty"),
    ("presence-penalty-under-minus-2", C, {"prompt": "hi", "presence_penalty": -3}, 400, "presence_penalty"),
    ("logit-bias-over-100", C, {"prompt": "hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    ("logit-bias-key-not-an-id", C, {"prompt": "hi", "logit_bias": {"fox": 1}}, 400, "logit_bias"),
    ("logit-bias-id-out-of-vocab", C, {"prompt": "hi", "logit_bias": {"1000000": 1}}, 400, "logit_bias"),
    ("logit-bias-value-string", C, {"prompt": "hi", "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ("repetition-penalty-zero", C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("min-tokens-over-max-tokens", C, {"prompt": "hi", "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ("min-tokens-negative", C, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("echo-not-bool", C, {"prompt": "hi", "echo": 1}, 400, "echo"),
    ("unknown-model", C, {"prompt": "hi", "model": "gpt-9"}, 404, "gpt-9"),
    ("model-wrong-type", C, {"prompt": "hi", "model": 7}, 400, "model"),
    ("chat-messages-empty", CH, {"messages": []}, 400, "messages"),
    ("chat-messages-missing", CH, {"max_tokens": 2}, 400, "messages"),
    ("chat-messages-string", CH, {"messages": "hi"}, 400, "messages"),
    ("chat-message-no-content", CH, {"messages": [{"role": "user"}]}, 400, "content"),
    ("chat-message-bad-role", CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("chat-message-content-number", CH, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("chat-message-image-part", CH, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, 400, "content"),
    ("chat-message-content-null", CH, {"messages": [{"role": "assistant", "content": None}]}, 400, "content"),
    ("chat-too-long", CH, {"messages": [{"role": "user", "content": "fox " * 400}], "max_tokens": 4}, 400, "512"),
    ("chat-max-tokens-0", CH, {"messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    ("chat-max-tokens-negative", CH, {"messages": MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("chat-top-logprobs-21", CH, {"messages": MSG, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ("chat-top-logprobs-without-logprobs", CH, {"messages": MSG, "top_logprobs": 2}, 400, "logprobs"),
    ("chat-logprobs-int", CH, {"messages": MSG, "logprobs": 5}, 400, "logprobs"),
    ("chat-temperature-negative", CH, {"messages": MSG, "temperature": -1}, 400, "temperature"),
    ("chat-n-0", CH, {"messages": MSG, "n": 0}, 400, "n"),
    ("chat-tools-bad-schema", CH, {"messages": MSG, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "wat"}}}]}, 400, "tools[0].function.parameters"),
    ("chat-tools-not-function", CH, {"messages": MSG, "tools": [{"type": "code_interpreter"}]}, 400, "tools[0].type"),
    ("chat-tool-choice", CH, {"messages": MSG, "tool_choice": "auto"}, 400, "tool_choice"),
    ("chat-functions", CH, {"messages": MSG, "functions": [{"name": "f"}]}, 400, "functions"),
    ("chat-audio", CH, {"messages": MSG, "audio": {"voice": "alloy"}}, 400, "audio"),
    ("chat-modalities-audio", CH, {"messages": MSG, "modalities": ["text", "audio"]}, 400, "modalities"),
    ("chat-prediction", CH, {"messages": MSG, "prediction": {"type": "content", "content": "x"}}, 400,
     "prediction"),
    ("chat-reasoning-effort", CH, {"messages": MSG, "reasoning_effort": "high"}, 400, "reasoning_effort"),
    ("chat-response-format-unknown-type", CH, {"messages": MSG, "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("chat-response-format-bad-schema", CH, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}}, 400, "response_format"),
    ("chat-response-format-schema-not-object", CH, {"messages": MSG, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}}, 400, "response_format"),
    ("chat-response-format-with-ignore-eos", CH, {"messages": MSG, "ignore_eos": True, "response_format": {
        "type": "json_object"}}, 400, "ignore_eos"),
    ("chat-unknown-model", CH, {"messages": MSG, "model": "nope"}, 404, "nope"),
    ("body-too-large", C, {"prompt": "x" * (MAX_REQUEST_BYTES + 10)}, 413, "max-request-bytes"),
]


@pytest.mark.parametrize("name,path,body,status,needle", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input(http, name, path, body, status, needle):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] in ("invalid_request_error", "not_found_error")
    assert isinstance(err["message"], str) and err["message"]
    assert needle in err["message"] or needle == err["param"], err
    assert r.headers["x-request-id"] and r.headers[FP_HEADER]


def test_body_too_large_chunked_without_content_length(http):
    def gen():
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1000 + 5):
            yield b"x" * 1000
        yield b'"}'

    r = http.post(C, content=gen(), headers={"content-type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_unknown_route_and_method_are_openai_errors(http):
    r = http.get("/v1/nothing")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get(C)
    assert r.status_code == 405 and "error" in r.json()


def test_bad_input_disturbs_nothing(http, srv):
    """After the whole table (sent here too: the test order is random, so the table's own tests may come
    later): no 5xx ever, the server is ready, a normal request works, nothing is stuck."""
    for _, path, body, status, _ in BAD_INPUTS:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        assert http.post(path, content=content, headers={"content-type": "application/json"}).status_code == status
    assert five_xx(srv) == 0, status_counts(srv)
    assert srv.metric("steadyserve_requests_rejected_total", reason="invalid") > 0
    assert http.get("/readyz").status_code == 200
    # ignore_eos: the random tiny model, sampling, ended this answer on EOS after one token once (a full run)
    r = http.post(C, json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert srv.metric("steadyserve_engine_alive") == 1.0
    assert srv.proc.poll() is None
