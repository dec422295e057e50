"""When a sequence stops: the five stop rules as one pure function (vLLM's `check_stop`).

It imports no torch and touches no engine state, so its order of precedence is tested alone
(tests/test_stop.py), like the scheduler. The engine asks it once per sampled token, after the
detokenizer has seen the token (or, for an end token, without showing it the token at all: an end
token never becomes text).
"""

from __future__ import annotations

from typing import AbstractSet, Literal

StopReason = Literal["stop", "length"]


def end_token_ids(eos_ids: AbstractSet[int], ignore_eos: bool, stop_token_ids: AbstractSet[int]) -> frozenset[int]:
    """The tokens that end a sequence: the request's stop tokens, and the model's EOS unless ignored.

    The logits processors use the same set (min_tokens holds these back), so both rules agree."""
    return frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_ids))


def stop_reason(token: int, end_ids: AbstractSet[int], stop_string_seen: bool, num_generated: int,
                max_tokens: int, num_tokens: int, max_model_len: int) -> StopReason | None:
    """Why the sequence stops after `token`, or None to go on.

    Precedence, first match wins: an end token (EOS or a stop token) -> "stop"; a stop string completed
    in the text -> "stop"; max_tokens generated or the context full -> "length". A stop on the last
    allowed token therefore reports "stop", which is what a client that asked for the stop expects."""
    if token in end_ids:
        return "stop"
    if stop_string_seen:
        return "stop"
    if num_generated >= max_tokens or num_tokens >= max_model_len:
        return "length"
    return None


def final_reason(reason: StopReason, stop_string_seen_at_flush: bool) -> StopReason:
    """The reason after the detokenizer's final flush: held-back partial characters can complete a stop
    string only then, and a stop string outranks the length limit."""
    return "stop" if stop_string_seen_at_flush else reason
