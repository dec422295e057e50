"""One request's trace record: filled in as the request goes, turned into OpenTelemetry spans once it has ended.

A transport opens the record where a request arrives and closes it where its answer ends: the HTTP envelope
(completions, chat, Responses, WebSocket) and the gRPC interceptor, through `Tracing.begin` (api/otel.py), which
reads the caller's W3C `traceparent`. In between the record is the context's current one (a ContextVar: each
HTTP request and each RPC runs in its own task), and the request path adds to it in three places every
transport shares: `requests.admit` (what the request asked for, and a watch on its engine requests' final
outputs, whose RequestTimings carry the engine's own times: scheduled, prefill done, first token, preemptions,
finish), a refusal (`note_refusal`) and the end code of its RequestChannel (`note_end`).

Nothing here calls the OpenTelemetry SDK, and the engine thread never sees a record: api/otel.py builds the
spans, with explicit start and end times, when both the answer and every engine request have ended. With
tracing off no record is made, and each hook costs one ContextVar read.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..engine.sequence import RequestOutput, RequestTimings

if TYPE_CHECKING:  # type names only
    from ..engine.channel import RequestChannel
    from ..limits import Refused

_current: ContextVar["RequestTrace | None"] = ContextVar("steadyserve_request_trace", default=None)

# The GenAI operation (gen_ai.operation.name) of each request kind (requests.ValidatedRequest.kind).
OPERATIONS = {"chat": "chat", "completion": "text_completion", "score": "score", "embedding": "embeddings"}


def current() -> "RequestTrace | None":
    """The trace record of the request this task serves; None when tracing is off or the route is not traced."""
    return _current.get()


def note_refusal(e: "Refused") -> None:
    """The request was refused (any transport): its span gets error status and `error.type` = the reason."""
    t = _current.get()
    if t is not None and t.refusal is None:
        t.refusal = (e.reason, str(e))


def note_end(error: tuple[str, str] | None) -> None:
    """How the request's RequestChannel ended it: None, or its (code, message) (stall, deadline, request_error, ...)."""
    t = _current.get()
    if t is not None and error is not None and t.end_error is None:
        t.end_error = error


@dataclass
class ChoiceEnd:
    """One engine request's final output, as the span needs it."""

    finish_reason: str | None  # stop | length | abort | error
    error: str | None  # the engine's message with finish_reason error
    num_prompt_tokens: int
    num_generated_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    timings: RequestTimings | None  # the engine's times; None when it never held the request


class RequestTrace:
    """What one request's spans are built from. Written on the event loop only."""

    def __init__(self, sink: Callable[["RequestTrace"], None], transport: str, operation: str, parent: Any,
                 attributes: dict[str, Any]) -> None:
        self.start_ns = time.time_ns()  # wall clock, for the span; start_mono is the same instant
        self.start_mono = time.monotonic()  # the engine's clock: every other time here is on it
        self.transport = transport  # http | ws | grpc
        self.operation = operation  # gen_ai.operation.name as the route suggests it; admitted() knows better
        self.parent = parent  # the OpenTelemetry Context extracted from the caller's traceparent
        self.attributes = dict(attributes)  # the transport's own (http.*, rpc.*), added to at the end
        self.request_attributes: dict[str, Any] = {}  # gen_ai.request.* and the like, from the validated request
        self.request_id: str | None = None
        self.num_samples = 1  # choices per prompt: usage counts each prompt once
        self.validated: float | None = None  # when the request passed validation (admission began)
        self.choices: list[ChoiceEnd | None] = []  # one per engine request, once admitted
        self.refusal: tuple[str, str] | None = None  # (reason, message) of a refusal
        self.end_error: tuple[str, str] | None = None  # (code, message) the request's events ended with
        self.failure: tuple[str, str] | None = None  # (error.type, description) the transport reported
        self.end_mono: float | None = None  # when the answer ended (last byte, close, or RPC status)
        self.status: int | None = None  # the transport's status as it is sent: HTTP status, WebSocket close code
        self._sink = sink
        self._open = 1  # the answer, plus each engine request not yet finished

    def to_ns(self, mono: float) -> int:
        """A time on the monotonic clock as the span's wall-clock nanoseconds."""
        return self.start_ns + int((mono - self.start_mono) * 1e9)

    def admitted(self, req: Any, channel: "RequestChannel") -> None:
        """The request (a requests.ValidatedRequest, which imports this module) passed validation and its engine
        requests were admitted: note what it asked for, and watch each engine request's final output (after
        the state's own observer)."""
        self.validated = time.monotonic()
        self.operation = OPERATIONS.get(req.kind, req.kind)
        self.request_id = req.request_id
        self.num_samples = req.num_samples
        p = req.params[0]
        a: dict[str, Any] = {"gen_ai.response.id": req.request_id, "gen_ai.request.max_tokens": p.max_tokens,
                             "gen_ai.request.temperature": p.temperature, "gen_ai.request.top_p": p.top_p,
                             "gen_ai.request.stream": req.stream}
        if p.top_k:
            a["gen_ai.request.top_k"] = p.top_k
        if p.seed is not None:
            a["gen_ai.request.seed"] = p.seed
        if p.presence_penalty:
            a["gen_ai.request.presence_penalty"] = p.presence_penalty
        if p.frequency_penalty:
            a["gen_ai.request.frequency_penalty"] = p.frequency_penalty
        if p.stop:
            a["gen_ai.request.stop_sequences"] = list(p.stop)
        if req.n != 1:
            a["gen_ai.request.choice.count"] = req.n
        if len(req.prompts) > req.num_samples:
            a["steadyserve.prompts"] = len(req.prompts) // req.num_samples
        self.request_attributes = a
        n = len(channel.request_ids)
        self.choices = [None] * n
        self._open += n
        for i in range(n):
            channel.observe(i, self._watch(i))

    def _watch(self, i: int) -> Callable[[RequestOutput], None]:
        def on_output(out: RequestOutput) -> None:
            if out.finished and self.choices[i] is None:
                self.choices[i] = ChoiceEnd(out.finish_reason, out.error, out.num_prompt_tokens,
                                            out.num_generated_tokens, out.num_cached_tokens, out.timings)
                self._release()
        return on_output

    def ended(self, failure: tuple[str, str] | None = None, **attributes: Any) -> None:
        """The answer ended: `failure` is (error.type, description) when the transport reported one (an HTTP
        status >= 400, a WebSocket error close, a gRPC status other than OK); `attributes` its own."""
        if self.end_mono is not None:
            return
        self.end_mono = time.monotonic()
        self.failure = failure
        self.attributes.update(attributes)
        if _current.get() is self:
            _current.set(None)
        self._release()

    def _release(self) -> None:
        self._open -= 1
        if self._open == 0:
            self._sink(self)

    def enter(self) -> None:
        """Make this the current record of the running task."""
        _current.set(self)
