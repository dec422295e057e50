"""gRPC front end against a real server (ephemeral ports, tiny model): round-trips, health,
reflection, bad input, message limits, metrics, and bitwise-identical Score under concurrency.

Overload, deadlines, cancellation and SIGTERM drain are in test_grpc_load.py (own servers).
"""

from __future__ import annotations

import asyncio
import struct
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from steadyserve.api.grpc import ERROR_FIELD_KEY, FINGERPRINT_KEY, codegen
from steadyserve.client import AsyncClient, Client, fingerprint_of, generate_request, logprobs_f32, pb

TEXT = "The quick brown fox jumps over the lazy dog, again and again."


@pytest.fixture(scope="module")
def client(server):
    with Client(server.grpc_addr, timeout=30, retries=False) as c:
        yield c


def test_checked_in_stubs_match_the_proto():
    assert codegen.stale_files() == [], "generated stubs are stale: run `make proto`"


def test_score_round_trip(server, client):
    resp, call = client.stub.Score.with_call(pb.ScoreRequest(text=TEXT, top_logprobs=3))
    ids = list(client.tokenize(TEXT).token_ids)
    assert [t.token_id for t in resp.tokens] == ids and resp.usage.prompt_tokens == len(ids)
    assert not resp.tokens[0].HasField("logprob")  # nothing to condition the first token on
    for t in resp.tokens[1:]:
        assert t.HasField("logprob") and t.logprob <= 0.0
        tops = [a.logprob for a in t.top]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and t.logprob <= tops[0]
    info = client.model_info()
    assert resp.fingerprint == info.fingerprint == fingerprint_of(call)
    assert resp.model == info.model and resp.request_id.startswith("req-")
    # Token ids in give the same bits as the text they came from.
    assert logprobs_f32(client.score(token_ids=ids)) == logprobs_f32(resp)


