"""POST /v1/embeddings in OpenAI's shape, over the engine (api/embeddings.py does the work for every transport).

The body is validated as every other body is (unknown fields refused by name, `user` accepted without
effect), tokenized on the tokenizer thread, admitted all at once or refused with 429, and answered once every
input's vector is pooled: `{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model",
"usage"}`, the vectors as float32 values (JSON numbers that round-trip to the same float32) or base64.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, StrictInt, field_validator

from ...limits import Refused
from ..embeddings import EmbedSpec, ValidatedEmbed, admit_embed, build_embed, float32_base64, vectors
from ..state import ServerState
from .errors import error_response
from .inputs import client_request_id, find_surrogate, read_json, validated
from .schemas import RequestBody
from .sse import collect_events


class EmbeddingRequest(RequestBody):
    """Body of POST /v1/embeddings."""
    accepted_unused: ClassVar[frozenset[str]] = frozenset({"user"})  # OpenAI's end-user id: no effect

    input: str | list[str] | list[StrictInt] | list[list[StrictInt]] = Field(
        description="what to embed: a string, a list of token ids, or a batch of either (a list of strings or of "
                    "token-id lists): one embedding per input, in order, admitted all at once or refused")
    model: str | None = Field(default=None, description="the served model's id (GET /v1/models); any other is a "
                              "404, leaving it out means the served model")
    encoding_format: Literal["float", "base64"] = Field(default="float", description="float: JSON numbers; "
                                                        "base64: the float32 values, little-endian, base64-encoded")
    dimensions: StrictInt | None = Field(default=None, description="keep the first this many components (1..the "
                                         "model's width) and re-normalise, as OpenAI's text-embedding-3 models do")

    @field_validator("input", mode="before")
    @classmethod
    def _one_of_the_four_shapes(cls, v: Any) -> Any:
        """Name the four shapes rather than pydantic's four union errors (`input.str: ...`)."""
        def ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        if isinstance(v, str) or ids(v) or (isinstance(v, list) and (all(isinstance(x, str) for x in v)
                                                                     or all(ids(x) for x in v))):
            return v
        raise ValueError("input must be a string, a list of strings, a list of token ids, or a list of token-id "
                         "lists")

    def inputs(self) -> list[str | list[int]]:
        """The inputs, one embedding each: a string or a token-id list alone is a batch of one."""
        x = self.input
        if isinstance(x, str) or (x and isinstance(x[0], int)):
            return [x]  # type: ignore[list-item]
        return list(x)  # type: ignore[arg-type]


def parse_embedding_body(body: Any, transport: str, request_id: str) -> tuple[EmbedSpec, str]:
    """An HTTP body as the transport-neutral EmbedSpec, and its encoding_format. Raises Refused naming the
    field."""
    bad = find_surrogate(body)
    if bad is not None:
        raise Refused("invalid_unicode", f"{bad}: contains an unpaired UTF-16 surrogate escape; not valid Unicode",
                      bad)
    req = validated(EmbeddingRequest, body)
    spec = EmbedSpec(transport=transport, request_id=request_id, model=req.model, inputs=req.inputs(),
                     dimensions=req.dimensions)
    return spec, req.encoding_format


def add_embeddings_routes(app: FastAPI, state: ServerState) -> None:
    cfg = state.config.server

    def build(body: Any, request_id: str) -> tuple[ValidatedEmbed, str]:
        """Parse, validate and tokenize, on the tokenizer thread."""
        spec, encoding = parse_embedding_body(body, "http", request_id)
        return build_embed(state, spec), encoding

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        """OpenAI-compatible embeddings: one vector per input, pooled from the model's final-norm hidden states
        (the model's own pooling, else --pooling) and L2-normalised as the model's config says. Bitwise the
        same vector for the same input whatever else the server computes. 429 with `Retry-After` at capacity."""
        body = await read_json(request, cfg.max_request_bytes)
        req, encoding = await state.run_tokenizer(build, body, client_request_id(request.scope))
        channel = admit_embed(state, req)
        events = await collect_events(request.receive, channel)
        if isinstance(events, Response):
            return events
        vecs = vectors(state, req, events.accs)
        if vecs is None:
            return error_response(500, "the engine finished an embedding without its vector", "server_error", None,
                                  "engine_error")
        data = [{"object": "embedding", "index": i, "embedding": float32_base64(v) if encoding == "base64" else v}
                for i, v in enumerate(vecs)]
        n = req.num_prompt_tokens
        return JSONResponse({"object": "list", "data": data, "model": state.model_name,
                             "usage": {"prompt_tokens": n, "total_tokens": n}})
