"""How a stream ends when its last batch holds both tokens and a failure (a fast engine generates a few
tokens and then fails the request within one read of its queue): the tokens go out first, then the error.
Drives the real SSE response over a recorded ASGI `send`, with a handle that yields that one batch."""

from __future__ import annotations

import asyncio
import json

from steadyserve.api.http.openai_format import Formatter
from steadyserve.api.http.sse import SSEResponse
from steadyserve.api.streams import StreamHandle
from steadyserve.engine.sequence import RequestOutput


class _Stream:
    finished = False

    def abort(self) -> None:
        pass


class _Registry:
    metrics = None

    def close(self, h) -> None:
        pass


def _outputs() -> list[RequestOutput]:
    tok = [RequestOutput("r", [t], text, []) for t, text in ((11, "Hel"), (12, "lo"))]
    err = RequestOutput("r", [], "", [], finished=True, finish_reason="error",
                        error="RuntimeError: test fault: request failed")
    return [*tok, err]


def _handle(batch: list[RequestOutput]) -> StreamHandle:
    h = StreamHandle.__new__(StreamHandle)
    h.registry, h.request_id, h.stream, h.transport = _Registry(), "r", _Stream(), "http"
    h.end_reason, h.backlog_bytes = None, 0

    async def batches():
        yield batch

    h.batches = batches  # type: ignore[method-assign]
    return h


def test_sse_sends_the_tokens_of_a_failing_batch_before_the_error():
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    fmt = Formatter("completion", "r", "m", "fp", tokenizer=None)
    response = SSEResponse(_handle(_outputs()), fmt, want_logprobs=False, include_usage=False, stall_timeout=5)
    asyncio.run(response({"type": "http", "state": {}}, receive, send))
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" in chunks[-1] and "test fault" in chunks[-1]["error"]["message"], chunks
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == "Hello", chunks  # both tokens reached the client, before the error
