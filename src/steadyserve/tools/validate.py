"""`steadyserve validate`: N identical requests at once, logprobs compared bitwise.

The incident report's check ("1,000 identical calls in parallel, all logprob
vectors equal"), done rigorously: identical probes (scoring, and greedy
generation with logprobs) go out concurrently over HTTP and gRPC, mixed with
random background traffic so they land in different batches at different
positions. Their logprob vectors are compared as float32 bytes, per probe kind
and per server fingerprint (different fingerprints are different models or
devices, reported as such, not as drift).
"""

from __future__ import annotations

import asyncio
import json
import random
import struct
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

import httpx

DEFAULT_PROMPT = "Batch invariance means the same request gets the same numbers, whatever else the server is doing."


@dataclass
class Probe:
    transport: str  # http | grpc
    kind: str  # score | generate
    ok: bool = False
    vector: bytes = b""  # float32 bytes of the logprob vector
    values: list[float] = field(default_factory=list)
    text: str = ""
    fingerprint: str = ""
    max_batch_seqs: int = 0  # the most sequences this probe shared a step with (HTTP only)
    error: str = ""
    retries: int = 0
    replica: str = ""  # the x-steadyserve-replica header behind a Ray Serve proxy (HTTP only), else ""


def f32(values: list[float]) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


class Runner:
    def __init__(self, http: str | None, grpc: str | None, prompt: str, max_tokens: int, api_key: str,
                 timeout: float = 300.0) -> None:
        self.http = http.rstrip("/") if http else None
        self.grpc = grpc
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(timeout=timeout, limits=httpx.Limits(max_connections=1000))
        self.grpc_client: Any = None
        self.api_key = api_key
        self.num_overloaded = 0

    async def _post(self, body: dict[str, Any]) -> tuple[dict[str, Any], int, str]:
        retries = 0
        while True:
            r = await self.client.post(self.http + "/v1/completions", json=body, headers=self.headers)  # type: ignore[operator]
            if r.status_code in (429, 503) and retries < 50:
                self.num_overloaded += 1
                retries += 1
                await asyncio.sleep(min(float(r.headers.get("retry-after", "1")), 2.0) * random.uniform(0.2, 1.0))
                continue
            if r.status_code != 200:
                raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
            return r.json(), retries, r.headers.get("x-steadyserve-replica", "")

    async def http_probe(self, kind: str) -> Probe:
        p = Probe("http", kind)
        body: dict[str, Any] = {"prompt": self.prompt, "temperature": 0, "logprobs": 0}
        if kind == "score":
            body.update(max_tokens=0, echo=True)
        else:
            body.update(max_tokens=self.max_tokens, ignore_eos=True)
        try:
            data, p.retries, p.replica = await self._post(body)
            ch = data["choices"][0]
            p.values = [v for v in ch["logprobs"]["token_logprobs"] if v is not None]
            p.text = ch["text"] if kind == "generate" else ""
            p.fingerprint = data.get("system_fingerprint", "")
            p.max_batch_seqs = (data.get("steadyserve") or {}).get("max_batch_seqs", 0)
            p.vector, p.ok = f32(p.values), True
        except Exception as e:
            p.error = f"{type(e).__name__}: {e}"
        return p

    async def grpc_probe(self, kind: str) -> Probe:
        import grpc

        from ..client import AsyncClient, retry_after_ms

        p = Probe("grpc", kind)
        if self.grpc_client is None:
            self.grpc_client = AsyncClient(self.grpc.split(","), api_key=self.api_key or None)  # type: ignore[union-attr]
        try:
            for _ in range(50):
                try:
                    if kind == "score":
                        res = await self.grpc_client.score(self.prompt)
                        p.values = [t.logprob for t in res.tokens[1:]]
                        p.fingerprint = res.fingerprint
                    else:
                        values: list[float] = []
                        text = []
                        async for msg in self.grpc_client.generate(self.prompt, max_tokens=self.max_tokens,
                                                                   temperature=0.0, logprobs=0, ignore_eos=True):
                            if msg.HasField("batch"):
                                values += [t.logprob for t in msg.batch.logprobs]
                                text.append(msg.batch.text)
                            else:
                                p.fingerprint = msg.final.fingerprint
                        p.values, p.text = values, "".join(text)
                    break
                except grpc.RpcError as e:
                    if e.code() not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
                        raise
                    self.num_overloaded += 1
                    p.retries += 1
                    await asyncio.sleep(min((retry_after_ms(e) or 1000) / 1000, 2.0) * random.uniform(0.2, 1.0))
            p.vector, p.ok = f32(p.values), bool(p.values)
            if not p.ok:
                p.error = "no logprobs returned (overloaded 50 times?)"
        except Exception as e:
            p.error = f"{type(e).__name__}: {e}"
        return p

    async def background(self, rng: random.Random) -> None:
        words = "the a model server batch token stream logprob engine cache request under load".split()
        body = {"prompt": " ".join(rng.choice(words) for _ in range(rng.randint(1, 120))),
                "max_tokens": rng.randint(1, 48), "temperature": rng.choice([0, 0.7, 1.0]), "ignore_eos": True}
        try:
            await self._post(body)
        except Exception:
            pass  # background traffic only exists to share batches with the probes


