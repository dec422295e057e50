"""OpenTelemetry export of request traces (on with --otlp-traces-endpoint or the OTEL_EXPORTER_OTLP_* variables).

`Tracing` owns the SDK's tracer provider, exporting over OTLP/HTTP (protobuf) through a BatchSpanProcessor whose
worker thread alone talks to the collector. Finished spans are handed over by appending to its bounded queue:
the event loop never waits on the collector and the engine thread never calls the SDK. A dead, slow or refusing
collector costs a counted drop and nothing else: a span that finds the queue full is dropped
(steadyserve_trace_spans_dropped_total{reason="queue_full"}) and a batch the exporter could not deliver is
counted as dropped (reason="export_failed") once its retries, bounded by OTEL_EXPORTER_OTLP_TRACES_TIMEOUT, end.

The spans of one request are built when it has ended, from its tracing.RequestTrace, with the times recorded
on the way (see docs/tracing.md for the spans, events and attributes).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Callable, Mapping, Sequence
from urllib.parse import urlsplit

from ..config import ConfigError
from .tracing import RequestTrace

log = logging.getLogger("steadyserve.tracing")

TRACES_PATH = "v1/traces"  # the OTLP/HTTP traces path, appended to a base URL
DEFAULT_MAX_QUEUE = 2048  # the SDK's OTEL_BSP_MAX_QUEUE_SIZE default
DEFAULT_MAX_BATCH = 512  # the SDK's OTEL_BSP_MAX_EXPORT_BATCH_SIZE default
SHUTDOWN_TIMEOUT_S = 5.0  # the most a server's stop waits to flush spans to a collector


def check_url(url: str, name: str) -> str:
    """`url` if it is an http(s) URL with a host; else ConfigError naming the variable `name`."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{name} must be an http:// or https:// URL of an OTLP/HTTP collector "
                          f"(e.g. http://127.0.0.1:4318), not {url!r}")
    return url


def traces_endpoint(flag: str, env: Mapping[str, str] = os.environ) -> str:
    """The OTLP/HTTP traces URL to export to, or "" when tracing is off.

    --otlp-traces-endpoint first (a URL without a path gets /v1/traces), else OTEL_EXPORTER_OTLP_TRACES_ENDPOINT
    as given, else OTEL_EXPORTER_OTLP_ENDPOINT + /v1/traces (the OpenTelemetry rules). OTEL_SDK_DISABLED=true
    turns tracing off. Only http/protobuf is spoken: another OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL is refused."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    if flag:  # ServerConfig.validate has checked it
        url = flag
        if urlsplit(url).path in ("", "/"):
            url = url.rstrip("/") + "/" + TRACES_PATH
    elif env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip():
        url = check_url(env["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"].strip(), "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    elif env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip():
        base = check_url(env["OTEL_EXPORTER_OTLP_ENDPOINT"].strip(), "OTEL_EXPORTER_OTLP_ENDPOINT")
        url = base.rstrip("/") + "/" + TRACES_PATH
    else:
        return ""
    for name in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        proto = env.get(name, "").strip()
        if proto and proto != "http/protobuf":
            raise ConfigError(f"{name}={proto}: steadyserve exports traces over OTLP/HTTP only; set it to "
                              "http/protobuf (the collector's port 4318) or unset it")
        if proto:
            break
    return url


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    text = env.get(name, "").strip()
    if not text:
        return default
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(f"{name} must be a positive integer, not {text!r}")
    return int(text)


class CountedBatchProcessor:
    """The SDK's BatchSpanProcessor behind a bound of its own, so that every span lost is counted.

    A span is handed to the batch processor only while fewer than `max_queue_size` are waiting in it (counted
    here: in on_end, out when the exporter takes a batch, which the processor pops first); a span that finds
    them all taken is dropped at once and counted, never waited for, so the processor's own queue, of the same
    size, never overflows unseen. The exporter's failures are counted by _CountingExporter."""

    def __init__(self, exporter: Any, max_queue_size: int, max_export_batch_size: int,
                 dropped: Callable[[str, int], None], exported: Callable[[int], None]) -> None:
        from opentelemetry.sdk.trace.export import BatchSpanProcessor

        self._lock = threading.Lock()
        self._queued = 0  # spans handed to the batch processor and not yet taken by the exporter
        self._max = max_queue_size
        self._closed = False
        self._dropped = dropped
        self._exporter = _CountingExporter(exporter, self._taken, dropped, exported)
        # The schedule delay comes from OTEL_BSP_SCHEDULE_DELAY, as the SDK reads it.
        self._batch = BatchSpanProcessor(self._exporter, max_queue_size=max_queue_size,
                                         max_export_batch_size=min(max_export_batch_size, max_queue_size))

    def _taken(self, n: int) -> None:
        with self._lock:
            self._queued -= n

    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def _on_ending(self, span: Any) -> None:  # the SDK calls it on processors that have it
        pass

    def on_end(self, span: Any) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._lock:
            full = self._closed or self._queued >= self._max
            if not full:
                self._queued += 1
        if full:
            self._dropped("queue_full", 1)
            return
        self._batch.on_end(span)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self._batch.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._batch.force_flush(timeout_millis)


