"""Metrics, logs and alert rules against a live server (issue 6).

Counters must move exactly as events happen: one disconnect, one 429, one
INVALID_ARGUMENT. The alert rules may only name metrics a live scrape has.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import grpc
import httpx
import pytest
import yaml

from steadyserve.client import Client
from steadyserve.engine.async_engine import SECOND_MODEL_THREAD
from steadyserve.testing.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    # One running sequence and no queue: a second concurrent request is refused (429).
    with ServerProcess(tiny_model, "--max-num-seqs", "1", "--max-queue", "0", "--log-format", "json") as s:
        yield s


def wait_for(fn, timeout: float = 10.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(interval)
    return fn()


def wait_for_the_seat(srv: ServerProcess) -> None:
    """The server has one seat: wait until whatever an earlier test left in flight (any order) is gone.

    Admission counts requests in flight (admitted, not yet finished), which the running gauge can show free a
    moment before: an aborted stream leaves the batch, then its finish is delivered. The console's stats give
    the count admission uses."""
    def free() -> bool:
        gauges = httpx.get(srv.http_url + "/v1/console/stats", timeout=10).json()["gauges"]
        return gauges["in_flight"] == 0
    assert wait_for(free), "the server's seat never came free"


@pytest.fixture(autouse=True)
def seat_free_before_each_test(srv: ServerProcess) -> None:
    """Tests run in random order, and one that closed a stream may leave its request in flight a moment after
    it returns: every test starts with the one seat free, so its own first request is not the 429."""
    wait_for_the_seat(srv)


def open_stream(srv: ServerProcess, max_tokens: int = 400) -> socket.socket:
    """Start an SSE stream on a raw socket and read until its first event arrives (once the seat is free)."""
    wait_for_the_seat(srv)
    body = json.dumps({"prompt": "The quick brown fox", "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()
    s = socket.create_connection(("127.0.0.1", srv.http_port), timeout=30)
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    data = b""
    while b"data:" not in data:
        chunk = s.recv(4096)
        assert chunk, f"server closed the stream before the first event: {data[:300]!r}"
        data += chunk
    return s


def test_scrape_parses_and_histograms_fill(srv: ServerProcess) -> None:
    r = httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True})
    assert r.status_code == 200
    m = srv.metrics()
    for h in ("steadyserve_time_to_first_token_seconds", "steadyserve_inter_token_latency_seconds",
              "steadyserve_request_duration_seconds", "steadyserve_queue_wait_seconds", "steadyserve_batch_size",
              "steadyserve_step_duration_seconds", "http_request_duration_seconds"):
        count = sum(v for (name, _), v in m.items() if name == h + "_count")
        assert count > 0, f"{h} has no observations after a generation"
    assert wait_for(lambda: srv.metric("steadyserve_event_loop_lag_seconds_count") > 0)
    assert srv.metric("steadyserve_engine_alive") == 1
    assert srv.metric("steadyserve_device_mismatch") == 0
    assert srv.metric("steadyserve_generated_tokens_total") >= 8
    assert srv.metric("steadyserve_process_resident_memory_bytes") > 50e6
    fp = r.headers["x-steadyserve-fingerprint"]
    info = [labels for (name, labels), v in m.items() if name == "steadyserve_model_info" and v == 1]
    assert len(info) == 1 and dict(info[0])["fingerprint"] == fp and dict(info[0])["device"] == "cpu"


def test_one_disconnect_counts_once(srv: ServerProcess) -> None:
    before = srv.metric("steadyserve_streams_aborted_total", reason="client_disconnect")
    s = open_stream(srv)
    s.close()
    assert wait_for(lambda: srv.metric("steadyserve_streams_aborted_total", reason="client_disconnect") == before + 1)
    assert wait_for(lambda: srv.metric("steadyserve_requests_running") == 0)
    time.sleep(0.3)
    assert srv.metric("steadyserve_streams_aborted_total", reason="client_disconnect") == before + 1


def test_one_429_counts_once(srv: ServerProcess) -> None:
    before = srv.metric("steadyserve_requests_rejected_total", reason="overloaded")
    s = open_stream(srv)  # holds the only seat
    try:
        r = httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4})
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "overloaded"
    finally:
        s.close()
    assert srv.metric("steadyserve_requests_rejected_total", reason="overloaded") == before + 1
    # Counted by the middleware once the response is done, which may be just after the client has it.
    assert wait_for(lambda: srv.metric("http_requests_total", method="POST", route="/v1/completions",
                                       status="429") >= 1)


def test_one_invalid_argument_counts_once(srv: ServerProcess) -> None:
    labels = dict(grpc_type="unary", grpc_service="steadyserve.v1.Inference", grpc_method="Score",
                  grpc_code="INVALID_ARGUMENT")
    before = srv.metric("grpc_server_handled_total", **labels)
    with Client(srv.grpc_addr, retries=False) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.score("")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The server may count the call just after the client sees its status: wait for the count, then make a
    # later call and wait for it to be counted too, so a second (double) count of the first would be seen.
    assert wait_for(lambda: srv.metric("grpc_server_handled_total", **labels) >= before + 1)
    ok = {**labels, "grpc_code": "OK"}
    ok_before = srv.metric("grpc_server_handled_total", **ok)
    wait_for_the_seat(srv)
    with Client(srv.grpc_addr, retries=False) as c:
        c.score("a valid one")
    assert wait_for(lambda: srv.metric("grpc_server_handled_total", **ok) >= ok_before + 1)
    assert srv.metric("grpc_server_handled_total", **labels) == before + 1
    started = dict(grpc_type="unary", grpc_service="steadyserve.v1.Inference", grpc_method="Score")
    assert srv.metric("grpc_server_started_total", **started) >= 1


def test_one_structured_log_line_per_request(srv: ServerProcess) -> None:
    rid = "obs-log-test-1"
    r = httpx.post(srv.http_url + "/v1/completions", headers={"x-request-id": rid},
                   json={"prompt": "hello", "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200 and r.headers["x-request-id"] == rid

    def lines():
        out = []
        for line in srv.logs().splitlines():
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if obj.get("request_id") == rid:
                out.append(obj)
        return out

    found = wait_for(lines)
    assert len(found) == 1
    rec = found[0]
    assert rec["transport"] == "http" and rec["prompt_tokens"] > 0 and rec["generated_tokens"] == 3
    assert rec["finish_reason"] == "length" and rec["fingerprint"] == r.headers["x-steadyserve-fingerprint"]
    assert rec["ttft_s"] is not None and rec["total_s"] >= rec["ttft_s"]


def test_model_code_runs_on_one_thread(srv: ServerProcess) -> None:
    """Load, self-test and the engine loop share one thread (a second OpenMP pool halves small-GEMM speed)."""
    assert httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      timeout=30).status_code == 200
    started = [obj for obj in map(_json_or_none, srv.logs().splitlines())
               if obj and obj.get("msg") == "engine loop started"]
    assert len(started) == 1, started
    assert started[0]["built_on_this_thread"] is True, started[0]
    assert SECOND_MODEL_THREAD not in srv.logs()


def _json_or_none(line: str) -> dict | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


PROMQL_WORDS = {"sum", "by", "rate", "increase", "histogram_quantile", "count", "max", "min", "avg", "on",
                "avg_over_time", "without", "le", "instance", "reason", "status", "grpc_code", "model", "device", "dtype",
                "batch_invariant", "and", "or", "unless", "bool", "ignoring", "group_left", "group_right"}


def scraped_after_traffic(srv: ServerProcess) -> set[str]:
    """Metric names exported once the server has served HTTP and gRPC (labelled counters appear on first use):
    each test makes its own traffic, so it passes alone and in any order."""
    assert httpx.post(srv.http_url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                      timeout=30).status_code == 200
    with Client(srv.grpc_addr, timeout=30, retries=False) as c:
        assert c.score("hello there").usage.prompt_tokens > 0
    return {name for name, _ in srv.metrics()}


def test_alert_rules_name_only_live_metrics(srv: ServerProcess) -> None:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/alerts.yml").read_text())
    scraped = scraped_after_traffic(srv)
    alerts = [r for g in rules["groups"] for r in g["rules"]]
    assert {a["alert"] for a in alerts} >= {"SteadyserveServerErrors", "SteadyserveStalledStreams",
                                            "SteadyserveStreamBacklog", "SteadyserveEventLoopLag",
                                            "SteadyserveKVCacheFull", "SteadyserveRejecting",
                                            "SteadyserveEngineDead", "SteadyserveDeviceMismatch",
                                            "SteadyserveMemoryNearLimit"}
    for a in alerts:
        expr = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]', " ", a["expr"])
        names = {w for w in re.findall(r"[a-zA-Z_:][a-zA-Z0-9_:]*", expr) if w not in PROMQL_WORDS}
        assert names, a["alert"]
        for n in names:
            assert n in scraped, f"alert {a['alert']} uses {n}, which the server does not export"
        assert set(a) >= {"alert", "expr", "labels", "annotations"}


def test_memory_limit_gauge_beside_rss_and_the_alert_quiet_on_a_healthy_server(srv: ServerProcess) -> None:
    """steadyserve_memory_limit_bytes is the limit the server reported at start-up, and the memory alert's
    condition (RSS > 90% of it) is false on a server far from its limit."""
    limit = srv.metric("steadyserve_memory_limit_bytes")
    rss = srv.metric("steadyserve_process_resident_memory_bytes")
    platform = httpx.get(srv.http_url + "/v1/models", timeout=30).json()["data"][0]["platform"]
    assert limit == platform["memory_limit_bytes"] > 0 and platform["memory_limit_source"]
    assert 0 < rss < 0.9 * limit


def test_grafana_dashboard_queries_live_metrics(srv: ServerProcess) -> None:
    dash = json.loads((ROOT / "deploy/grafana/steadyserve.json").read_text())
    scraped = scraped_after_traffic(srv)
    for panel in dash["panels"]:
        for t in panel["targets"]:
            expr = re.sub(r'\{[^}]*\}|"[^"]*"|\[[^\]]*\]', " ", t["expr"])
            for n in re.findall(r"[a-z_]+_(?:total|seconds_bucket|bytes|ratio|running|waiting)\b", expr):
                assert n in scraped, f"panel {panel['title']!r} queries {n}, not exported"
