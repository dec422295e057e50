"""steadyserve vs its peers, side by side in one run.

Starts, on the same model and machine (SmolLM2-135M, float32, CPU, `--threads` threads each, 1 GiB of
KV cache where the server has one):
- steadyserve (batch-invariant) and steadyserve --no-batch-invariant;
- `transformers serve --continuous-batching` (Hugging Face's OpenAI-compatible server), installed with
  the benchmark extra: `.venv/bin/pip install -e '.[bench]'` (`--no-peer` runs without it);
- benchmarks/baseline_server.py (transformers generate() behind a global lock);
then measures streaming `/v1/completions` throughput and TTFT at each concurrency level (closed loop,
`steadyserve bench`'s load generator), scoring requests/s at concurrency 64, drift (distinct logprob
vectors from `steadyserve validate`) and each server's peak RSS. Writes benchmarks/results/serving.json
and serving.md.

Every stream must produce exactly --output-tokens tokens: steadyserve and the baseline get
`ignore_eos`; transformers serve refuses that field (HTTP 422) but honours `max_tokens` and takes a
`generation_config` JSON whose EOS id (-1) never matches. Tokens are counted from each stream's final
`usage` object (`stream_options.include_usage`), since one SSE event can carry several tokens or none;
each row records whether the count equals requests x output tokens.

    .venv/bin/python benchmarks/serving.py                     # the full run: levels 1,16,64
    .venv/bin/python benchmarks/serving.py --quick --levels 1,4 --output-tokens 8   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

from peers import (TRANSFORMERS_NO_EOS, Peer, PeerMissing, check_transformers_serve, cpu_name, peak_rss_mib,
                   start_baseline, start_transformers_serve, supports_echo_logprobs, warm_up)

from steadyserve.models.loader import convert_gguf, default_model_path
from steadyserve.testing.server import ServerProcess
from steadyserve.tools.bench import Bench
from steadyserve.tools.validate import run_validate

HERE = Path(__file__).parent
SS, PLAIN, PEER, BASE = "steadyserve", "steadyserve --no-batch-invariant", "transformers serve", "baseline"
KV_BYTES = 1024**3


def bench(url: str, *, mode: str, concurrency: int, n: int, output_tokens: int, prompt_words: str,
          ignore_eos: bool | None = True, extra_body: dict | None = None) -> dict:
    a = SimpleNamespace(url=url, grpc=None, mode=mode, transport="sse", concurrency=concurrency, n=n, rate=None,
                        duration=0, prompt_words=prompt_words, output_tokens=str(output_tokens), ignore_eos=ignore_eos,
                        slow_readers=0.0, slow_rate=2000.0, disconnect=0.0, seed=1, api_key="", json=True,
                        output=None, plot=None, count_usage=True, extra_body=extra_body)
    return asyncio.run(Bench(a).run())


def validate(url: str, n: int, background: float = 0.5) -> dict:
    return asyncio.run(run_validate(url, None, n, min(n, 64), background,
                                    "Batch invariance means the same request gets the same numbers.", 16, "", False))


def distinct(rep: dict) -> int:
    return max((g["distinct_vectors"] for k in rep["kinds"].values() for g in k["fingerprints"].values()), default=0)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer requests per level, scoring and validate probes")
    p.add_argument("--levels", default="1,16,64", help="streaming concurrency levels, comma-separated")
    p.add_argument("--n", type=int, help="requests per level (default: the level, at least 4, with --quick, else 2 x level, "
                                         "at least 8)")
    p.add_argument("--probes", type=int, help="scoring requests and validate probes per server "
                                              "(default: 64 with --quick, else 256 and 200)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="compute threads of every server")
    p.add_argument("--out", type=Path, default=HERE / "results", help="where serving.json and serving.md go")
    p.add_argument("--no-peer", action="store_true", help="leave out transformers serve (no `bench` extra)")
    return p.parse_args()


def start_all(a: argparse.Namespace, model_dir: str) -> dict[str, dict]:
    """name -> {url, pid, stop, settings, extra}, in table order; everything started is stopped on failure."""
    servers: dict[str, dict] = {}
    common = ("--kv-cache-memory", "1GiB", "--max-num-seqs", "64", "--max-queue", "512")
    try:
        for name, extra in ((SS, ()), (PLAIN, ("--no-batch-invariant",))):
            sp = ServerProcess("", *common, *extra, threads=a.threads)
            servers[name] = {"url": sp.http_url, "pid": sp.proc.pid, "stop": sp.stop, "ignore_eos": True,
                             "settings": {"command": " ".join(sp.argv), "dtype": "float32", "threads": a.threads}}
        peers: list[Peer] = [] if a.no_peer else [start_transformers_serve(model_dir, a.threads, KV_BYTES)]
        for peer in peers + [start_baseline(model_dir, a.threads)]:
            servers[peer.name] = {"url": peer.url, "pid": peer.pid, "stop": peer.stop, "settings": peer.settings,
                                  "ignore_eos": None if peer.name == PEER else True,
                                  "extra_body": TRANSFORMERS_NO_EOS if peer.name == PEER else None}
        for name, s in servers.items():
            print(f"started {name} (pid {s['pid']}) at {s['url']}; warming up", file=sys.stderr)
            warm_up(s["url"], s.get("extra_body"))
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: dict[str, dict]) -> None:
    for name, s in servers.items():
        try:
            s["stop"]()
        except Exception as e:  # keep stopping the others
            print(f"stopping {name}: {e}", file=sys.stderr)


def main() -> int:
    a = parse_args()
    if not a.no_peer:
        try:
            check_transformers_serve()
        except PeerMissing as e:
            print(f"{e}\n(or run without the peer: --no-peer)", file=sys.stderr)
            return 2
    levels = [int(x) for x in a.levels.split(",")]
    model_dir = str(convert_gguf(Path(default_model_path()))[0])
    results: dict = {"date": datetime.date.today().isoformat(), "cpu": cpu_name(), "cpus": os.cpu_count(),
                     "model": "SmolLM2-135M-Instruct (GGUF Q4_1 dequantized to float32)", "model_dir": model_dir,
                     "command": " ".join([".venv/bin/python benchmarks/serving.py", *sys.argv[1:]]),
                     "output_tokens": a.output_tokens, "threads": a.threads, "levels": {}}
    servers = start_all(a, model_dir)
    results["servers"] = {name: s["settings"] for name, s in servers.items()}
    try:
        for c in levels:
            n = a.n or (max(c, 4) if a.quick else max(2 * c, 8))  # at least 4: one stream alone is noise
            for name, s in servers.items():
                print(f"streaming c={c} n={n} {name}", file=sys.stderr)
                r = results["levels"].setdefault(str(c), {})[name] = bench(
                    s["url"], mode="generate", concurrency=c, n=n, output_tokens=a.output_tokens,
                    prompt_words="20-40", ignore_eos=s["ignore_eos"], extra_body=s.get("extra_body"))
                r["expected_output_tokens"] = r["requests"] * a.output_tokens
                print(f"  {r['output_tokens_per_s']:.1f} tok/s, ttft p50 {r['ttft_s']['p50']}, "
                      f"p99 {r['ttft_s']['p99']}, truncated {r['truncated_streams']}, tokens {r['output_tokens']}"
                      f"/{r['expected_output_tokens']}", file=sys.stderr)
        support = {name: supports_echo_logprobs(s["url"]) for name, s in servers.items()}
        score_n = a.probes or (64 if a.quick else 256)
        results["scoring"], results["drift"] = {}, {}
        for name in (SS, PEER, BASE):
            if name not in servers:
                continue
            if not support[name][0]:
                results["scoring"][name] = {"n/a": support[name][1]}
                continue
            print(f"scoring c=64 n={score_n} {name}", file=sys.stderr)
            results["scoring"][name] = bench(servers[name]["url"], mode="score", concurrency=64, n=score_n,
                                             output_tokens=0, prompt_words="20-40")
        for name, s in servers.items():
            if not support[name][0]:
                results["drift"][name] = {"n/a": support[name][1]}
                continue
            print(f"validate {name}", file=sys.stderr)
            # The baseline serializes every request behind its lock: background traffic cannot share
            # a batch with its probes, so it would only make the run longer.
            probes = a.probes or ((32 if name == BASE else 64) if a.quick else 200)
            rep = validate(s["url"], probes, 0.0 if name == BASE else 0.5)
            print(f"  distinct vectors {distinct(rep)}", file=sys.stderr)
            results["drift"][name] = {"distinct_vectors": distinct(rep), "report": rep}
        results["peak_rss"] = {name: peak_rss_mib(s["pid"]) for name, s in servers.items()}
    finally:
        stop_all(servers)
    out = a.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.json").write_text(json.dumps(results, indent=2))
    table = markdown(results)
    print(table)
    (out / "serving.md").write_text(table)
    return 0


def markdown(r: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.0f}"

    def ratio(x: dict | None, y: dict | None) -> str:
        if not x or not y:
            return "-"
        return f"{x['output_tokens_per_s'] / y['output_tokens_per_s']:.2f}x" if y["output_tokens_per_s"] else "inf"

    names = [SS, PLAIN, PEER, BASE]
    lines = [f"Serving benchmark, {r['date']}, {r['cpu']} ({r['cpus']} cpus), {r['model']}, float32, "
             f"{r['threads']} threads per server, {r['output_tokens']} output tokens per stream, "
             f"streaming /v1/completions, command: `{r['command']}`", "",
             "| concurrency | " + " | ".join(f"{n} tok/s" for n in names) + " | steadyserve / transformers serve | "
             "steadyserve / baseline | steadyserve / --no-batch-invariant |", "|---" * (len(names) + 4) + "|"]
    short = []
    for c, d in r["levels"].items():
        lines.append(f"| {c} | " + " | ".join(f"{d[n]['output_tokens_per_s']:.1f}" if n in d else "-" for n in names)
                     + f" | {ratio(d.get(SS), d.get(PEER))} | {ratio(d.get(SS), d.get(BASE))} | "
                       f"{ratio(d.get(SS), d.get(PLAIN))} |")
        short += [f"{n} at c={c}: {x['output_tokens']}/{x['expected_output_tokens']} tokens, "
                  f"{x['truncated_streams']} truncated" for n, x in d.items()
                  if x["output_tokens"] != x["expected_output_tokens"] or x["truncated_streams"]]
    lines += ["", "| concurrency | " + " | ".join(f"{n} TTFT p50 / p99 ms" for n in names) + " |",
              "|---" * (len(names) + 1) + "|"]
    for c, d in r["levels"].items():
        lines.append(f"| {c} | " + " | ".join(f"{ms(d[n]['ttft_s']['p50'])} / {ms(d[n]['ttft_s']['p99'])}"
                                              if n in d else "-" for n in names) + " |")
    lines += ["", "Every stream produced its requested tokens, none truncated." if not short else
              "**Streams short of their tokens or truncated:** " + "; ".join(short) + ".", "",
              "| server | peak RSS MiB | scoring at c=64 req/s | distinct logprob vectors per probe kind (validate) |",
              "|---|---|---|---|"]
    for n in names:
        if n not in r["servers"]:
            continue
        rss = r["peak_rss"][n]
        sc, dr = r["scoring"].get(n), r["drift"][n]
        score = "-" if sc is None else f"n/a ({sc['n/a']})" if "n/a" in sc else f"{sc['requests_per_s']:.1f}"
        drift = f"n/a ({dr['n/a']})" if "n/a" in dr else str(dr["distinct_vectors"])
        procs = f" ({rss['processes']} processes)" if rss["processes"] > 1 else ""
        lines.append(f"| {n} | {rss['peak_rss_mib']:.0f}{procs} | {score} | {drift} |")
    lines += ["", "Servers as started:", ""] + [
        f"- {n}: `{''.join(f'{k}={v} ' for k, v in s.get('env', {}).items())}{s['command']}`"
        for n, s in r["servers"].items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
