"""How far each KV cache format's logprobs are from the float32 cache's: measured, not assumed (issue 44 item 4).

For each packaged model (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) and prompt length (64, 1k and the longest
asked for, by default the model's context capped by --max-len), the log-probability of every prompt token
given the ones before it, from steadyserve with --kv-cache-dtype fp32 (the reference), f16, bf16 and q8_0,
on the same numerics path (--numerics, portable by default): mean and max |Δ logprob| against fp32 per format.

With a llama.cpp build at hand (--llama-cpp DIR holding llama-server), the same for llama.cpp's own caches:
llama-server generates greedily after the prompt with -ctk/-ctv f32, f16 and q8_0 (flash attention on, which
its quantized V cache needs), and each cache's reported logprobs are compared with f32's over the tokens
where the greedy continuations still agree.

Writes benchmarks/results/kv_dtype_accuracy.json (one row per model and length) and prints each row.

    .venv/bin/python benchmarks/kv_dtype_accuracy.py [--lengths 64,1024,max] [--max-len 8192]
        [--models smollm2,gemma3-270m] [--formats f16,bf16,q8_0] [--llama-cpp /tmp/llama/bin]
    # a quick check: --lengths 64 --models smollm2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import torch
from peers import cpu_name

HERE = Path(__file__).parent
ROOT = HERE.parent
FORMATS = ("fp32", "f16", "bf16", "q8_0")
LLAMA_CACHES = ("f32", "f16", "q8_0")


def corpus() -> str:
    """Real English prose that ships with the repository: the documentation, in a fixed order."""
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def prompt_logprobs(loaded, kv_dtype: str, numerics: str, ids: list[int], threads: int) -> torch.Tensor:
    """(n-1,) log p(ids[i] | ids[:i]) with the KV cache stored as `kv_dtype`."""
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.kv_cache import bytes_per_block, kv_layout
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams

    # A block holds one group of layers (kv_layout.py): every group needs the prompt's blocks (Gemma 3: 6 groups).
    blocks = ((len(ids) + 31) // 32 + 2) * kv_layout(loaded.args).num_groups
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=blocks * bytes_per_block(loaded.args, 32, kv_dtype),
                                            threads=threads, numerics=numerics, kv_cache_dtype=kv_dtype,
                                            max_model_len=loaded.max_model_len, speculation="off"))
    done = run_requests(engine, [Request("s", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))])["s"]
    return torch.tensor(done.prompt_logprob_values, dtype=torch.float64)


def stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = (got.double() - ref.double()).abs()
    return {"mean_abs": float(d.mean()) if d.numel() else 0.0, "max_abs": float(d.max()) if d.numel() else 0.0,
            "n": int(d.numel())}


def llama_generated(server_bin: Path, gguf: str, ids: list[int], n: int, cache: str, ctx: int,
                    threads: int) -> tuple[list[int], list[float]]:
    """llama-server's greedy tokens after the prompt, and the logprob it reports for each, with its KV cache
    stored as `cache` (f32 | f16 | q8_0)."""
    import httpx

    from peers import free_port

    port = free_port()  # never a fixed port: a server left from an earlier run would answer for this one
    proc = subprocess.Popen([str(server_bin), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t",
                             str(threads), "-c", str(ctx), "-np", "1", "-fa", "on", "-ctk", cache, "-ctv", cache],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            if proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {proc.returncode} before it was ready")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=3600,
                       json={"prompt": ids, "n_predict": n, "temperature": 0, "n_probs": 1,
                             "post_sampling_probs": False, "cache_prompt": False, "ignore_eos": True}).json()
        probs = r["completion_probabilities"]
        return [p["id"] for p in probs], [p["logprob"] for p in probs]
    finally:
        proc.terminate()
        proc.wait(30)


def llama_rows(server_bin: Path, gguf: str, ids: list[int], n: int, threads: int) -> dict[str, dict]:
    """Each llama.cpp cache against its f32 cache, over the generated tokens both continuations share."""
    ctx = len(ids) + n + 16
    runs = {c: llama_generated(server_bin, gguf, ids, n, c, ctx, threads) for c in LLAMA_CACHES}
    ref_tokens, ref_lp = runs["f32"]
    out = {}
    for c in LLAMA_CACHES[1:]:
        tokens, lp = runs[c]
        same = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), min(len(tokens), n))
        out[c] = {**stats(torch.tensor(lp[:same]), torch.tensor(ref_lp[:same])), "tokens_before_divergence": same}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="64,1024,max", help="prompt lengths; max: the model's context, capped")
    p.add_argument("--max-len", type=int, default=8192, help="the cap on `max` (a 32k prompt takes long on a CPU)")
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--numerics", default="portable")
    p.add_argument("--formats", default=",".join(FORMATS[1:]), help="the formats measured against fp32")
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")))
    p.add_argument("--generate", type=int, default=32, help="tokens llama-server generates for its comparison")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=HERE / "results" / "kv_dtype_accuracy.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from steadyserve.models import known
    from steadyserve.models.loader import load_model

    text = corpus()
    results = []
    for name in a.models.split(","):
        path = str(known.resolve(name))
        probe = load_model(path, numerics=a.numerics)
        context = probe.max_model_len
        lengths = [min(context, a.max_len) - 1 if x == "max" else int(x) for x in a.lengths.split(",")]
        all_ids = probe.tokenizer(text)["input_ids"]
        while len(all_ids) < max(lengths):  # the docs are shorter than a long context: read them again
            all_ids = all_ids + all_ids
        loaded = load_model(path, numerics=a.numerics, max_model_len=max(lengths) + 8)
        for n in lengths:
            ids = all_ids[:n]
            t0 = time.perf_counter()
            formats = ["fp32", *a.formats.split(",")]
            lps = {fmt: prompt_logprobs(loaded, fmt, a.numerics, ids, a.threads) for fmt in formats}
            row = {"model": name, "prompt_tokens": len(ids), "numerics": a.numerics,
                   "seconds": round(time.perf_counter() - t0, 1)}
            row.update({fmt: stats(lps[fmt], lps["fp32"]) for fmt in formats[1:]})
            if (a.llama_cpp / "llama-server").exists():
                row["llama.cpp"] = llama_rows(a.llama_cpp / "llama-server", path, ids, a.generate, a.threads)
            print(json.dumps(row), flush=True)
            results.append(row)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(),
           "threads": a.threads, "reference": "steadyserve's fp32 KV cache, same numerics path and weights",
           "rows": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
