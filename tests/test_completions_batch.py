"""Batched prompts in /v1/completions (the four prompt forms of the OpenAI API, as eval harnesses send
them), and /tokenize and /detokenize.

A batch is one choice per prompt, `index` in prompt order, usage summed, streaming included, admitted all
at once or not at all. Each choice is its own engine request, so (on the batch-invariant path) its tokens
and logprobs are bitwise those of the same prompt sent alone.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from http_util import parse_stream
from steadyserve.testing.server import ServerProcess

PROMPTS = ["The fox", "A quick brown dog jumps", "Hello"]


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    with ServerProcess(tiny_model, "--grpc-port", "-1", "--stall-timeout", "5") as s:
        yield s


@pytest.fixture(scope="module")
def http(srv) -> httpx.Client:
    with httpx.Client(base_url=srv.http_url, timeout=60) as c:
        yield c


def complete(http: httpx.Client, **body) -> dict:
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokenize(http: httpx.Client, text: str) -> list[int]:
    r = http.post("/tokenize", json={"prompt": text})
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("form", ["strings", "token_lists"])
def test_each_choice_equals_its_prompt_sent_alone_bitwise(http, form) -> None:
    alone = [complete(http, prompt=p, max_tokens=6, temperature=0, logprobs=2, echo=True) for p in PROMPTS]
    batch_prompt = PROMPTS if form == "strings" else [tokenize(http, p) for p in PROMPTS]
    batch = complete(http, prompt=batch_prompt, max_tokens=6, temperature=0, logprobs=2, echo=True)
    assert [c["index"] for c in batch["choices"]] == [0, 1, 2]
    for i, single in enumerate(alone):
        got, want = batch["choices"][i], single["choices"][0]
        assert got["text"] == want["text"] and got["finish_reason"] == want["finish_reason"]
        assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]  # floats compared exactly
        assert got["logprobs"]["top_logprobs"] == want["logprobs"]["top_logprobs"]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert batch["usage"][key] == sum(s["usage"][key] for s in alone)
    assert batch["system_fingerprint"] == alone[0]["system_fingerprint"]


def test_scoring_a_batch_of_token_lists_as_lm_eval_does(srv) -> None:
    """lm-eval-harness's local-completions loglikelihood request: prompt=[[ids], ...], echo, logprobs, max_tokens 0."""
    client = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0)
    contexts = [[5, 17, 230, 41, 9], [88, 3, 3, 120], [7] * 12]
    batch = client.completions.create(model="", prompt=contexts, max_tokens=0, echo=True, logprobs=1,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    for i, ids in enumerate(contexts):
        alone = client.completions.create(model="", prompt=ids, max_tokens=0, echo=True, logprobs=1, temperature=0)
        got, want = batch.choices[i].logprobs, alone.choices[0].logprobs
        assert len(got.token_logprobs) == len(ids) and got.token_logprobs[0] is None
        assert got.token_logprobs == want.token_logprobs and got.top_logprobs == want.top_logprobs
    assert batch.usage.prompt_tokens == sum(map(len, contexts)) and batch.usage.completion_tokens == 0


def test_a_streamed_batch_carries_each_choice_by_index_and_sums_usage(http) -> None:
    whole = complete(http, prompt=PROMPTS, max_tokens=5, temperature=0)
    with http.stream("POST", "/v1/completions", json={"prompt": PROMPTS, "max_tokens": 5, "temperature": 0,
                                                      "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        raw = r.read()
    chunks, done = parse_stream(raw)
    assert done and raw.count(b"data: [DONE]") == 1
    texts = {i: "" for i in range(len(PROMPTS))}
    finished = set()
    for c in chunks[:-1]:
        for ch in c["choices"]:
            texts[ch["index"]] += ch["text"]
            if ch["finish_reason"]:
                finished.add(ch["index"])
    assert finished == {0, 1, 2}
    assert [texts[i] for i in range(3)] == [c["text"] for c in whole["choices"]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]


def test_a_batch_is_admitted_whole_or_refused_whole(tiny_model: str) -> None:
    """Capacity 2 running + 1 waiting: with two long requests in flight, a batch of two does not fit, so neither
    of its prompts is admitted (429); a batch over the whole capacity is a 400 naming `prompt`."""
    with ServerProcess(tiny_model, "--grpc-port", "-1", "--max-num-seqs", "2", "--max-queue", "1",
                       "--max-num-batched-tokens", "64") as s, httpx.Client(base_url=s.http_url, timeout=60) as c:
        r = c.post("/v1/completions", json={"prompt": ["a"] * 4, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt" and "at most 3" in r.text
        admitted_before = s.metric("steadyserve_requests_admitted_total", transport="http")
        body = {"prompt": "a long one", "max_tokens": 200, "ignore_eos": True, "stream": True}
        streams = [c.stream("POST", "/v1/completions", json=body) for _ in range(2)]
        responses = [st.__enter__() for st in streams]
        try:
            assert all(r.status_code == 200 for r in responses)
            r = c.post("/v1/completions", json={"prompt": ["x", "y"], "max_tokens": 2})
            assert r.status_code == 429, r.text
            assert "2 asked for at once" in r.json()["error"]["message"]
            assert s.metric("steadyserve_requests_admitted_total", transport="http") == admitted_before + 2
            one = c.post("/v1/completions", json={"prompt": ["x"], "max_tokens": 2})  # one still fits
            assert one.status_code == 200 and len(one.json()["choices"]) == 1
        finally:
            for st in streams:
                st.__exit__(None, None, None)


def test_an_invalid_prompt_refuses_the_whole_batch(http, srv) -> None:
    """One prompt's token id is outside the vocabulary: the request builder refuses the batch before any of it
    is admitted, naming the id as gRPC always did (`tokens.ids[1]`): prompt 1, token 1."""
    before = srv.metric("steadyserve_requests_admitted_total", transport="http")
    r = http.post("/v1/completions", json={"prompt": [[1, 2, 3], [1, 10 ** 6]], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt[1][1]"
    assert srv.metric("steadyserve_requests_admitted_total", transport="http") == before


def test_websocket_takes_one_prompt_and_says_so(srv) -> None:
    from websockets.sync.client import connect

    with connect(srv.http_url.replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"prompt": ["a", "b"], "max_tokens": 2}))
        msg = json.loads(ws.recv(timeout=30))
    assert msg["type"] == "error" and "one prompt" in msg["error"]["message"] and msg["error"]["param"] == "prompt"
    with connect(srv.http_url.replace("http", "ws") + "/v1/stream") as ws:
        ws.send(json.dumps({"prompt": "a", "n": 2, "max_tokens": 2}))
        msg = json.loads(ws.recv(timeout=30))
    assert msg["type"] == "error" and msg["error"]["param"] == "n"


# ---- /tokenize and /detokenize --------------------------------------------------------------------------------

def test_tokenize_matches_what_completions_count_and_detokenize_inverts_it(http) -> None:
    text = "The quick brown fox"
    t = http.post("/tokenize", json={"prompt": text}).json()
    scored = complete(http, prompt=text, max_tokens=0, echo=True, logprobs=0)
    assert t["count"] == len(t["tokens"]) == scored["usage"]["prompt_tokens"]
    assert t["max_model_len"] == http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert complete(http, prompt=t["tokens"], max_tokens=0, echo=True, logprobs=0)["choices"][0]["logprobs"] == \
        scored["choices"][0]["logprobs"]
    d = http.post("/detokenize", json={"tokens": t["tokens"]}).json()
    assert text in d["prompt"]
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    r = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert chat["count"] == r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, None),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, None),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "a", "unknown_field": 1}, "unknown_field"),
    ("/tokenize", {"prompt": "a", "model": "other"}, "model"),
    ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
    ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens[1]"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_and_detokenize_refuse_bad_input_by_name(http, path, body, param) -> None:
    r = http.post(path, json=body)
    assert r.status_code in (400, 404), r.text
    err = r.json()["error"]
    assert err["param"] == param or (param is None and "exactly one of prompt and messages" in err["message"])


def test_tokenize_needs_the_api_key_when_the_server_has_one(tiny_model: str) -> None:
    with ServerProcess(tiny_model, "--grpc-port", "-1", "--api-key", "sekret") as s:
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert httpx.post(s.http_url + path, json=body).status_code == 401
            ok = httpx.post(s.http_url + path, json=body, headers={"Authorization": "Bearer sekret"})
            assert ok.status_code == 200


# ---- n > 1 -----------------------------------------------------------------------------------------------------

def test_n_choices_are_seeded_seed_plus_j_and_equal_single_requests_bitwise(http) -> None:
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 41, "logprobs": 2}
    many = complete(http, prompt=PROMPTS[:2], n=3, **body)
    assert [c["index"] for c in many["choices"]] == list(range(6))
    singles = {}
    for i, p in enumerate(PROMPTS[:2]):
        for j in range(3):
            one = complete(http, prompt=p, **{**body, "seed": 41 + j})
            singles[i * 3 + j] = one
            got, want = many["choices"][i * 3 + j], one["choices"][0]
            assert got["text"] == want["text"]
            assert got["logprobs"]["token_logprobs"] == want["logprobs"]["token_logprobs"]
    texts = [c["text"] for c in many["choices"][:3]]
    assert len(set(texts)) > 1, texts  # different seeds, different samples
    # A prompt counts once, however many choices it has; generated tokens all count.
    assert many["usage"]["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"] + singles[3]["usage"]["prompt_tokens"]
    assert many["usage"]["completion_tokens"] == sum(s["usage"]["completion_tokens"] for s in singles.values())


