"""One owner per limit: the sampling ranges are SamplingParams.validate's (the engine's, gRPC's and HTTP's
alike); the HTTP schema only shows them in OpenAPI (shared_range), so both transports refuse a value with the
same reason, field and message."""

from __future__ import annotations

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
    spec.params.max_tokens = 16  # as requests.build resolves it
    with pytest.raises(InvalidRequest) as http:
        spec.params.validate()
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
