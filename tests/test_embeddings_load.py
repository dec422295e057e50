"""Embeddings under load share the engine fairly: a 256-input embedding batch beside running generation streams
stalls none of them, and admission bounds embeddings like any other request (429 / RESOURCE_EXHAUSTED).

The stall budget: every step serves the running streams first (one token each) and gives the prefill chunks of
the embeddings what is left of --max-num-batched-tokens, so a stream's gap between tokens is one step, however
large the batch. Measured twice: by the server's own inter-token-latency histogram (no observation above the
budget while the batch ran) and by the client (the largest gap between a stream's events). The batch must take
several budgets for the check to mean anything, and does: it is asserted.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import httpx
import pytest

from http_util import wait_for
from steadyserve.client import AsyncClient
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.sse_client import StreamResult, sse_post

BUDGET_S = 0.5  # a stream may wait at most this long for its next token (a bucket of LATENCY_BUCKETS)
NUM_STREAMS = 4
BATCH = 256
INPUT_TOKENS = 900  # 256 x 900 tokens: hundreds of steps of prefill on the tiny model
ITL = "steadyserve_inter_token_latency_seconds"


@pytest.fixture(scope="module")
def srv(long_model: str):  # 4096 positions: streams that outlast the batch; bodies of 256 token-id lists
    with ServerProcess(long_model, "--max-request-bytes", "8MiB", "--stall-timeout", "30") as s:
        yield s


def itl_over_budget(srv: ServerProcess) -> tuple[float, float]:
    """(observations, of which above BUDGET_S) of the server's inter-token-latency histogram so far."""
    m = srv.metrics()  # one scrape: count and bucket of the same moment
    total = m.get((ITL + "_count", ()), 0.0)
    within = m.get((ITL + "_bucket", (("le", str(BUDGET_S)),)), 0.0)
    return total, total - within


async def until(pred, timeout: float, what: str) -> None:
    """Poll `pred` (a blocking call, run off the loop so the streams keep being read) until true."""
    t0 = time.monotonic()
    while not await asyncio.to_thread(pred):
        assert time.monotonic() - t0 < timeout, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.05)


def inputs(n: int, length: int) -> list[list[int]]:
    return [[5 + (i * 7 + j) % 300 for j in range(length)] for i in range(n)]


def test_a_256_input_batch_stalls_no_stream_and_admission_bounds_it(srv: ServerProcess):
    async def run() -> dict:
        wait_for(lambda: srv.metric("steadyserve_requests_running") == 0, 60, what="idle server")
        body = {"prompt": "stream", "max_tokens": 3500, "ignore_eos": True, "temperature": 0, "stream": True}
        results = [StreamResult() for _ in range(NUM_STREAMS)]
        streams = [asyncio.create_task(sse_post(srv.http_url + "/v1/completions", body, result=r, timeout=600))
                   for r in results]
        try:
            while min(len(r.token_times) for r in results) < 5:  # every stream is decoding
                assert not any(t.done() for t in streams), [t.result() for t in streams if t.done()]
                await asyncio.sleep(0.02)
            itl0 = await asyncio.to_thread(itl_over_budget, srv)
            rejected0 = await asyncio.to_thread(srv.metric, "steadyserve_requests_rejected_total", reason="overloaded")
            async with httpx.AsyncClient(base_url=srv.http_url, timeout=600) as c, \
                    AsyncClient(srv.grpc_addr, timeout=60, retries=False) as g:
                t0 = time.monotonic()
                batch = asyncio.create_task(c.post("/v1/embeddings", json={"input": inputs(BATCH, INPUT_TOKENS)}))
                await until(lambda: srv.metric("steadyserve_requests_waiting") > 0, 120, "the batch admitted")
                # Full: 4 streams + 256 inputs in flight of 64 + 256 seats; 64 more are refused at once, whole.
                over = await c.post("/v1/embeddings", json={"input": inputs(64, 4)})
                with pytest.raises(grpc.RpcError) as e:
                    await g.embed(inputs(64, 4))
                r = await batch
                t1 = time.monotonic()
            assert not any(t.done() for t in streams), "a stream ended before the batch did"
            itl1 = await asyncio.to_thread(itl_over_budget, srv)
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        gaps = [b - a for res in results for a, b in zip(res.token_times, res.token_times[1:]) if t0 <= b <= t1]
        return {"response": r, "over": over, "grpc_error": e.value, "t": t1 - t0, "itl": (itl0, itl1),
                "gaps": gaps, "rejected": srv.metric("steadyserve_requests_rejected_total", reason="overloaded")
                - rejected0}

    res = asyncio.run(run())
    r = res["response"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == BATCH and body["usage"]["prompt_tokens"] == BATCH * INPUT_TOKENS
    (n0, over0), (n1, over1) = res["itl"]
    gaps = res["gaps"]
    print(f"\n{BATCH} x {INPUT_TOKENS}-token batch took {res['t']:.2f} s beside {NUM_STREAMS} streams; "
          f"{n1 - n0:.0f} inter-token latencies observed meanwhile, {over1 - over0:.0f} above {BUDGET_S} s; "
          f"client gaps: {len(gaps)}, largest {max(gaps) * 1000:.0f} ms")
    assert res["t"] > 4 * BUDGET_S, "the batch was too quick for the stall check to mean anything"
    assert n1 - n0 > 0 and len(gaps) > 0, "no stream produced a token while the batch ran"
    assert over1 - over0 == 0, "a stream waited longer than its budget for a token (server histogram)"
    assert max(gaps) < 2 * BUDGET_S, f"a stream's client waited {max(gaps):.2f} s between events"
    over, err = res["over"], res["grpc_error"]
    assert over.status_code == 429 and over.json()["error"]["code"] == "overloaded", over.text
    assert float(over.headers["retry-after"]) >= 1
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
    assert res["rejected"] == 2


def test_the_pooling_is_named_at_start(srv: ServerProcess):
    """The tiny model states no pooling: the start-up log says which one serves, and why."""
    line = next(ln for ln in srv.logs().splitlines() if "embedding pooling" in ln)
    assert "pooling=last" in line and "normalize=True" in line and "source=default" in line, line