class _CountingExporter:
    """An exporter that counts what it delivered and what it could not (its retries spent, or an exception)."""

    def __init__(self, inner: Any, taken: Callable[[int], None], dropped: Callable[[str, int], None],
                 exported: Callable[[int], None]) -> None:
        self._inner = inner
        self._taken = taken
        self._dropped = dropped
        self._exported = exported

    def export(self, spans: Sequence[Any]) -> Any:
        from opentelemetry.sdk.trace.export import SpanExportResult

        self._taken(len(spans))
        try:
            result = self._inner.export(spans)
        except Exception:  # an exporter bug must not end the worker thread
            log.exception("span export failed")
            result = SpanExportResult.FAILURE
        if result == SpanExportResult.SUCCESS:
            self._exported(len(spans))
        else:
            self._dropped("export_failed", len(spans))
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


class Tracing:
    """The tracer of one server: opens request records (tracing.RequestTrace) and exports their spans."""

    def __init__(self, endpoint: str, model: str, fingerprint: str, metrics: Any = None,
                 env: Mapping[str, str] = os.environ) -> None:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider

        from .. import __version__

        self.endpoint = endpoint
        self.model = model
        self.fingerprint = fingerprint
        dropped_total = metrics.trace_spans_dropped if metrics is not None else None
        exported_total = metrics.trace_spans_exported if metrics is not None else None

        def dropped(reason: str, n: int) -> None:
            if dropped_total is not None:
                dropped_total.labels(reason).inc(n)

        def exported(n: int) -> None:
            if exported_total is not None:
                exported_total.inc(n)

        self.processor = CountedBatchProcessor(
            OTLPSpanExporter(endpoint=endpoint), _env_int(env, "OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE),
            _env_int(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", DEFAULT_MAX_BATCH), dropped, exported)
        resource = Resource.create({"service.version": __version__})  # OTEL_SERVICE_NAME, OTEL_RESOURCE_ATTRIBUTES
        if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):
            resource = resource.merge(Resource({"service.name": "steadyserve"}))
        # The exporter warns at each retry of a batch; one error per batch lost is enough beside the drop counter.
        logging.getLogger(OTLPSpanExporter.__module__).setLevel(logging.ERROR)
        self.provider = TracerProvider(resource=resource)  # sampler: OTEL_TRACES_SAMPLER, parent-based by default
        self.provider.add_span_processor(self.processor)  # type: ignore[arg-type]
        self.tracer = self.provider.get_tracer("steadyserve", __version__)

    def begin(self, transport: str, operation: str, carrier: Mapping[str, str], **attributes: Any) -> RequestTrace:
        """Open the record of a request that just arrived, as the running task's current one; `carrier` holds
        its headers or metadata (lower-case names), whose traceparent the span joins."""
        from opentelemetry import propagate

        trace = RequestTrace(self._emit, transport, operation, propagate.extract(carrier), attributes)
        trace.enter()
        return trace

    def _emit(self, t: RequestTrace) -> None:
        try:
            from .spans import build_spans

            build_spans(self.tracer, t, self.model, self.fingerprint)
        except Exception:  # a tracing bug must never fail or slow a request; it is logged
            log.exception("could not record a request's trace")

    def shutdown(self, timeout_s: float = SHUTDOWN_TIMEOUT_S) -> bool:
        """Flush what is queued and stop, waiting at most `timeout_s` (a dead collector is not waited for).
        Returns whether it finished in time."""
        done = threading.Thread(target=self.provider.shutdown, name="steadyserve-trace-shutdown", daemon=True)
        done.start()
        done.join(timeout_s)
        return not done.is_alive()
