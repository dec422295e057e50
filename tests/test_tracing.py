"""OpenTelemetry traces (--otlp-traces-endpoint) against a real OTLP/HTTP receiver on 127.0.0.1 (otlp_receiver.py):
the caller's traceparent joined over HTTP, WebSocket and gRPC; the GenAI attributes, the phase spans and the
engine's events of streamed and whole requests; error status on refused requests; and a dead collector that
costs the server nothing but counted drops.
"""

from __future__ import annotations

import json
import secrets
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx
import pytest
import torch
import websockets
import websockets.sync.client as ws_client

from steadyserve.api.otel import traces_endpoint
from steadyserve.client import generate_request, pb, score_request
from steadyserve.config import ConfigError, ServerConfig
from steadyserve.engine.kv_cache import STORAGE, resolve_kv_dtype
from steadyserve.numerics import DEFAULT_NATIVE_PATH
from steadyserve.testing.server import ServerProcess
from steadyserve.api.protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc

from http_util import parse_stream
from otlp_receiver import OtlpReceiver, Span

SERVER_KIND, INTERNAL_KIND = 2, 1  # OTLP Span.SpanKind
ERROR = 2  # OTLP Status.StatusCode
EXPORT_TIMEOUT_S = 2  # OTEL_EXPORTER_OTLP_TRACES_TIMEOUT of the traced server
MAX_QUEUE = 64  # OTEL_BSP_MAX_QUEUE_SIZE of the traced server
# The tiny model's K and V: layers x kv heads x head dim x 32 tokens x the bytes of the default path's cache format
KV_BLOCK_BYTES = 2 * 2 * 2 * 16 * 32 * STORAGE[resolve_kv_dtype("auto", torch.float32, DEFAULT_NATIVE_PATH)].itemsize


@pytest.fixture(scope="module")
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced(tiny_model: str, receiver: OtlpReceiver):
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_TIMEOUT": str(EXPORT_TIMEOUT_S),
           "OTEL_BSP_MAX_QUEUE_SIZE": str(MAX_QUEUE)}
    # A KV cache of 12 blocks (384 tokens): a few long generations at once must preempt each other.
    with ServerProcess(tiny_model, "--otlp-traces-endpoint", receiver.url, "--stall-timeout", "5",
                       "--kv-cache-memory", f"{12 * KV_BLOCK_BYTES}", env=env) as s:
        yield s


@pytest.fixture(scope="module")
def model(traced: ServerProcess) -> str:
    return httpx.get(traced.http_url + "/v1/models", timeout=10).json()["data"][0]["id"]


def traceparent() -> tuple[str, str, str]:
    """A caller's (header, trace id, span id), sampled."""
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def request_spans(receiver: OtlpReceiver, trace_id: str, num_choices: int = 1, decode: bool = True
                  ) -> tuple[Span, dict[str, list[Span]]]:
    """The request's SERVER span and its children by name, once validate + queue/prefill(/decode) per choice
    have all arrived."""
    count = 2 + num_choices * (3 if decode else 2)
    spans = receiver.wait_trace(trace_id, count)
    roots = [s for s in spans if s.kind == SERVER_KIND]
    assert len(roots) == 1, spans
    root = roots[0]
    children: dict[str, list[Span]] = {}
    for s in spans:
        if s is not root:
            assert s.parent_id == root.span_id and s.kind == INTERNAL_KIND, s
            children.setdefault(s.name, []).append(s)
    return root, children


def check_phases(root: Span, children: dict[str, list[Span]], generated: bool = True) -> dict[str, int]:
    """The phase spans and the events agree with each other and lie inside the request span. Returns the events'
    times by name."""
    events = {name: t for name, t, _ in root.events}
    names = [name for name, _, _ in root.events]
    expected = ["scheduled", "prefill_end", "first_token", "finished"] if generated else \
        ["scheduled", "prefill_end", "finished"]
    assert [n for n in names if n != "preempted"] == expected, names
    times = [t for _, t, _ in root.events]
    assert times == sorted(times) and root.start_ns <= times[0] and times[-1] <= root.end_ns
    (validate,), (queue,), (prefill,) = children["validate"], children["queue"], children["prefill"]
    assert validate.start_ns == root.start_ns and validate.end_ns <= root.end_ns
    assert queue.end_ns == prefill.start_ns == events["scheduled"]  # the queue wait ends at first scheduling
    assert prefill.end_ns == events["prefill_end"]
    if generated:
        (decode,) = children["decode"]
        assert decode.start_ns == events["first_token"] and decode.end_ns == events["finished"]
    assert all(s.status_code != ERROR for ss in children.values() for s in ss)
    return events