def test_score_matches_http_bitwise(server, client):
    """HTTP echo logprobs and gRPC Score are the same computation: the same float32 bits."""
    r = httpx.post(server.http_url + "/v1/completions", timeout=30,
                   json={"prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    http_lps = r.json()["choices"][0]["logprobs"]["token_logprobs"]
    assert http_lps[0] is None
    http_bytes = struct.pack(f"<{len(http_lps) - 1}f", *http_lps[1:])
    assert logprobs_f32(client.score(TEXT)) == http_bytes


def test_generate_round_trip(client):
    msgs = list(client.generate(TEXT, max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))
    assert [m.WhichOneof("event") for m in msgs][-1] == "final"
    assert all(m.WhichOneof("event") == "batch" for m in msgs[:-1])
    batches, final = [m.batch for m in msgs[:-1]], msgs[-1].final
    ids = [t for b in batches for t in b.token_ids]
    lps = [lp for b in batches for lp in b.logprobs]
    assert len(ids) == 8 == final.usage.completion_tokens
    assert [lp.token_id for lp in lps] == ids and all(len(lp.top) == 2 for lp in lps)
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.usage.prompt_tokens == len(client.tokenize(TEXT).token_ids)
    assert final.fingerprint == client.model_info().fingerprint
    # Greedy is deterministic, text deltas concatenate to the same text.
    again = list(client.generate(TEXT, max_tokens=8, temperature=0, ignore_eos=True, logprobs=2))
    assert [t for m in again[:-1] for t in m.batch.token_ids] == ids
    assert "".join(m.batch.text for m in again[:-1]) == "".join(b.text for b in batches)


def test_generate_reports_cached_prompt_tokens_with_the_same_logprobs(client):
    text = " ".join(f"item {i} of the list" for i in range(30))
    runs = [list(client.generate(text, max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)) for _ in range(2)]
    n = runs[0][-1].final.usage.prompt_tokens
    assert n > 64
    assert runs[1][-1].final.usage.cached_prompt_tokens == (n - 1) // 32 * 32  # full 32-token blocks
    lps = [[(lp.token_id, lp.logprob) for m in r[:-1] for lp in m.batch.logprobs] for r in runs]
    assert lps[0] == lps[1] and lps[0]


def test_generate_chat_and_stop_token(client):
    msgs = list(client.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0))
    assert msgs[-1].final.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    first = list(client.generate(TEXT, max_tokens=3, temperature=0, ignore_eos=True))[0].batch.token_ids[0]
    stopped = list(client.generate(TEXT, max_tokens=3, temperature=0, ignore_eos=True, stop_token_ids=[first]))
    assert stopped[-1].final.finish_reason == pb.FINISH_REASON_STOP


def test_model_info_and_tokenize(client):
    info = client.model_info()
    assert info.context_length == 512 and info.device == "cpu" and info.dtype == "float32"
    assert info.batch_invariant and info.fingerprint.endswith("-bi") and info.vocab_size > 0
    tok = client.tokenize(messages=[{"role": "user", "content": "hello"}])
    assert len(tok.token_ids) == len(tok.tokens) > 0 and tok.context_length == 512


def test_health_and_reflection(server, client):
    assert client.health() == "SERVING" and client.health("steadyserve.v1.Inference") == "SERVING"
    with pytest.raises(grpc.RpcError) as e:
        client.health("no.such.Service")
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    watch = client.health_stub.Watch(health_pb2.HealthCheckRequest(), timeout=5)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()
    with grpc.insecure_channel(server.grpc_addr) as ch:
        services = set(ProtoReflectionDescriptorDatabase(ch).get_services())
        health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert {"steadyserve.v1.Inference", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= services


BAD_SCORE = [
    (pb.ScoreRequest(text=""), "text"),
    (pb.ScoreRequest(), "input"),
    (pb.ScoreRequest(tokens=pb.TokenIds()), "tokens.ids"),
    (pb.ScoreRequest(tokens=pb.TokenIds(ids=[1, 10**6])), "tokens.ids[1]"),
    (pb.ScoreRequest(text="hi", top_logprobs=21), "top_logprobs"),
    (pb.ScoreRequest(text="hi", model="gpt-4"), "model"),
    (pb.ScoreRequest(text="hi", request_id="x" * 200), "request_id"),
    (pb.ScoreRequest(text="hi " * 700), "text"),  # longer than the 512-token context
]
BAD_GENERATE = [
    (generate_request("hi", temperature=-1.0), "params.temperature"),
    (generate_request("hi", temperature=float("nan")), "params.temperature"),
    (generate_request("hi", top_p=0.0), "params.top_p"),
    (generate_request("hi", top_p=1.5), "params.top_p"),
    (generate_request("hi", max_tokens=0), "params.max_tokens"),
    (generate_request("hi", max_tokens=5000), "params.max_tokens"),
    (generate_request("hello " * 50, max_tokens=500), "params.max_tokens"),  # prompt + max_tokens > context
    (generate_request("hi", logprobs=21), "params.logprobs"),
    (generate_request("hi", stop=[""]), "params.stop"),
    (generate_request("hi", stop=["a", "b", "c", "d", "e"]), "params.stop"),
    (generate_request(messages=[]), "chat.messages"),
    (generate_request(messages=[{"role": "robot", "content": "x"}]), "chat.messages[0].role"),
]


@pytest.mark.parametrize("req,field", BAD_SCORE + BAD_GENERATE, ids=lambda v: v if isinstance(v, str) else "")
def test_invalid_argument_names_the_field(client, req, field):
    with pytest.raises(grpc.RpcError) as e:
        if isinstance(req, pb.ScoreRequest):
            client.stub.Score(req, timeout=10)
        else:
            list(client.stub.Generate(req, timeout=10))
    err = e.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
    trailers = dict(err.trailing_metadata())
    assert trailers[ERROR_FIELD_KEY] == field and err.details().startswith(field)
    assert trailers[FINGERPRINT_KEY]


def test_oversize_message_gets_a_clean_error(client):
    with pytest.raises(grpc.RpcError) as e:
        client.stub.Score(pb.ScoreRequest(text="x" * (2 * 1024 * 1024)), timeout=10)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.value.details()
    assert client.score("still fine").usage.prompt_tokens > 0  # the connection survives


def test_200_concurrent_scores_are_bitwise_identical(server):
    async def run() -> tuple[list, float]:
        async with AsyncClient(server.grpc_addr, timeout=60, retries=False) as c:
            solo = logprobs_f32(await c.score(TEXT))
            t0 = time.perf_counter()
            results = await asyncio.gather(*(c.score(TEXT) for _ in range(200)), return_exceptions=True)
            return [solo] + [r if isinstance(r, Exception) else logprobs_f32(r) for r in results], \
                time.perf_counter() - t0

    results, seconds = asyncio.run(run())
    errors = [r for r in results if isinstance(r, Exception)]
    assert not errors, errors[:3]
    distinct = set(results)
    print(f"\n200 concurrent Score: {len(distinct)} distinct float32 vector(s), {seconds:.2f} s")
    assert len(distinct) == 1 and len(results[0]) > 0


def test_metrics_count_every_rpc_by_code(server, client):
    # Self-contained (pytest-randomly may run this before any other test of the module):
    # every counter must move by the calls made here.
    score = dict(grpc_type="unary", grpc_service="steadyserve.v1.Inference", grpc_method="Score")
    gen = dict(score, grpc_type="server_stream", grpc_method="Generate")
    watched = [("grpc_server_started_total", score), ("grpc_server_handled_total", dict(score, grpc_code="OK")),
               ("grpc_server_handled_total", dict(score, grpc_code="INVALID_ARGUMENT")),
               ("grpc_server_handled_total", dict(gen, grpc_code="OK")),
               ("steadyserve_requests_admitted_total", dict(transport="grpc"))]
    before = [server.metric(name, **labels) for name, labels in watched]
    client.score("count me")
    with pytest.raises(grpc.RpcError):
        client.stub.Score(pb.ScoreRequest(text=""), timeout=10)
    assert len(list(client.generate(TEXT, max_tokens=2, temperature=0, ignore_eos=True))) >= 1
    # The handled counter is bumped after the last message leaves; give it a moment.
    deadline = time.monotonic() + 5
    while True:
        after = [server.metric(name, **labels) for name, labels in watched]
        if all(a >= b + 1 for a, b in zip(after, before)) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    for (name, labels), b, a in zip(watched, before, after):
        assert a >= b + 1, (name, labels, b, a)
    # steadyserve's own service never ends a call with UNKNOWN or INTERNAL. (grpc's reflection service is
    # left out: one CI run counted a reflection stream whose client hung up as UNKNOWN, inside grpcio-reflection.)
    bad = [k for k, v in server.metrics().items() if k[0] == "grpc_server_handled_total" and v
           and dict(k[1])["grpc_code"] in ("UNKNOWN", "INTERNAL")
           and dict(k[1])["grpc_service"] == "steadyserve.v1.Inference"]
    assert not bad, bad
