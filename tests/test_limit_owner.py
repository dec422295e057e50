"""One owner per limit: the sampling ranges are SamplingParams.validate's (the engine's, gRPC's and HTTP's
alike); the HTTP schema only shows them in OpenAPI (shared_range), so both transports refuse a value with the
same reason, field and message."""

from __future__ import annotations

import dataclasses

import pytest

from steadyserve.api.http.inputs import request_spec
from steadyserve.api.http.schemas import ChatCompletionRequest, CompletionRequest
from steadyserve.engine.sequence import SamplingParams
from steadyserve.limits import InvalidRequest

CASES = [("top_k", -1), ("seed", 2**64), ("frequency_penalty", 2.5), ("presence_penalty", -2.5),
         ("repetition_penalty", 0.0), ("repetition_penalty", 10.5), ("min_tokens", -1)]


@pytest.mark.parametrize("field, value", CASES)
def test_http_and_the_engine_refuse_a_sampling_range_the_same_way(field: str, value: float) -> None:
    spec = request_spec({"prompt": "a", field: value}, "completion", "http", "r")  # the schema lets it through
    params = dataclasses.replace(spec.params, max_tokens=16)  # as requests.build resolves it
    with pytest.raises(InvalidRequest) as http:
        params.validate()
    with pytest.raises(InvalidRequest) as grpc_side:  # gRPC builds SamplingParams directly
        SamplingParams(max_tokens=16, **{field: value}).validate()
    assert (http.value.reason, http.value.param, str(http.value)) == \
        (grpc_side.value.reason, grpc_side.value.param, str(grpc_side.value))
    assert http.value.param == field and http.value.reason == "invalid_value"


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_the_openapi_schema_still_shows_the_ranges(model: type) -> None:
    props = model.model_json_schema()["properties"]
    assert props["top_k"]["minimum"] == 0 and props["min_tokens"]["minimum"] == 0
    assert props["repetition_penalty"]["exclusiveMinimum"] == 0 and props["repetition_penalty"]["maximum"] == 10
    assert props["seed"]["maximum"] == 2**64 - 1
    assert props["presence_penalty"]["minimum"] == -2
    if model is ChatCompletionRequest:
        assert props["top_logprobs"]["maximum"] == 20 and props["max_completion_tokens"]["minimum"] == 0
    assert props["max_tokens"]["minimum"] == 0


@pytest.mark.parametrize("value", [-1, 21])
def test_chat_top_logprobs_has_one_range_check_and_is_named_as_sent(value: int) -> None:
    """Not pydantic's le/ge: the range of the completions' logprobs (limits.MAX_LOGPROBS), named top_logprobs
    (without logprobs: true it is refused for that first)."""
    with pytest.raises(InvalidRequest) as e:
        request_spec({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": value},
                     "chat", "http", "r")
    assert (e.value.param, e.value.reason, str(e.value)) == \
        ("top_logprobs", "invalid_value", "top_logprobs must be in 0..20")
    with pytest.raises(InvalidRequest) as completions:
        SamplingParams(max_tokens=16, logprobs=value).validate()
    assert str(completions.value) == "logprobs must be in 0..20"


@pytest.mark.parametrize("kind, field", [("completion", "max_tokens"), ("chat", "max_tokens"),
                                         ("chat", "max_completion_tokens")])
def test_a_negative_max_tokens_passes_the_schema_for_requests_build_to_refuse(kind: str, field: str) -> None:
    """resolve_max_tokens owns max_tokens' range (>= 0, >= 1 for chat, <= --max-tokens-cap)."""
    body = {"prompt": "a"} if kind == "completion" else {"messages": [{"role": "user", "content": "a"}]}
    spec = request_spec({**body, field: -1}, kind, "http", "r")
    assert spec.requested_max_tokens == -1 and spec.max_tokens_param == field
