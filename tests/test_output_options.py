"""The typed request (api/requests.py): the raw body stops at the spec builder; the encoders read OutputOptions."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from steadyserve.api.http.inputs import request_spec
from steadyserve.api.requests import OutputOptions, RequestSpec, ValidatedRequest


@pytest.mark.parametrize("cls", [RequestSpec, ValidatedRequest])
def test_no_untyped_field_travels(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    assert "body" not in names and hints["output"] is OutputOptions
    assert all(hints[n] is not typing.Any for n in names), {n: hints[n] for n in names}


@pytest.mark.parametrize("kind, body, want", [
    ("completion", {"prompt": "a"}, OutputOptions()),
    ("completion", {"prompt": "a", "logprobs": 0}, OutputOptions(logprobs=True)),
    ("completion", {"prompt": "a", "logprobs": 3, "echo": True}, OutputOptions(True, 3, echo=True)),
    ("completion", {"prompt": "a", "stream": True, "stream_options": {"include_usage": True}},
     OutputOptions(include_usage=True)),
    ("chat", {"messages": [{"role": "user", "content": "a"}]}, OutputOptions()),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 2},
     OutputOptions(logprobs=True, top_logprobs=2)),
    ("chat", {"messages": [{"role": "user", "content": "a"}], "stream": True,
              "stream_options": {"include_usage": False}}, OutputOptions()),
])
def test_the_http_builder_reads_the_output_options_once(kind: str, body: dict, want: OutputOptions) -> None:
    assert request_spec(body, kind, "http", "rid").output == want
