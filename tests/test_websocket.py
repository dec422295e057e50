"""WS /v1/stream against a real server: one JSON request in, deltas out, a final message, close 1000;
errors as a JSON message then close 1008 (bad request), 1013 (overloaded / draining) or 1011 (server)."""

from __future__ import annotations

import contextlib
import json
import signal
import time

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from http_util import FP_HEADER, wait_for
from steadyserve.testing import build_tiny_model
from steadyserve.testing.faults import SLOW_REQUEST_MARKER
from steadyserve.testing.server import ServerProcess


@pytest.fixture(scope="module")
def srv(tiny_model: str):
    # Capacity 2 (1 running + 1 queued) so overload is cheap to reach.
    with ServerProcess(tiny_model, "--grpc-port", "-1", "--served-model-name", "tiny", "--max-num-seqs", "1",
                       "--max-queue", "1", "--stall-timeout", "5", threads=1) as s:
        yield s


def ws_url(srv) -> str:
    return f"ws://127.0.0.1:{srv.http_port}/v1/stream"


def run_ws(srv, request: dict | str | bytes, **kw) -> tuple[list[dict], int | None]:
    """Send one request; collect every JSON message until the server closes. Returns (messages, close code)."""
    msgs: list[dict] = []
    with connect(ws_url(srv), open_timeout=30, **kw) as ws:
        ws.send(request if isinstance(request, (str, bytes)) else json.dumps(request))
        try:
            while True:
                msgs.append(json.loads(ws.recv(timeout=60)))
        except ConnectionClosed:
            pass
        return msgs, ws.close_code


def idle(srv) -> bool:
    return srv.metric("steadyserve_requests_running") == 0 and srv.metric("steadyserve_requests_waiting") == 0


def test_ws_completion_stream_matches_http(srv):
    req = {"prompt": "The quick brown fox", "max_tokens": 20, "temperature": 0.9, "seed": 11, "logprobs": 3}
    msgs, code = run_ws(srv, req)
    assert code == 1000
    deltas, final = msgs[:-1], msgs[-1]
    assert deltas and all(m["type"] == "delta" for m in deltas)
    assert final["type"] == "final" and final["finish_reason"] == "length"
    assert final["usage"]["completion_tokens"] == 20
    fp = httpx.get(srv.http_url + "/readyz").json()["system_fingerprint"]
    assert all(m["system_fingerprint"] == fp for m in msgs)
    token_ids = [t for m in deltas for t in m["token_ids"]]
    lps = [lp for m in deltas for lp in m["logprobs"]]
    assert len(token_ids) == len(lps) == 20
    assert [lp["token_id"] for lp in lps] == token_ids
    assert all(len(lp["top"]) == 3 for lp in lps)
    whole = httpx.post(srv.http_url + "/v1/completions", json=req, timeout=60).json()
    assert "".join(m["text"] for m in deltas) == whole["choices"][0]["text"]
    assert [lp["logprob"] for lp in lps] == whole["choices"][0]["logprobs"]["token_logprobs"]


def test_ws_chat_and_headers(srv):
    req = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0, "seed": 1}
    msgs: list[dict] = []
    with connect(ws_url(srv), additional_headers={"x-request-id": "ws-rid-7"}, open_timeout=30) as ws:
        assert ws.response.headers["x-request-id"] == "ws-rid-7"
        assert ws.response.headers[FP_HEADER]
        ws.send(json.dumps(req))
        with pytest.raises(ConnectionClosed):
            while True:
                msgs.append(json.loads(ws.recv(timeout=60)))
        assert ws.close_code == 1000
    assert msgs[-1]["type"] == "final" and msgs[-1]["request_id"] == "ws-rid-7"
    whole = httpx.post(srv.http_url + "/v1/chat/completions", json=req, timeout=60).json()
    assert "".join(m.get("text", "") for m in msgs[:-1]) == whole["choices"][0]["message"]["content"]


def test_ws_scoring_returns_prompt_logprobs(srv):
    msgs, code = run_ws(srv, {"prompt": [10, 20, 30, 40, 50], "max_tokens": 0, "echo": True, "logprobs": 2})
    assert code == 1000
    final = msgs[-1]
    assert final["type"] == "final" and final["usage"]["completion_tokens"] == 0
    pl = final["prompt_logprobs"]
    assert len(pl) == 5 and pl[0] is None
    assert [p["token_id"] for p in pl[1:]] == [20, 30, 40, 50] and all(len(p["top"]) == 2 for p in pl[1:])


BAD_WS = [
    ("not-json", "{nope", "invalid_json"),
    ("json-array", "[1]", "invalid_json"),
    ("binary-frame", b'{"prompt": "hi"}', "binary_frame"),
    ("temperature-negative", {"prompt": "hi", "temperature": -1}, "temperature"),
    ("empty-prompt", {"prompt": ""}, "empty"),
    ("empty-messages", {"messages": []}, "messages"),
    ("unknown-model", {"prompt": "hi", "model": "nope"}, "nope"),
    ("logprobs-21", {"prompt": "hi", "logprobs": 21}, "logprobs"),
    ("too-long", {"prompt": list(range(5, 300)) * 2}, "512"),
    ("huge-seed", {"prompt": "hi", "seed": 2 ** 80}, "seed"),
]


