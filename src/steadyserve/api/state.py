"""What the front ends share: the engine, the model's identity, and the server's phase."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..config import Config
from ..engine.async_engine import AsyncEngine
from ..engine.engine import AdmissionError
from ..engine.selftest import SelfTestResult
from ..engine.sequence import Request, RequestOutput, SamplingParams
from ..models.loader import Fingerprint, LoadedModel
from .streams import StreamRegistry

reqlog = logging.getLogger("steadyserve.request")


@dataclass
class ServerState:
    config: Config
    loaded: LoadedModel
    engine: AsyncEngine
    fingerprint: Fingerprint
    selftest: SelfTestResult | None  # None when invariance is off and the test was skipped
    draining: bool = False  # SIGTERM seen: refuse new work, finish what is in flight
    started_at: float = field(default_factory=time.time)
    metrics: Any = None  # steadyserve.metrics.Metrics, when enabled
    streams: StreamRegistry = field(default_factory=StreamRegistry)
    # The last finished requests, newest last, for the web console's table (api/console/routes.py).
    recent: deque = field(default_factory=lambda: deque(maxlen=200))

    @property
    def model_name(self) -> str:
        return self.loaded.name

    @property
    def ready(self) -> bool:
        """Model loaded, self-test passed (or not claimed), engine alive, not draining."""
        test_ok = self.selftest is None or self.selftest.passed
        return test_ok and self.engine.alive and not self.draining

    def new_request_id(self, given: str | None = None) -> str:
        return given if given else f"req-{uuid.uuid4().hex[:20]}"

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams, transport: str):
        """Admit a request (or raise AdmissionError); returns the engine's RequestStream."""
        return self.submit_all([(request_id, prompt_ids, params)], transport)[0]

    def submit_all(self, items: list[tuple[str, list[int], SamplingParams]], transport: str) -> list:
        """Admit all of (request id, prompt ids, params), one client call, or none (AdmissionError);
        returns their RequestStreams in order."""
        if self.draining:
            raise AdmissionError("draining", "server is draining (shutting down); retry on another replica",
                                 retry_after=5.0)
        requests = [Request(rid, ids, params, transport) for rid, ids, params in items]
        streams = self.engine.submit_all(requests)
        for request, stream in zip(requests, streams):
            self._observe(request, stream)
        return streams

    def _observe(self, request: Request, stream: Any) -> None:
        """Count the admission; log the request and record it for the console when it finishes."""
        request_id, transport = request.request_id, request.transport
        metrics = self.metrics
        if metrics is not None:
            metrics.on_admitted(transport)
        first_token: list[float] = []
        fingerprint = str(self.fingerprint)

        def on_output(out: RequestOutput) -> None:
            if metrics is not None:
                metrics.on_output(out, request.arrival_time)
            if out.new_token_ids and not first_token:
                first_token.append(time.monotonic())
            if out.finished:
                now = time.monotonic()
                ttft = first_token[0] - request.arrival_time if first_token else None
                fields = {
                    "request_id": request_id, "transport": transport, "prompt_tokens": out.num_prompt_tokens,
                    "generated_tokens": out.num_generated_tokens,
                    "ttft_s": None if ttft is None else round(ttft, 4),
                    "total_s": round(now - request.arrival_time, 4), "finish_reason": out.finish_reason,
                    "error": out.error, "fingerprint": fingerprint}
                reqlog.info("request done", extra={"fields": fields})
                self.recent.append({**fields, "finished_at": time.time()})

        stream.on_output = on_output
