"""Errors of the Anthropic Messages API (/v1/messages): Anthropic's JSON shape and status codes.

    {"type": "error", "error": {"type": "invalid_request_error", "message": "max_tokens: field required"}}

The statuses themselves are decided where every endpoint's are (errors.REFUSAL_STATUS for refusals,
events.END_STATUS for a request that ended early); this module only translates an HTTP status into the
status and error type Anthropic uses for it (ANTHROPIC_STATUS). The one choice made here: a server at
capacity (queue full) is a 429 `rate_limit_error` with `retry-after`, as on every other endpoint, so a client
backs off and retries; a server that cannot take work at all (draining, engine down: 503 elsewhere) is a 529
`overloaded_error`, the status Anthropic uses for "temporarily overloaded, retry later". Both are retried by
Anthropic's SDKs.
"""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from ...limits import Refused
from ..events import end_status
from .errors import refusal_status

MESSAGES_PATH = "/v1/messages"  # this API's routes: /v1/messages and /v1/messages/count_tokens

# The HTTP status steadyserve's tables give -> (the status Anthropic answers, its error type). Anthropic also
# uses invalid_request_error for a 4xx it does not list, and api_error for an unexpected 5xx.
ANTHROPIC_STATUS: dict[int, tuple[int, str]] = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    429: (429, "rate_limit_error"),
    500: (500, "api_error"),
    503: (529, "overloaded_error"),  # draining, engine down, a drain that cut a stream: retry elsewhere
}


def is_messages_path(path: str) -> bool:
    """Whether a request path belongs to this API (its errors then take Anthropic's shape)."""
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def anthropic_status(status: int) -> tuple[int, str]:
    """(Anthropic's status, error type) for the status steadyserve's tables give."""
    if status in ANTHROPIC_STATUS:
        return ANTHROPIC_STATUS[status]
    return (status, "invalid_request_error") if status < 500 else (500, "api_error")


def anthropic_error_body(type_: str, message: str) -> dict:
    return {"type": "error", "error": {"type": type_, "message": message}}


def anthropic_error(status: int, message: str, retry_after: float | None = None) -> JSONResponse:
    """The error response for `status` (as steadyserve's tables give it), in Anthropic's shape."""
    code, type_ = anthropic_status(status)
    headers = {"retry-after": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse(anthropic_error_body(type_, message), status_code=code, headers=headers)


def anthropic_refusal(e: Refused) -> JSONResponse:
    """A refusal of this API's routes: the message names the field, as on every endpoint."""
    status, _, retry = refusal_status(e)
    return anthropic_error(status, str(e), retry)


def anthropic_end_error(code: str, message: str) -> tuple[int, dict]:
    """(status, body) of a request that ended with an error code (events.END_STATUS): a whole response's
    status, or a stream's `error` event body."""
    status, type_ = anthropic_status(end_status(code).http)
    return status, anthropic_error_body(type_, message)