def test_n_in_chat_through_the_sdk_and_streamed(srv, http) -> None:
    client = openai.OpenAI(base_url=srv.http_url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="", messages=msgs, n=2, max_tokens=5, seed=7, temperature=0.9)
    assert [c.index for c in r.choices] == [0, 1]
    alone = client.chat.completions.create(model="", messages=msgs, max_tokens=5, seed=8, temperature=0.9)
    assert r.choices[1].message.content == alone.choices[0].message.content
    with http.stream("POST", "/v1/completions", json={"prompt": "The fox", "n": 2, "max_tokens": 4, "seed": 3,
                                                      "stream": True}) as s:
        chunks, done = parse_stream(s.read())
    assert done and {ch["index"] for c in chunks for ch in c["choices"]} == {0, 1}


def test_n_times_prompts_beyond_what_the_server_admits_is_refused_by_name(http, srv) -> None:
    r = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 128, "max_tokens": 1})  # 384 > 320
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"


def test_n_samples_share_the_prompts_computation(http, srv) -> None:
    """Choices 1..n-1 wait for choice 0's prompt blocks and take them from the prefix cache."""
    prompt = tokenize(http, "the quick brown fox jumps over the lazy dog " * 12)[:100]  # 3 full 32-token blocks
    before = srv.metric("steadyserve_prefix_cache_hit_tokens_total")
    r = complete(http, prompt=prompt, n=4, max_tokens=2, seed=5, temperature=1.0)
    assert len(r["choices"]) == 4
    assert srv.metric("steadyserve_prefix_cache_hit_tokens_total") - before >= 3 * 96


def test_best_of_returns_the_n_samples_with_the_best_mean_logprob(http) -> None:
    body = {"prompt": "The fox", "max_tokens": 5, "temperature": 1.0, "seed": 11}
    samples = [complete(http, **{**body, "seed": 11 + j, "logprobs": 0})["choices"][0] for j in range(4)]
    means = [sum(s["logprobs"]["token_logprobs"]) / len(s["logprobs"]["token_logprobs"]) for s in samples]
    best = complete(http, **body, best_of=4, n=2)
    order = sorted(range(4), key=lambda j: -means[j])[:2]
    assert [c["text"] for c in best["choices"]] == [samples[j]["text"] for j in order]
    assert [c["index"] for c in best["choices"]] == [0, 1]
    assert all(c["logprobs"] is None for c in best["choices"])  # not asked for: ranking used them internally
    assert best["usage"]["completion_tokens"] == sum(len(s["logprobs"]["tokens"]) for s in samples)