@pytest.mark.parametrize("name,request_,needle", BAD_WS, ids=[b[0] for b in BAD_WS])
def test_ws_bad_request_gets_error_then_1008(srv, name, request_, needle):
    msgs, code = run_ws(srv, request_)
    assert code == 1008
    assert len(msgs) == 1 and msgs[0]["type"] == "error"
    err = msgs[0]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert needle in err["message"] or needle == err["param"] or needle == err["code"], err


def test_ws_second_request_and_disconnect_free_the_slot(srv):
    wait_for(lambda: idle(srv), 30, what="idle")
    long = {"prompt": "go on", "max_tokens": 450, "ignore_eos": True}
    # A second request on the same connection ends the stream with 1008.
    with connect(ws_url(srv), open_timeout=30) as ws:
        ws.send(json.dumps(long))
        assert json.loads(ws.recv(timeout=30))["type"] == "delta"
        ws.send(json.dumps(long))
        msgs = []
        with pytest.raises(ConnectionClosed):
            while True:
                msgs.append(json.loads(ws.recv(timeout=30)))
        assert ws.close_code == 1008 and msgs[-1]["type"] == "error"
        assert msgs[-1]["error"]["code"] == "second_request"
    wait_for(lambda: idle(srv), 5, interval=0.01, what="slot freed after second request")
    # A client that just goes away is aborted in the engine.
    aborted0 = srv.metric("steadyserve_streams_aborted_total", reason="client_disconnect")
    with connect(ws_url(srv), open_timeout=30) as ws:
        ws.send(json.dumps(long))
        assert json.loads(ws.recv(timeout=30))["type"] == "delta"
        wait_for(lambda: srv.metric("steadyserve_requests_running") == 1, 10, what="running")
        t0 = time.monotonic()
        ws.socket.shutdown(2)  # abrupt: no close frame
        wait_for(lambda: idle(srv), 5, interval=0.01, what="slot freed after disconnect")
    print(f"\nWS disconnect -> slot freed in {(time.monotonic() - t0) * 1000:.0f} ms")
    wait_for(lambda: srv.metric("steadyserve_streams_aborted_total", reason="client_disconnect") > aborted0, 5,
             what="disconnect counted")


def test_ws_overload_gets_error_then_1013(srv):
    wait_for(lambda: idle(srv), 30, what="idle")
    long = json.dumps({"prompt": "hold", "max_tokens": 450, "ignore_eos": True})
    # max_queue=None: the client keeps reading, so its polite close is answered at once.
    with contextlib.ExitStack() as stack:
        holders = [stack.enter_context(connect(ws_url(srv), open_timeout=30, max_queue=None)) for _ in range(2)]
        _overload_with(srv, holders, long)
    wait_for(lambda: idle(srv), 10, what="holders gone")


def _overload_with(srv, holders, long: str) -> None:
    try:
        for h in holders:
            h.send(long)
        wait_for(lambda: srv.metric("steadyserve_requests_running") + srv.metric("steadyserve_requests_waiting")
                 >= 2, 10, what="2 in flight")
        msgs, code = run_ws(srv, {"prompt": "one more", "max_tokens": 2})
        assert code == 1013
        assert msgs[0]["type"] == "error" and msgs[0]["error"]["code"] == "overloaded"
        assert msgs[0]["status"] == 429 and msgs[0]["retry_after"] >= 1
    finally:
        for h in holders:
            h.close()
            # The server answers a close mid-stream: a close it never answered would end as 1006 after the
            # client's close timeout, so the code alone shows it (no wall-clock bound needed).
            assert h.close_code == 1000, h.close_code


@pytest.fixture
def drain_srv(models_dir):
    """Its own server (the module's must survive for tests that run after this one, in any order), with a
    4096-token context: 4000 tokens cannot finish within --drain-timeout 0.3 s on any CPU, as the prompt's
    SLOW_REQUEST_MARKER adds 5 ms to each step that computes it and a step yields at most 8 of its tokens (n-gram
    drafts): at least 2.5 s; the test also checks the stream was cut by the drain timeout (error event), not
    finished."""
    path = build_tiny_model(models_dir / "tiny-4k-ws", max_position_embeddings=4096)
    with ServerProcess(str(path), "--grpc-port", "-1", "--drain-timeout", "0.3", threads=1, test_faults=True) as s:
        yield s


def test_ws_drain_timeout_gets_error_then_1011(drain_srv):
    """SIGTERM with a stream that cannot finish in --drain-timeout 0.3 s."""
    srv = drain_srv
    with connect(ws_url(srv), open_timeout=30) as ws:
        ws.send(json.dumps({"prompt": f"forever {SLOW_REQUEST_MARKER}", "max_tokens": 4000, "ignore_eos": True}))
        assert json.loads(ws.recv(timeout=30))["type"] == "delta"
        srv.signal(signal.SIGTERM)
        msgs = []
        with pytest.raises(ConnectionClosed):
            while True:
                msgs.append(json.loads(ws.recv(timeout=30)))
        assert ws.close_code == 1011
    assert msgs[-1]["type"] == "error" and msgs[-1]["error"]["code"] == "drain_timeout"
    assert all(m["type"] == "delta" for m in msgs[:-1])
    assert srv.wait(30) == 0
