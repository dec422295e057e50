"""gpt-oss's replies read back from its harmony format: the analysis channel as reasoning, the rest as content.

A harmony model writes its reply as messages, each a header and a body between special tokens:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...` (the template's
generation prompt already wrote the first `<|start|>assistant`; `<|return|>` or `<|call|>` ends the turn and is
an end-of-sequence token, so never in the text). The chat endpoints decode such a reply with its special tokens
(SamplingParams.skip_special_tokens off) and send the analysis channel's bodies as `reasoning_content` (what
llama.cpp's server sends) and the final and commentary channels' bodies as `content`. A reply with no harmony
header at all (a model that did not follow its format) is all content, as any other model's.

Tool calls (a commentary message with a recipient, `to=functions.NAME`) are not parsed into `tool_calls`: their
bodies go to content as written, header and all, so nothing the model wrote is lost.

The stream and the whole reply are read by the same `HarmonyReader`, so a stream's deltas concatenate to the
whole reply's fields.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

START, CHANNEL, MESSAGE, END = "<|start|>", "<|channel|>", "<|message|>", "<|end|>"
ENDS = (END, "<|return|>", "<|call|>")  # what ends a message's body
MARKERS = (START, CHANNEL, MESSAGE, "<|constrain|>", *ENDS)
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))


_SPEAKS: dict[int, bool] = {}  # id(tokenizer) -> whether it writes harmony: vocabularies do not change


def speaks_harmony(tokenizer: Any) -> bool:
    """Whether this tokenizer writes harmony: the channel and message markers are special tokens of its
    vocabulary (gpt-oss's o200k_harmony). Decided by the vocabulary, not by the model's name; once per tokenizer."""
    key = id(tokenizer)
    if key not in _SPEAKS:
        added = getattr(tokenizer, "get_added_vocab", dict)()
        special = set(getattr(tokenizer, "all_special_tokens", []) or [])
        _SPEAKS[key] = all(t in added or t in special for t in (CHANNEL, MESSAGE))
    return _SPEAKS[key]


@dataclass
class HarmonyReader:
    """Reads one reply's text as it grows into reasoning and content deltas."""

    text: str = ""  # the reply so far, special tokens included
    pos: int = 0  # characters of `text` read for good
    harmony: bool | None = None  # whether the reply is in harmony (None: not known yet, nothing read)
    in_body: bool = False  # inside a message's body (after <|message|>)
    header: str = ""  # the current message's header (role, channel, recipient), markers included
    reasoning: list[str] = field(default_factory=list)  # every reasoning delta returned
    content: list[str] = field(default_factory=list)  # every content delta returned

    def _kind(self) -> str:
        """The current message's kind: "reasoning" on the analysis channel; "call" with a recipient (a tool
        call, kept as written); else "content"."""
        if "to=" in self.header:
            return "call"
        channel = self.header.rsplit(CHANNEL, 1)[-1].strip().split(" ")[0] if CHANNEL in self.header else ""
        return "reasoning" if channel == "analysis" else "content"

    def _safe_end(self) -> int:
        """The end of what can be read now: a suffix that may be the start of a marker waits."""
        end = len(self.text)
        for k in range(min(end - self.pos, max(map(len, MARKERS)) - 1), 0, -1):
            if any(m.startswith(self.text[end - k:]) for m in MARKERS):
                return end - k
        return end

    def feed(self, delta: str, finished: bool) -> tuple[str, str]:
        """(reasoning delta, content delta) after `delta`; `finished` reads everything held back."""
        self.text += delta
        out: dict[str, list[str]] = {"reasoning": [], "content": []}
        end = len(self.text) if finished else self._safe_end()
        if self.harmony is None and end > self.pos:  # a reply in harmony opens with a marker
            self.harmony = _MARKER.match(self.text, self.pos) is not None
        if self.harmony is False:  # not harmony: all content, as written
            end = len(self.text)
            out["content"].append(self.text[self.pos:end])
            self.pos = end
        while self.harmony and self.pos < end:
            m = _MARKER.search(self.text, self.pos, end)
            stop = m.start() if m else end
            piece = self.text[self.pos:stop]
            if self.in_body:
                kind = self._kind()
                out["reasoning" if kind == "reasoning" else "content"].append(piece)
            else:
                self.header += piece
            self.pos = stop
            if m is None:
                break
            marker = m.group()
            self.pos = m.end()
            if self.in_body and marker in ENDS:
                if self._kind() == "call":
                    out["content"].append(marker)
                self.in_body, self.header = False, ""
            elif self.in_body:  # a header's marker inside a body: the model left the format; kept as text
                out["reasoning" if self._kind() == "reasoning" else "content"].append(marker)
            elif marker == MESSAGE:
                self.in_body = True
                if self._kind() == "call":
                    out["content"].append(self.header + marker)
            else:
                self.header += marker
        r, c = "".join(out["reasoning"]), "".join(out["content"])
        if r:
            self.reasoning.append(r)
        if c:
            self.content.append(c)
        return r, c

    @property
    def reasoning_text(self) -> str:
        return "".join(self.reasoning)

    @property
    def content_text(self) -> str:
        return "".join(self.content)


def read_reply(text: str) -> tuple[str | None, str]:
    """A whole reply's (reasoning or None, content)."""
    reader = HarmonyReader()
    reader.feed(text, finished=True)
    return reader.reasoning_text or None, reader.content_text
