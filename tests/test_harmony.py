"""gpt-oss's harmony replies through the chat endpoints: the analysis channel as reasoning_content, the final and
commentary channels as content, whole and streamed alike, and every other model's replies untouched.

The reader is checked on written replies, cut into every kind of delta; then a real server on a tiny gpt-oss whose
tokenizer has harmony's markers as special tokens (and "analysis" and "final" as tokens, so a random model writes
headers when logit_bias favours them) answers chat requests: what it returns is the reader's reading of the very
tokens it generated (their bytes, from the chat logprobs), and the stream's deltas add up to the whole reply.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import httpx
import pytest

from steadyserve.api.harmony import HarmonyReader, read_reply
from steadyserve.kernels import load
from steadyserve.testing import build_tiny_model
from steadyserve.testing.server import ServerProcess

MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|constrain|>")
# gpt-oss's own template renders far more (a system message, tools, reasoning effort); this keeps its shape
HARMONY_TEMPLATE = ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")

REPLY = ("<|channel|>analysis<|message|>The user greets; answer <b>politely</b>.<|end|>"
         "<|start|>assistant<|channel|>final<|message|>Hello there! <| not a marker")


def read_in_pieces(text: str, rng: random.Random) -> tuple[str, str]:
    reader = HarmonyReader()
    i = 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        reader.feed(text[i:j], finished=j == len(text))
        i = j
    return reader.reasoning_text, reader.content_text


def test_a_reply_is_read_into_reasoning_and_content_whatever_its_deltas():
    assert read_reply(REPLY) == ("The user greets; answer <b>politely</b>.", "Hello there! <| not a marker")
    rng = random.Random(0)
    for _ in range(300):  # a marker cut anywhere between deltas is held back, never sent as text
        assert read_in_pieces(REPLY, rng) == read_reply(REPLY)


def test_a_reply_without_harmony_is_all_content_and_a_tool_call_is_kept_as_written():
    assert read_reply("Plain text, even with <|end|> in it") == (None, "Plain text, even with <|end|> in it")
    call = "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\": \"Oslo\"}<|call|>"
    assert read_reply(call) == (None, call)
    two = "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>final<|message|>Done."
    assert read_reply(two) == (None, "Let me check.Done.")


def test_the_reader_would_leak_a_marker_if_it_did_not_hold_one_back(monkeypatch):
    """Teeth: without the hold-back, a delta ending in "<|chan" is sent as content."""
    monkeypatch.setattr(HarmonyReader, "_safe_end", lambda self: len(self.text))
    reader = HarmonyReader()
    reader.feed("<|channel|>final<|message|>Hi <|en", finished=False)
    reader.feed("d|>", finished=True)
    assert reader.content_text != "Hi "


# ---- a real server -----------------------------------------------------------------------------------------------

needs_kernels = pytest.mark.skipif(not load().available, reason="native kernels not built")
PROMPT = [{"role": "user", "content": "The quick brown fox"}]


@pytest.fixture(scope="module")
def harmony_model(models_dir: Path) -> tuple[str, str]:
    """A tiny gpt-oss that writes harmony: its layers add nothing to the residual stream, so each token's logits
    are its embedding through the output layer, set so that the greedy reply is the chain
    `<|channel|>analysis<|message|>X<|end|><|start|>final<|message|>X<|end|><|start|>final...` (a bigram model).
    Returns the directory and X's text."""
    import torch
    from transformers import AutoTokenizer, GptOssForCausalLM

    d = models_dir / "tiny-gptoss-harmony"
    build_tiny_model(d, arch="gptoss", chat_template=HARMONY_TEMPLATE, special_tokens=MARKERS,
                     added_tokens=("analysis", "final"))
    tok = AutoTokenizer.from_pretrained(d)
    ids = {t: tok.convert_tokens_to_ids(t) for t in (*MARKERS, "analysis", "final")}
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    last = tok.encode(text, add_special_tokens=False)[-1]  # the prompt's last token
    x = next(i for i in tok.encode(" quick brown") if i != last)
    chain = {last: ids["<|channel|>"], ids["<|channel|>"]: ids["analysis"], ids["analysis"]: ids["<|message|>"],
             ids["<|message|>"]: x, x: ids["<|end|>"], ids["<|end|>"]: ids["<|start|>"],
             ids["<|start|>"]: ids["final"], ids["final"]: ids["<|message|>"]}
    model = GptOssForCausalLM.from_pretrained(d, dtype=torch.float32)
    with torch.no_grad():
        for layer in model.model.layers:  # every layer's output is zero: the residual stream is the embedding
            for p in (layer.self_attn.o_proj.weight, layer.self_attn.o_proj.bias, layer.mlp.experts.down_proj,
                      layer.mlp.experts.down_proj_bias):
                p.zero_()
        model.lm_head.weight.zero_()
        for k, (src, dst) in enumerate(chain.items()):
            direction = torch.zeros(model.config.hidden_size)
            direction[k] = 1.0
            model.model.embed_tokens.weight[src] = 5 * direction
            model.lm_head.weight[dst] += 10 * direction  # <|message|> follows two tokens
    model.save_pretrained(d)
    return str(d), tok.decode([x])


