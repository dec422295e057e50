"""Embedding requests, transport-neutral: validated in one place, admitted like any other request.

HTTP `POST /v1/embeddings` (api/http/embeddings_routes.py) and gRPC `Embed` (api/grpc/servicer.py) parse their
input into an `EmbedSpec` and call `build_embed` (every check short of admission, the same messages for both),
then `admit_embed`: each input is one engine request (Request.embed: a prefill-only sequence whose final-norm
hidden states the engine pools, engine/pooler.py), all admitted at once or refused (429 / RESOURCE_EXHAUSTED),
scheduled by the same scheduler as generation, so an embedding batch waits its turn rather than stalling
streams. `vectors` turns the finished requests into what the client receives (engine/pooler.finish_vector).
"""

from __future__ import annotations

import base64
import struct
import uuid
from dataclasses import dataclass

from ..engine.channel import RequestChannel
from ..engine.pooler import finish_vector
from ..engine.sequence import Accumulated, SamplingParams
from ..limits import InvalidRequest, Refused, check_request_id
from .protocol import encode_prompt
from .requests import check_context, check_model
from .state import ServerState


@dataclass
class EmbedSpec:
    """An embedding request as a transport parsed it, before any check."""

    transport: str  # http | grpc: for logs, metrics and the streams' bookkeeping
    request_id: str  # the client's request id; "" when it sent none
    model: str | None  # the model the client named; None or "" means the served one
    inputs: list[str | list[int]]  # one embedding each, in order: a text (tokenized with the BOS policy) or ids
    dimensions: int | None = None  # keep the first this many components (then re-normalise); None = all


@dataclass(frozen=True)
class ValidatedEmbed:
    """An embedding request that passed every check short of admission."""

    request_id: str  # the id responses carry: the client's, or a new one
    transport: str  # http | grpc
    prompts: list[list[int]]  # each input's token ids
    dimensions: int | None  # components kept; None = the model's width

    @property
    def engine_ids(self) -> list[str]:
        """One engine request id per input: the request id itself when there is one input."""
        if len(self.prompts) == 1:
            return [self.request_id]
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


def model_width(state: ServerState) -> int:
    """The components of the model's embedding: its hidden size."""
    return state.loaded.args.hidden_size


def build_embed(state: ServerState, spec: EmbedSpec) -> ValidatedEmbed:
    """Every check an embedding request passes, for every transport, the engine's limits included (the only
    one: AsyncEngine.submit_all then counts capacity). Raises Refused.
    Field names are the HTTP API's (`input`, `input[3]`, `dimensions`); gRPC renames them."""
    state.refuse_if_closed()
    check_model(state, spec.model)
    if spec.request_id:
        check_request_id(spec.request_id)
    width = model_width(state)
    if spec.dimensions is not None and not 1 <= spec.dimensions <= width:
        raise InvalidRequest("dimensions", f"dimensions must be in 1..{width} (this model's embedding width)")
    if not spec.inputs:
        raise InvalidRequest("input", "input must not be empty")
    capacity = state.engine.capacity
    if len(spec.inputs) > capacity:
        raise InvalidRequest("input", f"input: at most {capacity} inputs per request (--max-num-seqs + "
                             "--max-queue), all admitted at once")
    tok, limits = state.loaded.tokenizer, state.limits
    prompts = []
    for i, item in enumerate(spec.inputs):
        param = "input" if len(spec.inputs) == 1 else f"input[{i}]"
        ids = encode_prompt(tok, item, param)
        if not isinstance(item, str):
            limits.check_prompt_ids(ids, param)
        check_context(len(ids), param, limits.context, scoring=True)  # an embedding may fill the whole context
        prompts.append(ids)
    for ids in prompts:  # the engine's own limits, once here (submit_all only counts capacity)
        limits.check_fit(len(ids), 0)
    return ValidatedEmbed(state.new_request_id(spec.request_id or None), spec.transport, prompts, spec.dimensions)


def admit_embed(state: ServerState, req: ValidatedEmbed) -> RequestChannel:
    """Submit every input at once, or none (Refused: 429 / RESOURCE_EXHAUSTED at capacity); their channel
    (choice i is input i), held by the server's open channels."""
    ids = req.engine_ids
    try:
        channel = state.submit_all([(rid, p, SamplingParams(max_tokens=0)) for rid, p in zip(ids, req.prompts)],
                                   req.transport, embed=True)
    except Refused as e:  # an id already in flight (a client reusing ids): suffixed engine ids, as requests.admit
        if e.reason != "invalid" or e.param != "request_id":
            raise
        tag = uuid.uuid4().hex[:8]
        ids = [f"{rid}.{tag}" for rid in ids]
        channel = state.submit_all([(rid, p, SamplingParams(max_tokens=0)) for rid, p in zip(ids, req.prompts)],
                                   req.transport, embed=True)
    return state.streams.add(channel)


def vectors(state: ServerState, req: ValidatedEmbed, accs: list[Accumulated]) -> list[list[float]] | None:
    """Each input's embedding as the client receives it (truncated to `dimensions`, normalised as the model's
    pooling says); None if an input finished without one (an engine failure the caller reports)."""
    if any(a.embedding is None for a in accs):
        return None
    normalize = state.loaded.pooling.normalize
    return [finish_vector(a.embedding, req.dimensions, normalize) for a in accs]  # type: ignore[arg-type]


def float32_base64(vector: list[float]) -> str:
    """OpenAI's `encoding_format: base64`: the float32 values, little-endian, base64-encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
