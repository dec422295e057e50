"""Structured output (response_format json_object / json_schema) by constrained decoding with llguidance.

The grammar mask is computed from the request's own tokens and applied to its own row, so it leaves other
requests' bits alone and its own bits invariant; the outputs parse and validate against the schema.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import run_requests
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.engine.structured import Grammars, json_schema_grammar
from steadyserve.models.loader import load_model
from steadyserve.testing.drift import install_batch_drift
from steadyserve.testing.server import ServerProcess

# Bounded: every value has a bounded length, so a random model must finish the object within max_tokens.
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["color", "count", "ok", "tag"],
          "properties": {"color": {"enum": ["red", "green", "blue"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 999},
                         "ok": {"type": "boolean"},
                         "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"}}}


@pytest.fixture(scope="module")
def engine(tiny_model: str) -> LLMEngine:
    loaded = load_model(tiny_model)
    return LLMEngine(loaded, EngineConfig(kv_cache_memory=32 * 1024**2, threads=1, max_num_seqs=64,
                                          max_num_batched_tokens=512))


def structured(rid: str, prompt: list[int], seed: int, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=seed, logprobs=0,
                                               grammar=json_schema_grammar(SCHEMA), **kw))


def test_every_sampled_output_parses_and_validates(engine) -> None:
    rng = random.Random(0)
    vocab = engine.loaded.args.vocab_size
    reqs = [structured(f"s{i}", [rng.randrange(vocab) for _ in range(rng.randrange(2, 20))], seed=i)
            for i in range(40)]
    done = run_requests(engine, reqs)
    for rid, c in done.items():
        assert c.finish_reason == "stop", (rid, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert len({c.text for c in done.values()}) > 5  # constrained, still sampled


def _grammar_among_plain(engine, prompt: list[int], plain: list[Request]) -> list[str]:
    """Run the structured request alone, the plain ones alone, then all mixed in one batch; name every
    request whose tokens or logprobs differ between the two."""
    alone = run_requests(engine, [structured("s", prompt, seed=3)])
    alone.update(run_requests(engine, [Request(r.request_id, r.prompt_token_ids, r.params) for r in plain]))
    mixed = run_requests(engine, plain[:3] + [structured("s", prompt, seed=3)] + plain[3:])
    return [rid for rid, c in alone.items()
            if (mixed[rid].token_ids, mixed[rid].logprob_values) != (c.token_ids, c.logprob_values)]


@pytest.mark.parametrize("drift", [False, True], ids=["invariant", "broken"])
def test_the_grammar_leaves_the_request_invariant_and_others_untouched(engine, drift: bool) -> None:
    """Broken: a TEST-ONLY batch drift (testing/drift.py) makes each row depend on its batch; the same
    comparison must then name every request, the structured one included."""
    rng = random.Random(1)
    vocab = engine.loaded.args.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(40)]
    plain = [Request(f"p{i}", [rng.randrange(vocab) for _ in range(9)],
                     SamplingParams(max_tokens=8, temperature=0, logprobs=0, ignore_eos=True)) for i in range(6)]
    restore = install_batch_drift(engine) if drift else (lambda: None)
    try:
        differing = _grammar_among_plain(engine, prompt, plain)
    finally:
        restore()
    assert differing == (["s"] + [r.request_id for r in plain] if drift else []), differing
    if drift:
        return
    alone = run_requests(engine, [structured("s", prompt, seed=3)])["s"]
    # The mask does something: unconstrained, the same seed samples text that is not this schema's JSON.
    free = run_requests(engine, [Request("f", prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=3))])["f"]
    assert free.token_ids != alone.token_ids
    assert json.loads(alone.text) and alone.finish_reason == "stop"


def test_smollm2_generations_under_a_schema_all_parse_and_validate(smollm2) -> None:
    """The issue's check on the real model: 100 generations, every one valid."""
    engine = LLMEngine(smollm2.loaded, EngineConfig(kv_cache_memory=256 * 1024**2, threads=2, max_num_seqs=64,
                                                    max_num_batched_tokens=1024))
    tok = smollm2.loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Describe a fruit as JSON."}], tokenize=False,
                                   add_generation_prompt=True)
    prompt = tok(text, add_special_tokens=False)["input_ids"]
    done = run_requests(engine, [structured(f"g{i}", prompt, seed=i) for i in range(100)])
    bad = []
    for rid, c in done.items():
        try:
            jsonschema.validate(json.loads(c.text), SCHEMA)
        except Exception as e:  # noqa: BLE001 - collect every failure
            bad.append((rid, c.finish_reason, c.text, str(e)[:80]))
    assert not bad, bad[:5]


def test_response_format_over_http_with_the_sdk(tiny_model: str) -> None:
    import openai

    with ServerProcess(tiny_model, "--grpc-port", "-1") as s:
        client = openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "JSON please"}]
        r = client.chat.completions.create(model="", messages=msgs, max_tokens=64, seed=1, response_format={
            "type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
        assert r.choices[0].finish_reason == "stop"
        obj = client.chat.completions.create(model="", messages=msgs, max_tokens=200, seed=2,
                                             response_format={"type": "json_object"})
        if obj.choices[0].finish_reason == "stop":  # a random model may keep a free-form object open
            assert isinstance(json.loads(obj.choices[0].message.content), dict)
        else:
            assert obj.choices[0].message.content.startswith("{")
        comp = client.completions.create(model="", prompt="x", max_tokens=64, seed=3, extra_body={
            "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
        jsonschema.validate(json.loads(comp.choices[0].text), SCHEMA)


def test_a_tokenizer_with_a_token_past_the_lm_heads_rows_still_constrains(engine) -> None:
    """A Llama 3 GGUF's tokenizer, as transformers reads it, holds one token more than the LM head has rows (its
    GPT-2 class adds <|endoftext|> as unk): llguidance refused such a tokenizer for the LM head's count. The row
    is masked over its own length, and what is allowed next is a token of the grammar."""
    tok = engine.loaded.tokenizer
    grammars = Grammars(tok, len(tok) - 1)  # the LM head one row short of the tokenizer
    m = grammars.matcher(json_schema_grammar(SCHEMA))
    row = torch.zeros(len(tok) - 1)
    m.mask_(row)
    allowed = torch.isfinite(row).nonzero()[:, 0].tolist()
    assert allowed and all(tok.decode([t]).startswith("{") for t in allowed)
    m.advance(allowed[0])
