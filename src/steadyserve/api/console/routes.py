"""The web console: a dashboard at `/` and a playground at `/playground`, served by the HTTP server itself.

Static files live in `static/` next to this module (plain JS and CSS, no build
step, nothing fetched from elsewhere). The pages carry no data: everything they
show comes from `/v1/...` endpoints, which need the API key when one is set.

`GET /v1/console/stats` is the dashboard's JSON: identity, phase, cumulative
counters (the browser turns them into rates between polls), gauges, latency
percentiles over a recent window (from the Prometheus histograms' bucket
deltas, interpolated as `histogram_quantile` does) and recently finished
requests. `POST /v1/console/tokens` gives the text of token ids, so the
playground can show each streamed token and its alternatives.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from ...platform_info import platform_info
from ..http.errors import error_response
from ..protocol import token_text

STATIC_DIR = Path(__file__).with_name("static")
WINDOW_S = 10.0  # latency percentiles cover this many recent seconds
MAX_TOKEN_IDS = 8192  # per /v1/console/tokens call

CSP = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self' ws: wss:; font-src 'self'; object-src 'none'; base-uri 'none'; "
       "form-action 'self'; frame-ancestors 'none'")
SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-cache",
}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}


def _load_static() -> dict[str, tuple[bytes, str]]:
    """Every shipped file, read once: a fixed set of names, so no path from a request touches the disk."""
    files = {}
    for p in sorted(STATIC_DIR.rglob("*")):
        if p.is_file() and p.suffix in CONTENT_TYPES:
            files[p.relative_to(STATIC_DIR).as_posix()] = (p.read_bytes(), CONTENT_TYPES[p.suffix])
    return files


# ---- reading prometheus-client objects ------------------------------------------------------------

def _samples(metric: Any) -> list[Any]:
    return [s for fam in metric.collect() for s in fam.samples]


def _by_label(counter: Any, label: str) -> dict[str, float]:
    return {s.labels[label]: s.value for s in _samples(counter) if s.name.endswith("_total")}


def _total(counter: Any) -> float:
    return sum(s.value for s in _samples(counter) if s.name.endswith("_total"))


def _buckets(hist: Any) -> list[tuple[float, float]]:
    """Cumulative (upper bound, count) pairs, +Inf last."""
    return [(float(s.labels["le"]), s.value) for s in _samples(hist) if s.name.endswith("_bucket")]


def quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus' histogram_quantile over cumulative buckets: linear within the bucket; None when empty."""
    if not buckets:
        return None
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    lower, prev = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # beyond the last finite bound: report that bound, as Prometheus does
            if count == prev:
                return upper
            return lower + (upper - lower) * (rank - prev) / (count - prev)
        lower, prev = upper, count
    return lower


class Stats:
    """Builds /v1/console/stats; keeps timestamped histogram snapshots for the recent-window percentiles."""

    HISTS = ("ttft", "itl", "loop_lag", "duration", "queue_wait")

    def __init__(self, state: Any) -> None:
        self.state = state
        self._snaps: deque[tuple[float, dict[str, list[tuple[float, float]]]]] = deque()
        self._lock = threading.Lock()

    def _window(self, now: float, current: dict[str, list[tuple[float, float]]]) -> tuple[float, dict]:
        """Bucket deltas since the newest snapshot at least WINDOW_S old (or the oldest one we have)."""
        with self._lock:
            self._snaps.append((now, current))
            # Keep one snapshot older than the window, drop anything before it.
            while len(self._snaps) > 1 and now - self._snaps[1][0] >= WINDOW_S:
                self._snaps.popleft()
            base_t, base = self._snaps[0]
        if base is current:  # the first call: everything since start-up is the window
            return max(0.0, time.time() - self.state.started_at), current
        out = {}
        for name, cur in current.items():
            old = dict(base.get(name, []))
            out[name] = [(le, c - old.get(le, 0.0)) for le, c in cur]
        return now - base_t, out

    def build(self) -> dict[str, Any]:
        st = self.state
        loaded, fp, m = st.loaded, st.fingerprint, st.metrics
        engine = st.engine
        selftest = None if st.selftest is None else {"passed": st.selftest.passed, "detail": st.selftest.detail,
                                                      "seconds": round(st.selftest.seconds, 3)}
        out: dict[str, Any] = {
            "time": time.time(),
            "uptime_s": round(time.time() - st.started_at, 3),
            "model": {
                "name": st.model_name, "fingerprint": str(fp), "weights": fp.weights, "device": fp.device,
                "dtype": fp.dtype, "batch_invariant": fp.batch_invariant, "selftest": selftest,
                "kernel": fp.kernel, "numerics_id": fp.numerics, "numerics": _numerics_text(),
                "max_model_len": st.limits.context, "architecture": loaded.args.architecture,
                "num_layers": loaded.args.num_layers, "vocab_size": st.limits.vocab_size,
            },
            "status": {
                "ready": st.ready, "draining": st.draining, "engine_alive": engine.alive, "engine_error": engine.dead,
                "selftest_ok": st.selftest is None or st.selftest.passed,
            },
            "capacity": {"max_num_seqs": engine.max_num_seqs, "max_queue": engine.max_queue},
            "metrics_enabled": m is not None,
            "window_s": WINDOW_S,
        }
        in_flight = engine.num_in_flight
        if m is not None:
            running = min(m.running._value.get(), in_flight)
            waiting = min(m.waiting._value.get(), in_flight - running)
            out["gauges"] = {"running": running, "waiting": waiting, "in_flight": in_flight,
                             "kv_cache_usage": m.kv_usage._value.get(),
                             "kv_cache_cached_blocks": m.cached_blocks._value.get()}
            out["counters"] = {
                "generated_tokens": _total(m.generated_tokens), "prompt_tokens": _total(m.prompt_tokens),
                "finished": _by_label(m.finished, "finish_reason"), "rejected": _by_label(m.rejected, "reason"),
                "aborted": _by_label(m.aborted, "reason"), "admitted": _by_label(m.admitted, "transport"),
                "preemptions": _total(m.preemptions),
                "prefix_cache_queried_tokens": _total(m.prefix_queried),
                "prefix_cache_hit_tokens": _total(m.prefix_hits),
            }
            now = time.monotonic()
            current = {name: _buckets(getattr(m, name)) for name in self.HISTS}
            span, window = self._window(now, current)
            out["latency"] = {
                name: {"p50": quantile(0.5, b), "p99": quantile(0.99, b), "count": b[-1][1] if b else 0}
                for name, b in window.items()
            }
            out["latency_window_s"] = round(span, 3)
        else:
            last = engine.last_stats
            out["gauges"] = {"running": getattr(last, "num_running", 0), "waiting": getattr(last, "num_waiting", 0),
                             "in_flight": in_flight, "kv_cache_usage": getattr(last, "kv_usage", 0.0)}
        recent = list(getattr(st, "recent", ()))
        out["recent"] = recent[::-1][:50]
        out["tenants"] = _tenants(st)
        return out


