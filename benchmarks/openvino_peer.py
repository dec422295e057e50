"""OpenVINO GenAI as a benchmark peer: its ContinuousBatchingPipeline driven through the engine API, no HTTP.

Intel's own CPU LLM engine (int4/int8 weights compressed by NNCF, paged attention, continuous batching: what
OpenVINO Model Server runs) has no OpenAI server in its pip packages, so this measures the engine directly, the
way OVMS drives it: one loop that adds requests and calls step(). That favours it (no HTTP, no detokenized stream);
the JSON says so. This file runs inside a venv that has openvino-genai (never steadyserve's): int8_serving.py
writes a job file, starts `VENV/bin/python benchmarks/openvino_peer.py JOB OUT` as a child process, and reads OUT.
Only the standard library, numpy and openvino_genai are imported here.

The job (JSON), written by int8_serving.py so that every server gets the same work:
  model_dir        an OpenVINO IR directory (`optimum-cli export openvino ... --weight-format int4|int8`)
  threads          INFERENCE_NUM_THREADS
  cache_gb         SchedulerConfig.cache_size
  kv_precision     the CPU plugin's KV_CACHE_PRECISION ("" keeps its default, u8)
  output_tokens    tokens per request (ignore_eos)
  temperature      0: greedy; above: sampled with rng_seed 1 per request
  levels           [{"c": concurrency, "prompts": [text, ...]}]: a closed loop that keeps c requests running
                   until every prompt has been answered, as the HTTP benchmark does
  long_prompts     [[token id, ...], ...]: the first warms up, the rest are timed alone (time to first token)
Writes OUT: per level output tok/s over the level's wall time and TTFT percentiles; the mean long-prompt TTFT;
the process's own peak RSS (VmHWM).

    VENV/bin/python benchmarks/openvino_peer.py JOB.json OUT.json
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import openvino as ov
import openvino_genai as ov_genai

Handle = Any  # openvino_genai's GenerationHandle (its class is not exported at the package's top level)


def percentiles(vals: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 as steadyserve's bench reports them (tools/bench.py's pct, which this venv cannot import)."""
    s = sorted(vals)
    return {f"p{q}": (s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))] if s else None) for q in (50, 90, 99)}


def generation_config(job: dict, tokens: int) -> ov_genai.GenerationConfig:
    cfg = ov_genai.GenerationConfig()
    cfg.max_new_tokens = tokens
    cfg.ignore_eos = True
    if job["temperature"]:
        cfg.do_sample = True
        cfg.temperature = job["temperature"]
        cfg.top_p = 1.0
        cfg.top_k = 0
        cfg.rng_seed = 1
    return cfg


def read_tokens(h: Handle) -> int:
    """The tokens generated since the last read (a read consumes them)."""
    return sum(len(o.generated_ids) for o in h.read().values()) if h.can_read() else 0


def closed_loop(pipe: ov_genai.ContinuousBatchingPipeline, job: dict, c: int, prompts: list[str],
                first_id: int) -> dict:
    """Keep c requests in the pipeline until every prompt has run; one step() at a time, as OVMS's loop does."""
    cfg = generation_config(job, job["output_tokens"])
    todo = list(prompts)
    live: dict[int, tuple[Handle, float]] = {}
    ttft: list[float] = []
    first_seen: set[int] = set()
    tokens = 0
    next_id = first_id
    t0 = time.perf_counter()
    while todo or live:
        while todo and len(live) < c:
            live[next_id] = (pipe.add_request(next_id, todo.pop(0), cfg), time.perf_counter())
            next_id += 1
        pipe.step()
        now = time.perf_counter()
        for rid, (h, t_add) in list(live.items()):
            n = read_tokens(h)
            if n and rid not in first_seen:
                first_seen.add(rid)
                ttft.append(now - t_add)
            tokens += n
            if h.get_status() != ov_genai.GenerationStatus.RUNNING:
                tokens += read_tokens(h)
                del live[rid]
    wall = time.perf_counter() - t0
    return {"requests": len(prompts), "concurrency": c, "wall_s": round(wall, 3), "output_tokens": tokens,
            "output_tokens_per_s": tokens / wall, "ttft_s": percentiles(ttft)}


def first_token_s(pipe: ov_genai.ContinuousBatchingPipeline, job: dict, ids: list[int], rid: int) -> float:
    """Seconds from add_request to the first generated token of one prompt given as token ids."""
    t0 = time.perf_counter()
    h = pipe.add_request(rid, ov.Tensor(np.array([ids], dtype=np.int64)), generation_config(job, 2))
    while True:
        pipe.step()
        if read_tokens(h):
            t = time.perf_counter() - t0
            break
        if h.get_status() != ov_genai.GenerationStatus.RUNNING:
            raise RuntimeError(f"the long prompt ended without a token: {h.get_status()}")
    while pipe.has_non_finished_requests():  # let it finish before the next one is timed
        pipe.step()
    return t


def peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    job = json.loads(Path(sys.argv[1]).read_text())
    sched = ov_genai.SchedulerConfig()
    sched.cache_size = job["cache_gb"]
    props = {"INFERENCE_NUM_THREADS": job["threads"]}
    if job.get("kv_precision"):
        props["KV_CACHE_PRECISION"] = job["kv_precision"]
    t0 = time.perf_counter()
    pipe = ov_genai.ContinuousBatchingPipeline(job["model_dir"], sched, "CPU", props)
    res: dict = {"load_s": round(time.perf_counter() - t0, 2), "openvino_genai": ov_genai.__version__,
                 "scheduler": {"cache_size_gb": sched.cache_size, "max_num_batched_tokens": sched.max_num_batched_tokens,
                               "dynamic_split_fuse": sched.dynamic_split_fuse},
                 "properties": props, "levels": {}, "transport": "engine API (no HTTP)"}
    rid = 0
    warm = job["levels"][0]["prompts"][:1] if job["levels"] else ["The engine warms up on one short prompt."]
    res["warm_up"] = closed_loop(pipe, job, 1, warm, rid)
    rid += 1
    for lv in job["levels"]:
        res["levels"][str(lv["c"])] = closed_loop(pipe, job, lv["c"], lv["prompts"], rid)
        rid += len(lv["prompts"])
        print(f"  openvino c={lv['c']}: {res['levels'][str(lv['c'])]['output_tokens_per_s']:.1f} tok/s", file=sys.stderr)
    if job["long_prompts"]:
        times = []
        for i, ids in enumerate(job["long_prompts"]):
            t = first_token_s(pipe, job, ids, rid)
            rid += 1
            if i:  # the first warms up
                times.append(t)
        res["ttft_long_prompt_s"] = sum(times) / len(times)
        print(f"  openvino TTFT {len(job['long_prompts'][-1])}-token prompt: {res['ttft_long_prompt_s']:.2f} s",
              file=sys.stderr)
    res["peak_rss_mib"] = peak_rss_mib()
    Path(sys.argv[2]).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
