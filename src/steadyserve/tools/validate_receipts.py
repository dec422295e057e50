"""`steadyserve validate --receipts N`: receipts collected from a deployment under load, verified locally.

Each probe asks for a receipt: scoring (prompt logprobs), greedy generation and unseeded sampling (the server
draws the seed and records it), over HTTP and gRPC in turn, mixed into validate's background traffic so they
share batches with it. Then every receipt is replayed on this machine (receipts/replay.py): a replica whose
bits differ from the replay is named, receipt by receipt.
"""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

KINDS = ("score", "greedy", "sampled")


def probe_body(kind: str, prompt: str, max_tokens: int, i: int) -> dict[str, Any]:
    """The HTTP completion body of receipt probe `i` of `kind`."""
    body: dict[str, Any] = {"prompt": f"{prompt} ({i})", "receipt": True, "logprobs": 2}
    if kind == "score":
        body.update(max_tokens=0, echo=True)
    else:
        body.update(max_tokens=max_tokens, temperature=0 if kind == "greedy" else 0.8)
    return body


async def http_receipt(runner: Any, kind: str, i: int) -> dict[str, Any]:
    data, _, _ = await runner._post(probe_body(kind, runner.prompt, runner.max_tokens, i))
    return data["choices"][0]["receipt"]


async def grpc_receipt(runner: Any, kind: str, i: int) -> dict[str, Any]:
    import grpc

    from ..client import AsyncClient, retry_after_ms

    if runner.grpc_client is None:
        runner.grpc_client = AsyncClient(runner.grpc.split(","), api_key=runner.api_key or None)
    text = f"{runner.prompt} ({i})"
    for _ in range(50):
        try:
            if kind == "score":
                res = await runner.grpc_client.score(text, top_logprobs=2, receipt=True)
                return json.loads(res.receipt)
            temperature = 0.0 if kind == "greedy" else 0.8
            async for msg in runner.grpc_client.generate(text, max_tokens=runner.max_tokens, temperature=temperature,
                                                         logprobs=2, receipt=True):
                if msg.HasField("final"):
                    return json.loads(msg.final.receipt)
            raise RuntimeError("Generate ended without a final message")
        except grpc.RpcError as e:
            if e.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                raise
            runner.num_overloaded += 1
            await asyncio.sleep(min((retry_after_ms(e) or 1000) / 1000, 2.0) * random.uniform(0.2, 1.0))
    raise RuntimeError("overloaded 50 times")


async def collect_receipt(runner: Any, transport: str, kind: str, i: int) -> tuple[str, Any]:
    """(source label, receipt object, or the error as a string)."""
    label = f"{transport}:{kind}:{i}"
    try:
        r = await (http_receipt if transport == "http" else grpc_receipt)(runner, kind, i)
        return label, r
    except Exception as e:
        return label, f"{type(e).__name__}: {e}"


def verify_collected(collected: list[tuple[str, Any]], model: str) -> dict[str, Any]:
    """Replay every collected receipt here; the report's `receipts` section."""
    from ..receipts.format import ReceiptError, parse
    from ..receipts.replay import INVALID, Verdict, verify
    from .verify import exit_status, summary

    parsed, verdicts = [], []
    for label, obj in collected:
        if isinstance(obj, str):
            verdicts.append(Verdict(label, INVALID, f"no receipt: {obj}"))
            continue
        try:
            parsed.append((label, parse(obj)))
        except ReceiptError as e:
            verdicts.append(Verdict(label, INVALID, f"not a receipt: {e}"))
    verdicts += verify(parsed, model=model)
    bad = [v.as_dict() for v in verdicts if v.status != "verified"]
    return {**summary(verdicts), "exit_status": exit_status(verdicts), "not_verified": bad[:20]}
