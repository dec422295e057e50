"""Receipts on the serving path: asked for by a request field or a header, built in one place for every
transport (HTTP whole and streamed, WebSocket, gRPC) from the choice's accumulated outputs.

Nothing here runs unless a receipt was asked for: the engine then records the seed its sampler ran with
(Request.receipt), and the receipt is built from values already on the host (receipts/format.py).
"""

from __future__ import annotations

from typing import Any, Callable

from ..engine.sequence import Accumulated
from ..receipts.format import Identity, identity_of, make_receipt
from .requests import ValidatedRequest
from .state import ServerState

HEADER = "x-steadyserve-receipt"  # HTTP header and gRPC metadata key, for clients that cannot add a field
_YES = ("1", "true", "yes", "on")


def header_asks(value: str | bytes | None) -> bool:
    """Whether a header value asks for a receipt (1, true, yes, on; any case)."""
    if value is None:
        return False
    if isinstance(value, bytes):
        value = value.decode("latin-1")
    return value.strip().lower() in _YES


def identity(state: ServerState) -> Identity:
    return identity_of(state.loaded, state.fingerprint)


def receipts_of(state: ServerState, req: ValidatedRequest) -> Callable[[int, Accumulated], dict[str, Any]] | None:
    """The receipt of choice i from its Accumulated, for encoders; None when the request asked for none."""
    if not req.receipt:
        return None
    return lambda index, acc: receipt_for(state, req, index, acc)


def receipt_for(state: ServerState, req: ValidatedRequest, index: int, acc: Accumulated) -> dict[str, Any]:
    """Choice `index`'s receipt, once it finished with a finish reason (its Accumulated is complete)."""
    params = req.params[index]
    # Greedy sampling and scoring draw nothing: the seed is the one given (or none). Sampled: the generator's.
    draws = not params.greedy and params.max_tokens > 0
    seed = acc.seed if draws and params.seed is None else params.seed
    return make_receipt(identity(state), req.request_id, index, req.prompts[index], params, seed, acc.token_ids,
                        acc.finish_reason, acc.prompt_logprobs, acc.logprobs)
