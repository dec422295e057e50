"""The receipt format: what a response proves about itself, as plain JSON (see docs/reference/receipts.md).

A receipt names what computed a response (the weights' sha256 and the numerics fingerprint) and everything
the engine needs to compute it again: the exact prompt token ids after templating, the sampling parameters
as the engine ran them (with the seed it drew for unseeded sampling), the hash of the grammar that
constrained it, the output token ids, the finish reason, and the float32 bits of every logprob the
engine returned for it, with their SHA-256. It never carries the prompt or output text.

This module is pure Python (no torch): the server builds receipts here (api/receipts.py, for every
transport) and `steadyserve verify` reads them here (receipts/replay.py), so both sides lay out the
logprob bytes the same way.
"""

from __future__ import annotations

import base64
import hashlib
import math
import struct
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from ..engine.sequence import SamplingParams, TokenLogprob

RECEIPT_VERSION = 1
# The order the logprob bytes follow, spelled out in every receipt so that a reader needs no code of ours.
LAYOUT = ("float32 little-endian; prompt positions 1.. (each: the token's logprob, then its top alternatives), "
          "then generated tokens (each: the token's logprob, then its top alternatives)")
# SamplingParams fields a receipt records (all but grammar, which it names by hash only).
PARAM_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids", "ignore_eos",
                "logprobs", "prompt_logprobs", "logit_bias", "presence_penalty", "frequency_penalty",
                "repetition_penalty", "min_tokens")


class ReceiptError(ValueError):
    """A receipt that cannot be read: the message names the field."""


@dataclass(frozen=True)
class Identity:
    """What computed a response: the fingerprint's facts, with the weights' full hash."""

    model: str  # the served model's name (informational: the weights hash identifies it)
    weights_sha256: str  # loader.LoadedModel.weights_hash: full sha256 over the weight files
    fingerprint: str  # the string stamped on every response (loader.Fingerprint)
    numerics_mode: str  # portable | int8 | host (numerics.py)
    numerics_id: str  # e.g. pfd4d6e: equal ids, equal bits on every host that can run the path
    dtype: str  # float32 | bfloat16 | float16
    device: str  # cpu | cuda:N
    attention: str  # the attention kernel's id: nat1 (native) or py
    batch_invariant: bool  # enabled and confirmed by the start-up self-test

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.model, "weights_sha256": self.weights_sha256, "fingerprint": self.fingerprint,
                "numerics": {"mode": self.numerics_mode, "id": self.numerics_id}, "dtype": self.dtype,
                "device": self.device, "attention": self.attention, "batch_invariant": self.batch_invariant}


def identity_of(loaded: Any, fingerprint: Any) -> Identity:
    """The Identity of a loaded model (models.loader.LoadedModel) under its Fingerprint."""
    num = loaded.numerics
    return Identity(model=loaded.name, weights_sha256=loaded.weights_hash, fingerprint=str(fingerprint),
                    numerics_mode=num.mode if num else "", numerics_id=num.numerics_id if num else "",
                    dtype=fingerprint.dtype, device=fingerprint.device, attention=fingerprint.kernel,
                    batch_invariant=fingerprint.batch_invariant)


def logprob_values(prompt_logprobs: Sequence[TokenLogprob | None] | None,
                   logprobs: Sequence[TokenLogprob]) -> list[float]:
    """Every logprob in the receipt's order (LAYOUT): values already on the host, no pass over a vocabulary."""
    out: list[float] = []
    for lp in list(prompt_logprobs or []) + list(logprobs):
        if lp is not None:
            out.append(lp.logprob)
            out.extend(v for _, v in lp.top)
    return out


def f32_bytes(values: Iterable[float]) -> bytes:
    """The float32 bits of `values` (engine logprobs are float32 values widened exactly to float)."""
    vals = list(values)
    return struct.pack(f"<{len(vals)}f", *vals)


