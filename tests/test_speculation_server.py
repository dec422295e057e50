"""`--speculation ngram` over the wire: a real server against a real `--speculation off` one, the same requests,
streamed and not, with n and best_of; bodies equal but for ids and timestamps, the fingerprint unchanged,
and the speculation metrics counting."""

from __future__ import annotations

import httpx
import pytest

from steadyserve.testing.server import start_servers

from http_util import FP_HEADER, stream_completion

PROMPT = "one two three four one two three four one two three four one two"


@pytest.fixture(scope="module")
def servers(tiny_model):
    off, on = start_servers(((tiny_model, "--grpc-port", "-1", "--speculation", "off"), {}),
                            ((tiny_model, "--grpc-port", "-1", "--speculation", "ngram"), {}))
    try:
        yield off, on
    finally:
        for s in (off, on):
            s.__exit__(None, None, None)


def bodies() -> list[dict]:
    common = dict(model="", prompt=PROMPT, max_tokens=32, logprobs=2)
    return [dict(common, temperature=0, stop=["e"]), dict(common, temperature=0.4, seed=7, n=2),
            dict(common, temperature=0.4, seed=9, n=2, best_of=3)]


def comparable(body: dict) -> dict:
    return {"choices": sorted(body["choices"], key=lambda c: c["index"]), "usage": body["usage"],
            "system_fingerprint": body["system_fingerprint"]}


def streamed(chunks: list[dict]) -> dict:
    """Per choice: the concatenated text, every token's logprob and top_logprobs, the finish reason."""
    out: dict[int, dict] = {}
    for ch in chunks:
        for c in ch.get("choices", []):
            o = out.setdefault(c["index"], {"text": "", "tokens": [], "lps": [], "top": [], "finish": None})
            o["text"] += c["text"]
            if c.get("logprobs"):
                o["tokens"] += c["logprobs"]["tokens"]
                o["lps"] += c["logprobs"]["token_logprobs"]
                o["top"] += c["logprobs"]["top_logprobs"]
            o["finish"] = c.get("finish_reason") or o["finish"]
    usage = next((ch["usage"] for ch in chunks if ch.get("usage")), None)
    return {"choices": out, "usage": usage}


def test_responses_are_bitwise_those_of_off(servers):
    off, on = servers
    # The servers are the module's: counters are taken before and after, so that the drafts counted are this
    # test's own (another test may have run first on the same servers).
    counters = ("steadyserve_speculation_drafted_tokens_total", "steadyserve_speculation_accepted_tokens_total")
    before = {name: on.metric(name) for name in counters}
    off_before = off.metric(counters[0])
    with httpx.Client(timeout=60) as a, httpx.Client(timeout=60) as b:
        # Both prefix caches first hold the prompt's full blocks, whatever ran on either server before (the
        # validate test runs on one of them only): usage.cached_tokens then depends on this test's requests alone.
        for client, srv in ((a, off), (b, on)):
            assert client.post(srv.http_url + "/v1/completions",
                               json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200
        for body in bodies():
            ra = a.post(off.http_url + "/v1/completions", json=body)
            rb = b.post(on.http_url + "/v1/completions", json=body)
            assert ra.status_code == rb.status_code == 200, (ra.text, rb.text)
            assert comparable(ra.json()) == comparable(rb.json()), body
            assert ra.headers[FP_HEADER] == rb.headers[FP_HEADER]
            stream_body = dict(body, stream_options={"include_usage": True})
            if "best_of" in stream_body:
                continue  # best_of does not stream
            _, ca, da = stream_completion(a, off.http_url + "/v1/completions", stream_body)
            _, cb, db = stream_completion(b, on.http_url + "/v1/completions", stream_body)
            assert da and db
            assert streamed(ca) == streamed(cb), body
    drafted, accepted = (on.metric(name) - before[name] for name in counters)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert off.metric(counters[0]) == off_before == 0


def test_speculation_is_logged_once_decided_after_the_selftest(servers):
    """Start-up logs whether it speculates once, after the self-test that has the last word (engine.py
    settle_speculation): ngram on, off off."""
    for server, speculating in zip(servers, (False, True)):
        logs = server.logs()
        lines = [line for line in logs.splitlines() if "speculating" in line]
        assert len(lines) == 1 and f"speculating={speculating}" in lines[0], lines
        assert logs.index("batch-invariance self-test") < logs.index(lines[0])


def test_validate_passes_against_the_speculating_server(servers):
    """`steadyserve validate`: identical probes at once among background traffic, one vector per kind."""
    import asyncio

    from steadyserve.tools.validate import run_validate

    _, on = servers
    rep = asyncio.run(run_validate(on.http_url, None, n=12, concurrency=3, background=0.3, prompt=PROMPT,
                                   max_tokens=24, api_key="", progress=False))
    assert rep["passed"] and rep["errors"] == 0, rep
