"""OpenAI-style error bodies and the status code of each refusal."""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from ...engine.engine import AdmissionError

# AdmissionError.reason -> (HTTP status, OpenAI error type)
ADMISSION_STATUS = {
    "overloaded": (429, "overloaded"),
    "too_long": (400, "invalid_request_error"),
    "invalid": (400, "invalid_request_error"),
    "draining": (503, "unavailable"),
    "dead": (503, "unavailable"),
}


def error_body(message: str, type_: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str, param: str | None = None, code: str | None = None,
                   retry_after: float | None = None) -> JSONResponse:
    headers = {"Retry-After": str(max(1, math.ceil(retry_after)))} if retry_after is not None else None
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def admission_response(e: AdmissionError) -> JSONResponse:
    status, type_ = ADMISSION_STATUS.get(e.reason, (400, "invalid_request_error"))
    retry = e.retry_after if status in (429, 503) else None
    if status in (429, 503) and retry is None:
        retry = 1.0
    return error_response(status, str(e), type_, e.param, e.reason, retry)