def _tenants(st: Any) -> list[dict[str, Any]]:
    """Capacity by tenant (--api-keys): each tenant in force with its share, limits and use so far."""
    gate, m = getattr(st, "gate", None), st.metrics
    if gate is None or gate.keyring is None:
        return []
    admitted = _by_label(m.tenant_admitted, "tenant") if m is not None else {}
    tokens = {(s.labels["tenant"], s.labels["kind"]): s.value for s in (_samples(m.tenant_tokens) if m else ())
              if s.name.endswith("_total")}
    refused: dict[str, float] = {}
    for s in _samples(m.tenant_rejected) if m is not None else ():
        if s.name.endswith("_total"):
            refused[s.labels["tenant"]] = refused.get(s.labels["tenant"], 0.0) + s.value
    return [{"name": t.name, "weight": t.weight, "priority": t.priority, "max_concurrent": t.max_concurrent,
             "in_flight": st.quotas.in_flight(t.name), "admitted": admitted.get(t.name, 0.0),
             "prompt_tokens": tokens.get((t.name, "prompt"), 0.0), "output_tokens": tokens.get((t.name, "output"), 0.0),
             "refused": refused.get(t.name, 0.0)} for t in gate.keyring.tenants.values()]


def _numerics_text() -> dict[str, Any]:
    n = platform_info().numerics
    return {"mode": n.mode, "facts": n.facts} if n else {"mode": "unknown", "facts": {}}


def mount_console(app: FastAPI, state: Any) -> None:
    """Register the console's pages, its static files and its two JSON endpoints on `app`."""
    files = _load_static()
    stats = Stats(state)

    def static(name: str) -> Response:
        found = files.get(name)
        if found is None:
            return error_response(404, f"no such console file: {name}", "invalid_request_error", None, "not_found")
        body, ctype = found
        return Response(body, media_type=ctype, headers=SECURITY_HEADERS)

    @app.get("/", include_in_schema=False)
    async def dashboard() -> Response:
        return static("index.html")

    @app.get("/playground", include_in_schema=False)
    async def playground() -> Response:
        return static("playground.html")

    @app.get("/static/{name:path}", include_in_schema=False)
    async def static_file(name: str) -> Response:
        return static(name)

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return static("favicon.svg") if "favicon.svg" in files else Response(status_code=204)

    @app.get("/v1/console/stats")
    async def console_stats() -> JSONResponse:
        """The web console's dashboard data: identity, self-test, throughput, queue, KV cache, latencies,
        refusals and recent requests, as one JSON object (polled by the dashboard)."""
        return JSONResponse(stats.build(), headers={"Cache-Control": "no-store"})

    @app.post("/v1/console/tokens")
    async def console_tokens(request: Request) -> Response:
        """The text of each token id, for the console's playground: `{"ids": [...]}` gives `{"tokens": [...]}`."""
        try:
            body = await request.json()
            ids = body["ids"]
            if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
                raise ValueError
        except Exception:
            return error_response(400, 'send {"ids": [token ids]}', "invalid_request_error", "ids", "invalid_value")
        if len(ids) > MAX_TOKEN_IDS:
            return error_response(400, f"ids: at most {MAX_TOKEN_IDS} per call", "invalid_request_error", "ids",
                                  "invalid_value")
        tok = state.loaded.tokenizer
        vocab = state.limits.vocab_size
        out = []
        for i in ids:
            if not 0 <= i < vocab:
                return error_response(400, f"ids: {i} is not a token id of this model", "invalid_request_error",
                                      "ids", "invalid_value")
            out.append(token_text(tok, i))
        return JSONResponse({"tokens": out})
