"""A burst of requests into the engine alone: how long the prefill takes and what a full decode step costs.

The shape of a served c=64 run without the sockets: `--requests` requests of `--prompt` random tokens (a range,
drawn per request from a fixed seed) arrive at once, each asking for `--output-tokens` greedy tokens with
`ignore_eos`. The engine runs them with the server's scheduling (`--max-num-batched-tokens` per step, chunked
prefill mixed with the decodes of the sequences already admitted) until all are done. Reported:
- `prefill_steps_s`: the time of the steps that still held prompt tokens (the last prompt's TTFT, about);
- `decode_step_ms`: the mean step with every request decoding (the served ITL at this concurrency, without the
  event loop and the client's share of the cores);
- `total_s`: the whole burst. One untimed burst first (warm-up), then `--rounds` timed ones, each with new prompts.

To compare two trees (a change and its parent), run it on each, alternating, on a quiet machine:

    .venv/bin/python benchmarks/engine_burst.py [--model PATH.gguf] [--requests 64] [--prompt 30-60]
        [--output-tokens 64] [--max-num-batched-tokens 512] [--rounds 2] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from peers import cpu_name

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model


def burst(eng: LLMEngine, rng: random.Random, tag: str, a: argparse.Namespace, vocab: int) -> dict:
    """One burst: every request added at once, the engine stepped until it has no work."""
    lo, hi = (int(v) for v in a.prompt.split("-"))
    for i in range(a.requests):
        ids = [rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))]
        eng.add_request(Request(f"{tag}-{i}", ids, SamplingParams(max_tokens=a.output_tokens, temperature=0,
                                                                  ignore_eos=True)))
    prefill, full, t0 = 0.0, [], time.perf_counter()
    while eng.has_work():
        _, s = eng.step()
        if s.num_tokens > s.num_seqs:  # a step that still held prompt tokens
            prefill += s.duration
        elif s.num_seqs == a.requests:
            full.append(s.duration)
    return {"total_s": time.perf_counter() - t0, "prefill_steps_s": prefill,
            "decode_step_ms": 1e3 * statistics.mean(full) if full else None, "full_decode_steps": len(full)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="", help="a GGUF path; the default model when empty")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--prompt", default="30-60", help="prompt tokens per request, LO-HI")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model(a.model)
    eng = LLMEngine(lm, EngineConfig(kv_cache_memory=1024**3, threads=a.threads, max_num_seqs=a.requests,
                                     speculation="off", max_num_batched_tokens=a.max_num_batched_tokens))
    rng = random.Random(0)
    vocab = min(lm.args.vocab_size, 40000)
    burst(eng, rng, "warm", a, vocab)
    rounds = [burst(eng, rng, f"r{r}", a, vocab) for r in range(a.rounds)]
    res = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M+00:00"), "cpu": cpu_name(),
           "threads": a.threads, "model": Path(a.model).name if a.model else "default",
           "fingerprint": str(eng.fingerprint(True)), "command": " ".join(["benchmarks/engine_burst.py", *sys.argv[1:]]),
           "requests": a.requests, "prompt": a.prompt, "output_tokens": a.output_tokens,
           "max_num_batched_tokens": a.max_num_batched_tokens, "rounds": rounds}
    print(json.dumps(res, indent=1))
    if a.out:
        a.out.write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
