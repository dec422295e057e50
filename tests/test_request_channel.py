"""One request channel (engine/channel.py): one abort path and one end decision, whatever the transport.

- A stream that ends early aborts its engine request exactly once, on every transport: a client that hangs up on
  SSE (chat/completions, Responses, Messages) or WebSocket, a gRPC call cancelled or past its deadline. Counted
  once under its reason, finished once as `abort`, and the engine's own log of the aborts it received
  (TEST-ONLY, testing/prompt_log.py) holds one line for the request.
- A request that fails mid-stream ends the same way in the three SSE APIs, which share one driver: the tokens
  generated before the failure, then the API's error event, and nothing after; the WebSocket and gRPC say so too.
- RequestChannel alone: repeated cuts (a watcher, a stall, leaving the block) send one abort per engine request,
  none for a choice the engine already finished, and the first reason is the one counted and reported.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time

import grpc
import httpx
import pytest
from websockets.sync.client import connect

from http_util import post_request, sse_events, wait_for
from steadyserve.api.protos.steadyserve.v1 import inference_pb2 as pb
from steadyserve.api.protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc
from steadyserve.engine.channel import END_MESSAGES, RequestChannel
from steadyserve.engine.sequence import RequestOutput
from steadyserve.testing.prompt_log import logged_aborts
from steadyserve.testing.faults import FAIL_REQUEST_MARKER, SLOW_REQUEST_MARKER
from steadyserve.testing.server import ServerProcess

LONG = 4000  # tokens a stream asks for (of the 4096 positions): it is surely still running when the client leaves
DEADLINE_S = 1.0  # the gRPC deadline case: its stream is slowed to >= 4000 x SLOW_STEP_S = 20 s on any CPU


@pytest.fixture(scope="module")
def srv(long_model: str):
    with ServerProcess(long_model, "--served-model-name", "tiny", "--max-num-seqs", "4", test_faults=True,
                       test_log_aborts=True, threads=1) as s:
        yield s


def idle(srv) -> bool:
    return srv.metric("steadyserve_requests_running") == 0 and srv.metric("steadyserve_requests_waiting") == 0


def handled(srv) -> float:
    """Answers every transport has finished handling (their handlers returned), from the server's counters."""
    m = srv.metrics()
    return sum(v for (name, _), v in m.items() if name in ("http_requests_total", "grpc_server_handled_total"))


# ---- leaving early: one abort per engine request ---------------------------------------------------------------

def _hang_up_sse(srv, rid: str, path: str, body: dict) -> None:
    """POST a stream, read its first events, close the socket."""
    s = socket.create_connection(("127.0.0.1", srv.http_port))
    try:
        s.sendall(post_request(srv.http_port, path, json.dumps({**body, "stream": True}).encode(),
                               f"x-request-id: {rid}\r\n"))
        got = b""
        while got.count(b"data: ") < 3:
            part = s.recv(65536)
            assert part, got
            got += part
    finally:
        s.close()


def hang_up_chat(srv, rid: str) -> None:
    _hang_up_sse(srv, rid, "/v1/chat/completions", {"messages": [{"role": "user", "content": "go on"}],
                                                    "max_tokens": LONG, "ignore_eos": True})


def hang_up_completion(srv, rid: str) -> None:
    _hang_up_sse(srv, rid, "/v1/completions", {"prompt": "go on", "max_tokens": LONG, "ignore_eos": True})


# Responses and Messages have no ignore_eos, and sampled at their default temperature 1 the random tiny model ends
# "go on" on EOS after 2-1961 tokens (6 tries each), sometimes before the server sees the client go (one full run
# failed so). Greedy, it runs all 4000 tokens, the same on every CPU (the portable path's bits).
def hang_up_responses(srv, rid: str) -> None:
    _hang_up_sse(srv, rid, "/v1/responses", {"input": "go on", "max_output_tokens": LONG, "temperature": 0})


def hang_up_messages(srv, rid: str) -> None:
    _hang_up_sse(srv, rid, "/v1/messages", {"messages": [{"role": "user", "content": "go on"}], "max_tokens": LONG,
                                            "temperature": 0})


