"""How far the int8 path's logprobs are from float32: measured on the packaged real models, not assumed.

For each model (SmolLM2-135M Q4_1, Gemma 3 270M Q4_K_M) and prompt length, the log-probability of every
prompt token given the ones before it, from:
  * transformers in float32 on the same dequantized weights (the reference: the host path's converted
    directory, gguf-py's dequantization);
  * steadyserve --numerics portable (float32 activations; expected within 1e-4 of the reference);
  * steadyserve --numerics int8;
  * llama.cpp's llama-server on the same GGUF, where a build is at hand (--llama-cpp): the logprob it
    reports for each token it generates greedily after a prompt, against the reference's on the same
    sequence; steadyserve's int8 path is scored on those very positions beside it.
Prints mean and max |Δ logprob| per source, and int8's minus llama.cpp's on the same positions (the paired
mean and its standard error), and writes benchmarks/results/int8_accuracy.json.

One window's comparison with llama.cpp is close to a coin toss where the two errors are level: its positions are
one greedy continuation, so they are not independent and the standard error understates the spread from one prompt
to the next. --windows W measures W disjoint windows of the corpus per length (the prompt of window i starts at
token i x length) and adds, per model and length, a summary across them: the mean of the paired means, its standard
error over the windows, and in how many windows int8's mean and max are at most llama.cpp's.

    .venv/bin/python benchmarks/int8_accuracy.py [--lengths 64,1024,4096] [--llama-cpp /tmp/llama/bin]
        [--int8-kv auto,f16] [--windows 1]
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


def corpus() -> str:
    """Real English prose that ships with the repository: the documentation, in a fixed order."""
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def reference_logprobs(hf_dir: Path, ids: list[int]) -> torch.Tensor:
    """(n-1,) float32 log p(ids[i] | ids[:i]) from transformers in float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), torch_dtype=torch.float32)
    model.eval()
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def steady_logprobs(path: str, numerics: str, ids: list[int], kv: str = "auto") -> torch.Tensor:
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models.loader import load_model

    loaded = load_model(path, numerics=numerics, max_model_len=max(len(ids) + 8, 2048))
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=2 * 1024**3, threads=torch.get_num_threads(),
                                            numerics=numerics, max_model_len=max(len(ids) + 8, 2048),
                                            kv_cache_dtype=kv))
    done = run_requests(engine, [Request("s", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))])["s"]
    return torch.tensor(done.prompt_logprob_values, dtype=torch.float32)