def f32_values(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // 4}f", data))


def f32_hex(x: float) -> str:
    return struct.pack("<f", x).hex()


def grammar_sha256(grammar: str | None) -> str | None:
    return None if grammar is None else hashlib.sha256(grammar.encode()).hexdigest()


def params_dict(p: SamplingParams, seed: int | None) -> dict[str, Any]:
    """The sampling parameters as the engine ran them, with `seed` the one its generator ran with."""
    d: dict[str, Any] = {name: getattr(p, name) for name in PARAM_FIELDS}
    d["seed"] = seed
    d["seed_drawn"] = p.seed is None and seed is not None  # the engine drew it: the request gave none
    d["stop"] = list(p.stop)
    d["stop_token_ids"] = list(p.stop_token_ids)
    d["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    return d


def make_receipt(identity: Identity, request_id: str, choice: int, prompt_token_ids: Sequence[int],
                 params: SamplingParams, seed: int | None, output_token_ids: Sequence[int],
                 finish_reason: str | None, prompt_logprobs: Sequence[TokenLogprob | None] | None,
                 logprobs: Sequence[TokenLogprob]) -> dict[str, Any]:
    """One choice's receipt. `seed`: the seed the engine's generator ran with (None for greedy without one)."""
    data = f32_bytes(logprob_values(prompt_logprobs, logprobs))
    return {
        "receipt_version": RECEIPT_VERSION,
        "request_id": request_id,
        "choice": choice,
        "model": identity.as_dict(),
        "prompt_token_ids": list(prompt_token_ids),
        "sampling": params_dict(params, seed),
        "grammar_sha256": grammar_sha256(params.grammar),
        "output_token_ids": list(output_token_ids),
        "finish_reason": finish_reason,
        "logprobs": {"count": len(data) // 4, "sha256": hashlib.sha256(data).hexdigest(),
                     "float32": base64.b64encode(data).decode(), "layout": LAYOUT},
    }


@dataclass
class Receipt:
    """A receipt read back (parse): what `steadyserve verify` replays."""

    raw: dict[str, Any]  # the JSON object as read
    version: int
    identity: Identity
    prompt_token_ids: list[int]
    params: SamplingParams  # as the engine ran them, seed included (grammar: None; see grammar_sha256)
    grammar_sha256: str | None
    output_token_ids: list[int]
    finish_reason: str | None
    logprob_bytes: bytes  # the float32 values the receipt carries
    logprob_sha256: str  # their hash as the receipt states it
    request_id: str = ""
    choice: int = 0
    problems: list[str] = field(default_factory=list)  # inconsistencies within the receipt itself


def _get(obj: dict[str, Any], key: str, kind: type | tuple[type, ...], path: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise ReceiptError(f"{path}{key}: missing")
    v = obj[key]
    if not isinstance(v, kind) or (kind is int and isinstance(v, bool)):
        raise ReceiptError(f"{path}{key}: expected {getattr(kind, '__name__', kind)}, got {type(v).__name__}")
    return v


def _ids(obj: dict[str, Any], key: str) -> list[int]:
    v = _get(obj, key, list, "")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in v):
        raise ReceiptError(f"{key}: expected a list of token ids")
    return list(v)


def parse(obj: Any) -> Receipt:
    """A receipt from its JSON object. Raises ReceiptError naming the first bad field."""
    if not isinstance(obj, dict):
        raise ReceiptError("a receipt is a JSON object")
    version = _get(obj, "receipt_version", int, "")
    if version != RECEIPT_VERSION:
        raise ReceiptError(f"receipt_version: {version} is not a version this build reads ({RECEIPT_VERSION})")
    m = _get(obj, "model", dict, "")
    num = _get(m, "numerics", dict, "model.")
    identity = Identity(model=str(m.get("name", "")), weights_sha256=_get(m, "weights_sha256", str, "model."),
                        fingerprint=_get(m, "fingerprint", str, "model."),
                        numerics_mode=_get(num, "mode", str, "model.numerics."),
                        numerics_id=_get(num, "id", str, "model.numerics."), dtype=_get(m, "dtype", str, "model."),
                        device=_get(m, "device", str, "model."), attention=_get(m, "attention", str, "model."),
                        batch_invariant=_get(m, "batch_invariant", bool, "model."))
    s = _get(obj, "sampling", dict, "")
    missing = [k for k in PARAM_FIELDS if k not in s]
    if missing:
        raise ReceiptError(f"sampling.{missing[0]}: missing")
    try:
        params = SamplingParams(
            max_tokens=s["max_tokens"], temperature=float(s["temperature"]), top_p=float(s["top_p"]),
            top_k=s["top_k"], seed=s["seed"], stop=list(s["stop"]), stop_token_ids=list(s["stop_token_ids"]),
            ignore_eos=bool(s["ignore_eos"]), logprobs=s["logprobs"], prompt_logprobs=s["prompt_logprobs"],
            logit_bias={int(k): float(v) for k, v in dict(s["logit_bias"]).items()},
            presence_penalty=float(s["presence_penalty"]), frequency_penalty=float(s["frequency_penalty"]),
            repetition_penalty=float(s["repetition_penalty"]), min_tokens=s["min_tokens"])
        params.validate()
    except (TypeError, ValueError, AttributeError) as e:
        raise ReceiptError(f"sampling: {e}") from None
    if params.temperature != 0 and params.max_tokens > 0 and params.seed is None:
        raise ReceiptError("sampling.seed: a sampled (temperature > 0) receipt must carry its seed")
    lp = _get(obj, "logprobs", dict, "")
    try:
        data = base64.b64decode(_get(lp, "float32", str, "logprobs."), validate=True)
    except ValueError:
        raise ReceiptError("logprobs.float32: not base64") from None
    if len(data) % 4:
        raise ReceiptError("logprobs.float32: not a whole number of float32 values")
    r = Receipt(raw=obj, version=version, identity=identity, prompt_token_ids=_ids(obj, "prompt_token_ids"),
                params=params, grammar_sha256=obj.get("grammar_sha256"), output_token_ids=_ids(obj, "output_token_ids"),
                finish_reason=obj.get("finish_reason"), logprob_bytes=data,
                logprob_sha256=_get(lp, "sha256", str, "logprobs."), request_id=str(obj.get("request_id", "")),
                choice=int(obj.get("choice", 0) or 0))
    if not r.prompt_token_ids:
        raise ReceiptError("prompt_token_ids: empty")
    if hashlib.sha256(data).hexdigest() != r.logprob_sha256:
        r.problems.append("logprobs.sha256 is not the SHA-256 of logprobs.float32: the receipt was altered")
    if any(math.isnan(v) for v in f32_values(data)):
        r.problems.append("logprobs.float32 holds NaN, which the engine never returns")
    return r
