"""The design the incident reports started from, kept only to be measured against.

FastAPI; one transformers model; every request runs `model.generate()` (or a
scoring forward pass) behind one global `threading.Lock` — the first report's
"fix". No batching, no admission control, no stall handling. It speaks just
enough of the OpenAI completions API for `steadyserve bench` and `validate`:
streaming and non-streaming generation with logprobs, and echo scoring.

    python benchmarks/baseline_server.py --model HF_DIR --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

app = FastAPI()
LOCK = threading.Lock()
MODEL = TOKENIZER = None
NAME = "baseline"


def _score(ids: list[int]) -> list[float | None]:
    with LOCK, torch.no_grad():
        logits = MODEL(torch.tensor([ids])).logits[0].float()  # type: ignore[misc]
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [lp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def _generate(ids: list[int], max_tokens: int, ignore_eos: bool) -> tuple[list[int], list[float]]:
    with LOCK, torch.no_grad():
        out = MODEL.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,  # type: ignore[union-attr]
                             min_new_tokens=max_tokens if ignore_eos else 0, output_scores=True,
                             return_dict_in_generate=True, pad_token_id=TOKENIZER.eos_token_id)  # type: ignore[union-attr]
    new = out.sequences[0, len(ids):].tolist()
    lps = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.scores, new)]
    return new, lps


@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    ids = TOKENIZER(body["prompt"])["input_ids"]  # type: ignore[misc]
    max_tokens = int(body.get("max_tokens", 16))
    rid = "cmpl-" + uuid.uuid4().hex[:12]
    if body.get("stream"):
        return StreamingResponse(_stream(ids, max_tokens, bool(body.get("ignore_eos")), rid),
                                 media_type="text/event-stream")
    loop = asyncio.get_running_loop()
    if max_tokens == 0:
        lps = await loop.run_in_executor(None, _score, ids)
        toks, text = ids, body["prompt"]
    else:
        toks, lps = await loop.run_in_executor(None, _generate, ids, max_tokens, bool(body.get("ignore_eos")))
        text = TOKENIZER.decode(toks, skip_special_tokens=True)  # type: ignore[union-attr]
    return JSONResponse({"id": rid, "object": "text_completion", "model": NAME, "system_fingerprint": "baseline",
                         "choices": [{"index": 0, "text": text, "finish_reason": "length",
                                      "logprobs": {"tokens": [str(t) for t in toks], "token_logprobs": lps}}],
                         "usage": {"prompt_tokens": len(ids), "completion_tokens": 0 if max_tokens == 0 else len(toks)}})


class _CountingStreamer(TextIteratorStreamer):
    """Counts generated tokens: the text arrives a word at a time, so events are not tokens."""

    generated = 0

    def put(self, value) -> None:
        if not self.next_tokens_are_prompt:
            self.generated += value.numel()
        super().put(value)


async def _stream(ids: list[int], max_tokens: int, ignore_eos: bool, rid: str):
    streamer = _CountingStreamer(TOKENIZER, skip_prompt=True, skip_special_tokens=True)  # type: ignore[arg-type]

    def run() -> None:
        with LOCK, torch.no_grad():
            MODEL.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,  # type: ignore[union-attr]
                           min_new_tokens=max_tokens if ignore_eos else 0, streamer=streamer,
                           pad_token_id=TOKENIZER.eos_token_id)  # type: ignore[union-attr]

    threading.Thread(target=run, daemon=True).start()
    loop = asyncio.get_running_loop()
    it = iter(streamer)
    while True:
        text = await loop.run_in_executor(None, next, it, None)
        if text is None:
            break
        if text:
            yield "data: " + json.dumps({"id": rid, "object": "text_completion", "created": int(time.time()),
                                         "choices": [{"index": 0, "text": text, "finish_reason": None}]}) + "\n\n"
    yield "data: " + json.dumps({"id": rid, "object": "text_completion",
                                 "choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                                 "usage": {"prompt_tokens": len(ids), "completion_tokens": streamer.generated}}) + "\n\n"
    yield "data: [DONE]\n\n"


def main() -> None:
    global MODEL, TOKENIZER, NAME
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="HF model directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    TOKENIZER = AutoTokenizer.from_pretrained(a.model)
    MODEL = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    NAME = a.model
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")


if __name__ == "__main__":
    main()
