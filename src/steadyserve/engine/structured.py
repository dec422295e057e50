"""Structured output: sampling constrained to a grammar (a JSON schema), with llguidance.

Why llguidance: its token masks are computed on the CPU in Rust in tens of microseconds per token, it
needs no GPU and pulls no other dependency (no second torch), it takes JSON schemas as OpenAI's
`response_format` sends them, and vLLM and SGLang ship it as a grammar backend (maintained by the
guidance-ai project). xgrammar would also do; outlines-core compiles a whole index up front, which is
slow for large schemas.

A request with a grammar owns one `LLMatcher`. Each step the engine masks the request's own row (every
token the grammar does not allow next gets -inf), samples from it, and feeds the chosen token to the
matcher. The mask depends only on the request's own tokens, so batch invariance holds; once the grammar
is complete the mask allows only end-of-sequence tokens, so the request stops with `stop`.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import torch

from ..limits import InvalidRequest

# Compact JSON (no optional whitespace): a small model cannot wander into endless blank lines, and every
# response to one schema has one layout.
JSON_DEFAULTS = {"whitespace_flexible": False}


def json_schema_grammar(schema: dict[str, Any]) -> str:
    """The llguidance grammar for a JSON schema; `{"type": "object"}` for OpenAI's json_object mode."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_DEFAULTS)


class Grammars:
    """One model's grammar machinery: its llguidance tokenizer (built on first use, about 0.3 s for a 49k
    vocabulary), grammar validation and a matcher per request."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        self.hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # rows of the model's LM head; tokens past the tokenizer's are never allowed
        # llguidance needs an id for every token of the tokenizer, which can hold one past the LM head's rows: a
        # Llama 3 GGUF's, read by transformers' GPT-2 class, gains "<|endoftext|>" as its unk token at id 128256.
        # Such a token has no logit: its bits, past the row, are never applied (apply_token_bitmask_inplace).
        self.n_vocab = max(vocab_size, len(hf_tokenizer))
        self._tokenizer: Any = None
        self._build_lock = threading.Lock()  # the tokenizer is built once, by whichever thread needs it first
        self._lock = threading.Lock()  # the validation memo: the tokenizer thread and the event loop
        self._errors: dict[str, str] = {}  # grammar -> validation error ('' = valid), oldest first

    @property
    def tokenizer(self) -> Any:
        with self._build_lock:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self.hf_tokenizer, n_vocab=self.n_vocab)
            return self._tokenizer

    def check(self, grammar: str) -> None:
        """Refuse a grammar this model cannot follow: the one grammar check, run by the request builder (off
        the event loop), through ModelLimits.check_grammar; offline callers get it from ModelLimits.check."""
        why = self.error(grammar)
        if why:
            raise InvalidRequest("response_format", f"response_format: {why}")

    def error(self, grammar: str) -> str:
        """Why this grammar cannot be used with this model, or '' when it can. Remembered for the last 256
        grammars: a client sending one schema again (and tools' grammars, rebuilt per request) finds the answer
        instead of compiling it again."""
        import llguidance

        with self._lock:
            known = self._errors.get(grammar)
        if known is None:
            known = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer) or ""
            with self._lock:
                if len(self._errors) >= 256:
                    self._errors.pop(next(iter(self._errors)))
                self._errors[grammar] = known
        return known

    def matcher(self, grammar: str) -> "Matcher":
        return Matcher(self, grammar)


class Matcher:
    """One request's position in its grammar."""

    def __init__(self, grammars: Grammars, grammar: str) -> None:
        import llguidance
        import llguidance.torch

        self._ll = llguidance.torch
        self.matcher = llguidance.LLMatcher(grammars.tokenizer, grammar)
        self.bitmask = llguidance.torch.allocate_token_bitmask(1, grammars.n_vocab)  # (1, ceil(n / 32)) int32
        if self.matcher.is_error():
            raise ValueError(f"response_format: {self.matcher.get_error()}")

    def mask_(self, row: torch.Tensor) -> None:
        """row: (V,) float32 log-probabilities; tokens the grammar does not allow next become -inf, in place."""
        self._ll.fill_next_token_bitmask(self.matcher, self.bitmask, 0)
        self._ll.apply_token_bitmask_inplace(row, self.bitmask[0])

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            raise ValueError(f"structured output: token {token_id} rejected: {self.matcher.get_error()}")
