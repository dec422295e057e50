"""Admit once, then trust: a request is checked against the engine's ModelLimits once, by its builder
(api/requests.py, api/embeddings.py, every transport); AsyncEngine.submit_all then only counts capacity. What is
built is immutable: the builder derives new SamplingParams rather than editing the client's.

In-process on the tiny model: the real ServerState (startup.build_state), the real builder and engine loop; the
checks are counted by wrapping them (each call still runs the real check)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from steadyserve.api.embeddings import EmbedSpec, admit_embed, build_embed
from steadyserve.api.requests import OutputOptions, RequestSpec, admit, build
from steadyserve.api.startup import build_state
from steadyserve.config import Config
from steadyserve.engine.admission import ModelLimits
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.engine.structured import Grammars
from steadyserve.limits import Refused


@pytest.fixture(scope="module")
def state(tiny_model: str):
    cfg = Config()
    cfg.model.path = tiny_model
    cfg.engine.kv_cache_memory = 8 * 1024**2
    cfg.engine.threads = 1
    cfg.engine.max_queue = 8
    st = build_state(cfg)
    st.engine.start()
    yield st
    st.engine.shutdown()
    st.tokenizer_pool.shutdown()


@pytest.fixture
def counted(monkeypatch):
    """Count every admission check as it runs (each still runs, unchanged)."""
    calls = {"validate": 0, "prompt_ids": 0, "grammar": 0, "fit": 0, "engine_check": 0, "limits_check": 0}

    def wrap(owner: type, name: str, key: str) -> None:
        real = getattr(owner, name)

        def counting(*args, **kw):
            calls[key] += 1
            return real(*args, **kw)

        monkeypatch.setattr(owner, name, counting)

    wrap(SamplingParams, "validate", "validate")
    wrap(ModelLimits, "check_prompt_ids", "prompt_ids")
    wrap(Grammars, "check", "grammar")
    wrap(ModelLimits, "check_fit", "fit")
    wrap(LLMEngine, "check", "engine_check")
    wrap(ModelLimits, "check", "limits_check")
    return calls


def spec(prompt, **kw) -> RequestSpec:
    params = kw.pop("params", SamplingParams(temperature=0, logprobs=0))
    return RequestSpec(kind="completion", transport="http", request_id="", model=None, params=params,
                       prompts=[prompt], requested_max_tokens=kw.pop("max_tokens", 4), output=OutputOptions(), **kw)


async def finish(channel) -> list:
    """Every output of every choice, in the order the request channel delivers them."""
    async with channel:
        return [o async for event in channel for o in event.outputs]


def serve(state, s: RequestSpec) -> list:
    """build on the tokenizer thread and admit on the loop, as the HTTP and gRPC handlers do; run to the end."""
    async def go() -> list:
        req = await state.run_tokenizer(build, state, s)
        return await finish(admit(state, req))

    return asyncio.run(go())


def test_the_server_path_checks_each_limit_once(state, counted) -> None:
    """A token-id prompt with a grammar: validate, the O(prompt) token-id check and the grammar check run once,
    the fit once per choice; the engine's own full check (LLMEngine.check / ModelLimits.check) never."""
    grammar = '%llguidance {}\nstart: /[a-z]+/'
    outs = serve(state, spec(list(range(5, 40)), params=SamplingParams(temperature=0, logprobs=0, grammar=grammar)))
    assert outs[-1].finished and outs[-1].finish_reason in ("stop", "length"), outs[-1]
    assert counted == {"validate": 1, "prompt_ids": 1, "grammar": 1, "fit": 1, "engine_check": 0,
                       "limits_check": 0}, counted


def test_best_of_fits_each_choice_and_validates_once(state, counted) -> None:
    outs = serve(state, spec("hello there", num_samples=3, n=1,
                             params=SamplingParams(temperature=1.0, seed=7)))
    assert sum(o.finished for o in outs) == 3
    assert counted["validate"] == 1 and counted["fit"] == 3 and counted["engine_check"] == 0, counted


def test_embeddings_check_once_and_submit_without_the_engine_check(state, counted) -> None:
    async def go() -> list:
        req = await state.run_tokenizer(build_embed, state, EmbedSpec("http", "", None, [[5, 6, 7], "hi"]))
        return await finish(admit_embed(state, req))

    outs = asyncio.run(go())
    assert [o.embedding is not None for o in outs if o.finished] == [True, True]
    assert counted["prompt_ids"] == 1 and counted["fit"] == 2, counted  # ids checked for the id input only
    assert counted["engine_check"] == 0 and counted["limits_check"] == 0, counted


def test_submit_all_only_counts_capacity(state) -> None:
    """Whatever reaches AsyncEngine.submit_all is taken as its builder checked it: a request over the context
    is counted in there, not refused (the engine stops it at the context); the builder refuses it, with the
    message ModelLimits.check gives offline callers."""
    limits: ModelLimits = state.limits
    ids = [1] * (limits.context - 2)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0, ignore_eos=True)
    too_long = Request("too-long", ids, params)
    with pytest.raises(Refused) as offline:
        limits.check(too_long)
    assert offline.value.reason == "too_long"

    async def go() -> list:
        channel = state.engine.submit_all([too_long])  # not refused: submit_all checks nothing
        return await asyncio.wait_for(finish(channel), 120)

    outs = asyncio.run(go())
    end = outs[-1]
    assert end.finished and end.finish_reason == "length", end
    assert end.num_prompt_tokens + end.num_generated_tokens == limits.context  # stopped by the context

    with pytest.raises(Refused) as built:
        build(state, spec(ids, max_tokens=4, params=params))
    assert (built.value.reason, built.value.param, str(built.value)) == \
        (offline.value.reason, offline.value.param, str(offline.value))


def test_the_builder_leaves_the_clients_params_alone(state) -> None:
    """best_of sets logprobs and a resolved max_tokens for the engine: on new values, never the spec's."""
    sent = SamplingParams(max_tokens=999, temperature=0.5, seed=3)  # as sent: the builder resolves 16
    s = spec("hello", num_samples=2, n=1, params=sent, max_tokens=None)
    before = dataclasses.astuple(sent)
    req = build(state, s)
    assert dataclasses.astuple(s.params) == before and s.params is sent
    assert all(p.logprobs == 0 for p in req.params) and req.params[0].max_tokens != sent.max_tokens
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.params[0].max_tokens = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        Request("r", [1], sent).params = sent  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        req.prompts = []  # type: ignore[misc]


def test_model_limits_are_the_engines(state) -> None:
    """ModelLimits is built once from what owns each value: the model (vocabulary, context, grammars) and the
    KV cache the engine allocated; the server state holds that one value."""
    engine = state.engine.engine
    limits: ModelLimits = state.limits
    assert limits is engine.limits
    assert limits.vocab_size == state.loaded.args.vocab_size and limits.context == engine.max_model_len
    bm = engine.block_manager  # one group of layers: the whole cache, up to the context
    assert limits.kv_tokens == bm.token_capacity(engine.max_model_len) == min(engine.max_model_len,
                                                                             bm.num_blocks * bm.block_size)
    assert limits.grammars is engine.grammars and limits.eos_token_ids == frozenset(engine.eos_token_ids)
    with pytest.raises(dataclasses.FrozenInstanceError):
        limits.context = 1  # type: ignore[misc]
