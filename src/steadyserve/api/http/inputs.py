"""HTTP request input, validated once: bodies read within limits, pydantic errors named by field, the choices
of a completion or chat request (`Prepared`) and their all-or-nothing admission.

Shared by the HTTP routes (app.py) and the WebSocket (ws.py).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from pydantic import ValidationError

from ...engine.engine import AdmissionError
from ...engine.sequence import SamplingParams
from ..state import ServerState


class BadRequest(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


async def read_json(request: Request, limit: int) -> Any:
    """The body as JSON, refusing oversize bodies, invalid UTF-8 and malformed JSON by name."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body exceeds {limit} bytes (--max-request-bytes)", None,
                             "request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BadRequest(400, f"request body is not valid UTF-8 (byte {e.start})", None, "invalid_utf8") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as e:
        raise BadRequest(400, f"request body is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}",
                         None, "invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object", None, "invalid_json")
    return body


_SURROGATE = re.compile("[\ud800-\udfff]")


def find_surrogate(value: Any, path: str = "") -> str | None:
    """The path of the first string holding an unpaired UTF-16 surrogate (JSON's "\\ud800"), else None."""
    if isinstance(value, str):
        return path or "body" if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)  # type: ignore[assignment]
    else:
        return None
    for k, v in items:
        if isinstance(k, str) and _SURROGATE.search(k):
            return f"{path}.{k}".lstrip(".") if path else "body"
        found = find_surrogate(v, f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}".lstrip("."))
        if found:
            return found
    return None


def submit_unique(state: ServerState, request_id: str, prompt_ids: list[int], params: Any, transport: str):
    """One request through submit_unique_all; returns its RequestStream."""
    return submit_unique_all(state, [request_id], [prompt_ids], [params], transport)[0]


def submit_unique_all(state: ServerState, request_ids: list[str], prompts: list[list[int]], params: list[Any],
                      transport: str) -> list:
    """state.submit_all under the client's x-request-id; if an id is already in flight (a client or proxy
    reusing ids), the engine gets suffixed ids while the client still sees its own."""
    try:
        return state.submit_all(list(zip(request_ids, prompts, params)), transport)
    except AdmissionError as e:
        if e.reason != "invalid" or e.param != "request_id":
            raise
    tag = uuid.uuid4().hex[:8]
    return state.submit_all([(f"{rid}.{tag}", ids, p) for rid, ids, p in zip(request_ids, prompts, params)],
                            transport)


@dataclass
class Prepared:
    """A validated completion or chat body: one engine request per choice, n choices per prompt, in the order of
    the choices' indices (prompt i's choice j is index i * n + j, as OpenAI numbers them)."""

    req: Any  # the validated CompletionRequest or ChatCompletionRequest
    prompts: list[list[int]]  # each choice's prompt token ids
    params: list[SamplingParams]  # each choice's sampling parameters (own seed; max_tokens default per prompt)
    echo_texts: list[str | None]  # each choice's prompt text for echo, None where it came as token ids
    n: int = 1  # choices generated per prompt (best_of, else n)
    keep: int = 1  # choices returned per prompt (n): the best `keep` of every `n` by mean token logprob


def derived_seed(seed: int | None, j: int) -> int | None:
    """The seed of a prompt's choice j: seed + j, wrapped into the range torch.Generator takes."""
    if seed is None or j == 0:
        return seed
    s = seed + j
    return s - 2**64 if s > 2**64 - 1 else s


def validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(p) for p in err.get("loc", ()) if p not in ("body",))
    msg = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        msg = "field required"
    return (f"{loc}: {msg}" if loc else msg), (loc or None)
