"""Which attention kernel runs is a choice the fingerprint names: native C++ or the Python fallback.

The Python fallback runs on the host numerics path only (portable bits need every kernel native), so a
model asked for `--attention python` computes on the host path, and its fingerprint says that too."""

from __future__ import annotations

import contextlib
import json
import urllib.request

import pytest

from steadyserve.config import ConfigError, EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.selftest import run_selftest
from steadyserve.models import load_model
from steadyserve.models.loader import LoadError
from steadyserve.numerics import DEFAULT_NATIVE_PATH
from steadyserve.testing.server import start_servers


@pytest.mark.parametrize("attention, kernel_id", [("auto", "nat1"), ("python", "py")])
def test_each_kernel_passes_the_selftest_and_is_named(tiny_model: str, attention: str, kernel_id: str) -> None:
    loaded = load_model(tiny_model, attention=attention)
    assert loaded.model.kernel_id == kernel_id
    st = run_selftest(LLMEngine(loaded, EngineConfig(kv_cache_memory=8 * 1024**2, threads=2)))
    assert st.passed, st.detail
    assert f"attention {kernel_id}" in st.detail


def test_kernels_agree_within_tolerance_and_each_repeats_its_bits(tiny_model: str) -> None:
    """What is promised of two kernels: each gives a request the same bits every time (alone or batched:
    test_engine_invariance), and they agree to float32 rounding. Their bits are not promised equal (nor
    unequal): the fingerprint names the kernel, so no client compares bits across the two."""
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams

    outs = {}
    for attention in ("auto", "python"):
        # float32 activations on both sides (the native kernel on the portable path; Python attention runs host)
        loaded = load_model(tiny_model, attention=attention, numerics="portable" if attention == "auto" else "auto")
        engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=8 * 1024**2))
        runs = [run_requests(engine, [Request(f"r{i}", list(range(3, 60)), SamplingParams(
            max_tokens=0, prompt_logprobs=0))])[f"r{i}"].prompt_logprob_values for i in range(2)]
        assert runs[0] == runs[1], attention
        outs[attention] = runs[0]
    assert len(outs["auto"]) == len(outs["python"]) == 56  # every prompt token but the first
    diffs = [abs(a - b) for a, b in zip(outs["auto"], outs["python"])]
    assert max(diffs) < 1e-4, max(diffs)


def test_native_kernel_refuses_a_block_size_it_cannot_run(tiny_model: str) -> None:
    with pytest.raises(LoadError, match="--attention native"):
        load_model(tiny_model, attention="native", block_size=24)
    loaded = load_model(tiny_model, attention="native")
    with pytest.raises(ConfigError, match="multiple of 16"):
        LLMEngine(loaded, EngineConfig(kv_cache_memory=8 * 1024**2, block_size=24))
    # auto falls back to Python attention for such a block size (host numerics), and says so in the kernel id.
    fallback = load_model(tiny_model, block_size=24, numerics="host")
    assert fallback.model.kernel_id == "py"
    with pytest.raises(LoadError, match="--attention native"):  # portable needs the native kernel
        load_model(tiny_model, block_size=24)


def test_served_fingerprint_names_the_kernel(tiny_model: str) -> None:
    fps = {}
    kinds = ("auto", "python")
    with contextlib.ExitStack() as stack:  # the two servers start side by side, and both are stopped
        servers = [stack.enter_context(s) for s in
                   start_servers(*(((tiny_model, "--attention", attention), {}) for attention in kinds))]
        for attention, s in zip(kinds, servers):
            with urllib.request.urlopen(s.http_url + "/readyz", timeout=10) as r:
                fps[attention] = json.load(r)["system_fingerprint"]
    auto, python = fps["auto"].split("-"), fps["python"].split("-")
    assert auto[4] == "nat1" and python[4] == "py" and auto[-1] == python[-1] == "bi", fps
    # the default native path's id (i: int8, p: portable); Python attention runs the host path
    assert auto[3][0] == DEFAULT_NATIVE_PATH[0] and python[3].startswith("h"), fps
    assert auto[:3] == python[:3]


def test_without_native_kernels_auto_runs_the_host_path_and_says_so(tiny_model: str, monkeypatch) -> None:
    """Where the extension cannot be built (no compiler), the default numerics fall back to the host path, the
    fingerprint's numerics id and kernel say so, and asking for portable numerics explicitly is refused."""
    from steadyserve.kernels.build import KernelStatus
    from steadyserve.models import loader

    missing = KernelStatus(False, "py", "native kernels unavailable, using Python attention: no compiler")
    monkeypatch.setattr(loader.kernels, "load", lambda: missing)
    loaded = load_model(tiny_model)
    assert loaded.numerics is not None and loaded.numerics.numerics_id.startswith("h")
    assert loaded.model.kernel_id == "py" and not loaded.model.native
    st = run_selftest(LLMEngine(loaded, EngineConfig(kv_cache_memory=8 * 1024**2)))
    assert st.passed, st.detail
    with pytest.raises(LoadError, match="--numerics portable: portable numerics need the native kernels: .*no compiler"):
        load_model(tiny_model, numerics="portable")
