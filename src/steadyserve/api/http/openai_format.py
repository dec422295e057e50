"""Engine outputs -> OpenAI JSON shapes (completions and chat, whole and chunked)."""

from __future__ import annotations

import json
import re
import time
from typing import Any, Callable

from ...engine.sequence import RequestOutput, TokenLogprob
from ..events import Accumulated, sum_usage
from ..protocol import token_text
from ..requests import ValidatedRequest
from ..harmony import HarmonyReader, read_reply
from ..tools import ToolCallStream, ToolFormat, tool_finish, tool_turn


def _bytes_to_unicode_inverse() -> dict[str, int]:
    """GPT-2's byte-level alphabet, reversed: the stand-in character of each byte -> the byte."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


_BYTE_DECODER = _bytes_to_unicode_inverse()
_BYTE_LEVEL: dict[int, bool] = {}  # id(tokenizer) -> decoder is ByteLevel


def _is_byte_level(tokenizer: Any) -> bool:
    key = id(tokenizer)
    if key not in _BYTE_LEVEL:
        try:
            spec = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
            kinds = [spec.get("type")] + [d.get("type") for d in spec.get("decoders", []) or []]
            _BYTE_LEVEL[key] = "ByteLevel" in kinds
        except Exception:
            _BYTE_LEVEL[key] = False
    return _BYTE_LEVEL[key]


_ADDED: dict[int, frozenset[str]] = {}


def _added_tokens(tokenizer: Any) -> frozenset[str]:
    key = id(tokenizer)
    if key not in _ADDED:
        try:
            _ADDED[key] = frozenset(tokenizer.get_added_vocab())
        except Exception:
            _ADDED[key] = frozenset()
    return _ADDED[key]


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


_TOKEN_BYTES: dict[int, dict[int, bytes]] = {}


def token_bytes(tokenizer: Any, token_id: int) -> bytes:
    cache = _TOKEN_BYTES.setdefault(id(tokenizer), {})
    b = cache.get(token_id)
    if b is None:
        b = cache[token_id] = _token_bytes(tokenizer, token_id)
    return b


def _token_bytes(tokenizer: Any, token_id: int) -> bytes:
    """A token's raw bytes (OpenAI's `bytes`): exact for byte-level BPE and byte-fallback pieces,
    even when the token is part of a UTF-8 character and its text is only U+FFFD."""
    try:
        piece = tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if _is_byte_level(tokenizer) and piece not in _added_tokens(tokenizer) \
                    and all(ch in _BYTE_DECODER for ch in piece):
                return bytes(_BYTE_DECODER[ch] for ch in piece)
            m = _BYTE_PIECE.fullmatch(piece)
            if m:
                return bytes([int(m.group(1), 16)])
    except Exception:
        pass
    return token_text(tokenizer, token_id).encode("utf-8")


class Formatter:
    """Builds response bodies for one choice (one engine request) of one endpoint kind."""

    def __init__(self, kind: str, request_id: str, model: str, fingerprint: str, tokenizer: Any,
                 echo_prompt_ids: list[int] | None = None, echo_text: str = "", index: int = 0,
                 tool_format: ToolFormat | None = None,
                 receipt: Callable[[Accumulated], dict[str, Any]] | None = None, harmony: bool = False) -> None:
        self.kind = kind  # "completion" | "chat"
        self.index = index  # the choice's index: its prompt's position in a batched request
        self.id = ("chatcmpl-" if kind == "chat" else "cmpl-") + request_id
        self.model = model
        self.fingerprint = fingerprint
        self.tokenizer = tokenizer
        self.created = int(time.time())
        self.echo_prompt_ids = echo_prompt_ids  # completions with echo=true
        self.echo_text = echo_text
        self._offset = 0  # text offset for completion logprobs
        self._sent_role = False
        self._sent_echo = False
        self.request_id = request_id
        self.tool_format = tool_format  # chat with tools: the output is parsed into content and tool_calls
        self.tool_stream = ToolCallStream(tool_format, request_id, index) if tool_format is not None else None
        self.receipt = receipt  # the choice's receipt from its outputs (api/receipts.py); None: not asked for
        # a chat reply in harmony (api/harmony.py): its analysis channel sent as reasoning_content
        self.harmony = HarmonyReader() if harmony and kind == "chat" else None

    def _envelope(self, chunk: bool) -> dict[str, Any]:
        obj = {"completion": "text_completion", "chat": "chat.completion.chunk" if chunk else "chat.completion"}
        return {"id": self.id, "object": obj[self.kind], "created": self.created, "model": self.model,
                "system_fingerprint": self.fingerprint}

    # ---- logprobs ----------------------------------------------------------
    def _completion_logprobs(self, lps: list[TokenLogprob | None], ids: list[int]) -> dict[str, Any]:
        tokens, values, tops, offsets = [], [], [], []
        for tid, lp in zip(ids, lps):
            s = token_text(self.tokenizer, tid)
            tokens.append(s)
            offsets.append(self._offset)
            self._offset += len(s)
            values.append(None if lp is None else lp.logprob)
            tops.append(None if lp is None else self._top_dict(lp.top))
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}

    def _top_dict(self, top: list[tuple[int, float]]) -> dict[str, float]:
        """OpenAI's legacy shape keys alternatives by text; where two tokens share a text
        (e.g. partial UTF-8 characters), the likelier one (first) keeps the key."""
        d: dict[str, float] = {}
        for t, v in top:
            d.setdefault(token_text(self.tokenizer, t), v)
        return d

    def _chat_logprobs(self, lps: list[TokenLogprob]) -> dict[str, Any]:
        def entry(tid: int, v: float) -> dict[str, Any]:
            s = token_text(self.tokenizer, tid)
            return {"token": s, "logprob": v, "bytes": list(token_bytes(self.tokenizer, tid))}

        return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                            for lp in lps]}

    def _logprobs(self, acc_lps: list[TokenLogprob], ids: list[int], want: bool,
                  prompt_lps: list[TokenLogprob | None] | None = None) -> dict[str, Any] | None:
        if not want:
            return None
        if self.kind == "chat":
            return self._chat_logprobs(acc_lps)
        all_lps: list[TokenLogprob | None] = []
        all_ids: list[int] = []
        if prompt_lps is not None and self.echo_prompt_ids is not None:
            all_lps += prompt_lps
            all_ids += self.echo_prompt_ids
        return self._completion_logprobs(all_lps + list(acc_lps), all_ids + ids)

    # ---- bodies --------------------------------------------------------------
    def full(self, acc: Accumulated, want_logprobs: bool) -> dict[str, Any]:
        body = self._envelope(chunk=False)
        lp = self._logprobs(acc.logprobs, acc.token_ids, want_logprobs, acc.prompt_logprobs)
        if self.kind == "chat" and self.tool_format is not None:
            turn = tool_turn(self.tool_format, acc.text, self.request_id, self.index, acc.finish_reason)
            message: dict[str, Any] = {"role": "assistant", "content": turn.content}
            if turn.tool_calls:
                message["tool_calls"] = turn.tool_calls
            choice = {"index": self.index, "message": message, "logprobs": lp, "finish_reason": turn.finish_reason}
        elif self.kind == "chat" and self.harmony is not None:
            reasoning, content = read_reply(acc.text)
            message = {"role": "assistant", "content": content}
            if reasoning:
                message["reasoning_content"] = reasoning
            choice = {"index": self.index, "message": message, "logprobs": lp, "finish_reason": acc.finish_reason}
        elif self.kind == "chat":
            choice = {"index": self.index, "message": {"role": "assistant", "content": acc.text}, "logprobs": lp,
                      "finish_reason": acc.finish_reason}
        else:
            choice = {"index": self.index, "text": self.echo_text + acc.text, "logprobs": lp,
                      "finish_reason": acc.finish_reason}
        if self.receipt is not None:
            choice["receipt"] = self.receipt(acc)
        body["choices"] = [choice]
        body["usage"] = acc.usage()
        # Extension: how this request was batched, so clients can see that identical
        # requests shared steps with different numbers of others.
        body["steadyserve"] = {"max_batch_seqs": acc.max_batch_seqs,
                               "queue_wait_s": None if acc.queue_wait is None else round(acc.queue_wait, 6)}
        return body

    def chunk(self, outs: list[RequestOutput], want_logprobs: bool) -> dict[str, Any]:
        """One SSE/WS event for a batch of outputs (one or more engine steps)."""
        text = "".join(o.text_delta for o in outs)
        ids = [t for o in outs for t in o.new_token_ids]
        lps = [lp for o in outs for lp in o.logprobs]
        prompt_lps = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), None)
        finish = outs[-1].finish_reason if outs[-1].finished else None
        body = self._envelope(chunk=True)
        lp = self._logprobs(lps, ids, want_logprobs, prompt_lps)
        if self.kind == "chat":
            reasoning, content = self.harmony.feed(text, finish is not None) if self.harmony else ("", text)
            delta: dict[str, Any] = {"reasoning_content": reasoning} if reasoning else {}
            if content or not self._sent_role:
                delta["content"] = content
            if not self._sent_role:
                delta["role"] = "assistant"
                self._sent_role = True
            choice = {"index": self.index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        else:
            if self.echo_text and not self._sent_echo:
                text = self.echo_text + text
                self._sent_echo = True
            choice = {"index": self.index, "text": text, "logprobs": lp, "finish_reason": finish}
        body["choices"] = [choice]
        return body

    def chunks(self, outs: list[RequestOutput], want_logprobs: bool) -> list[dict[str, Any]]:
        """The SSE events for a batch of outputs: one chunk, or with tools the content and then one chunk per
        tool_calls entry (a call's id and name, then its argument fragments), as OpenAI streams them. None at
        all for a batch whose text is all held back (a call not yet named), unless it carries logprobs."""
        if self.tool_stream is None or self.kind != "chat":
            return [self.chunk(outs, want_logprobs)]
        text = "".join(o.text_delta for o in outs)
        finished = outs[-1].finished
        content, entries = self.tool_stream.feed(text, finished)
        ids = [t for o in outs for t in o.new_token_ids]
        lp = self._logprobs([lp for o in outs for lp in o.logprobs], ids, want_logprobs)
        bodies: list[dict[str, Any]] = []

        def add(delta: dict[str, Any], logprobs: Any = None) -> None:
            if not self._sent_role:
                delta = {"role": "assistant", "content": None, **delta}
                self._sent_role = True
            body = self._envelope(chunk=True)
            body["choices"] = [{"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": None}]
            bodies.append(body)

        if content or not self._sent_role or (lp is not None and lp["content"]):
            add({"content": content} if content else {}, lp)
        for entry in entries:
            add({"tool_calls": [entry]})
        if finished:
            if not bodies:
                add({})
            bodies[-1]["choices"][0]["finish_reason"] = tool_finish(outs[-1].finish_reason, self.tool_stream.called)
        return bodies

    def usage_chunk(self, acc: Accumulated) -> dict[str, Any]:
        body = self._envelope(chunk=True)
        body["choices"] = []
        body["usage"] = acc.usage()
        return body


def mean_logprob(acc: Accumulated) -> float:
    """A choice's mean log-probability per generated token (best_of's ranking); -inf for none."""
    return sum(lp.logprob for lp in acc.logprobs) / len(acc.logprobs) if acc.logprobs else float("-inf")


def full_body(fmts: list[Formatter], accs: list[Accumulated], want_logprobs: bool, n: int = 1) -> dict[str, Any]:
    """One response body for the choices of one HTTP request (n per prompt), in index order, usage summed."""
    bodies = [f.full(a, want_logprobs) for f, a in zip(fmts, accs)]
    if len(bodies) == 1:
        return bodies[0]
    body = bodies[0]
    body["choices"] = [b["choices"][0] for b in sorted(bodies, key=lambda b: b["choices"][0]["index"])]
    body["usage"] = sum_usage(accs, n).usage()
    waits = [a.queue_wait for a in accs if a.queue_wait is not None]
    body["steadyserve"] = {"max_batch_seqs": max(a.max_batch_seqs for a in accs),
                           "queue_wait_s": round(max(waits), 6) if waits else None}
    return body


def formatters(req: ValidatedRequest, model: str, fingerprint: str, tokenizer: Any,
               receipts: Callable[[int, Accumulated], dict[str, Any]] | None = None) -> list[Formatter]:
    """One Formatter per choice of a validated completion or chat request; `receipts` (api/receipts.py) when
    the request asked for them."""
    echo = req.output.echo  # only a completion's builder sets it
    # Echo: a text prompt as sent; token ids decoded (the builder has checked they are ids of this model).
    return [Formatter(req.kind, req.request_id, model, fingerprint, tokenizer,
                      echo_prompt_ids=ids if echo else None,
                      echo_text=(text if text is not None else tokenizer.decode(ids)) if echo else "", index=i,
                      tool_format=req.tool_format, receipt=_bind(receipts, i), harmony=req.harmony)
            for i, (ids, text) in enumerate(zip(req.prompts, req.echo_texts))]


def _bind(receipts: Callable[[int, Accumulated], dict[str, Any]] | None,
          i: int) -> Callable[[Accumulated], dict[str, Any]] | None:
    return None if receipts is None else (lambda acc: receipts(i, acc))