def test_http_completion_joins_the_callers_trace(traced, receiver, model):
    header, trace_id, parent = traceparent()
    r = httpx.post(traced.http_url + "/v1/completions", headers={"traceparent": header}, timeout=30,
                   json={"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0, "seed": 7,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    root, children = request_spans(receiver, trace_id)
    assert root.trace_id == trace_id and root.parent_id == parent  # joined the caller's trace
    assert root.name == f"text_completion {model}"
    a = root.attrs
    assert a["gen_ai.operation.name"] == "text_completion"
    assert a["gen_ai.request.model"] == a["gen_ai.response.model"] == model
    assert a["gen_ai.usage.input_tokens"] == body["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 6
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["gen_ai.request.max_tokens"] == 6 and a["gen_ai.request.temperature"] == 0.0
    assert a["gen_ai.request.seed"] == 7 and a["gen_ai.request.stream"] is False
    assert body["id"] == "cmpl-" + a["gen_ai.response.id"] and a["steadyserve.request_id"] == a["gen_ai.response.id"]
    assert a["steadyserve.fingerprint"] == body["system_fingerprint"] == r.headers["x-steadyserve-fingerprint"]
    assert a["http.response.status_code"] == 200 and a["http.route"] == "/v1/completions"
    assert a["steadyserve.transport"] == "http"
    assert root.status_code != ERROR and "error.type" not in a
    assert root.resource["service.name"] == "steadyserve"
    check_phases(root, children)


def test_http_chat_stream_and_best_of(traced, receiver, model):
    header, trace_id, parent = traceparent()
    r = httpx.post(traced.http_url + "/v1/chat/completions", headers={"traceparent": header}, timeout=30,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "stream": True,
                         "ignore_eos": True, "stream_options": {"include_usage": True}, "top_p": 0.9})
    assert r.status_code == 200
    chunks, done = parse_stream(r.content)
    assert done
    usage = chunks[-1]["usage"]
    root, children = request_spans(receiver, trace_id)
    assert root.parent_id == parent and root.name == f"chat {model}"
    a = root.attrs
    assert a["gen_ai.request.stream"] is True and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 5
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.response.finish_reasons"] == ["length"]
    assert a["steadyserve.fingerprint"] == chunks[0]["system_fingerprint"]
    check_phases(root, children)

    # n = 2 choices: a queue/prefill/decode trio per engine request, told apart by steadyserve.choice.
    header, trace_id, _ = traceparent()
    r = httpx.post(traced.http_url + "/v1/completions", headers={"traceparent": header}, timeout=30,
                   json={"prompt": "ab", "max_tokens": 3, "n": 2, "ignore_eos": True, "seed": 1})
    assert r.status_code == 200, r.text
    root, children = request_spans(receiver, trace_id, num_choices=2)
    assert root.attrs["gen_ai.request.choice.count"] == 2
    assert root.attrs["gen_ai.response.finish_reasons"] == ["length", "length"]
    assert root.attrs["gen_ai.usage.output_tokens"] == r.json()["usage"]["completion_tokens"] == 6
    for name in ("queue", "prefill", "decode"):
        assert sorted(s.attrs["steadyserve.choice"] for s in children[name]) == [0, 1]


def test_websocket_stream_joins_the_callers_trace(traced, receiver, model):
    header, trace_id, parent = traceparent()
    url = traced.http_url.replace("http://", "ws://") + "/v1/stream"
    with ws_client.connect(url, additional_headers={"traceparent": header}) as ws:
        ws.send(json.dumps({"prompt": "hello", "max_tokens": 4, "ignore_eos": True}))
        msgs = []
        try:
            while True:
                msgs.append(json.loads(ws.recv(timeout=30)))
        except websockets.exceptions.ConnectionClosedOK:
            pass
    assert msgs[-1]["type"] == "final"
    root, children = request_spans(receiver, trace_id)
    assert root.parent_id == parent and root.attrs["steadyserve.transport"] == "ws"
    assert root.attrs["gen_ai.usage.output_tokens"] == msgs[-1]["usage"]["completion_tokens"] == 4
    assert root.status_code != ERROR
    check_phases(root, children)


def test_grpc_generate_and_score_join_the_callers_trace(traced, receiver, model):
    with grpc.insecure_channel(traced.grpc_addr) as ch:
        stub = pb_grpc.InferenceStub(ch)
        header, trace_id, parent = traceparent()
        msgs = list(stub.Generate(generate_request("hello there", max_tokens=5, temperature=0, ignore_eos=True),
                                  metadata=[("traceparent", header)], timeout=30))
        final = msgs[-1].final
        root, children = request_spans(receiver, trace_id)
        assert root.parent_id == parent and root.name == f"text_completion {model}"
        a = root.attrs
        assert a["rpc.system"] == "grpc" and a["rpc.method"] == "Generate" and a["rpc.grpc.status_code"] == 0
        assert a["gen_ai.usage.output_tokens"] == final.usage.completion_tokens == 5
        assert a["gen_ai.usage.input_tokens"] == final.usage.prompt_tokens
        assert a["steadyserve.fingerprint"] == final.fingerprint and a["steadyserve.transport"] == "grpc"
        assert a["gen_ai.response.finish_reasons"] == ["length"]
        check_phases(root, children)

        header, trace_id, parent = traceparent()
        resp = stub.Score(score_request("one two three"), metadata=[("traceparent", header)], timeout=30)
        root, children = request_spans(receiver, trace_id, decode=False)
        assert root.parent_id == parent and root.name == f"score {model}"
        assert root.attrs["gen_ai.usage.input_tokens"] == resp.usage.prompt_tokens
        assert root.attrs["gen_ai.usage.output_tokens"] == 0
        check_phases(root, children, generated=False)


def test_preemptions_are_events_of_the_preempted_requests(traced, receiver):
    """Five 150-token generations at once need 25 of the 12 KV blocks: the engine preempts, and each preemption
    is an event on that request's span (as many as steadyserve_preemptions_total counted)."""
    before = traced.metric("steadyserve_preemptions_total")
    parents = [traceparent() for _ in range(5)]

    def one(header: str) -> dict:
        r = httpx.post(traced.http_url + "/v1/completions", headers={"traceparent": header}, timeout=60,
                       json={"prompt": "count with me", "max_tokens": 150, "ignore_eos": True})
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(len(parents)) as pool:
        bodies = list(pool.map(one, [p[0] for p in parents]))
    preempted = traced.metric("steadyserve_preemptions_total") - before
    assert preempted > 0, "the test needs preemptions"
    events = 0
    for (_, trace_id, parent), body in zip(parents, bodies):
        root, children = request_spans(receiver, trace_id)
        assert root.parent_id == parent
        assert root.attrs["gen_ai.usage.output_tokens"] == body["usage"]["completion_tokens"] == 150
        times = check_phases(root, children)
        for name, when, _ in root.events:
            if name == "preempted":
                events += 1
                assert times["scheduled"] <= when <= times["finished"]
    assert events == preempted


def test_refused_requests_are_error_spans(traced, receiver, model):
    header, trace_id, parent = traceparent()
    r = httpx.post(traced.http_url + "/v1/completions", headers={"traceparent": header}, timeout=30,
                   json={"prompt": "x", "max_tokens": 4, "temperature": 5})
    assert r.status_code == 400
    (root, validate) = sorted(receiver.wait_trace(trace_id, 2), key=lambda s: s.kind != SERVER_KIND)
    assert root.parent_id == parent and root.status_code == ERROR
    assert root.attrs["error.type"] == r.json()["error"]["code"] == "invalid_value"
    assert "temperature" in root.status_message and root.attrs["http.response.status_code"] == 400
    assert validate.name == "validate" and validate.status_code == ERROR and validate.parent_id == root.span_id
    assert "gen_ai.usage.output_tokens" not in root.attrs  # never admitted: no engine request

    with grpc.insecure_channel(traced.grpc_addr) as ch:
        header, trace_id, parent = traceparent()
        with pytest.raises(grpc.RpcError) as e:
            list(pb_grpc.InferenceStub(ch).Generate(generate_request("x", max_tokens=10**6),
                                                    metadata=[("traceparent", header)], timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    (root, validate) = sorted(receiver.wait_trace(trace_id, 2), key=lambda s: s.kind != SERVER_KIND)
    assert root.parent_id == parent and root.status_code == ERROR and validate.status_code == ERROR
    assert root.attrs["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert root.attrs["error.type"] == "invalid_value"


def test_a_stream_the_client_leaves_is_an_error_span(traced, receiver):
    """The client reads one chunk and hangs up: the request's events end with client_disconnect, the engine
    aborts it, and the span (sent once the engine's final output is in) says so."""
    header, trace_id, parent = traceparent()
    with httpx.stream("POST", traced.http_url + "/v1/completions", headers={"traceparent": header}, timeout=30,
                      json={"prompt": "go", "max_tokens": 300, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    root, children = request_spans(receiver, trace_id)
    assert root.parent_id == parent and root.status_code == ERROR
    assert root.attrs["error.type"] == "client_disconnect"
    assert root.attrs["gen_ai.response.finish_reasons"] == ["abort"]
    assert 0 < root.attrs["gen_ai.usage.output_tokens"] < 300
    assert [n for n, _, _ in root.events][-1] == "finished"


def test_a_request_without_traceparent_starts_a_trace(traced, receiver):
    rid = "trace-" + secrets.token_hex(6)
    r = httpx.post(traced.http_url + "/v1/completions", headers={"x-request-id": rid}, timeout=30,
                   json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200
    deadline = time.monotonic() + 30
    while not (roots := receiver.find(lambda s: s.attrs.get("steadyserve.request_id") == rid)):
        assert time.monotonic() < deadline, "no span for the request"
        time.sleep(0.05)
    assert roots[0].parent_id == "" and len(roots[0].trace_id) == 32


def _latencies(url: str, n: int) -> list[float]:
    out = []
    with httpx.Client(timeout=30) as c:
        for i in range(n):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/completions", json={"prompt": f"p{i}", "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            out.append(time.perf_counter() - t0)
    return out


def test_a_dead_collector_costs_only_counted_drops(traced, receiver):
    """A collector that takes connections and never answers: requests keep their latency (the exporter waits on
    its own thread), spans past the queue bound are dropped at once, and the batches the exporter gave up on
    are counted."""
    base = _latencies(traced.http_url, 6)
    dropped0 = {r: traced.metric("steadyserve_trace_spans_dropped_total", reason=r)
                for r in ("queue_full", "export_failed")}
    exported0 = traced.metric("steadyserve_trace_spans_exported_total")
    assert exported0 > 0  # the live collector took spans
    receiver.mode = "hang"
    try:
        dead = _latencies(traced.http_url, 30)  # 5 spans each: past MAX_QUEUE while the exporter waits
        deadline = time.monotonic() + 6 * EXPORT_TIMEOUT_S
        while traced.metric("steadyserve_trace_spans_dropped_total", reason="export_failed") <= \
                dropped0["export_failed"]:
            assert time.monotonic() < deadline, "no failed export counted"
            time.sleep(0.1)
    finally:
        receiver.mode = "ok"
    assert traced.metric("steadyserve_trace_spans_dropped_total", reason="queue_full") > dropped0["queue_full"]
    # Latency: a request never waits on the collector (which would cost EXPORT_TIMEOUT_S each).
    assert statistics.median(dead) < statistics.median(base) + 0.5, (base, dead)
    assert max(dead) < EXPORT_TIMEOUT_S, dead
    # The collector back: spans flow again.
    header, trace_id, _ = traceparent()
    httpx.post(traced.http_url + "/v1/completions", headers={"traceparent": header}, timeout=30,
               json={"prompt": "x", "max_tokens": 2})
    receiver.wait_trace(trace_id, 5)


def test_endpoint_from_the_flag_or_the_standard_variables():
    assert traces_endpoint("") == traces_endpoint("", {}) == ""
    assert traces_endpoint("http://c:4318", {}) == "http://c:4318/v1/traces"
    assert traces_endpoint("https://c/otlp/v1/traces", {}) == "https://c/otlp/v1/traces"
    assert traces_endpoint("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == "http://c:4318/v1/traces"
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}
    assert traces_endpoint("", env) == "http://t/x"  # the signal's own variable is taken as given
    assert traces_endpoint("http://flag:1", env) == "http://flag:1/v1/traces"  # the flag wins
    assert traces_endpoint("http://flag:1", {"OTEL_SDK_DISABLED": "true"}) == ""
    for bad, env in (("", {"OTEL_EXPORTER_OTLP_ENDPOINT": "localhost"}),
                     ("", {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "ftp://c/"}),
                     ("http://c:4318", {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"})):
        with pytest.raises(ConfigError, match=next(iter(env))):
            traces_endpoint(bad, env)
    with pytest.raises(ConfigError, match="--otlp-traces-endpoint"):  # the flag's own check, with the others
        ServerConfig(otlp_traces_endpoint="collector:4318").validate()
    ServerConfig(otlp_traces_endpoint="http://[::1]:4318").validate()


def test_a_collector_that_is_gone_costs_a_counted_drop(monkeypatch):
    """Nothing listens at the collector's address (connection refused): recording a request's spans returns at
    once and the batch is counted as dropped when the exporter gives up (the Tracing object of a server, used
    in-process with the server's own metrics)."""
    import socket

    from steadyserve.api.otel import Tracing
    from steadyserve.metrics import Metrics

    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "1")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    metrics = Metrics("m", "fp", "cpu", "float32", True)
    tracing = Tracing(f"http://127.0.0.1:{port}/v1/traces", "m", "fp", metrics)
    try:
        header, _, _ = traceparent()
        t0 = time.perf_counter()
        for _ in range(20):
            tracing.begin("http", "chat", {"traceparent": header}).ended(("400", "HTTP 400"))
        assert time.perf_counter() - t0 < 0.5  # 40 spans recorded without waiting on the exporter
        dropped = metrics.trace_spans_dropped.labels("export_failed")
        deadline = time.monotonic() + 15
        while dropped._value.get() < 40:
            assert time.monotonic() < deadline, dropped._value.get()
            time.sleep(0.05)
        assert metrics.trace_spans_exported._value.get() == 0
    finally:
        assert tracing.shutdown(5.0)
