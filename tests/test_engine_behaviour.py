"""Engine behaviour on the tiny model: admission, stop strings, isolation of failures, abort,
and the AsyncEngine's death reporting."""

from __future__ import annotations

import asyncio
import os

import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.async_engine import SECOND_MODEL_THREAD, AsyncEngine
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.kv_cache import STORAGE, resolve_kv_dtype
from steadyserve.limits import Refused
from steadyserve.engine.model_thread import ModelThread
from steadyserve.engine.offline import Completed, run_requests
from steadyserve.engine.selftest import run_selftest
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model

THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))


@pytest.fixture(scope="module")
def loaded(tiny_model):
    return load_model(tiny_model)


def make_engine(loaded, **kw) -> LLMEngine:
    cfg = dict(kv_cache_memory=8 * 1024**2, threads=THREADS, max_num_batched_tokens=256, max_num_seqs=16)
    cfg.update(kw)
    engine = LLMEngine(loaded, EngineConfig(**cfg))
    assert run_selftest(engine).passed
    return engine


@pytest.fixture
def engine(loaded):
    return make_engine(loaded)


def gen(rid: str, prompt: list[int], n: int = 12, **kw) -> Request:
    kw.setdefault("temperature", 0)
    return Request(rid, prompt, SamplingParams(max_tokens=n, logprobs=0, ignore_eos=True, **kw))


PROMPTS = [[5, 17, 42, 99, 3], [100, 200, 300], list(range(10, 50)), [7] * 12, [250, 11, 64, 64, 1]]


def same(a: Completed, b: Completed) -> bool:
    return a.token_ids == b.token_ids and a.logprob_values == b.logprob_values and a.text == b.text


# ---- admission ---------------------------------------------------------------------------------

def test_too_long_for_the_context_is_refused_at_once(loaded):
    engine = make_engine(loaded, max_model_len=0)
    ctx = engine.max_model_len
    with pytest.raises(Refused) as e:
        engine.add_request(gen("long", [1] * (ctx - 5), 6))
    assert e.value.reason == "too_long" and "context length" in str(e.value) and e.value.param == "max_tokens"
    engine.add_request(gen("fits", [1] * (ctx - 5), 5))  # exactly the context: fine
    assert engine.scheduler.num_waiting == 1


def test_larger_than_the_whole_cache_is_refused_at_once(loaded):
    fmt = resolve_kv_dtype("auto", torch.float32, loaded.numerics.mode)  # the cache format the engine picks
    per_block = 2 * loaded.args.num_layers * loaded.args.num_kv_heads * loaded.args.head_dim * 32 * STORAGE[fmt].itemsize
    engine = make_engine(loaded, kv_cache_memory=3 * per_block)
    assert engine.kv.num_blocks == 3
    with pytest.raises(Refused) as e:
        engine.add_request(gen("huge", [1] * 90, 7))  # 97 tokens > 96 slots: it could never run
    assert e.value.reason == "too_long" and "KV cache of 96 tokens" in str(e.value)
    assert not engine.has_work()
    done = run_requests(engine, [gen("ok", [1] * 90, 6)])  # 96 tokens: runs
    assert done["ok"].finish_reason == "length"


@pytest.mark.parametrize("prompt, params, param, reason", [
    ([], SamplingParams(), "prompt", "invalid_value"),
    # The token range is the request builder's check (steadyserve.limits.check_token_ids), reason and all.
    ([1, 10 ** 6], SamplingParams(), "prompt[1]", "invalid_value"),
    ([1], SamplingParams(temperature=-1), "temperature", "invalid_value"),
    ([1], SamplingParams(top_p=0), "top_p", "invalid_value"),
    ([1], SamplingParams(max_tokens=0), "max_tokens", "invalid_value"),
    ([1], SamplingParams(logprobs=21), "logprobs", "invalid_value"),
    ([1], SamplingParams(stop=[""]), "stop", "invalid_value"),
])
def test_invalid_requests(engine, prompt, params, param, reason):
    with pytest.raises(Refused) as e:
        engine.add_request(Request("bad", prompt, params))
    assert e.value.reason == reason and e.value.param == param


