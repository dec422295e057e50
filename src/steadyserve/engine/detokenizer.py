"""Incremental detokenization with stop strings.

`token_text` is the one place a single token becomes text (logprobs, speculation's lookup keys).

Contract: the `text_delta`s a request emits concatenate exactly to its final
text, never carry a U+FFFD made by a multi-byte character split across tokens,
and never leak any part of a stop string.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

REPLACEMENT = "\ufffd"


def text_decoder(tokenizer: Any, skip_special_tokens: bool = True) -> Callable[[list[int]], str]:
    """`ids -> tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)`, the decode every
    generated token goes through (twice, IncrementalDetokenizer.add).

    For transformers' fast tokenizers (TokenizersBackend) with its own decode and _decode, that is exactly the
    backend tokenizer's decode of the list: transformers' wrapper only converts the ids, checks for a batch and, with
    the clean-up off, returns the backend's text. Called directly a 6-token decode costs 1.0-1.1 instead of 3.2-3.4 us
    (SmolLM2, Intel Xeon): 0.3 ms of a c=64 decode step on the engine thread, where the step's Python runs while the
    other compute thread waits. Any other tokenizer goes through its own decode."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # a transformers without the class: its own decode
        TokenizersBackend = PreTrainedTokenizerBase = None  # noqa: N806
    cls = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode):
        backend = tokenizer.backend_tokenizer
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                        clean_up_tokenization_spaces=False)


_TOKEN_TEXT: dict[int, dict[int, str]] = {}  # id(tokenizer) -> token id -> text; at most the vocabulary


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text a single token stands for, as OpenAI's logprobs show it and speculation's n-gram keys read it
    (engine.py `_token_text`): the one decode of a lone token, with one set of flags. Memoized, the one memo of every
    transport and the engine: logprobs with 20 alternatives, an echoed prompt or a high-rate gRPC Score would
    otherwise decode tens of thousands of single tokens on the event loop."""
    cache = _TOKEN_TEXT.setdefault(id(tokenizer), {})
    text = cache.get(token_id)
    if text is None:
        text = cache[token_id] = tokenizer.decode([token_id], skip_special_tokens=False,
                                                  clean_up_tokenization_spaces=False)
    return text


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, stop: list[str], skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self._decode = text_decoder(tokenizer, skip_special_tokens)  # ids -> text, no clean-up
        self.stop = stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.ids: list[int] = []
        self.prefix_offset = 0  # ids[:prefix_offset] are decoded into `text` for good
        self.read_offset = 0
        self.text = ""  # all text decoded so far (stable part)
        self.num_sent = 0  # characters of `text` already emitted
        self.stopped = False  # a stop string was found; text is cut before it

    def add(self, token_id: int) -> str:
        """Add one generated token; return the text that can be emitted now."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT):
            self.text += new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """The request ends: flush what was held back (partial characters included)."""
        if not self.stopped:
            full = self._decode(self.ids)
            if full.startswith(self.text):
                self.text = full
        return self._emit(final=True)

    def _emit(self, final: bool) -> str:
        if self.stopped:
            return ""
        end = len(self.text)
        if self.stop:
            start = max(0, self.num_sent - self.max_stop_len + 1)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                end = min(hits)
                self.text = self.text[:end]
                self.stopped = True
            elif not final:
                end -= self._held_back()
        end = max(end, self.num_sent)
        delta = self.text[self.num_sent:end]
        self.num_sent = end
        return delta

    def _held_back(self) -> int:
        """Length of the longest tail of text that could still grow into a stop string."""
        for n in range(min(self.max_stop_len - 1, len(self.text) - self.num_sent), 0, -1):
            tail = self.text[-n:]
            if any(s.startswith(tail) for s in self.stop):
                return n
        return 0
