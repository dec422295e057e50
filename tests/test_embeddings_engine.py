"""Embeddings in the engine: where the pooling comes from, parity with transformers, and bitwise invariance.

* pooling: a GGUF file's `<arch>.pooling_type`, a sentence-transformers directory's modules.json and Pooling
  config (and its Normalize module), else `--pooling` / last; metadata asking for a pooling we do not compute is
  refused at load unless --pooling overrides it.
* parity: the engine's vectors (chunked prefill, several prompts per step) against transformers' base model
  (`last_hidden_state`, after the final norm) pooled as sentence-transformers pools it (a right-padded batch with
  its attention mask: the last real token, or the masked mean; then F.normalize), on tiny random Qwen3 and
  Llama models, last and mean, within 1e-5.
* invariance: the same prompt's vector is bitwise the same alone, in a batch of 64, with other chunk sizes,
  and beside decoding streams; a TEST-ONLY drifting engine (steadyserve.testing.drift) is caught.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.kv_cache import bytes_per_block
from steadyserve.engine.offline import run_requests
from steadyserve.engine.pooler import finish_vector
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import LoadError, LoadedModel, load_model
from steadyserve.models.pooling import gguf_pooling, resolve_pooling
from steadyserve.testing import build_tiny_model
from steadyserve.testing.drift import install_batch_drift

TOL = 1e-5
VOCAB = 300  # below the tiny tokenizer's 384


def prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in lengths]


def engine(loaded: LoadedModel, budget: int = 512, prefix_caching: bool = True) -> LLMEngine:
    return LLMEngine(loaded, EngineConfig(kv_cache_memory=16 * 1024**2, threads=1, max_num_batched_tokens=budget,
                                          max_num_seqs=64, prefix_caching=prefix_caching))


def embed(eng: LLMEngine, ps: list[list[int]], others: list[Request] = (), arrivals=None) -> list[list[float]]:
    reqs = [Request(f"e{i}", p, SamplingParams(max_tokens=0), embed=True) for i, p in enumerate(ps)]
    done = run_requests(eng, [*others, *reqs], arrivals)
    out = [done[r.request_id] for r in reqs]
    assert all(o.finish_reason == "length" and o.embedding is not None for o in out), out
    return [finish_vector(o.embedding, None, eng.loaded.pooling.normalize) for o in out]  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def qwen3_dir(models_dir: Path) -> str:
    return str(build_tiny_model(models_dir / "tiny-qwen3-emb", arch="qwen3"))


def st_dir(src: str, dst: Path, mode_key: str, normalize: bool) -> Path:
    """A copy of a tiny model dressed as a sentence-transformers directory (modules.json, 1_Pooling)."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir(exist_ok=True)
    keys = ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens", "pooling_mode_lasttoken")
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                               **{k: k == mode_key for k in keys}}))
    return dst


# ---- where the pooling comes from -------------------------------------------------------------------------

def test_pooling_from_sentence_transformers_config(tiny_model: str, tmp_path: Path):
    d = st_dir(tiny_model, tmp_path / "st-mean", "pooling_mode_mean_tokens", normalize=False)
    p = resolve_pooling("auto", d, d)
    assert (p.mode, p.normalize) == ("mean", False) and "1_Pooling" in p.source, p
    d2 = st_dir(tiny_model, tmp_path / "st-last", "pooling_mode_lasttoken", normalize=True)
    assert (resolve_pooling("auto", d2, d2).mode, resolve_pooling("auto", d2, d2).normalize) == ("last", True)
    assert resolve_pooling("mean", d2, d2).mode == "mean"  # the flag overrides the metadata
    plain = resolve_pooling("auto", Path(tiny_model), Path(tiny_model))
    assert (plain.mode, plain.normalize) == ("last", True) and plain.source.startswith("default"), plain
    cls = st_dir(tiny_model, tmp_path / "st-cls", "pooling_mode_cls_token", normalize=True)
    with pytest.raises(LoadError, match="cls pooling.*--pooling"):
        load_model(str(cls))
    assert load_model(str(cls), pooling="last").pooling.mode == "last"


def test_pooling_from_gguf_metadata(tiny_model: str, tmp_path: Path):
    from steadyserve.testing.tiny_gguf import write_tiny_gguf

    assert gguf_pooling({"general.architecture": "qwen3", "qwen3.pooling_type": 3}).mode == "last"
    assert gguf_pooling({"general.architecture": "llama", "llama.pooling_type": 0}).mode is None  # none: unstated
    g = write_tiny_gguf(tiny_model, tmp_path / "mean.gguf", quant="F32", pooling_type=1)
    loaded = load_model(str(g))
    assert loaded.pooling.mode == "mean" and "llama.pooling_type=1" in loaded.pooling.source, loaded.pooling
    # The file's F32 weights are the HF model's: its mean-pooled vectors are the HF directory's served --pooling mean.
    ps = prompts(3, [9, 40])
    from_dir = embed(engine(load_model(tiny_model, pooling="mean")), ps)
    from_gguf = embed(engine(loaded), ps)
    assert max(abs(a - b) for u, v in zip(from_dir, from_gguf) for a, b in zip(u, v)) < TOL


# ---- parity with transformers -----------------------------------------------------------------------------

