"""What the output layer and every sampling feature cost at a 128k-152k vocabulary, against one decode step.

Loads a GGUF (default: the Llama-3.1-8B-shape Q4_K_M that deployed_shapes_gguf.py makes), runs `--batch` greedy
streams through the engine and times its decode steps with every sequence in them (the step the sampling
features are measured against). The (batch, V) log-probability rows and hidden states of the last step are kept,
and on them, as the engine runs them for a batch of that size, are timed: the LM head (matrix and log-softmax),
the runner's row-wise argmax and NaN check, sample() greedy, with a temperature, with top-p and with top-k + top-p
(with the former torch.sort nucleus beside the current one: before and after), the logits processors
(repetition, frequency and presence penalties over a 1,000-token history, 20 logit_bias entries), logprobs with 5
and 20 alternatives, and constrained decoding (llguidance's mask and advance, one matcher per stream, inside a
JSON string). Each figure is the median of `--repeat` runs, in ms per step and as a share of the step.

    python benchmarks/sampler_profile.py [--model PATH.gguf] [--batch 16] [--steps 6] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

from peers import cpu_name

DEFAULT = Path.home() / ".cache" / "steadyserve" / "bench-models" / "llama3.1-8b-shape-Q4_K_M.gguf"
SCHEMA = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
PENALTIES = dict(repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5)


def timed(fn, repeat: int) -> tuple[float, float]:
    """Median seconds of fn() over `repeat` runs, after one unmeasured run: wall clock, and the calling thread's
    CPU time (what the engine thread spends, whatever else the machine runs; the sampler uses that thread alone)."""
    fn()
    wall, cpu = [], []
    for _ in range(repeat):
        t0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return statistics.median(wall), statistics.median(cpu)


def step_rows(model: str, batch: int, steps: int, threads: int, prompt: int):
    """(mean decode step seconds, load seconds, the last step's (batch, V) rows and (batch, hidden) states, the
    loaded model)."""
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models.loader import load_model

    t0 = time.monotonic()
    lm = load_model(model)
    load_s = time.monotonic() - t0
    eng = LLMEngine(lm, EngineConfig(kv_cache_memory=1024**3, threads=threads, max_num_seqs=batch,
                                     speculation="off"))
    kept = {}
    logprobs = eng.runner._logprobs

    def keep(hidden, rows):  # the step's sampled rows: their hidden states and log-probabilities
        out = logprobs(hidden, rows)
        kept.update(hidden=hidden[torch.tensor(rows)].clone(), rows=out.clone())
        return out

    eng.runner._logprobs = keep
    rng = random.Random(0)
    for i in range(batch):
        eng.add_request(Request(str(i), [rng.randrange(100, 20000) for _ in range(prompt)],
                                SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)))
    durations, cpu = [], []  # wall seconds, and the process's CPU seconds (every thread) per step
    while eng.has_work() and len(durations) < steps + 2:
        c0 = time.process_time()
        _, s = eng.step()
        if s.num_tokens == s.num_seqs == batch:
            durations.append(s.duration)
            cpu.append(time.process_time() - c0)
    if len(durations) < steps + 2:
        sys.exit(f"only {len(durations)} steps ran all {batch} sequences at once")
    return (statistics.mean(durations[2:]), statistics.mean(cpu[2:])), load_s, kept["rows"], kept["hidden"], lm


def profile(lm, rows: torch.Tensor, hidden: torch.Tensor, repeat: int) -> list[tuple[str, tuple[float, float]]]:
    """(what, (wall, thread CPU) seconds per step for all rows)."""
    import numpy as np

    from steadyserve.engine import sampler
    from steadyserve.engine.sampler import make_generator, process_row, sample, token_logprob
    from steadyserve.engine.sequence import SamplingParams
    from steadyserve.engine.structured import Grammars, json_schema_grammar

    model, n, vocab = lm.model, rows.shape[0], rows.shape[1]
    out: list[tuple[str, tuple[float, float]]] = []
    buf = torch.empty_like(rows)
    out.append(("LM head: int8 matrix (for scale; part of the step)",
                timed(lambda: model.lm_head(hidden, out=buf), repeat)))
    both, copy = (timed(lambda: torch.ops.steadyserve.qlog_softmax_(buf.copy_(rows), -1), repeat),
                  timed(lambda: buf.copy_(rows), repeat))
    out.append(("LM head: log-softmax", (both[0] - copy[0], both[1] - copy[1])))
    out.append(("row-wise argmax + NaN check (every step)", timed(lambda: np.isnan(rows.numpy()[
        np.arange(n), torch.ops.steadyserve.qargmax(rows, -1).numpy()]), repeat)))
    gens = [make_generator(i, torch.device("cpu")) for i in range(n)]
    argmax = torch.ops.steadyserve.qargmax(rows, -1).tolist()

    def sampling(p: SamplingParams):
        return lambda: [sample(rows[i], p, gens[i], argmax[i], False) for i in range(n)]

    out.append(("sample: greedy", timed(sampling(SamplingParams(temperature=0)), repeat)))
    out.append(("sample: temperature 0.8", timed(sampling(SamplingParams(temperature=0.8)), repeat)))
    for label, p in (("top-p 0.95", SamplingParams(temperature=0.8, top_p=0.95)),
                     ("top-k 50 + top-p 0.9", SamplingParams(temperature=0.8, top_k=50, top_p=0.9))):
        by_order, fallbacks = sampler.nucleus_by_order, []
        sampler.nucleus_by_order = lambda *a: fallbacks.append(1) or by_order(*a)  # rows with a tie at the boundary
        try:
            sampling(p)()
        finally:
            sampler.nucleus_by_order = by_order
        out.append((f"sample: temperature 0.8, {label} (rows with a boundary tie: {len(fallbacks)} of {n})",
                    (0.0, 0.0)))
        out.append((f"sample: temperature 0.8, {label}", timed(sampling(p), repeat)))
        current = sampler.nucleus
        sampler.nucleus = sampler.nucleus_by_order  # the former code, for the before figure
        try:
            out.append((f"sample: temperature 0.8, {label} (before: torch.sort)", timed(sampling(p), repeat)))
        finally:
            sampler.nucleus = current
    history = [random.Random(i).randrange(vocab) for i in range(1000)]
    pp = SamplingParams(temperature=0.8, logit_bias={i * 997: 2.0 for i in range(20)}, **PENALTIES)
    out.append(("penalties + 20 logit_bias (process_row)",
                timed(lambda: [process_row(rows[i], pp, history, 500, {2}) for i in range(n)], repeat)))
    for k in (5, 20):
        out.append((f"logprobs: chosen token + top {k}", timed(lambda: [token_logprob(rows[i], argmax[i], k)
                                                                          for i in range(n)], repeat)))
    grammars = Grammars(lm.tokenizer, vocab)
    t0 = time.perf_counter()
    grammars.tokenizer  # built once per model (startup), not per step: reported apart
    once = time.perf_counter() - t0
    out.append(("constrained: llguidance tokenizer (once per model, not per step)", (once, once)))
    grammar = json_schema_grammar(SCHEMA)
    matchers = [grammars.matcher(grammar) for _ in range(n)]
    prefix = lm.tokenizer.encode('{"text":"', add_special_tokens=False)
    for m in matchers:
        for t in prefix:
            m.advance(t)
    work = [rows[i].clone() for i in range(n)]

    def constrained():  # mask, pick (the masked argmax: a token the grammar allows), advance
        for i, m in enumerate(matchers):
            work[i].copy_(rows[i])
            m.mask_(work[i])
            m.advance(int(torch.argmax(work[i])))

    out.append(("constrained: JSON string, mask + advance", timed(constrained, repeat)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=7)
    p.add_argument("--shape", default="Llama-3.1-8B shape (random weights)", help="what the JSON calls the model")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--save-rows", type=Path, default=None, help="torch.save the step's (batch, V) rows here")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    load_before = os.getloadavg()
    (step, step_cpu), load_s, rows, hidden, lm = step_rows(str(a.model), a.batch, a.steps, a.threads, a.prompt)
    if a.save_rows:
        torch.save(rows, a.save_rows)
    parts = profile(lm, rows, hidden, a.repeat)
    load_after = os.getloadavg()
    table = [{"what": what, "ms": w * 1e3, "percent_of_step": 100 * w / step, "thread_cpu_ms": c * 1e3}
             for what, (w, c) in parts]
    res = {"benchmark": "sampler_profile", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "cpu": cpu_name(), "threads": a.threads, "gguf": a.model.name, "model_shape": a.shape,
           "vocab_size": lm.args.vocab_size, "numerics": lm.numerics.mode if lm.numerics else "auto",
           "batch": a.batch, "step_s": step, "step_sampling": "greedy (temperature 0), the step timed",
           # CPU seconds of all threads per step: on a machine shared with other work, the step's wall clock
           # includes waits for a descheduled thread; step_cpu_s / threads is what the step costs its cores.
           "step_cpu_s": step_cpu,
           "sampling_settings": {"temperature": 0.8, "top_p": [0.95, 0.9], "top_k": 50, **PENALTIES,
                                 "logit_bias_entries": 20, "penalty_history_tokens": 1000,
                                 "logprobs": [5, 20], "grammar": SCHEMA},
           "loadavg_before": load_before, "loadavg_after": load_after, "model_load_s": load_s,
           "command": " ".join(sys.argv), "rows": table}
    print(f"{res['cpu']}, {a.threads} threads, {a.model.name} (V={res['vocab_size']}), c={a.batch} decode step "
          f"{step * 1e3:.1f} ms ({step_cpu * 1e3:.1f} CPU ms); load average {load_before[0]:.1f} -> "
          f"{load_after[0]:.1f}\n")
    print("| what | ms per step | % of step | engine-thread CPU ms |\n|---|---|---|---|")
    for r in table:
        print(f"| {r['what']} | {r['ms']:.2f} | {r['percent_of_step']:.2f} | {r['thread_cpu_ms']:.2f} |")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