def hang_up_ws(srv, rid: str) -> None:
    # close_timeout=1: the client library stops reading at its 16-message queue, so it would wait its whole
    # default 10 s for the server's close frame behind the unread deltas; the server has cut the stream by then.
    with connect(f"ws://127.0.0.1:{srv.http_port}/v1/stream", open_timeout=30, close_timeout=1,
                 additional_headers={"x-request-id": rid}) as ws:
        ws.send(json.dumps({"prompt": "go on", "max_tokens": LONG, "ignore_eos": True}))
        for _ in range(3):
            assert json.loads(ws.recv(timeout=60))["type"] == "delta"
    # leaving the block closes the connection mid-stream


def _generate(srv, rid: str, timeout: float | None, text: str = "go on"):
    ch = grpc.insecure_channel(srv.grpc_addr)
    req = pb.GenerateRequest(text=text, request_id=rid, params=pb.SamplingParameters(max_tokens=LONG,
                                                                                         ignore_eos=True))
    return ch, pb_grpc.InferenceStub(ch).Generate(req, timeout=timeout)


def cancel_grpc(srv, rid: str) -> None:
    ch, call = _generate(srv, rid, None)
    with ch:
        for _, msg in zip(range(3), call):
            assert msg.HasField("batch")
        call.cancel()


def deadline_grpc(srv, rid: str) -> None:
    # Slowed (TEST-ONLY fault): a fast CPU made 3000 tokens in 1.9 s, before a 3 s deadline, so none fired.
    ch, call = _generate(srv, rid, DEADLINE_S, f"go on {SLOW_REQUEST_MARKER}")
    with ch, pytest.raises(grpc.RpcError) as e:
        for _ in call:
            pass
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("leave, reason", [
    (hang_up_chat, "client_disconnect"), (hang_up_completion, "client_disconnect"),
    (hang_up_responses, "client_disconnect"), (hang_up_messages, "client_disconnect"),
    (hang_up_ws, "client_disconnect"), (cancel_grpc, "client_disconnect"), (deadline_grpc, "deadline"),
], ids=["sse-chat", "sse-completion", "sse-responses", "sse-messages", "websocket", "grpc-cancel", "grpc-deadline"])
def test_leaving_early_aborts_the_engine_request_once(srv, leave, reason) -> None:
    wait_for(lambda: idle(srv), 60, what="idle engine")
    rid = f"leave-{leave.__name__}-{time.monotonic_ns()}"
    cut0 = srv.metric("steadyserve_streams_aborted_total", reason=reason)
    fin0 = srv.metric("steadyserve_requests_finished_total", finish_reason="abort")
    handled0 = handled(srv)
    leave(srv, rid)
    wait_for(lambda: srv.metric("steadyserve_requests_finished_total", finish_reason="abort") == fin0 + 1, 30,
             what="the engine request finished as aborted")
    if leave is not hang_up_ws:  # a WebSocket session is not counted as an HTTP request
        wait_for(lambda: handled(srv) > handled0, 30, what="the handler returned")
    # Aborts the handler sent reach the engine's inbox before a later request does: once one has finished,
    # the engine has taken (and logged) every abort sent for `rid`.
    r = httpx.post(srv.http_url + "/v1/completions", json={"prompt": "after", "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    assert logged_aborts(srv.logs())[rid] == 1, f"aborts of {rid}: {logged_aborts(srv.logs())[rid]}"
    assert srv.metric("steadyserve_streams_aborted_total", reason=reason) == cut0 + 1
    assert srv.metric("steadyserve_requests_finished_total", finish_reason="abort") == fin0 + 1
    assert idle(srv)


# ---- failing mid-stream: the one end decision, the one SSE driver ------------------------------------------------

FAIL_CHAT = [{"role": "user", "content": f"Fail {FAIL_REQUEST_MARKER} now"}]


def _sse(srv, path: str, body: dict) -> list[str]:
    with httpx.stream("POST", srv.http_url + path, json={**body, "stream": True, "temperature": 0},
                      timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.read())


def _chat_failed(evs: list[str]) -> None:
    assert evs[-1] == "[DONE]", evs
    chunks = [json.loads(e) for e in evs[:-1]]
    assert "error" in chunks[-1], chunks[-1]
    error = chunks[-1]["error"]
    assert (error["code"], error["type"]) == ("request_error", "invalid_request_error")
    assert "test fault" in error["message"]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])  # no finish, only the error
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks[:-1])