# ---- stop strings and text ---------------------------------------------------------------------

def run_streaming(engine: LLMEngine, reqs: list[Request]) -> dict[str, list]:
    outs: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        for o in engine.step()[0]:
            outs[o.request_id].append(o)
    return outs


def test_stop_strings_cut_the_text_and_never_leak(engine):
    prompt = engine.tokenizer.encode("The quick brown fox")
    sampled = dict(temperature=1.0, seed=3)  # seeded: every request below draws the same tokens
    text = run_requests(engine, [gen("full", prompt, 48, **sampled)])["full"].text
    starts = [i for i in range(2, len(text) - 6) if "\ufffd" not in text[i:i + 5]]
    assert len(starts) >= 8, text
    picks = [starts[len(starts) * k // 5] for k in range(1, 5)]
    stops = {f"s{k}": text[i:i + 2 + k % 3] for k, i in enumerate(picks)}
    reqs = [gen(rid, prompt, 48, stop=[s], **sampled) for rid, s in stops.items()]
    reqs.append(gen("two", prompt, 48, stop=[stops["s3"], stops["s2"]], **sampled))
    outs = run_streaming(engine, reqs)
    for rid, stream in outs.items():
        ss = [stops[rid]] if rid in stops else [stops["s3"], stops["s2"]]
        expected = text[:min(text.find(s) for s in ss)]
        sent = ""
        for o in stream:
            sent += o.text_delta
            assert expected.startswith(sent), f"{rid}: streamed {sent!r} is not a prefix of {expected!r}"
        assert sent == expected and stream[-1].finished and stream[-1].finish_reason == "stop", (rid, ss, sent)
        assert sum(len(o.new_token_ids) for o in stream) < 48


def test_stop_string_completed_by_the_final_flush_is_a_stop(engine):
    """Text held back as partial characters is only decoded at the end; a stop string it completes
    still cuts the text, and the finish reason says so.

    Which prompt makes the model end on held-back pieces of characters depends on the weights and kernels,
    so the test searches: greedy outputs of candidate prompts, streamed, until one ends with a run of U+FFFD
    that was only released by the final flush."""
    import random

    rng = random.Random(0)
    vocab = engine.loaded.args.vocab_size
    candidates = [list(range(10, 50))] + PROMPTS + [[rng.randrange(vocab) for _ in range(rng.randrange(3, 30))]
                                                   for _ in range(60)]
    outs = run_streaming(engine, [gen(f"c{i}", p, 12) for i, p in enumerate(candidates)])
    found = None
    for i, p in enumerate(candidates):
        stream = outs[f"c{i}"]
        full = "".join(o.text_delta for o in stream)
        before_final = "".join(o.text_delta for o in stream[:-1])
        run = len(full) - len(full.rstrip("\ufffd"))
        if not run:
            continue
        stop = "\ufffd" * run
        pos = full.find(stop)
        if pos + len(stop) > len(before_final):  # the stop string is completed only by the final flush
            found = (p, full, stop, pos)
            break
    assert found, (f"none of {len(candidates)} prompts made the model end on held-back partial characters: "
                   "widen the search")
    prompt, full, stop, pos = found
    got = run_requests(engine, [gen("st", prompt, 12, stop=[stop])])["st"]
    assert got.text == full[:pos] and got.finish_reason == "stop", (full, stop, got.text)


def test_deltas_concatenate_to_the_decoded_text(engine):
    outs = run_streaming(engine, [gen(f"r{i}", p, 30) for i, p in enumerate(PROMPTS)])
    for rid, stream in outs.items():
        ids = [t for o in stream for t in o.new_token_ids]
        text = "".join(o.text_delta for o in stream)
        assert text == engine.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        assert [o.finished for o in stream].count(True) == 1 and stream[-1].finished


def test_stop_token_ids(engine):
    full = run_requests(engine, [gen("full", PROMPTS[0], 20)])["full"]
    tok = full.token_ids[5]
    first = full.token_ids.index(tok)
    got = run_requests(engine, [gen("st", PROMPTS[0], 20, stop_token_ids=[tok])])["st"]
    assert got.finish_reason == "stop" and got.token_ids == full.token_ids[:first + 1]


# ---- failures stay with their request ----------------------------------------------------------

def test_fault_hook_fails_only_that_request(engine):
    reqs = lambda: [gen(f"r{i}", p, 10) for i, p in enumerate(PROMPTS)]  # noqa: E731
    ref = run_requests(engine, reqs())

    def hook(seq):
        if seq.request_id == "r2" and seq.num_generated_tokens == 3:
            raise RuntimeError("injected fault")

    engine.fault_hook = hook
    done = run_requests(engine, reqs())
    engine.fault_hook = None
    assert done["r2"].finish_reason == "error" and "injected fault" in done["r2"].error
    assert len(done["r2"].token_ids) == 3
    for rid in ("r0", "r1", "r3", "r4"):
        assert done[rid].finish_reason == "length" and same(done[rid], ref[rid]), rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert not engine.has_work()


def test_nan_row_fails_only_that_request(engine):
    """One NaN in one sampling row (not at its maximum) fails that request alone: the runner's
    step-wide row checks must find it."""
    reqs = lambda: [gen(f"r{i}", p, 8) for i, p in enumerate(PROMPTS)]  # noqa: E731
    ref = run_requests(engine, reqs())
    real_execute, real_logprobs = engine.runner.execute, engine.runner.model.logprobs
    target: list[int] = []  # r1's row among this step's sampling rows, while armed

    def execute(sched):
        target.clear()
        sampling = [it.seq for it in sched.scheduled if it.seq.num_computed_tokens + it.num_new_tokens == it.seq.num_tokens]
        for i, seq in enumerate(sampling):
            if seq.request_id == "r1" and seq.num_generated_tokens == 2:
                target.append(i)
        return real_execute(sched)

    def logprobs(hidden, out=None):
        out = real_logprobs(hidden, out=out)
        if target:
            row = out[target[0]]
            row[(int(row.argmax()) + 1) % row.shape[0]] = float("nan")
        return out

    engine.runner.execute, engine.runner.model.logprobs = execute, logprobs
    try:
        done = run_requests(engine, reqs())
    finally:
        engine.runner.execute = real_execute
        del engine.runner.model.logprobs  # the class's method again
    assert done["r1"].finish_reason == "error" and "NaN" in done["r1"].error
    for rid in ("r0", "r2", "r3", "r4"):
        assert same(done[rid], ref[rid]), rid
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_frees_and_others_continue(engine):
    ref = run_requests(engine, [gen(f"r{i}", p, 10) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        engine.add_request(gen(f"r{i}", p, 10))
    got: dict[str, Completed] = {f"r{i}": Completed() for i in range(len(PROMPTS))}
    step = 0
    while engine.has_work():
        if step == 3:
            out = engine.abort_request("r3")
            assert out is not None and out.finished and out.finish_reason == "abort"
            got["r3"].add(out)
            assert engine.abort_request("r3") is None
        for o in engine.step()[0]:
            got[o.request_id].add(o)
        step += 1
    assert got["r3"].finish_reason == "abort" and len(got["r3"].token_ids) < 10
    for rid in ("r0", "r1", "r2", "r4"):
        assert same(got[rid], ref[rid])
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ---- AsyncEngine ---------------------------------------------------------------------------------

async def collect(channel) -> list:
    return [o async for ev in channel for o in ev.outputs]


def test_async_engine_streams_match_offline(engine):
    ref = run_requests(engine, [gen(f"r{i}", p, 10) for i, p in enumerate(PROMPTS)])

    async def main():
        ae = AsyncEngine(engine, max_queue=8)
        ae.start()
        try:
            streams = [ae.submit(gen(f"r{i}", p, 10)) for i, p in enumerate(PROMPTS)]
            results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 60)
            assert ae.num_in_flight == 0
            return results
        finally:
            ae.shutdown()

    for i, outs in enumerate(asyncio.run(main())):
        c = Completed()
        for o in outs:
            c.add(o)
        assert same(c, ref[f"r{i}"]) and c.finish_reason == "length"


def test_async_engine_warns_when_the_loop_is_not_the_building_thread(loaded, caplog):
    """The server builds the engine on its ModelThread; a loop elsewhere is slow, and says so."""
    async def run(ae: AsyncEngine) -> None:
        ae.start()
        try:
            await asyncio.wait_for(collect(ae.submit(gen("w", [1, 2, 3], 2))), 60)
        finally:
            ae.shutdown()

    with caplog.at_level("INFO", logger="steadyserve.engine"):
        asyncio.run(run(AsyncEngine(make_engine(loaded), max_queue=2)))  # built here, looped on a new thread
    assert SECOND_MODEL_THREAD in caplog.text
    caplog.clear()
    mt = ModelThread()
    with caplog.at_level("INFO", logger="steadyserve.engine"):
        asyncio.run(run(AsyncEngine(mt.call(lambda: make_engine(loaded)), max_queue=2, model_thread=mt)))
    assert "engine loop started" in caplog.text and SECOND_MODEL_THREAD not in caplog.text
    assert not mt.is_alive()  # shutdown ended the model thread


def test_async_engine_refuses_beyond_capacity_and_too_long(engine):
    async def main():
        ae = AsyncEngine(engine, max_queue=0)
        ae.max_num_seqs = 2  # capacity 2, engine loop not started: nothing finishes
        s1 = ae.submit(gen("a", [1, 2], 4))
        ae.submit(gen("b", [1, 2], 4))
        with pytest.raises(Refused) as e:
            ae.submit(gen("c", [1, 2], 4))
        assert e.value.reason == "overloaded" and e.value.retry_after
        with pytest.raises(Refused) as e:  # a too-long request is its builder's to refuse (ModelLimits)...
            engine.limits.check(gen("d", [1] * engine.max_model_len, 4))
        assert e.value.reason == "too_long"
        with pytest.raises(Refused) as e:
            ae.submit(gen("a", [1, 2], 4))
        assert e.value.reason in ("invalid", "overloaded")
        del s1

    asyncio.run(main())


def test_async_engine_reports_death_and_fails_streams(engine):
    deaths = []

    async def main():
        ae = AsyncEngine(engine, max_queue=8)
        ae.death_observers.append(deaths.append)
        calls = {"n": 0}
        real_step = engine.step

        def step():
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("boom in the loop")
            return real_step()

        engine.step = step
        try:
            ae.start()
            streams = [ae.submit(gen(f"r{i}", p, 20)) for i, p in enumerate(PROMPTS)]
            results = await asyncio.wait_for(asyncio.gather(*(collect(s) for s in streams)), 30)  # never hangs
            for _ in range(100):
                if not ae.alive:
                    break
                await asyncio.sleep(0.05)
            assert not ae.alive and "boom in the loop" in ae.dead
            with pytest.raises(Refused) as e:
                ae.submit(gen("late", [1], 2))
            assert e.value.reason == "dead"
            return results
        finally:
            del engine.step
            ae.shutdown()

    results = asyncio.run(main())
    for outs in results:
        assert outs[-1].finished and outs[-1].finish_reason == "error"
        assert "engine failed" in outs[-1].error and "boom in the loop" in outs[-1].error
    assert deaths and "boom in the loop" in deaths[0]
