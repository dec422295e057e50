"""Prefix caching on vs off, in one run, as ratios (engine level, SmolLM2-135M fp32, invariant path).

Three workloads, each run by two engines in this process (`prefix_caching` on and off, same model
weights, same KV budget), alternated round by round so that machine drift cannot pass for a gain:
  * shared system prompt: `--chats` concurrent chats, each a `--system-len`-token system prompt plus
    its own 16-64-token message, `--output-len` tokens out. The system prompt is sent once before the
    clock starts (a server's cache holds it from its first request on);
  * multi-turn: `--conversations` conversations of `--turns` turns, run concurrently; each turn resends
    the whole history (previous prompt + answer + a new 32-token message);
  * no reuse: `--chats` unrelated random prompts of `--system-len` tokens: the cost of caching when it
    never hits.
For each: TTFT p50 (arrival to first token) and output tok/s; ratios on/off.

    .venv/bin/python benchmarks/prefix_cache.py [--rounds 2] [--chats 64] [--system-len 512] [--workloads no_reuse]

Writes benchmarks/results/prefix_cache.json and prints a Markdown table.
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

from peers import cpu_name

HERE = Path(__file__).parent


def run_workload(engine, turns: list[list[list[int]]], output_len: int) -> dict:
    """Run conversations concurrently; a conversation's turn k+1 arrives when turn k finishes.

    turns[c][k]: the new tokens of conversation c's turn k; its prompt is the history so far (earlier
    prompts and answers) plus these. Returns TTFT p50 (s), output tok/s and prompt tokens taken from the cache.
    """
    from steadyserve.engine.sequence import Request, SamplingParams

    history = [[] for _ in turns]
    next_turn = [0] * len(turns)
    arrival: dict[str, float] = {}
    ttft: list[float] = []
    generated = cached = 0
    answer: dict[str, list[int]] = {}

    def submit(c: int) -> None:
        new = turns[c][next_turn[c]]
        history[c] = history[c] + new
        rid = f"c{c}-t{next_turn[c]}"
        next_turn[c] += 1
        arrival[rid] = time.perf_counter()
        answer[rid] = []
        engine.add_request(Request(rid, list(history[c]), SamplingParams(max_tokens=output_len, temperature=0,
                                                                        ignore_eos=True)))

    t0 = time.perf_counter()
    for c in range(len(turns)):
        submit(c)
    while engine.has_work():
        outputs, _ = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids and not answer[out.request_id]:
                ttft.append(now - arrival[out.request_id])
            answer[out.request_id] += out.new_token_ids
            generated += len(out.new_token_ids)
            if out.finished:
                cached += out.num_cached_tokens
                c = int(out.request_id[1:].split("-")[0])
                history[c] = history[c] + answer[out.request_id]
                if next_turn[c] < len(turns[c]):
                    submit(c)
    wall = time.perf_counter() - t0
    return {"ttft_p50_s": statistics.median(ttft), "output_tokens_per_s": generated / wall, "wall_s": wall,
            "cached_prompt_tokens": cached, "requests": len(ttft)}


def workloads(a: argparse.Namespace, vocab: int, rng: random.Random) -> dict:
    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(n)]

    system = toks(a.system_len)
    return {
        "shared_system_prompt": ([[system + toks(rng.randrange(16, 65))] for _ in range(a.chats)], system),
        "multi_turn": ([[toks(32) for _ in range(a.turns)] for _ in range(a.conversations)], None),
        "no_reuse": ([[toks(a.system_len)] for _ in range(a.chats)], None),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--chats", type=int, default=64)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--workloads", default="shared_system_prompt,multi_turn,no_reuse")
    a = p.parse_args()

    import torch

    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.selftest import run_selftest
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models import load_model

    torch.set_num_threads(a.threads)
    loaded = load_model("")
    engines = {}
    for on in (True, False):
        cfg = EngineConfig(kv_cache_memory=2 * 1024 ** 3,  # 64 chats of ~600 tokens fit without sharing
                           threads=a.threads, max_num_seqs=a.chats,
                           max_num_batched_tokens=2048, max_queue=a.chats, prefix_caching=on)
        engines[on] = LLMEngine(loaded, cfg)
        run_selftest(engines[on])
    raw: dict[str, dict[str, list[dict]]] = {}
    for r in range(a.rounds):
        for name in a.workloads.split(","):
            for on in ((True, False) if r % 2 == 0 else (False, True)):
                rng = random.Random(1000 * r + len(name))  # the same prompts for both engines
                turns, warm = workloads(a, loaded.args.vocab_size, rng)[name]
                engine = engines[on]
                if warm is not None:
                    run_requests(engine, [Request("warm", warm, SamplingParams(max_tokens=1, temperature=0))])
                res = run_workload(engine, turns, a.output_len)
                raw.setdefault(name, {}).setdefault("on" if on else "off", []).append(res)
                print(f"round {r + 1} {name:22s} caching {'on ' if on else 'off'}: TTFT p50 {res['ttft_p50_s']:.3f} s, "
                      f"{res['output_tokens_per_s']:.1f} tok/s, {res['cached_prompt_tokens']} cached prompt tokens",
                      file=sys.stderr)
    summary = {}
    for name, runs in raw.items():
        med = {k: {m: statistics.median(x[m] for x in v) for m in ("ttft_p50_s", "output_tokens_per_s")}
               for k, v in runs.items()}
        summary[name] = {**med, "ttft_ratio_off_over_on": med["off"]["ttft_p50_s"] / med["on"]["ttft_p50_s"],
                         "throughput_ratio_on_over_off": med["on"]["output_tokens_per_s"]
                         / med["off"]["output_tokens_per_s"]}
    out = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "cpu": cpu_name(),
           "threads": a.threads, "args": vars(a), "command": "python benchmarks/prefix_cache.py " + " ".join(sys.argv[1:]),
           "summary": summary, "raw": raw}
    dest = HERE / "results" / ("prefix_cache.json" if a.workloads == p.get_default("workloads")
                               else f"prefix_cache_{a.workloads.replace(',', '_')}.json")
    dest.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nPrefix caching on vs off ({out['cpu']}, {a.threads} threads, {a.rounds} rounds, medians)\n")
    print("| workload | TTFT p50 off | TTFT p50 on | TTFT off/on | tok/s off | tok/s on | tok/s on/off |")
    print("|---|---|---|---|---|---|---|")
    for name, s in summary.items():
        print(f"| {name} | {s['off']['ttft_p50_s']:.3f} s | {s['on']['ttft_p50_s']:.3f} s | "
              f"{s['ttft_ratio_off_over_on']:.2f}x | {s['off']['output_tokens_per_s']:.1f} | "
              f"{s['on']['output_tokens_per_s']:.1f} | {s['throughput_ratio_on_over_off']:.3f}x |")
    print(f"\nwrote {dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
