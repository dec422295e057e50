"""Embeddings are bitwise invariant over the wire, on the SmolLM2-width servers test_invariance_api.py shares:
a probe's vector (float32 bits: HTTP base64, gRPC's float32 values) is the same alone, at position 17 of a batch
of 64 inputs, and while generation streams run, and HTTP and gRPC agree.

As for logprobs, each claim runs against three servers: the invariant one must be bitwise equal; the TEST-ONLY
drifting one (steadyserve.testing.serve --test-drift: hidden rows shift with the step's token count) must be
caught; the --no-batch-invariant one promises nothing, so the test searches for a drift there and reports what it
finds (tests/invariance_util.py).
"""

from __future__ import annotations

import asyncio
import base64
import random
import struct

import httpx

from http_util import wait_for
from invariance_util import report_plain_search
from steadyserve.client import AsyncClient
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.sse_client import sse_post

VOCAB = 384  # the tiny tokenizer's vocabulary
PROBE = [random.Random(11).randrange(VOCAB) for _ in range(45)]  # crosses a 32-token KV block
SMOLWIDTH_HIDDEN = 576  # the vectors' width: SmolLM2-135M's hidden size
OTHERS = [[random.Random(i).randrange(VOCAB) for _ in range(random.Random(-i).randrange(1, 90))] for i in range(63)]


def idle(srv: ServerProcess) -> bool:
    return srv.metric("steadyserve_requests_running") == 0 and srv.metric("steadyserve_requests_waiting") == 0


async def http_vectors(c: httpx.AsyncClient, inputs: list[list[int]]) -> list[bytes]:
    r = await c.post("/v1/embeddings", json={"input": inputs, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    return [base64.b64decode(d["embedding"]) for d in r.json()["data"]]


async def grpc_vector(g: AsyncClient, ids: list[int]) -> bytes:
    values = (await g.embed([ids])).embeddings[0].values
    return struct.pack(f"<{len(values)}f", *values)


async def cases(srv: ServerProcess, k: int = 4) -> dict[str, bool]:
    """{case: the probe's vector is bitwise its vector alone (over HTTP, the first request)}; the gRPC request
    alone comes second, so it takes the probe's first KV block from the prefix cache."""
    wait_for(lambda: idle(srv), 60, what="idle server")
    async with AsyncClient(srv.grpc_addr, timeout=120, retries=False) as g, \
            httpx.AsyncClient(base_url=srv.http_url, timeout=120) as c:
        alone = (await http_vectors(c, [PROBE]))[0]
        grpc_alone = await grpc_vector(g, PROBE)
        in_64 = (await http_vectors(c, [*OTHERS[:17], PROBE, *OTHERS[17:]]))[17]
        body = {"max_tokens": 400, "ignore_eos": True, "temperature": 0.8, "stream": True}  # context 512
        load = [asyncio.create_task(sse_post(srv.http_url + "/v1/completions",
                                             {**body, "prompt": f"background {i}", "seed": i}, timeout=300))
                for i in range(k)]
        try:
            while srv.metric("steadyserve_requests_running") < k:  # the probes start once all k streams run
                assert not any(t.done() for t in load), [t.result() for t in load if t.done()]
                await asyncio.sleep(0.02)
            beside_http = (await http_vectors(c, [PROBE]))[0]
            beside_grpc = await grpc_vector(g, PROBE)
            still = srv.metric("steadyserve_requests_running")
        finally:
            for t in load:
                t.cancel()
            await asyncio.gather(*load, return_exceptions=True)
    assert still >= k, "the background streams ended before the probes did"
    assert len(alone) == 4 * SMOLWIDTH_HIDDEN, len(alone)
    return {"http == grpc alone": alone == grpc_alone, "in a batch of 64": in_64 == alone,
            "beside streams (http)": beside_http == alone, "beside streams (grpc)": beside_grpc == alone}


def test_embeddings_alone_equal_batched_and_beside_streams(sw_invariant: ServerProcess):
    res = asyncio.run(cases(sw_invariant))
    assert all(res.values()), res


def test_embedding_invariance_catches_a_broken_invariant(sw_drift: ServerProcess):
    res = asyncio.run(cases(sw_drift))
    print(f"\ndrift server: {res}")
    # Even the second request alone differs there: it takes the first's 32-token prefix from the cache, so its
    # step computes 13 rows rather than 45 (the invariant server gives the same bits either way).
    assert not any(res.values()), res


def test_embedding_plain_drifts_found_by_search(sw_plain: ServerProcess):
    fp = httpx.get(sw_plain.http_url + "/readyz", timeout=30).json()["system_fingerprint"]
    assert fp.endswith("-nbi"), fp
    res = asyncio.run(cases(sw_plain))  # asserts the streams ran beside the probes and the vectors' width
    report_plain_search("embeddings alone vs batched", {k: not v for k, v in res.items()})
