"""How a stream ends when its last batch holds both tokens and a failure (a fast engine generates a few
tokens and then fails the request within one read of its queue): the tokens go out first, then the error.
Drives the real SSE driver over a recorded ASGI `send`, with a real RequestChannel that is delivered that one
batch as the engine thread delivers it."""

from __future__ import annotations

import asyncio
import json

from steadyserve.api.http.openai_format import Formatter
from steadyserve.api.http.sse import OpenAIChunks, SSEStream
from steadyserve.engine.channel import RequestChannel
from steadyserve.engine.sequence import RequestOutput


def _outputs() -> list[RequestOutput]:
    tok = [RequestOutput("r", [t], text, []) for t, text in ((11, "Hel"), (12, "lo"))]
    err = RequestOutput("r", [], "", [], finished=True, finish_reason="error",
                        error="RuntimeError: test fault: request failed")
    return [*tok, err]


def test_sse_sends_the_tokens_of_a_failing_batch_before_the_error():
    sent: list[dict] = []
    aborted: list[str] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def main() -> None:
        channel = RequestChannel(["r"], aborted.append, asyncio.get_running_loop())
        for out in _outputs():  # one batch: all delivered before the stream reads
            channel.deliver(0, out)
        fmt = Formatter("completion", "r", "m", "fp", tokenizer=None)
        response = SSEStream(channel, OpenAIChunks([fmt], want_logprobs=False, include_usage=False), stall_timeout=5)
        await response({"type": "http", "state": {}}, receive, send)

    asyncio.run(main())
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body").decode()
    events = [e.removeprefix("data: ") for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" in chunks[-1] and "test fault" in chunks[-1]["error"]["message"], chunks
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == "Hello", chunks  # both tokens reached the client, before the error
    assert aborted == []  # the engine had ended the request itself: nothing to abort
