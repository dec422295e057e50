"""The one end-code table (api/events.py END_STATUS): every code a stream can end with maps to a real status
on every transport, and the transports agree on the error's type."""

from __future__ import annotations

import grpc

from steadyserve.api.events import END_STATUS, OTHER_END, end_status
from steadyserve.api.streams import END_MESSAGES


def test_every_end_code_has_a_row_and_real_statuses() -> None:
    assert set(END_MESSAGES) | {"request_error"} <= set(END_STATUS)
    for code, end in {**END_STATUS, "unknown": OTHER_END}.items():
        assert isinstance(getattr(grpc.StatusCode, end.grpc), grpc.StatusCode), code
        assert end.ws_close in (1008, 1011), code  # policy violation (the request's fault) or server error
        assert end.error_type == ("server_error" if end.http >= 500 else "invalid_request_error"), code


def test_the_request_alone_failed_is_the_one_4xx_end() -> None:
    assert (end_status("request_error").http, end_status("request_error").ws_close) == (400, 1008)
    assert end_status("engine_error").grpc == "INTERNAL"  # the one use of INTERNAL
    assert end_status("drain_timeout").http == 503 and end_status("drain_timeout").grpc == "UNAVAILABLE"
    assert end_status("something-new") == OTHER_END
