"""Keys as tenants (issue 61) against a real server: --api-keys FILE on 127.0.0.1, the real engine, real sockets.

One server (without --metrics-auth: a keys file guards /metrics anyway; with the TEST-ONLY slow-request fault, so a
request stays in flight on any CPU, and a capacity of 8: 2 running + 6 waiting) and a keys file of five tenants:
  alpha:  admin, every endpoint                 beta:   max_concurrent 1
  scorer: endpoints score, tokenize and models  meter:  output_tokens_per_minute 20
  gamma:  added by the reload test, removed again
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import grpc
import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from http_util import sse_events, wait_for
from steadyserve.client import Client
from steadyserve.tenants import keys_file_entry
from steadyserve.testing.faults import SLOW_REQUEST_MARKER
from steadyserve.testing.server import ServerProcess

KEYS = {name: f"key-{name}-" + "z" * 20 for name in ("alpha", "beta", "scorer", "meter", "gamma")}
C = "/v1/completions"
BODY = {"prompt": "hello there", "max_tokens": 2, "temperature": 0}


def keys_file(*names: str) -> str:
    entries = {
        "alpha": 'roles = ["admin"]\nweight = 2',
        "beta": "max_concurrent = 1",
        "scorer": 'endpoints = ["score", "tokenize", "models"]',
        "meter": "output_tokens_per_minute = 20",
        "gamma": 'priority = "batch"',
    }
    return "".join(keys_file_entry(n, KEYS[n], entries[n] + "\n") for n in names)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(keys_file("alpha", "beta", "scorer", "meter"))
    return path


@pytest.fixture(scope="module")
def server(tiny_model: str, keys_path: Path):
    with ServerProcess(tiny_model, "--api-keys", str(keys_path), "--max-num-seqs", "2",
                       "--max-queue", "6", threads=1, test_faults=True) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.http_url, timeout=60) as c:
        yield c


def slow_stream(server, name: str, started: threading.Event, result: dict, max_tokens: int = 300,
                request_id: str = "") -> None:
    """A streamed completion that stays in flight >= max_tokens x 5 ms (the slow-request fault)."""
    body = {"prompt": f"{SLOW_REQUEST_MARKER} go", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    headers = {**auth(name), **({"x-request-id": request_id} if request_id else {})}
    with httpx.stream("POST", server.http_url + C, json=body, headers=headers, timeout=120) as r:
        result["status"] = r.status_code
        raw = b""
        for chunk in r.iter_bytes():
            raw += chunk
            started.set()
        result["events"] = sse_events(raw) if r.status_code == 200 else []
        result["body"] = raw
    started.set()


def finish_reason(events: list[str]) -> str | None:
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    return next((c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                 c["choices"][0]["finish_reason"]), None)


# ---- identity over every transport ------------------------------------------------------------------------

def test_a_tenant_key_works_over_http_anthropic_websocket_and_grpc(server, http) -> None:
    assert http.post(C, json=BODY, headers=auth("alpha")).status_code == 200
    r = http.post("/v1/messages", headers={"x-api-key": KEYS["alpha"], "anthropic-version": "2023-06-01"},
                  json={"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code in (200, 404), r.text  # 404: model name; the key itself got through
    if r.status_code == 404:
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "not_found_error"
    with connect(f"ws://127.0.0.1:{server.http_port}/v1/stream", additional_headers=auth("alpha"),
                 open_timeout=30) as ws:
        ws.send(json.dumps(BODY))
        msgs = [json.loads(ws.recv(timeout=30))]
        while msgs[-1]["type"] not in ("final", "error"):
            msgs.append(json.loads(ws.recv(timeout=30)))
        assert msgs[-1]["type"] == "final"
    with Client(server.grpc_addr, api_key=KEYS["alpha"], timeout=30, retries=False) as c:
        assert c.score("with a tenant key").usage.prompt_tokens > 0
    with grpc.insecure_channel(server.grpc_addr) as ch:  # gRPC metadata x-api-key, as over HTTP
        from steadyserve.api.protos.steadyserve.v1 import inference_pb2 as pb, inference_pb2_grpc as pb_grpc
        r = pb_grpc.InferenceStub(ch).Score(pb.ScoreRequest(text="x-api-key metadata"),
                                            metadata=(("x-api-key", KEYS["alpha"]),), timeout=30)
        assert r.usage.prompt_tokens > 0
    for bad in ({}, {"Authorization": "Bearer " + KEYS["alpha"][:-1]}, {"x-api-key": "nope"}):
        r = http.post(C, json=BODY, headers=bad)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", bad
    with Client(server.grpc_addr, api_key="nope", timeout=30, retries=False) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.score("x")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_endpoints_and_the_admin_role_are_enforced_with_403(server, http) -> None:
    r = http.post(C, json=BODY, headers=auth("scorer"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "forbidden", r.text
    assert "scorer" in r.json()["error"]["message"] and KEYS["scorer"] not in r.text
    r = http.post("/v1/messages", headers={"x-api-key": KEYS["scorer"]},
                  json={"model": "x", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
    with pytest.raises(InvalidStatus) as ws_refused:  # the WebSocket (endpoint stream): refused at the handshake
        with connect(f"ws://127.0.0.1:{server.http_port}/v1/stream", additional_headers=auth("scorer"),
                     open_timeout=30):
            pass
    assert ws_refused.value.response.status_code == 403
    assert http.post("/tokenize", json={"prompt": "a b"}, headers=auth("scorer")).status_code == 200
    assert http.get("/v1/models", headers=auth("scorer")).status_code == 200
    with Client(server.grpc_addr, api_key=KEYS["scorer"], timeout=30, retries=False) as c:
        assert c.score("scoring is allowed").usage.prompt_tokens > 0
        with pytest.raises(grpc.RpcError) as e:
            list(c.generate("generating is not", max_tokens=2))
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # the console's API and /metrics need the admin role (a keys file guards /metrics without --metrics-auth)
    assert http.get("/v1/console/stats", headers=auth("beta")).status_code == 403
    stats = http.get("/v1/console/stats", headers=auth("alpha"))
    assert stats.status_code == 200
    by_name = {t["name"]: t for t in stats.json()["tenants"]}  # the console's capacity by tenant
    assert {"alpha", "scorer"} <= set(by_name) and by_name["alpha"]["weight"] == 2.0
    assert by_name["scorer"]["admitted"] >= 1 and by_name["beta"]["max_concurrent"] == 1
    assert http.get("/metrics", headers=auth("beta")).status_code == 403
    assert http.get("/metrics", headers=auth("alpha")).status_code == 200
    assert http.get("/metrics").status_code == 401


# ---- each tenant's own limits -------------------------------------------------------------------------------

def test_a_tenant_over_its_concurrency_gets_429_while_others_are_admitted(server, http) -> None:
    started, result = threading.Event(), {}
    t = threading.Thread(target=slow_stream, args=(server, "beta", started, result))
    t.start()
    try:
        assert started.wait(60)
        r = http.post(C, json=BODY, headers=auth("beta"))
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == "tenant_concurrency" and "max_concurrent is 1" in err["message"]
        assert int(r.headers["retry-after"]) >= 1
        with Client(server.grpc_addr, api_key=KEYS["beta"], timeout=30, retries=False) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.score("over its limit")
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(e.value.trailing_metadata())["steadyserve-error-code"] == "tenant_concurrency"
            with pytest.raises(grpc.RpcError) as e:  # a streaming RPC is the same tenant
                list(c.generate("over its limit", max_tokens=2))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert http.post(C, json=BODY, headers=auth("alpha")).status_code == 200  # another tenant: admitted
        assert result.get("status") is None or t.is_alive(), "the slow stream ended before the checks"
    finally:
        t.join(120)
    assert result["status"] == 200 and finish_reason(result["events"]) == "length"
    assert http.post(C, json=BODY, headers=auth("beta")).status_code == 200  # its seat is free again
    line = next(x for x in server.metrics_text(auth("alpha")).splitlines()
                if x.startswith('steadyserve_tenant_requests_rejected_total{reason="tenant_concurrency",tenant="beta"}'))
    assert float(line.split()[-1]) >= 3.0, line


def test_a_tenant_over_its_tokens_per_minute_gets_429_from_its_own_refill(server, http) -> None:
    body = {"prompt": "count", "max_tokens": 30, "ignore_eos": True}
    assert http.post(C, json=body, headers=auth("meter")).status_code == 200  # admitted full; 30 > 20: in debt
    r = http.post(C, json=body, headers=auth("meter"))
    assert r.status_code == 429 and r.json()["error"]["code"] == "tenant_output_tokens", r.text
    assert "output_tokens_per_minute (20)" in r.json()["error"]["message"]
    # the debt (10 tokens) and one token more, at 20 a minute: about 33 s
    assert 20 <= int(r.headers["retry-after"]) <= 40, r.headers["retry-after"]
    assert http.post(C, json=body, headers=auth("alpha")).status_code == 200


def test_a_flood_past_three_quarters_of_capacity_leaves_the_rest_to_other_tenants(server, http) -> None:
    """alpha (weight 2 of 5) sends 8 slow streams at once to a server that admits 8: it gets 6 (three
    quarters: any tenant takes what is free up to there), then 429 tenant_share, while beta is admitted."""
    results = [({}, threading.Event()) for _ in range(8)]
    threads = [threading.Thread(target=slow_stream, args=(server, "alpha", ev, res)) for res, ev in results]
    for t in threads:
        t.start()
    try:
        # Every answer's status is in (2 refusals, 6 admissions); a refused stream's thread may still be reading its
        # error body, so the count is of admitted streams not yet ended, each in flight >= 1.5 s (slow_stream).
        wait_for(lambda: sorted(res.get("status", 0) for res, _ in results) == [200] * 6 + [429] * 2, 60,
                 what="alpha's 6 admissions and 2 refusals")
        in_flight = sum(res["status"] == 200 and "events" not in res for res, _ in results)
        assert in_flight == 6, "alpha's streams ended early: slow them down"
        r = http.post(C, json=BODY, headers=auth("beta"))
        assert r.status_code == 200, r.text  # another tenant, while alpha holds 6 of 8: admitted
    finally:
        for t in threads:
            t.join(120)
    statuses = sorted(res["status"] for res, _ in results)
    assert statuses == [200] * 6 + [429] * 2, statuses
    refused = [json.loads(res["body"]) for res, _ in results if res["status"] == 429]
    assert all(b["error"]["code"] == "tenant_share" and "alpha" in b["error"]["message"] for b in refused)
    assert all(finish_reason(res["events"]) == "length" for res, _ in results if res["status"] == 200)


# ---- isolation --------------------------------------------------------------------------------------------

def test_a_stored_response_is_404_to_another_tenant(http) -> None:
    r = http.post("/v1/responses", headers=auth("alpha"), json={"input": "hi", "max_output_tokens": 2})
    assert r.status_code == 200, r.text
    rid = r.json()["id"]
    assert http.get(f"/v1/responses/{rid}", headers=auth("alpha")).status_code == 200
    theirs = http.get(f"/v1/responses/{rid}", headers=auth("beta"))
    never = http.get("/v1/responses/resp_never_made", headers=auth("beta"))
    assert theirs.status_code == never.status_code == 404
    assert theirs.json()["error"]["message"].replace(rid, "X") == never.json()["error"]["message"].replace(
        "resp_never_made", "X")  # the same answer as an id never stored: no oracle
    r = http.post("/v1/responses", headers=auth("beta"),
                  json={"input": "and then", "max_output_tokens": 2, "previous_response_id": rid})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert http.delete(f"/v1/responses/{rid}", headers=auth("beta")).status_code == 404
    assert http.get(f"/v1/responses/{rid}", headers=auth("alpha")).status_code == 200


def test_a_request_id_in_flight_for_one_tenant_is_free_to_another(server, http) -> None:
    """Another tenant's in-flight request id is neither refused nor shared: the request runs as if the id were
    free (no oracle for ids), and gets its own output."""
    started, result = threading.Event(), {}
    t = threading.Thread(target=slow_stream, args=(server, "beta", started, result, 200, "shared-id-1"))
    t.start()
    try:
        assert started.wait(60)
        r = http.post(C, json={**BODY, "max_tokens": 3}, headers={**auth("alpha"), "x-request-id": "shared-id-1"})
        assert r.status_code == 200 and r.headers["x-request-id"] == "shared-id-1", r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    finally:
        t.join(120)
    assert result["status"] == 200 and finish_reason(result["events"]) == "length"


def test_per_tenant_metrics_and_no_key_in_clear_anywhere(server, http) -> None:
    http.post(C, json=BODY, headers=auth("alpha"))
    http.post(C, json=BODY, headers={"Authorization": "Bearer " + KEYS["alpha"] + "-wrong"})
    text = server.metrics_text(auth("alpha"))
    for metric in ("steadyserve_tenant_requests_admitted_total", "steadyserve_tenant_tokens_total",
                   "steadyserve_tenant_time_to_first_token_seconds_bucket",
                   "steadyserve_tenant_queue_wait_seconds_count"):
        assert f'{metric}{{' in text and 'tenant="alpha"' in text, metric
    tenants = {line.split('tenant="')[1].split('"')[0] for line in text.splitlines() if 'tenant="' in line}
    assert tenants <= {"alpha", "beta", "scorer", "meter", "gamma"}, tenants  # bounded by the keys file
    logs = server.logs()
    assert '"tenant": "alpha"' in logs or "tenant=alpha" in logs
    for key in KEYS.values():
        assert key not in text and key not in logs


# ---- reload -----------------------------------------------------------------------------------------------

def test_sighup_reload_finishes_a_removed_keys_streams_and_refuses_it_then(server, http, keys_path) -> None:
    original = keys_path.read_text()
    started, result = threading.Event(), {}
    t = threading.Thread(target=slow_stream, args=(server, "beta", started, result, 400))
    try:
        t.start()
        assert started.wait(60)
        keys_path.write_text(keys_file("alpha", "scorer", "meter", "gamma"))  # beta removed, gamma added
        server.signal(signal.SIGHUP)
        wait_for(lambda: http.post(C, json=BODY, headers=auth("gamma")).status_code == 200, 30,
                 what="the reloaded keys")
        assert t.is_alive(), "the stream ended before the reload: slow it down"
        r = http.post(C, json=BODY, headers=auth("beta"))
        assert r.status_code == 401
        t.join(120)
        assert result["status"] == 200 and finish_reason(result["events"]) == "length"  # it finished
        keys_path.write_text("[[tenant]]\nname = 'broken'\nkeys = ['not-a-digest']\n")
        server.signal(signal.SIGHUP)
        time.sleep(1.0)
        assert http.post(C, json=BODY, headers=auth("gamma")).status_code == 200  # a bad file: old keys stay
        assert "keys file not reloaded" in server.logs() and "keys[0]" in server.logs()
    finally:
        t.join(120) if t.is_alive() else None
        keys_path.write_text(original)
        server.signal(signal.SIGHUP)
        wait_for(lambda: http.post(C, json=BODY, headers=auth("beta")).status_code == 200, 30,
                 what="the original keys back")
    assert server.proc.poll() is None


def test_a_tenants_bits_do_not_depend_on_who_else_is_served(server, http) -> None:
    """The same greedy request of one tenant, alone and while other tenants (another share, another priority)
    stream and score beside it: bitwise the same logprobs."""
    body = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0, "logprobs": 3}

    def lps() -> list:
        r = http.post(C, json=body, headers=auth("alpha"))
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["logprobs"]["top_logprobs"]

    alone = lps()
    started, result = threading.Event(), {}
    t = threading.Thread(target=slow_stream, args=(server, "beta", started, result, 200))
    t.start()
    try:
        assert started.wait(60)
        with Client(server.grpc_addr, api_key=KEYS["scorer"], timeout=30, retries=False) as c:
            for i in range(3):
                c.score(f"scored beside it {i}")
                assert lps() == alone
    finally:
        t.join(120)
    assert result["status"] == 200


def test_saving_the_keys_file_puts_it_in_force_without_a_signal(server, http, keys_path) -> None:
    original = keys_path.read_text()
    try:
        assert http.post(C, json=BODY, headers=auth("gamma")).status_code == 401
        keys_path.write_text(original + keys_file("gamma"))
        wait_for(lambda: http.post(C, json=BODY, headers=auth("gamma")).status_code == 200, 20,
                 interval=0.5, what="the changed file to be read (polled every 2 s)")
    finally:
        keys_path.write_text(original)
        wait_for(lambda: http.post(C, json=BODY, headers=auth("gamma")).status_code == 401, 20,
                 interval=0.5, what="the original file back")