@torch.inference_mode()
def st_reference(model_dir: str, ps: list[list[int]], mode: str) -> list[torch.Tensor]:
    """sentence-transformers' pooling of transformers' base model: a right-padded batch with its mask."""
    from transformers import AutoModel

    m = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    n = max(len(p) for p in ps)
    ids = torch.tensor([p + [0] * (n - len(p)) for p in ps])
    mask = torch.tensor([[1] * len(p) + [0] * (n - len(p)) for p in ps])
    h = m(input_ids=ids, attention_mask=mask).last_hidden_state  # (B, n, hidden)
    if mode == "mean":  # Pooling(pooling_mode_mean_tokens)
        m_ = mask.unsqueeze(-1).float()
        pooled = (h * m_).sum(1) / m_.sum(1).clamp(min=1e-9)
    else:  # Pooling(pooling_mode_lasttoken), right padding: the last position the mask keeps
        pooled = h[torch.arange(len(ps)), mask.sum(1) - 1]
    return list(torch.nn.functional.normalize(pooled, p=2, dim=1))  # Normalize()


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("mode", ["last", "mean"])
def test_parity_with_transformers(arch: str, mode: str, qwen3_dir: str, tiny_model: str):
    path = qwen3_dir if arch == "qwen3" else tiny_model
    ps = prompts(1, [1, 5, 33, 70, 130])  # 70 and 130 span several chunks of 32 and several KV blocks
    ours = embed(engine(load_model(path, pooling=mode, numerics="portable"), budget=32), ps)  # float32 parity
    ref = st_reference(path, ps, mode)
    worst = max((torch.tensor(v) - r).abs().max().item() for v, r in zip(ours, ref))
    print(f"\n{arch} {mode}: max |ours - transformers| = {worst:.2e}")
    assert worst < TOL


# ---- bitwise invariance -----------------------------------------------------------------------------------

PROBE = prompts(9, [45])[0]  # crosses a 32-token KV block


def invariance_cases(loaded: LoadedModel) -> dict[str, bool]:
    """{case: the probe's vector is bitwise its vector alone}."""
    alone = embed(engine(loaded), [PROBE])[0]
    batch = prompts(4, [random.Random(i).randrange(1, 90) for i in range(63)])
    in_64 = embed(engine(loaded), [*batch[:20], PROBE, *batch[20:]])[20]
    small_chunks = embed(engine(loaded, budget=16), [PROBE])[0]
    streams = [Request(f"g{i}", p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
               for i, p in enumerate(prompts(5, [7, 12, 30]))]
    eng = engine(loaded)
    reqs = {3: [Request("probe", PROBE, SamplingParams(max_tokens=0), embed=True)]}  # arrives while they decode
    done = run_requests(eng, streams, reqs)
    beside = finish_vector(done["probe"].embedding, None, loaded.pooling.normalize)  # type: ignore[arg-type]
    assert done["probe"].max_batch_seqs > 1, "the probe never shared a step with the streams"
    return {"in a batch of 64": in_64 == alone, "chunks of 16": small_chunks == alone,
            "beside decoding streams": beside == alone}


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_vectors_are_bitwise_invariant(tiny_model: str, mode: str):
    res = invariance_cases(load_model(tiny_model, pooling=mode))
    assert all(res.values()), res


def test_invariance_check_catches_a_drifting_engine(tiny_model: str, monkeypatch):
    """The same cases on an engine whose hidden rows shift with the step's token count (TEST-ONLY drift)."""
    real_engine = engine

    def drifting(*a, **kw):
        eng = real_engine(*a, **kw)
        install_batch_drift(eng)
        return eng

    monkeypatch.setitem(globals(), "engine", drifting)
    res = invariance_cases(load_model(tiny_model, pooling="mean"))
    print(f"\ndrifting engine: {res}")
    assert not any(res.values()), res


def test_last_pooling_uses_cached_prefixes_and_mean_pooling_does_not(tiny_model: str):
    """A prefix-cache hit leaves its rows uncomputed: last pooling takes the hit (only the last row counts) with
    the same bits, mean pooling needs every row and takes none."""
    shared = prompts(6, [70])[0]
    for mode in ("last", "mean"):
        loaded = load_model(tiny_model, pooling=mode)
        eng = engine(loaded)
        first = embed(eng, [shared])[0]
        before = eng.block_manager.num_hit_tokens
        again = embed(eng, [shared])[0]
        hits = eng.block_manager.num_hit_tokens - before
        assert again == first and again == embed(engine(loaded, prefix_caching=False), [shared])[0]
        assert (hits > 0) == (mode == "last"), (mode, hits)


@pytest.mark.parametrize("mode", ["last", "mean"])
def test_preempted_embeddings_give_the_same_bits(tiny_model: str, mode: str):
    """A KV cache too small for the batch preempts sequences mid-prompt; recomputed rows are the same bits and
    are folded once, so every vector equals its vector alone."""
    loaded = load_model(tiny_model, pooling=mode)
    ps = prompts(7, [300, 280, 310])  # 10 blocks each, of the 12
    alone = [embed(engine(loaded), [p])[0] for p in ps]
    per_block = bytes_per_block(loaded.args, 32, engine(loaded).kv.fmt)  # the default path's cache format
    small = LLMEngine(loaded, EngineConfig(kv_cache_memory=per_block * 12, threads=1, max_num_batched_tokens=64,
                                           prefix_caching=False))
    gen = [Request(f"g{i}", p, SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
           for i, p in enumerate(prompts(8, [20, 30]))]
    together = embed(small, ps, others=gen)
    assert small.scheduler.num_preemptions > 0, "nothing was preempted: the cache is too large for this test"
    assert together == alone