def _responses_failed(evs: list[str]) -> None:
    out = [json.loads(e) for e in evs]
    assert out[-1]["type"] == "error" and out[-1]["code"] == "request_error", out[-1]
    assert "test fault" in out[-1]["message"]
    assert not any(e["type"] in ("response.completed", "response.incomplete") for e in out)
    assert "".join(e["delta"] for e in out if e["type"] == "response.output_text.delta")


def _messages_failed(evs: list[str]) -> None:
    out = [json.loads(e) for e in evs]
    assert out[-1]["type"] == "error" and out[-1]["error"]["type"] == "invalid_request_error", out[-1]
    assert "test fault" in out[-1]["error"]["message"]
    assert not any(e["type"] in ("message_delta", "message_stop") for e in out)
    assert "".join(e["delta"].get("text", "") for e in out if e["type"] == "content_block_delta")


@pytest.mark.parametrize("path, body, check", [
    ("/v1/chat/completions", {"messages": FAIL_CHAT, "max_tokens": 50}, _chat_failed),
    ("/v1/responses", {"input": f"Fail {FAIL_REQUEST_MARKER} now", "max_output_tokens": 50}, _responses_failed),
    ("/v1/messages", {"messages": FAIL_CHAT, "max_tokens": 50}, _messages_failed),
], ids=["chat", "responses", "messages"])
def test_a_failure_mid_stream_ends_each_sse_api_with_its_error_event(srv, path, body, check) -> None:
    """Greedy: the fault fires after the second generated token, so each stream has text before its error,
    and the error event is the stream's last."""
    check(_sse(srv, path, body))


def test_a_failure_mid_stream_on_the_websocket_and_grpc(srv) -> None:
    msgs = []
    with connect(f"ws://127.0.0.1:{srv.http_port}/v1/stream", open_timeout=30) as ws:
        ws.send(json.dumps({"messages": FAIL_CHAT, "max_tokens": 50, "temperature": 0}))
        try:
            while True:
                msgs.append(json.loads(ws.recv(timeout=60)))
        except Exception:  # closed
            pass
        close = ws.close_code
    assert msgs[-1]["type"] == "error" and msgs[-1]["error"]["code"] == "request_error", msgs[-1]
    assert close == 1008 and all(m["type"] == "delta" for m in msgs[:-1]) and msgs[:-1]
    with grpc.insecure_channel(srv.grpc_addr) as ch:
        req = pb.GenerateRequest(text=f"Fail {FAIL_REQUEST_MARKER} now",
                                 params=pb.SamplingParameters(max_tokens=50, temperature=0))
        got = []
        with pytest.raises(grpc.RpcError) as e:
            for msg in pb_grpc.InferenceStub(ch).Generate(req, timeout=60):
                got.append(msg)
    assert e.value.code() == grpc.StatusCode.ABORTED and "test fault" in e.value.details()
    assert got and all(m.HasField("batch") for m in got)


# ---- the channel alone -----------------------------------------------------------------------------------------------

def _final(rid: str, reason: str) -> RequestOutput:
    return RequestOutput(rid, [], "", [], finished=True, finish_reason=reason)


def test_cuts_abort_each_unfinished_engine_request_once_and_the_first_reason_reports() -> None:
    aborted: list[str] = []
    counted: list[tuple[str, int]] = []
    closed: list[RequestChannel] = []

    class Owner:
        def counted(self, reason: str, n: int) -> None:
            counted.append((reason, n))

        def closed(self, channel: RequestChannel) -> None:
            closed.append(channel)

    async def main() -> list:
        ch = RequestChannel(["a", "b", "c"], aborted.append, asyncio.get_running_loop())
        ch.owner = Owner()
        ch.deliver(0, RequestOutput("a", [7], "x", []))
        ch.deliver(1, _final("b", "length"))  # b is done in the engine: nothing to abort
        ch.cut("stall")  # a stall counts every stream, finished or not: the client never got their ends
        ch.cut("client_disconnect")  # too late: already cut
        events = []
        async with ch.watch(unfinished_reason=lambda: "deadline"):
            ch.deliver(0, _final("a", "abort"))
            async for ev in ch:
                events.append(ev)
        return events

    events = asyncio.run(main())
    assert aborted == ["a", "c"]  # one abort each, none for b
    assert counted == [("stall", 3)]
    assert len(closed) == 1
    assert events[-1].error == ("stall", END_MESSAGES["stall"]) and events[-1].index == 0