def llama_generated(server_bin: Path, gguf: str, prompt_ids: list[int], n: int) -> tuple[list[int], list[float]]:
    """llama-server's greedy tokens after the prompt and the logprob it reports for each."""
    import httpx

    port = 18931
    proc = subprocess.Popen([str(server_bin), "-m", gguf, "--host", "127.0.0.1", "--port", str(port), "-t", "2",
                             "-c", "4096", "-np", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(240):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        r = httpx.post(f"http://127.0.0.1:{port}/completion", timeout=600,
                       json={"prompt": prompt_ids, "n_predict": n, "temperature": 0, "n_probs": 1,
                             "post_sampling_probs": False, "cache_prompt": False, "ignore_eos": True}).json()
        probs = r["completion_probabilities"]
        return [p["id"] for p in probs], [p["logprob"] for p in probs]
    finally:
        proc.terminate()
        proc.wait(30)


def stats(got: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    d = (got.double() - ref.double()).abs()
    return {"mean_abs": float(d.mean()), "max_abs": float(d.max()), "n": int(d.numel())}


def paired(mine: torch.Tensor, theirs: torch.Tensor, ref: torch.Tensor) -> dict[str, float]:
    """|Δ| of ours minus |Δ| of theirs, position by position: its mean and standard error. Both errors move
    together with how hard a position is, so the paired difference says more than the two means apart."""
    d = (mine.double() - ref.double()).abs() - (theirs.double() - ref.double()).abs()
    return {"mean": float(d.mean()), "se": float(d.std() / d.numel() ** 0.5), "n": int(d.numel())}


def int8_label(kv: str) -> str:
    """The row name of the int8 path on --kv-cache-dtype kv: "int8" for the default (auto), else int8_kv_<dtype>."""
    return "int8" if kv == "auto" else f"int8_kv_{kv}"


def measure(a: argparse.Namespace, name: str, path: str, hf_dir: Path, ids: list[int]) -> dict:
    """One window: every source's error on the prompt, and llama.cpp's beside int8's on its generated positions."""
    ref = reference_logprobs(hf_dir, ids)
    row: dict = {"model": name, "prompt_tokens": len(ids)}
    kvs = {kv: int8_label(kv) for kv in a.int8_kv.split(",")}
    row["portable"] = stats(steady_logprobs(path, "portable", ids), ref)
    for kv, label in kvs.items():
        row[label] = stats(steady_logprobs(path, "int8", ids, kv), ref)
    if (a.llama_cpp / "llama-server").exists() and len(ids) <= 1024:
        gen, lp = llama_generated(a.llama_cpp / "llama-server", path, ids, a.generate)
        full = ids + gen
        ref_full = reference_logprobs(hf_dir, full)[-len(gen):]
        row["llama.cpp"] = stats(torch.tensor(lp), ref_full)
        for kv, label in kvs.items():
            mine = steady_logprobs(path, "int8", full, kv)[-len(gen):]
            row[f"{label}_on_llama_tokens"] = stats(mine, ref_full)
            row[f"{label}_minus_llama.cpp"] = paired(mine, torch.tensor(lp), ref_full)
    return row


def across_windows(name: str, n: int, rows: list[dict], int8_kv: str) -> dict:
    """Per int8 row: the paired means' mean and standard error over the windows, and the windows where int8's mean
    and max |Δ| on llama.cpp's positions are at most llama.cpp's."""
    out: dict = {"model": name, "prompt_tokens": n, "windows": len(rows)}
    for label in map(int8_label, int8_kv.split(",")):
        diffs = torch.tensor([r[f"{label}_minus_llama.cpp"]["mean"] for r in rows], dtype=torch.float64)
        mine = [r[f"{label}_on_llama_tokens"] for r in rows]
        theirs = [r["llama.cpp"] for r in rows]
        out[f"{label}_minus_llama.cpp_across_windows"] = {
            "mean": float(diffs.mean()), "se": float(diffs.std() / len(rows) ** 0.5),
            "windows_mean_at_most_llama": sum(m["mean_abs"] <= t["mean_abs"] for m, t in zip(mine, theirs)),
            "windows_max_at_most_llama": sum(m["max_abs"] <= t["max_abs"] for m, t in zip(mine, theirs))}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="64,1024,4096")
    p.add_argument("--models", default="smollm2,gemma3-270m")
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_BIN", "/tmp/llama/bin")))
    p.add_argument("--generate", type=int, default=32, help="tokens llama-server generates for its comparison")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--int8-kv", default="auto", help="the int8 rows' --kv-cache-dtype values, comma-separated "
                                                     "(auto: the row named int8; others: int8_kv_<dtype>)")
    p.add_argument("--windows", type=int, default=1, help="disjoint corpus windows per length (see above)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "int8_accuracy.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from steadyserve.models import known
    from steadyserve.models.loader import convert_gguf, load_model

    text = corpus()
    results = []
    for name in a.models.split(","):
        path = str(known.resolve(name))
        hf_dir, _ = convert_gguf(Path(path), with_weights=True)
        tok = load_model(path, numerics="portable").tokenizer
        all_ids = tok(text)["input_ids"]
        for n in (int(x) for x in a.lengths.split(",")):
            # checked before any window runs; one window takes what the corpus has, as it always did
            if a.windows > 1 and len(all_ids) < a.windows * n:
                raise SystemExit(f"the corpus has {len(all_ids)} tokens: too few for {a.windows} windows of {n}")
            window_rows = []
            for w in range(a.windows):
                ids = all_ids[w * n:(w + 1) * n]
                row = measure(a, name, path, hf_dir, ids)
                if a.windows > 1:
                    row["window"] = w
                print(json.dumps(row), flush=True)
                window_rows.append(row)
            results += window_rows
            if a.windows > 1 and "llama.cpp" in window_rows[0]:
                summary = across_windows(name, n, window_rows, a.int8_kv)
                print(json.dumps(summary), flush=True)
                results.append(summary)
    out = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "cpu": cpu_name(),
           "threads": a.threads, "reference": "transformers float32 on the GGUF's dequantized weights",
           "rows": results}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
