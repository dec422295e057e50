"""The int8 numerics path (`--numerics int8`) keeps every promise the portable path makes, bitwise.

A GGUF of SmolLM2-135M's layer widths with Q4_1 matrices (the default model's format) runs through the
engine with int8 activations: a request's logprobs are the same alone or in any batch, in prefill or in
decode, and with 1 or 2 threads; the TEST-ONLY drift is caught by the same checks (they have teeth).
The fingerprint names the path: its own numerics id, not the portable one's.
"""

from __future__ import annotations

import dataclasses
import math

import httpx
import pytest
import torch
from test_engine_invariance import engine_for, expect, greedy, probe_vs_batches, same, score_vs_generate

from steadyserve.engine.offline import run_requests
from steadyserve.kernel_versions import KERNELS
from steadyserve.engine.selftest import run_selftest
from steadyserve.kernels import load
from steadyserve.models.loader import load_model
from steadyserve.models.transformer import HEAD_MARGIN_LOGPROB, HEAD_MAX_PANELS, head_margin
from steadyserve.receipts.format import parse
from steadyserve.receipts.replay import VERIFIED, verify
from steadyserve.testing.drift import install_batch_drift
from steadyserve.testing.server import start_servers
from steadyserve.testing.tiny_gguf import write_tiny_gguf

pytestmark = pytest.mark.skipif(not load().available, reason="native kernels not built")


@pytest.fixture(scope="module")
def sw_q4_1(smolwidth_model, tmp_path_factory) -> str:
    return str(write_tiny_gguf(smolwidth_model, tmp_path_factory.mktemp("int8") / "smolwidth-q4_1.gguf", quant="Q4_1"))


@pytest.fixture(scope="module")
def int8(sw_q4_1):
    loaded = load_model(sw_q4_1, numerics="int8")
    engine = engine_for(loaded)
    result = run_selftest(engine)
    assert result.passed and f"int8 matmul {KERNELS['int8']}" in result.detail, result.detail
    return engine


@pytest.fixture(params=["invariant", "broken"])
def mode(request, int8):
    if request.param == "invariant":
        yield request.param, int8
        return
    restore = install_batch_drift(int8)
    try:
        yield request.param, int8
    finally:
        restore()


def test_the_matrices_run_packed_and_the_fingerprint_names_the_path(int8, sw_q4_1):
    model = int8.loaded.model
    for lw in model.layers:
        assert all(p.packed for m in (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down) for p in m.parts)
    assert all(p.packed for p in model.lm_head.parts)
    # the head, and no other matrix, adds each row's rounding residual as a second int8 row (q8.h) near its top
    assert model.lm_head.residual_margin == head_margin(model.args) == HEAD_MARGIN_LOGPROB
    assert model.lm_head.residual_panels == HEAD_MAX_PANELS
    assert all(m.residual_margin is None for name, m in model.int8_matrices().items() if name != "lm_head")
    # the margin is in log-probabilities: raw logits divided before the log-softmax (Granite) widen it; a soft cap
    # (Gemma 2), whose tanh narrows gaps, corrects every panel
    assert head_margin(dataclasses.replace(model.args, logits_divisor=8.0)) == 8.0 * HEAD_MARGIN_LOGPROB
    assert head_margin(dataclasses.replace(model.args, final_softcap=30.0)) == math.inf
    assert not any(p.packed for p in model.embed.parts)  # lookups read the GGUF's rows
    assert int8.loaded.numerics.mode == "int8" and int8.loaded.numerics.numerics_id.startswith("i")
    portable = load_model(sw_q4_1, numerics="portable")
    assert portable.numerics.numerics_id.startswith("p")
    assert portable.numerics.numerics_id != int8.loaded.numerics.numerics_id
    assert KERNELS["int8"] in int8.loaded.numerics.facts["kernels"]


# The servers of the two tests below, one per (numerics, KV cache) configuration, started once for both.
CACHE_CONFIGS = {"int8": ("--numerics", "int8"), "int8 fp32": ("--numerics", "int8", "--kv-cache-dtype", "fp32"),
                 "portable": ("--numerics", "portable"),
                 "portable bf16": ("--numerics", "portable", "--kv-cache-dtype", "bf16")}


@pytest.fixture(scope="module")
def cache_servers(sw_q4_1):
    servers = start_servers(*(((sw_q4_1, *args, "--kv-cache-memory", "32MiB"), {"threads": 1})
                              for args in CACHE_CONFIGS.values()))
    try:
        yield dict(zip(CACHE_CONFIGS, servers))
    finally:
        for srv in servers:
            srv.__exit__(None, None, None)


def test_its_cache_is_f16_by_default_and_the_served_fingerprint_names_it(int8, sw_q4_1, cache_servers):
    """`--kv-cache-dtype auto` is f16 on this path (the portable path keeps float32), and a real server's
    fingerprint says so (`kvh1`), so int8 responses from an f16 and a float32 cache are never confused."""
    assert int8.kv.fmt == "f16"
    assert engine_for(load_model(sw_q4_1, numerics="portable")).kv.fmt == "fp32"
    assert engine_for(int8.loaded, kv_cache_dtype="fp32").kv.fmt == "fp32"  # an explicit setting wins
    fingerprints = {}
    for name in ("int8", "int8 fp32", "portable"):
        r = httpx.post(cache_servers[name].http_url + "/v1/completions", json={"prompt": "a b", "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200, r.text
        fingerprints[name] = r.headers["x-steadyserve-fingerprint"]
    f16, fp32, portable = fingerprints.values()
    assert f16.endswith("-kvh1-bi") and "-kv" not in fp32 and "-kv" not in portable, fingerprints
    assert f16.replace("-kvh1", "") == fp32, fingerprints  # the same path otherwise


def test_receipts_replay_on_the_cache_format_they_were_made_with(sw_q4_1, cache_servers):
    """`verify` rebuilds the cache a receipt's fingerprint names, not the path's default: int8 receipts of an f16
    (default) and a float32 cache, and portable ones of a bf16 cache, all verify bitwise in one call."""
    receipts = []
    for name in ("int8", "int8 fp32", "portable bf16"):
        body = {"prompt": "one two three", "max_tokens": 6, "temperature": 0, "logprobs": 1, "receipt": True}
        r = httpx.post(cache_servers[name].http_url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        receipts.append((name, parse(r.json()["choices"][0]["receipt"])))
    verdicts = verify(receipts, model=sw_q4_1, threads=1)
    assert [v.status for v in verdicts] == [VERIFIED] * 3, [(v.source, v.detail) for v in verdicts]


def test_probe_alone_vs_inside_batches(mode):
    name, engine = mode
    expect(name, probe_vs_batches(engine, [2, 7, 33], name=name))


def test_score_equals_generate(mode):
    name, engine = mode
    expect(name, score_vs_generate(engine, [(37, 9), (5, 30)], name=name))


def test_thread_count_changes_no_bit(int8):
    prompt = list(range(3, 60, 2))
    threads = torch.get_num_threads()
    try:
        runs = []
        for n in (1, 2):
            torch.set_num_threads(n)
            runs.append(run_requests(int8, [greedy("t", prompt, 12)])["t"])
        assert same(runs[0], runs[1])
        assert len(runs[0].logprob_values) == 12 and len(runs[0].prompt_logprob_values) == len(prompt) - 1
    finally:
        torch.set_num_threads(threads)
