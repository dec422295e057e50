"""OpenAI-style error bodies, and the HTTP status of each refusal (steadyserve.limits.Refused)."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from ...limits import RETRY_REASONS, Refused

# Refused.reason -> (HTTP status, OpenAI error type); every other reason is a 400 invalid_request_error.
REFUSAL_STATUS = {
    "overloaded": (429, "overloaded"),
    # A tenant past its own limit (--api-keys): the code names the limit.
    "tenant_concurrency": (429, "rate_limit_error"),
    "tenant_prompt_tokens": (429, "rate_limit_error"),
    "tenant_output_tokens": (429, "rate_limit_error"),
    "tenant_share": (429, "rate_limit_error"),
    "forbidden": (403, "permission_error"),  # a tenant calling an endpoint its keys-file entry does not allow
    "draining": (503, "unavailable"),
    "dead": (503, "unavailable"),
    "model_not_found": (404, "invalid_request_error"),
    "not_found": (404, "invalid_request_error"),  # a stored response (Responses API) that is not there
    "request_too_large": (413, "invalid_request_error"),
    "too_long": (400, "invalid_request_error"),
    "invalid": (400, "invalid_request_error"),
    "invalid_value": (400, "invalid_request_error"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def refusal_status(e: Refused) -> tuple[int, str, float | None]:
    """(HTTP status, OpenAI error type, Retry-After seconds or None) of a refusal."""
    status, type_ = REFUSAL_STATUS.get(e.reason, (400, "invalid_request_error"))
    retry = (e.retry_after if e.retry_after is not None else 1.0) if e.reason in RETRY_REASONS else None
    return status, type_, retry


def refusal_response(e: Refused) -> JSONResponse:
    status, type_, retry = refusal_status(e)
    return error_response(status, str(e), type_, e.param, e.reason, retry)
