"""The spans of one finished request, built from its tracing.RequestTrace with explicit times.

One SERVER span per request, a child of the caller's span when it sent a W3C traceparent, named
"{gen_ai.operation.name} {model}". Its children are the phases, each with the times the request path and the
engine recorded (never a clock read now): `validate` (arrival to admission: body read, parse, tokenize, checks),
and per engine request `queue` (admission to first scheduling), `prefill` (first scheduling to the step that
computed the last prompt token) and `decode` (first token to finish). The request span's events mark the
instants: scheduled, prefill_end, first_token, each preempted, finished. The attributes follow the OpenTelemetry
GenAI semantic conventions, plus steadyserve.fingerprint (the numerics fingerprint of every response).
"""

from __future__ import annotations

from typing import Any

from .tracing import ChoiceEnd, RequestTrace


def _usage(choices: list[ChoiceEnd], n: int) -> tuple[int, int, int]:
    """(input, output, cached input) tokens of a request's choices: a prompt counts once per `n` samples."""
    inp = out = cached = 0
    for i, c in enumerate(choices):
        if i % n == 0:
            inp += c.num_prompt_tokens
            cached += c.num_cached_tokens
        out += c.num_generated_tokens
    return inp, out, cached


def outcome(t: RequestTrace, choices: list[ChoiceEnd]) -> tuple[str, str] | None:
    """(error.type, description) when the request failed, else None. A refusal names its reason, an early end
    its code (stall, deadline, client_disconnect, ...), else the transport's status; a choice the engine failed
    counts too."""
    if t.refusal is not None:
        return t.refusal
    if t.end_error is not None:
        return t.end_error
    if t.failure is not None:
        return t.failure
    failed = next((c for c in choices if c.finish_reason == "error"), None)
    if failed is not None:
        return "request_error", failed.error or "request failed"
    return None


def build_spans(tracer: Any, t: RequestTrace, model: str, fingerprint: str) -> None:
    from opentelemetry.trace import SpanKind, Status, StatusCode, set_span_in_context

    choices = [c for c in t.choices if c is not None]
    attrs: dict[str, Any] = {"gen_ai.operation.name": t.operation, "gen_ai.request.model": model,
                             "steadyserve.fingerprint": fingerprint, "steadyserve.transport": t.transport,
                             **t.attributes, **t.request_attributes}
    if t.request_id is not None:
        attrs["steadyserve.request_id"] = t.request_id
    if choices:
        inp, out, cached = _usage(choices, max(1, t.num_samples))
        attrs.update({"gen_ai.response.model": model, "gen_ai.usage.input_tokens": inp,
                      "gen_ai.usage.output_tokens": out, "gen_ai.usage.cache_read.input_tokens": cached,
                      "gen_ai.response.finish_reasons": [c.finish_reason or "error" for c in choices]})
    failed = outcome(t, choices)
    if failed is not None:
        attrs["error.type"] = failed[0]
    end_mono = t.end_mono if t.end_mono is not None else t.start_mono
    last = max([end_mono] + [c.timings.finished for c in choices if c.timings is not None])
    span = tracer.start_span(f"{t.operation} {model}", context=t.parent, kind=SpanKind.SERVER, attributes=attrs,
                             start_time=t.start_ns)
    ctx = set_span_in_context(span)

    def child(name: str, start: float, end: float, a: dict[str, Any], error: str | None = None) -> None:
        c = tracer.start_span(name, context=ctx, kind=SpanKind.INTERNAL, attributes=a, start_time=t.to_ns(start))
        if error is not None:
            c.set_status(Status(StatusCode.ERROR, error))
        c.end(end_time=t.to_ns(max(start, end)))

    refused_early = failed if (t.validated is None and failed is not None) else None
    child("validate", t.start_mono, t.validated if t.validated is not None else end_mono, {},
          refused_early[1] if refused_early else None)
    events: list[tuple[float, str, dict[str, Any]]] = []
    for i, c in enumerate(t.choices):
        tm = c.timings if c is not None else None
        if c is None or tm is None:
            continue
        a: dict[str, Any] = {"steadyserve.choice": i} if len(t.choices) > 1 else {}
        sched = tm.first_scheduled
        child("queue", tm.arrival, sched if sched is not None else tm.finished, a)
        if sched is not None:
            child("prefill", sched, tm.prefill_done if tm.prefill_done is not None else tm.finished, a)
            events.append((sched, "scheduled", a))
        if tm.prefill_done is not None:
            events.append((tm.prefill_done, "prefill_end", a))
        if tm.first_token is not None:
            child("decode", tm.first_token, tm.finished, a)
            events.append((tm.first_token, "first_token", a))
        for when in tm.preempted:
            events.append((when, "preempted", a))
        events.append((tm.finished, "finished", {**a, "gen_ai.response.finish_reasons": [c.finish_reason or "error"],
                                                 "gen_ai.usage.output_tokens": c.num_generated_tokens}))
    for when, name, a in sorted(events, key=lambda e: e[0]):
        span.add_event(name, a, timestamp=t.to_ns(when))
    if failed is not None:
        span.set_status(Status(StatusCode.ERROR, f"{failed[0]}: {failed[1]}"))
    span.end(end_time=t.to_ns(last))
