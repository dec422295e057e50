"""What a request may ask for, and the one error type for what it may not.

Every transport (HTTP, WebSocket, gRPC) and the engine itself check requests
against the limits defined here, and refuse with `Refused`: the refusal's
`reason` is the code clients see and (folded into `REJECT_REASONS`) the
metrics label; each transport only maps it to its own status. This module
imports nothing from the package, so the engine and the front ends both can.
"""

from __future__ import annotations

# ---- sampling limits (OpenAI's ranges where OpenAI has one) -------------------------------------------------
MAX_LOGPROBS = 20  # alternatives per position, for logprobs and prompt logprobs
MAX_TEMPERATURE = 2.0  # as OpenAI
MAX_STOP_STRINGS = 4  # as OpenAI
MAX_LOGIT_BIAS = 300  # tokens one request may bias
MAX_BIAS = 100.0  # |bias| per token: -100 bans it, 100 all but forces it
MAX_PENALTY = 2.0  # |presence_penalty|, |frequency_penalty|
MAX_REPETITION_PENALTY = 10.0
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1  # what torch.Generator.manual_seed takes

# ---- request limits -------------------------------------------------------------------------------------------
MAX_REQUEST_ID_CHARS = 128  # a client's request id (x-request-id, gRPC request_id): printable, at most this long
MAX_CHOICES = 128  # n and best_of
CHAT_ROLES = ("system", "user", "assistant", "developer", "tool")  # who may speak in a chat request's messages
# Tokens generated when the request names no max_tokens (never more than --max-tokens-cap or the context leaves).
DEFAULT_MAX_TOKENS = {"completion": 16, "chat": 512}

# ---- connection limits ------------------------------------------------------------------------------------------
# The HTTP server closes a kept-alive connection idle this long. A client that pools connections to it (the Ray
# replica's, to its child server) drops its own idle ones after POOLED_IDLE_S, well before: at equal timeouts the
# client reuses a connection in the instant the server closes it, and the request fails (httpx.ReadError) before
# the server read it.
HTTP_KEEP_ALIVE_S = 5.0
POOLED_IDLE_S = 1.0

# ---- edge limits: what one connection may send before any route runs (issue 61, api/http/edge.py) ----------------
# The operator's knobs among them (--max-request-bytes, --header-timeout, --body-timeout, --max-idle-connections)
# are flags in config.py ServerConfig; these are fixed because no legitimate client comes near them.
MAX_HEADER_BYTES = 16 * 1024  # request line + header lines of one HTTP request (Node's and h11's bound); past it: 431
MAX_HEADER_COUNT = 100  # header lines of one HTTP request (Apache's LimitRequestFields); past it: 431
# Nesting of objects and arrays in a JSON body (HTTP, WebSocket) or JSON field (gRPC's tools[].parameters_json).
# The deepest legitimate request is a tool's or response_format's JSON schema: a few levels per nested property.
MAX_JSON_DEPTH = 64
GRPC_MAX_CONCURRENT_STREAMS = 256  # open HTTP/2 streams per gRPC connection; more wait in the client's queue

# A tenant's own limits (--api-keys, steadyserve/tenants.py; counted by api/quotas.py): a tenant past one is refused
# with its name (429 / RESOURCE_EXHAUSTED and a Retry-After from its own refill) while other tenants are admitted.
# tenant_share: the server is nearly full and the tenant holds more than its weighted share of it (api/quotas.py).
TENANT_LIMIT_REASONS = ("tenant_concurrency", "tenant_prompt_tokens", "tenant_output_tokens", "tenant_share")

# The metrics' labels of steadyserve_requests_rejected_total. A refusal whose reason is not one of them
# (invalid_value, model_not_found, invalid_json, ...) is counted as "invalid".
REJECT_REASONS = ("overloaded", "too_long", "invalid", "draining", "dead", "unauthenticated", "forbidden",
                  *TENANT_LIMIT_REASONS)

# The refusals that say "not now" rather than "not this": a client retries them later or elsewhere.
RETRY_REASONS = ("overloaded", "draining", "dead", *TENANT_LIMIT_REASONS)

# The refusals that say "too much from you, or from everyone, right now": HTTP 429, gRPC RESOURCE_EXHAUSTED.
RATE_REASONS = ("overloaded", *TENANT_LIMIT_REASONS)


class Refused(ValueError):
    """A request refused before any work was done: retrying the same request is safe.

    Raised by the request builders of every transport (api/requests.py), by the HTTP body reader and by the
    engine's limits (engine/admission.py ModelLimits, which the builders and offline callers check against) and
    AsyncEngine.submit_all (capacity). Transports map `reason` to their status.
    """

    def __init__(self, reason: str, message: str, param: str | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason  # the code clients see (docs/reference/errors.md): invalid_value, too_long, ...
        self.param = param  # the request field at fault, as the HTTP API names it; None when no one field is
        self.retry_after = retry_after  # seconds a client should wait before retrying (RETRY_REASONS)

    @property
    def message(self) -> str:
        return self.args[0]

    @property
    def metric_reason(self) -> str:
        """The steadyserve_requests_rejected_total label."""
        return self.reason if self.reason in REJECT_REASONS else "invalid"

    def message_for(self, field: str) -> str:
        """The message with the field named as a transport names it (gRPC: `params.temperature`, `text`).

        A message that starts with the field's HTTP name gets the transport's name there instead; any other gets
        it as a `field: ` prefix. So both transports' texts agree apart from the field's name.
        """
        if self.param and self.message.startswith(self.param):
            return field + self.message[len(self.param):]
        return f"{field}: {self.message}"


class InvalidRequest(Refused):
    """A field is out of range or of the wrong type (reason `invalid_value`). `param` names the field.

    Kept as a subclass for the (param, message) call order that the sampling checks use.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__("invalid_value", message, param)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids a client sent must be ids of this model; the message points at the first that is not.

    The one token-range check, behind ModelLimits.check_prompt_ids: the request builder runs it for every
    transport, ModelLimits.check for offline callers, so both refuse with the same reason, field and message."""
    bad = next((i for i, t in enumerate(ids) if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"{param}[{bad}]", f"{param}[{bad}]: token id {ids[bad]} is out of range "
                             f"0..{vocab_size - 1}")


def valid_request_id(request_id: str) -> bool:
    """A client-chosen request id: at most MAX_REQUEST_ID_CHARS printable characters."""
    return len(request_id) <= MAX_REQUEST_ID_CHARS and request_id.isprintable()


def check_request_id(request_id: str) -> None:
    """Raise InvalidRequest unless valid_request_id."""
    if not valid_request_id(request_id):
        raise InvalidRequest("request_id", f"request_id must be at most {MAX_REQUEST_ID_CHARS} printable "
                             "characters")


def check_range(name: str, value: float, low: float, high: float) -> None:
    """`low <= value <= high`, refusing NaN too. Raises InvalidRequest naming `name`."""
    if not low <= value <= high:
        raise InvalidRequest(name, f"{name} must be in {_num(low)}..{_num(high)}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)
