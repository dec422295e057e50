"""What the front ends share: the engine, the model's identity, and the server's phase."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

from ..config import Config
from ..cpu_budget import CpuBudget
from ..engine.admission import ModelLimits
from ..engine.async_engine import AsyncEngine
from ..engine.channel import RequestChannel
from ..engine.selftest import SelfTestResult
from ..engine.sequence import Request, RequestOutput, SamplingParams
from ..limits import Refused
from ..models.loader import Fingerprint, LoadedModel
from ..tenants import Tenant
from .quotas import Load, TenantQuotas
from .streams import OpenChannels
from .tenancy import Gate, current as current_tenant

reqlog = logging.getLogger("steadyserve.request")
T = TypeVar("T")


def engine_times(out: RequestOutput, arrival: float) -> dict[str, float | None]:
    """Where a request's time went on the engine's side, for its log line: the queue wait (admission to the first
    step that scheduled it) and admission to the step that emitted its first token. The line's ttft_s is taken
    when the event loop handled that token, so ttft_s less engine_ttft_s is the event loop's own delay."""
    t = out.timings
    if t is None:
        return {}

    def since(when: float | None) -> float | None:
        return None if when is None else round(when - arrival, 4)
    return {"queue_s": since(t.first_scheduled), "engine_ttft_s": since(t.first_token),
            "preemptions": len(t.preempted)}


def _tokenizer_pool() -> ThreadPoolExecutor:
    # One thread: HF tokenizers are not meant to be used from several threads at once.
    return ThreadPoolExecutor(1, thread_name_prefix="steadyserve-tokenize")


@dataclass
class ServerState:
    config: Config
    loaded: LoadedModel
    engine: AsyncEngine
    fingerprint: Fingerprint
    selftest: SelfTestResult | None  # None when invariance is off and the test was skipped
    # The engine's limits (vocabulary, context, KV capacity, grammars), built once by the engine at start-up:
    # the request builders check against them, and nothing above the engine reads the engine for them.
    limits: ModelLimits
    draining: bool = False  # SIGTERM seen: refuse new work, finish what is in flight
    started_at: float = field(default_factory=time.time)
    metrics: Any = None  # steadyserve.metrics.Metrics, when enabled
    memory: Any = None  # steadyserve.memory.MemoryPlan: the limit, its source and the budget checked against it
    cpu: CpuBudget | None = None  # the CPU budget read at start-up: the engine's thread count and what decided it
    tracing: Any = None  # steadyserve.api.otel.Tracing while traces are exported (--otlp-traces-endpoint), else None
    streams: OpenChannels = field(default_factory=OpenChannels)  # the channels transports hold (drain cuts them)
    # The last finished requests, newest last, for the web console's table (api/console/routes.py).
    recent: deque = field(default_factory=lambda: deque(maxlen=200))
    # Tokenizing and chat-template rendering take time proportional to the input (seconds for a megabyte):
    # every transport runs them here (the tokenizer releases the GIL), never on the event loop.
    tokenizer_pool: ThreadPoolExecutor = field(default_factory=_tokenizer_pool)
    # Who may call (--api-keys / --api-key; api/tenancy.py) and each tenant's own limits, counted at admission.
    gate: Gate = field(default_factory=lambda: Gate(None))
    quotas: TenantQuotas = field(default_factory=TenantQuotas)

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

    async def run_tokenizer(self, fn: Callable[..., T], *args: Any) -> T:
        """fn(*args) on the one tokenizer thread, awaited from the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def refuse_if_closed(self) -> None:
        """Raise Refused while the server takes no new work: draining (shutting down) or its engine dead."""
        if self.draining:
            raise Refused("draining", "server is draining (shutting down); retry on another replica", retry_after=5.0)
        if self.engine.dead is not None or not self.engine.alive:
            why = f": {self.engine.dead}" if self.engine.dead else ""
            raise Refused("dead", f"the engine is not running{why}")

    def submit_all(self, items: list[tuple[str, list[int], SamplingParams]], transport: str,
                   embed: bool = False, receipt: bool = False) -> RequestChannel:
        """Admit all of (request id, prompt ids, params), one client call, or none (Refused); returns their
        RequestChannel (choice i is items[i]). `embed`: embedding requests (Request.embed); `receipt`: their
        final outputs carry what a receipt needs. The calling task's tenant (api/tenancy.py) is checked against
        its own limits first (api/quotas.py), then the engine's capacity."""
        self.refuse_if_closed()  # again: the server may have begun draining while the request was tokenized
        tenant = current_tenant()
        name, share, batch = (tenant.name, tenant.weight, tenant.priority == "batch") if tenant else ("", 1.0, False)
        requests = [Request(rid, ids, params, transport, embed=embed, receipt=receipt, tenant=name, share=share,
                            batch=batch) for rid, ids, params in items]
        prompt_tokens = sum(len(ids) for _, ids, _ in items)
        try:
            if tenant is not None:
                load = Load(self.engine.num_in_flight, self.engine.capacity, self.gate.total_weight)
                self.quotas.admit(tenant, len(requests), prompt_tokens, load)
            try:
                channel = self.engine.submit_all(requests)
            except Refused:
                if tenant is not None:
                    self.quotas.undo(tenant, len(requests), prompt_tokens)
                raise
        except Refused as e:
            if tenant is not None and self.metrics is not None and e.reason != "invalid":
                self.metrics.on_tenant_refused(name, e.reason)
            raise
        if tenant is not None and self.metrics is not None:
            self.metrics.on_tenant_admitted(name, len(requests), prompt_tokens, self.quotas.in_flight(name))
        for i, request in enumerate(requests):
            self._observe(request, channel, i, tenant)
        return channel

    def _observe(self, request: Request, channel: RequestChannel, index: int, tenant: Tenant | None) -> None:
        """Count the admission; log the request and record it for the console when it finishes; count a
        tenant's output tokens and its finish (api/quotas.py)."""
        request_id, transport = request.request_id, request.transport
        metrics = self.metrics
        if metrics is not None:
            metrics.on_admitted(transport)
        first_token: list[float] = []
        fingerprint = str(self.fingerprint)
        quotas = self.quotas

        def on_output(out: RequestOutput) -> None:
            first = bool(out.new_token_ids) and not first_token
            if metrics is not None:
                metrics.on_output(out, request.arrival_time)
            if out.new_token_ids and not first_token:
                first_token.append(time.monotonic())
            if tenant is not None:
                if out.new_token_ids:
                    quotas.generated(tenant.name, len(out.new_token_ids))
                if out.finished:
                    quotas.finished(tenant.name)
                if metrics is not None:
                    metrics.on_tenant_output(tenant.name, out, request.arrival_time, first,
                                             quotas.in_flight(tenant.name))
            if out.finished:
                now = time.monotonic()
                ttft = first_token[0] - request.arrival_time if first_token else None
                fields = {
                    "request_id": request_id, "transport": transport, "prompt_tokens": out.num_prompt_tokens,
                    "generated_tokens": out.num_generated_tokens,
                    "ttft_s": None if ttft is None else round(ttft, 4),
                    "total_s": round(now - request.arrival_time, 4), "finish_reason": out.finish_reason,
                    "error": out.error, "fingerprint": fingerprint}
                if tenant is not None:
                    fields["tenant"] = tenant.name
                fields.update(engine_times(out, request.arrival_time))
                reqlog.info("request done", extra={"fields": fields})
                self.recent.append({**fields, "finished_at": time.time()})

        channel.observe(index, on_output)
