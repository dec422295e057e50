"""The stop rules (engine/stop.py): a pure function, tested without torch or a model, like the scheduler."""

from __future__ import annotations

import subprocess
import sys

import pytest

from steadyserve.engine.stop import end_token_ids, final_reason, stop_reason

EOS, STOP_TOK, OTHER = 2, 7, 5
CTX = 100  # max_model_len


def reason(token: int = OTHER, *, ignore_eos: bool = False, stop_ids: frozenset[int] = frozenset({STOP_TOK}),
           text: bool = False, generated: int = 1, max_tokens: int = 10, total: int = 20) -> str | None:
    return stop_reason(token, end_token_ids({EOS}, ignore_eos, stop_ids), text, generated, max_tokens, total, CTX)


def test_stop_module_imports_no_torch() -> None:
    code = ("import sys\nimport steadyserve.engine.stop\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]\nassert not bad, bad\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_end_tokens_are_the_stop_tokens_and_eos_unless_ignored() -> None:
    assert end_token_ids({EOS}, False, {STOP_TOK}) == {EOS, STOP_TOK}
    assert end_token_ids({EOS}, True, {STOP_TOK}) == {STOP_TOK}  # ignore_eos keeps explicit stop tokens
    assert end_token_ids(set(), False, set()) == frozenset()


@pytest.mark.parametrize("kwargs, want", [
    ({}, None),  # an ordinary token mid-generation goes on
    ({"token": EOS}, "stop"),
    ({"token": EOS, "ignore_eos": True}, None),
    ({"token": STOP_TOK, "ignore_eos": True}, "stop"),
    ({"text": True}, "stop"),  # a stop string completed
    ({"generated": 10}, "length"),  # max_tokens reached
    ({"total": CTX}, "length"),  # the context is full
    ({"generated": 9, "total": CTX - 1}, None),  # one short of both limits
    # Precedence: a stop on the last allowed token, or in a full context, reports "stop".
    ({"token": EOS, "generated": 10}, "stop"),
    ({"token": STOP_TOK, "total": CTX}, "stop"),
    ({"text": True, "generated": 10, "total": CTX}, "stop"),
])
def test_stop_reason_rules_and_precedence(kwargs: dict, want: str | None) -> None:
    assert reason(**kwargs) == want


def test_the_final_flush_can_turn_a_length_stop_into_a_stop_string() -> None:
    assert final_reason("length", True) == "stop"
    assert final_reason("length", False) == "length"
    assert final_reason("stop", False) == "stop"