@pytest.fixture(scope="module")
def server(harmony_model):
    with ServerProcess(harmony_model[0], "--max-model-len", "512") as s:
        yield s


def chat(server: ServerProcess, **extra) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{server.http_port}/v1/chat/completions", timeout=120, json={
        "messages": PROMPT, "max_tokens": 16, "temperature": 0, **extra})


@needs_kernels
def test_a_harmony_chat_reply_is_read_by_channel_whole_and_streamed(server, harmony_model):
    _, x = harmony_model
    r = chat(server, logprobs=True)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    raw = b"".join(bytes(t["bytes"]) for t in choice["logprobs"]["content"]).decode()  # the tokens generated
    assert raw.startswith(f"<|channel|>analysis<|message|>{x}<|end|><|start|>final<|message|>{x}"), raw
    assert choice["message"]["reasoning_content"] == x
    assert choice["message"]["content"] == read_reply(raw)[1] and choice["message"]["content"].startswith(x + x)
    with httpx.stream("POST", f"http://127.0.0.1:{server.http_port}/v1/chat/completions", timeout=120, json={
            "messages": PROMPT, "max_tokens": 16, "temperature": 0, "stream": True}) as s:
        deltas = [json.loads(line[5:])["choices"][0]["delta"] for line in s.iter_lines()
                  if line.startswith("data:") and line[5:].strip() != "[DONE]"]
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == x
    assert "".join(d.get("content") or "" for d in deltas) == choice["message"]["content"]
    assert not any(m in (d.get("content") or "") + (d.get("reasoning_content") or "") for d in deltas for m in MARKERS)


@needs_kernels
def test_completions_keep_the_raw_text_and_skip_special_tokens_is_the_clients(server, harmony_model):
    """Only chat reads channels: a completion's text leaves special tokens out unless the client keeps them."""
    _, x = harmony_model
    url = f"http://127.0.0.1:{server.http_port}/v1/completions"
    body = {"prompt": "<|start|>user<|message|>The quick brown fox<|end|><|start|>assistant", "max_tokens": 8,
            "temperature": 0}
    plain = httpx.post(url, json=body, timeout=120).json()["choices"][0]["text"]
    kept = httpx.post(url, json={**body, "skip_special_tokens": False}, timeout=120).json()["choices"][0]["text"]
    assert kept.startswith(f"<|channel|>analysis<|message|>{x}<|end|>"), kept
    for m in MARKERS:
        kept = kept.replace(m, "")
    assert kept == plain and plain.startswith(f"analysis{x}final")
    bad = httpx.post(url, json={**body, "skip_special_tokens": "no"}, timeout=120)
    assert bad.status_code == 400 and "skip_special_tokens" in bad.text
