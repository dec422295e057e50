"""Embeddings under load share the engine fairly: a 256-input embedding batch beside running generation streams
stalls none of them, and admission bounds embeddings like any other request (429 / RESOURCE_EXHAUSTED).

The stall budget is one step: every step serves the running streams first (one token each) and gives the prefill
chunks of the embeddings what is left of --max-num-batched-tokens, so however large the batch, no stream goes a
step without a token. Measured by the server's own counters, independent of how busy the machine is: over the
batch's lifetime, tokens generated >= streams x engine steps (and nothing was preempted). In wall-clock terms,
measured by the client: no stream's gap between events comes near the batch's duration (a stream made to wait
for the batch would wait all of it). The server's inter-token-latency histogram is printed beside them.
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

BUDGET_S = 0.5  # a bucket of LATENCY_BUCKETS: inter-token latencies above it are printed (the machine may be busy)
NUM_STREAMS = 4
BATCH = 256
OVER = 200  # inputs asked for when the server is full (one call each over HTTP and gRPC)
INPUT_TOKENS = 900  # 256 x 900 tokens: hundreds of steps of prefill on the tiny model
ITL = "steadyserve_inter_token_latency_seconds"


@pytest.fixture(scope="module")
def srv(long_model: str):  # 4096 positions: streams that outlast the batch; bodies of 256 token-id lists
    with ServerProcess(long_model, "--max-request-bytes", "8MiB", "--stall-timeout", "30") as s:
        yield s


def counters(srv: ServerProcess) -> dict[str, float]:
    """The server's step, token and latency counters, from one scrape (all of the same moment)."""
    m = srv.metrics()
    get = lambda name, **labels: m.get((name, tuple(sorted(labels.items()))), 0.0)  # noqa: E731
    return {"steps": get("steadyserve_step_duration_seconds_count"),
            "generated": get("steadyserve_generated_tokens_total"),
            "preempted": get("steadyserve_preemptions_total"),
            "itl": get(ITL + "_count"), "itl_over": get(ITL + "_count") - get(ITL + "_bucket", le=str(BUDGET_S))}


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
            c0 = await asyncio.to_thread(counters, srv)
            rejected0 = await asyncio.to_thread(srv.metric, "steadyserve_requests_rejected_total", reason="overloaded")
            async with httpx.AsyncClient(base_url=srv.http_url, timeout=600) as c, \
                    AsyncClient(srv.grpc_addr, timeout=60, retries=False) as g:
                t0 = time.monotonic()
                batch = asyncio.create_task(c.post("/v1/embeddings", json={"input": inputs(BATCH, INPUT_TOKENS)}))
                await until(lambda: srv.metric("steadyserve_requests_waiting") > 0, 120, "the batch admitted")
                # Full: 4 streams + 256 inputs in flight of 64 + 256 seats; OVER more are refused at once, whole.
                # OVER leaves room for inputs of the batch that finish meanwhile: a refusal needs only that fewer
                # than 260 + OVER - 320 = 140 of them have (at 64 more, 4 finished inputs let one through, and
                # did in CI on a fast machine); both asked at once, so neither waits on the other's round trip.
                over, grpc_call = await asyncio.gather(c.post("/v1/embeddings", json={"input": inputs(OVER, 4)}),
                                                       g.embed(inputs(OVER, 4)), return_exceptions=True)
                assert isinstance(grpc_call, grpc.RpcError), f"the gRPC request was not refused: {grpc_call!r}"
                assert isinstance(over, httpx.Response), over
                r = await batch
                t1 = time.monotonic()
            assert not any(t.done() for t in streams), "a stream ended before the batch did"
            c1 = await asyncio.to_thread(counters, srv)
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        gaps = [b - a for res in results for a, b in zip(res.token_times, res.token_times[1:]) if t0 <= b <= t1]
        return {"response": r, "over": over, "grpc_error": grpc_call, "t": t1 - t0, "counters": {k: c1[k] - c0[k] for k in c0},
                "gaps": gaps, "rejected": srv.metric("steadyserve_requests_rejected_total", reason="overloaded")
                - rejected0}

    res = asyncio.run(run())
    r = res["response"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert len(body["data"]) == BATCH and body["usage"]["prompt_tokens"] == BATCH * INPUT_TOKENS
    d, gaps = res["counters"], res["gaps"]
    print(f"\n{BATCH} x {INPUT_TOKENS}-token batch took {res['t']:.2f} s beside {NUM_STREAMS} streams: "
          f"{d['steps']:.0f} engine steps, {d['generated']:.0f} tokens generated, {d['preempted']:.0f} preemptions; "
          f"{d['itl']:.0f} inter-token latencies, {d['itl_over']:.0f} above {BUDGET_S} s; client gaps: {len(gaps)}, "
          f"largest {max(gaps, default=0) * 1000:.0f} ms")
    assert d["steps"] > 100 and res["t"] > 4 * BUDGET_S, "the batch was too small for the stall check to mean anything"
    assert d["preempted"] == 0, d
    assert d["generated"] >= NUM_STREAMS * d["steps"], f"a stream went a step without a token: {d}"
    assert len(gaps) > 0 and max(gaps) < res["t"] / 4, f"a stream's client waited {max(gaps):.2f} s between events"
    over, err = res["over"], res["grpc_error"]
    assert over.status_code == 429 and over.json()["error"]["code"] == "overloaded", over.text
    assert float(over.headers["retry-after"]) >= 1
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, (err.code(), err.details())
    assert res["rejected"] == 2


def test_the_pooling_is_named_at_start(srv: ServerProcess):
    """The tiny model states no pooling: the start-up log says which one serves, and why."""
    line = next(ln for ln in srv.logs().splitlines() if "embedding pooling" in ln)
    assert "pooling=last" in line and "normalize=True" in line and "source=default" in line, line