def _drift(vectors: list[list[float]]) -> float:
    ref = vectors[0]
    worst = 0.0
    for v in vectors[1:]:
        if len(v) != len(ref):
            return float("inf")
        worst = max([worst] + [abs(a - b) for a, b in zip(v, ref)])
    return worst


def summarize(probes: list[Probe], seconds: float, num_background: int, num_overloaded: int) -> dict[str, Any]:
    report: dict[str, Any] = {"seconds": round(seconds, 2), "probes": len(probes), "background": num_background,
                              "overloaded_retries": num_overloaded, "kinds": {}, "passed": True}
    errors = [p for p in probes if not p.ok]
    report["errors"] = len(errors)
    report["error_examples"] = sorted({p.error for p in errors})[:5]
    if errors:
        report["passed"] = False
    by_kind: dict[str, list[Probe]] = defaultdict(list)
    for p in probes:
        if p.ok:
            by_kind[p.kind].append(p)
    for kind, ps in sorted(by_kind.items()):
        per_fp: dict[str, Any] = {}
        for fp in sorted({p.fingerprint for p in ps}):
            group = [p for p in ps if p.fingerprint == fp]
            distinct = Counter(p.vector for p in group)
            per_fp[fp] = {
                "probes": len(group),
                "by_transport": dict(Counter(p.transport for p in group)),
                "by_replica": dict(Counter(p.replica for p in group if p.replica)),
                "distinct_vectors": len(distinct),
                "distinct_texts": len({p.text for p in group}),
                "max_abs_drift": _drift([p.values for p in group]),
                "vector_length": len(group[0].values),
            }
            if len(distinct) != 1:
                report["passed"] = False
        batch = sorted(p.max_batch_seqs for p in ps if p.transport == "http")
        report["kinds"][kind] = {
            "fingerprints": per_fp,
            "batch_seqs": {"min": batch[0], "median": batch[len(batch) // 2], "max": batch[-1],
                           "distinct": len(set(batch))} if batch else None,
        }
    if not by_kind:
        report["passed"] = False
    return report


async def run_validate(http: str | None, grpc: str | None, n: int, concurrency: int, background: float,
                       prompt: str, max_tokens: int, api_key: str, progress: bool, seed: int = 0,
                       num_receipts: int = 0, model: str = "") -> dict[str, Any]:
    from .validate_receipts import KINDS, collect_receipt, verify_collected

    runner = Runner(http, grpc, prompt, max_tokens, api_key)
    rng = random.Random(seed)
    jobs: list[Any] = []
    transports = [t for t, on in (("http", http), ("grpc", grpc)) if on]
    for i in range(n):
        t = transports[i % len(transports)]
        kind = "score" if (i // len(transports)) % 2 == 0 else "generate"
        jobs.append((t, kind))
    for i in range(num_receipts):  # receipt probes: each transport and kind in turn
        jobs.append((f"receipt:{transports[i % len(transports)]}", f"{KINDS[(i // len(transports)) % 3]}:{i}"))
    num_bg = int((n + num_receipts) * background) if http else 0
    jobs += [("bg", None)] * num_bg
    rng.shuffle(jobs)
    sem = asyncio.Semaphore(concurrency)
    done = 0
    t0 = time.monotonic()
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(jobs), desc="validate", unit="req", file=sys.stderr)

    collected: list[tuple[str, Any]] = []

    async def one(job: tuple[str, str | None]) -> Probe | None:
        nonlocal done
        async with sem:
            t, kind = job
            if t.startswith("receipt:"):
                rkind, i = kind.split(":")  # type: ignore[union-attr]
                collected.append(await collect_receipt(runner, t.split(":")[1], rkind, int(i)))
                res = None
            elif t == "bg":
                await runner.background(random.Random(rng.random()))
                res = None
            elif t == "http":
                res = await runner.http_probe(kind)  # type: ignore[arg-type]
            else:
                res = await runner.grpc_probe(kind)  # type: ignore[arg-type]
            done += 1
            if bar is not None:
                bar.update(1)
            return res

    results = await asyncio.gather(*(one(j) for j in jobs))
    if bar is not None:
        bar.close()
    await runner.client.aclose()
    if runner.grpc_client is not None:
        await runner.grpc_client.close()
    report = summarize([p for p in results if p is not None], time.monotonic() - t0, num_bg, runner.num_overloaded)
    if num_receipts:  # replayed here, after the load: the model loads in this process
        if n == 0:  # receipts only: no probe kinds to compare
            report["passed"] = not report["errors"]
        collected.sort(key=lambda item: int(item[0].rsplit(":", 1)[1]))
        report["receipts"] = await asyncio.to_thread(verify_collected, collected, model)
        report["passed"] = report["passed"] and report["receipts"]["passed"]
    return report


def print_summary(rep: dict[str, Any]) -> None:
    print(f"steadyserve validate: {rep['probes']} probes + {rep['background']} background requests "
          f"in {rep['seconds']} s ({rep['overloaded_retries']} overload retries, {rep['errors']} errors)")
    for kind, k in rep["kinds"].items():
        b = k["batch_seqs"]
        if b:
            print(f"  {kind}: probes shared steps with {b['min']}..{b['max']} sequences "
                  f"(median {b['median']}, {b['distinct']} distinct batch sizes)")
        for fp, g in k["fingerprints"].items():
            verdict = "OK" if g["distinct_vectors"] == 1 else "DRIFT"
            print(f"    [{verdict}] fingerprint {fp}: {g['probes']} probes {g['by_transport']}, "
                  f"{g['distinct_vectors']} distinct logprob vector(s) of {g['vector_length']} values, "
                  f"max |drift| {g['max_abs_drift']:.3g}, {g['distinct_texts']} distinct text(s)")
            if g["by_replica"]:
                print(f"      HTTP probes per replica (x-steadyserve-replica): {g['by_replica']}")
        if len(k["fingerprints"]) > 1:
            print(f"    note: {len(k['fingerprints'])} fingerprints seen (different replicas/models), compared separately")
    rc = rep.get("receipts")
    if rc:
        print(f"  receipts: {rc['receipts']} collected under load, verified here: {rc['verified']} verified, "
              f"{rc['mismatch']} mismatched, {rc['not reproducible here']} not reproducible here, "
              f"{rc['invalid']} invalid")
        for v in rc["not_verified"]:
            print(f"    [{v['status'].upper()}] {v['source']} {v['request_id']}: {v['detail']}")
    for e in rep["error_examples"]:
        print(f"  error: {e}")
    print("PASS: exactly one distinct vector per probe kind" if rep["passed"] else "FAIL")


def main(a: Any) -> int:
    if not a.http and not a.grpc:
        print("steadyserve validate: give --http URL and/or --grpc ADDR", file=sys.stderr)
        return 2
    rep = asyncio.run(run_validate(a.http, a.grpc, a.n, a.concurrency, a.background, a.prompt, a.max_tokens,
                                   a.api_key, progress=not a.json and sys.stderr.isatty(),
                                   num_receipts=getattr(a, "receipts", 0), model=getattr(a, "model", "")))
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print_summary(rep)
    return 0 if rep["passed"] else 1
