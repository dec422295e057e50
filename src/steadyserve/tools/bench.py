"""`steadyserve bench`: a load generator that knows about tokens and streams.

Closed loop (`-c` clients, `-n` requests) or open loop (`--rate` req/s for
`--duration` s); scoring or streaming generation over HTTP SSE, WebSocket or
gRPC; slow readers and mid-stream disconnects on purpose. It counts truncated
streams (ended without a finish reason or an error event), which must be 0.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from .sse_client import StreamResult, sse_post

WORDS = ("the model server batch token stream logprob engine cache request load queue socket reader "
         "drain signal fingerprint kernel tile block attention softmax").split()


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    return int(lo), int(hi or lo)


@dataclass
class Outcome:
    kind: str  # what this client was: normal | slow | disconnect
    status: str  # HTTP status or gRPC code, or "exception"
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float = 0.0
    num_tokens: int = 0
    truncated: bool = False
    finish_reason: str | None = None
    error_code: str | None = None
    t_end: float = 0.0
    disconnected: bool = False  # this client hung up on purpose before the end
    usage_counted: bool = False  # num_tokens came from the server's usage object (count_usage)


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    return v[min(len(v) - 1, int(round(q / 100 * (len(v) - 1))))]


class Bench:
    def __init__(self, a: Any) -> None:
        self.a = a
        self.url = (a.url or "").rstrip("/")
        self.rng = random.Random(a.seed)
        self.headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        self.outcomes: list[Outcome] = []
        self.t0 = 0.0
        self.client: httpx.AsyncClient | None = None
        self.grpc_client: Any = None

    def prompt(self) -> str:
        lo, hi = parse_range(self.a.prompt_words)
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def role(self) -> str:
        x = self.rng.random()
        if x < self.a.slow_readers:
            return "slow"
        if x < self.a.slow_readers + self.a.disconnect:
            return "disconnect"
        return "normal"

    def draw(self) -> tuple[str, str, int]:
        """The next request's role, prompt and max_tokens, from the seeded generator (benchmarks that drive an engine
        without HTTP draw the same requests through this)."""
        kind = self.role()
        prompt = self.prompt()
        lo, hi = parse_range(self.a.output_tokens)
        return kind, prompt, self.rng.randint(lo, hi)

    async def one(self) -> None:
        kind, prompt, max_tokens = self.draw()
        t = time.monotonic()
        if self.a.mode == "score":
            out = await self.score(prompt)
        elif self.a.transport == "sse":
            out = await self.sse(prompt, max_tokens, kind)
        elif self.a.transport == "ws":
            out = await self.ws(prompt, max_tokens, kind)
        else:
            out = await self.grpc_generate(prompt, max_tokens, kind)
        out.e2e = time.monotonic() - t
        out.t_end = time.monotonic() - self.t0
        self.outcomes.append(out)

    async def score(self, prompt: str) -> Outcome:
        if self.a.transport == "grpc":
            from ..client import AsyncClient

            if self.grpc_client is None:
                self.grpc_client = AsyncClient(self.a.grpc.split(","), api_key=self.a.api_key or None, retries=False)
            try:
                await self.grpc_client.score(prompt)
                return Outcome("normal", "OK")
            except Exception as e:
                code = getattr(e, "code", None)
                return Outcome("normal", code().name if callable(code) else type(e).__name__)
        assert self.client is not None
        try:
            r = await self.client.post(self.url + "/v1/completions", headers=self.headers, json={
                "prompt": prompt, "max_tokens": 0, "echo": True, "logprobs": 0})
            return Outcome("normal", str(r.status_code))
        except httpx.HTTPError as e:
            return Outcome("normal", "exception", error_code=type(e).__name__)

    async def sse(self, prompt: str, max_tokens: int, kind: str) -> Outcome:
        body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
        if self.a.ignore_eos is not None:  # None: a server that refuses the extension (a benchmark peer)
            body["ignore_eos"] = self.a.ignore_eos
        count_usage = getattr(self.a, "count_usage", False)
        if count_usage:  # count the tokens the server says it sent, not the events that carried them
            body["stream_options"] = {"include_usage": True}
        body.update(getattr(self.a, "extra_body", None) or {})
        res: StreamResult = await sse_post(
            self.url + "/v1/completions", body, self.headers,
            read_rate=self.a.slow_rate if kind == "slow" else None, rcvbuf=4096 if kind == "slow" else None,
            disconnect_after_events=self.rng.randint(1, max(1, max_tokens // 2)) if kind == "disconnect" else None)
        out = Outcome(kind, str(res.status) if not res.exception else "exception", ttft=res.ttft,
                      num_tokens=res.usage_tokens if count_usage and res.usage_tokens is not None else res.num_tokens,
                      truncated=res.truncated and not res.exception,
                      finish_reason=res.finish_reason, error_code=(res.error or {}).get("code") or res.exception)
        if res.exception and kind != "disconnect":
            out.truncated = res.status == 200
        out.usage_counted = count_usage and res.usage_tokens is not None
        out.itls = [b - a for a, b in zip(res.token_times, res.token_times[1:])]
        out.disconnected = res.disconnected
        return out

    async def ws(self, prompt: str, max_tokens: int, kind: str) -> Outcome:
        import websockets

        url = self.url.replace("http", "ws", 1) + "/v1/stream"
        t = time.monotonic()
        out = Outcome(kind, "exception")
        times: list[float] = []
        try:
            async with websockets.connect(url, additional_headers=self.headers, max_size=2 ** 24) as ws:
                await ws.send(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                                          "ignore_eos": self.a.ignore_eos}))
                cut = self.rng.randint(1, max(1, max_tokens // 2)) if kind == "disconnect" else None
                async for raw in ws:
                    msg = json.loads(raw)
                    if msg["type"] == "delta":
                        times.append(time.monotonic())
                        out.num_tokens += len(msg["token_ids"])
                        if kind == "slow":
                            await asyncio.sleep(len(raw) / self.a.slow_rate)
                        if cut is not None and len(times) >= cut:
                            out.status, out.disconnected = "disconnected", True
                            return out
                    elif msg["type"] == "final":
                        out.finish_reason = msg["finish_reason"]
                    elif msg["type"] == "error":
                        out.error_code = msg["error"].get("code")
                out.status = str(ws.close_code)
        except Exception as e:
            out.error_code = type(e).__name__
        out.ttft = times[0] - t if times else None
        out.itls = [b - a for a, b in zip(times, times[1:])]
        out.truncated = out.status == "1000" and out.finish_reason is None and out.error_code is None
        return out

    async def grpc_generate(self, prompt: str, max_tokens: int, kind: str) -> Outcome:
        from ..client import AsyncClient

        if self.grpc_client is None:
            self.grpc_client = AsyncClient(self.a.grpc.split(","), api_key=self.a.api_key or None, retries=False)
        t = time.monotonic()
        out = Outcome(kind, "OK")
        times: list[float] = []
        cut = self.rng.randint(1, max(1, max_tokens // 2)) if kind == "disconnect" else None
        call = self.grpc_client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=self.a.ignore_eos)
        try:
            async for msg in call:
                if msg.HasField("final"):
                    out.finish_reason = {1: "stop", 2: "length", 3: "abort"}.get(msg.final.finish_reason, "?")
                    continue
                if msg.batch.token_ids:
                    times.append(time.monotonic())
                    out.num_tokens += len(msg.batch.token_ids)
                if kind == "slow":
                    await asyncio.sleep(len(msg.batch.text.encode()) / self.a.slow_rate)
                if cut is not None and len(times) >= cut:
                    call.cancel()
                    out.status, out.disconnected = "CANCELLED", True
                    break
        except Exception as e:
            code = getattr(e, "code", None)
            out.status = code().name if callable(code) else type(e).__name__
            out.error_code = out.status
        out.ttft = times[0] - t if times else None
        out.itls = [b - a for a, b in zip(times, times[1:])]
        out.truncated = out.status == "OK" and out.finish_reason is None
        return out

    async def closed_loop(self) -> None:
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(self.a.n):
            queue.put_nowait(i)

        async def worker() -> None:
            while True:
                try:
                    queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                await self.one()
                self.tick()

        await asyncio.gather(*(worker() for _ in range(self.a.concurrency)))

    async def open_loop(self) -> None:
        tasks = []
        end = time.monotonic() + self.a.duration
        interval = 1.0 / self.a.rate
        nxt = time.monotonic()
        while nxt < end:
            tasks.append(asyncio.create_task(self.one()))
            nxt += self.rng.expovariate(1.0 / interval)
            await asyncio.sleep(max(0.0, nxt - time.monotonic()))
        await asyncio.gather(*tasks)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    async def run(self) -> dict[str, Any]:
        self.bar = None
        if sys.stderr.isatty() and not self.a.json and self.a.rate is None:
            from tqdm import tqdm

            self.bar = tqdm(total=self.a.n, desc="bench", unit="req", file=sys.stderr)
        self.client = httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=10_000))
        self.t0 = time.monotonic()
        if self.a.rate:
            await self.open_loop()
        else:
            await self.closed_loop()
        wall = time.monotonic() - self.t0
        await self.client.aclose()
        if self.grpc_client is not None:
            await self.grpc_client.close()
        if self.bar is not None:
            self.bar.close()
        return self.report(wall)

    def report(self, wall: float) -> dict[str, Any]:
        o = self.outcomes
        ttft = [x.ttft for x in o if x.ttft is not None]
        itl = [v for x in o for v in x.itls]
        e2e = [x.e2e for x in o]
        tokens = sum(x.num_tokens for x in o)

        def p(vals: list[float]) -> dict[str, float | None]:
            return {f"p{q}": pct(vals, q) for q in (50, 90, 99)}

        return {
            "mode": self.a.mode, "transport": self.a.transport, "requests": len(o), "wall_s": round(wall, 3),
            "concurrency": self.a.concurrency if not self.a.rate else None, "rate": self.a.rate,
            "requests_per_s": len(o) / wall if wall else 0.0, "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall if wall else 0.0,
            "ttft_s": p(ttft), "itl_s": p(itl), "e2e_s": p(e2e),
            "status": dict(Counter(x.status for x in o)),
            "finish_reasons": dict(Counter(x.finish_reason for x in o if x.finish_reason)),
            "error_codes": dict(Counter(x.error_code for x in o if x.error_code)),
            "roles": dict(Counter(x.kind for x in o)),
            "disconnected": sum(x.disconnected for x in o),
            "truncated_streams": sum(x.truncated for x in o),
            "usage_counted_streams": sum(x.usage_counted for x in o),
        }


def print_report(r: dict[str, Any]) -> None:
    def ms(d: dict[str, float | None]) -> str:
        return " ".join(f"{k}={v * 1000:.0f}ms" if v is not None else f"{k}=-" for k, v in d.items())

    print(f"steadyserve bench: {r['requests']} {r['mode']} requests over {r['transport']} in {r['wall_s']} s")
    print(f"  throughput   {r['requests_per_s']:.1f} req/s, {r['output_tokens_per_s']:.1f} output tok/s")
    print(f"  ttft         {ms(r['ttft_s'])}")
    print(f"  inter-token  {ms(r['itl_s'])}")
    print(f"  end-to-end   {ms(r['e2e_s'])}")
    print(f"  status       {r['status']}   roles {r['roles']}")
    print(f"  finish       {r['finish_reasons']}   errors {r['error_codes']}")
    print(f"  hung up on purpose: {r['disconnected']}   truncated streams: {r['truncated_streams']}")


def plot(outcomes: list[Outcome], out_dir: str) -> list[str]:
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out_dir, exist_ok=True)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, vals in (("TTFT", [x.ttft for x in outcomes if x.ttft is not None]),
                       ("inter-token", [v for x in outcomes for v in x.itls]),
                       ("end-to-end", [x.e2e for x in outcomes])):
        v = sorted(vals)
        if v:
            ax.plot(v, [i / len(v) for i in range(len(v))], label=name)
    ax.set_xscale("log")
    ax.set_xlabel("seconds")
    ax.set_ylabel("fraction")
    ax.legend()
    ax.set_title("latency CDF")
    paths.append(os.path.join(out_dir, "latency_cdf.png"))
    fig.savefig(paths[-1], dpi=100)
    fig, ax = plt.subplots(figsize=(7, 4))
    ends = sorted((x.t_end, x.num_tokens) for x in outcomes)
    if ends:
        width = max(1.0, ends[-1][0] / 30)
        bins: Counter[int] = Counter()
        for t, n in ends:
            bins[int(t // width)] += n
        xs = sorted(bins)
        ax.bar([x * width for x in xs], [bins[x] / width for x in xs], width=width)
    ax.set_xlabel("seconds")
    ax.set_ylabel("output tokens/s (by finish time)")
    paths.append(os.path.join(out_dir, "tokens_per_s.png"))
    fig.savefig(paths[-1], dpi=100)
    return paths


def main(a: Any) -> int:
    if a.transport == "grpc" and not a.grpc:
        print("steadyserve bench: --transport grpc needs --grpc ADDR", file=sys.stderr)
        return 2
    if a.transport != "grpc" and not a.url:
        print("steadyserve bench: give --url http://HOST:PORT", file=sys.stderr)
        return 2
    b = Bench(a)
    rep = asyncio.run(b.run())
    if a.plot:
        rep["plots"] = plot(b.outcomes, a.plot)
    if a.json:
        print(json.dumps(rep, indent=2))
    else:
        print_report(rep)
    if a.output:
        with open(a.output, "w") as f:
            json.dump(rep, f, indent=2)
    return 0 if rep["truncated_streams"] == 0 else 1
