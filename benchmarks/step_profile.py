"""Where an engine step's time goes: decode steps at a fixed batch, timed and sampled with perf.

A child process loads the model with the given numerics, starts `--batch` greedy streams, and runs
`--steps` decode steps after a warm-up; `perf record -e cpu-clock` samples it meanwhile (software clock:
the VMs here expose no hardware counters). Prints the mean step time, the tokens/s it means, and the
functions with the largest share of samples (the native kernels' symbols, or Python frames where torch
ops run), and writes the table to JSON.

    .venv/bin/python benchmarks/step_profile.py --model PATH.gguf --numerics int8 --batch 1 [--steps 20]
        [--prompt 64] [--threads 2] [--out FILE] [--kv-cache-dtype auto|fp32|f16|bf16|q8_0]
        [--perf-data FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from peers import cpu_name

HERE = Path(__file__).parent

CHILD = """
import random, sys, time, torch
from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model
model, numerics, batch, steps, prompt, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
kv_dtype = sys.argv[7]
torch.set_num_threads(threads)
lm = load_model(model, numerics=numerics)
eng = LLMEngine(lm, EngineConfig(kv_cache_memory=1024**3, threads=threads, max_num_seqs=max(batch, 1), speculation="off",
                                 kv_cache_dtype=kv_dtype))
import gc
gc.freeze()  # as the server does before serving (api/startup.py)
rng = random.Random(0)
for i in range(batch):
    eng.add_request(Request(str(i), [rng.randrange(100, lm.args.vocab_size) for _ in range(prompt)],
                            SamplingParams(max_tokens=steps + 32, temperature=0, ignore_eos=True)))  # + a chunked prefill's steps
durations = []
while eng.has_work():
    _, s = eng.step()
    if s.num_tokens == s.num_seqs == batch:
        durations.append(s.duration)
        if len(durations) == 3:
            print("READY", flush=True)  # perf attaches after the warm-up
            time.sleep(0.5)
        if len(durations) == steps + 3:
            break
if len(durations) < steps + 3:  # sequences were preempted or never admitted together: no step of the batch to time
    sys.exit(f"only {len(durations)} steps ran all {batch} sequences at once (the 1 GiB KV budget holds fewer of "
             f"{prompt}-token prompts): lower --batch or --prompt, or pick a smaller --kv-cache-dtype")
d = durations[3:]
print("STEP", sum(d) / len(d), flush=True)
sys.stdin.readline()  # perf stops first: the process's exit (torch's teardown) is no part of a step
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="")
    p.add_argument("--numerics", default="int8")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--top", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--kv-cache-dtype", default="auto", help="the engine's --kv-cache-dtype")
    p.add_argument("--perf-data", type=Path, default=None, help="keep perf's recording at this path")
    a = p.parse_args()
    data = Path(tempfile.mkdtemp()) / "perf.data"
    child = subprocess.Popen([sys.executable, "-c", CHILD, a.model, a.numerics, str(a.batch), str(a.steps), str(a.prompt),
                              str(a.threads), a.kv_cache_dtype], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    if not any(line.startswith("READY") for line in child.stdout):  # stops at READY, or when the child ends
        data.parent.rmdir()
        return child.wait() or 1
    perf = subprocess.Popen(["perf", "record", "-e", "cpu-clock", "-F", "999", "-p", str(child.pid), "-o", str(data)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    step = 0.0
    for line in child.stdout:
        if line.startswith("STEP"):
            step = float(line.split()[1])
            break
    perf.send_signal(signal.SIGINT)
    perf.wait(60)
    assert child.stdin is not None
    child.stdin.close()
    if child.wait() != 0 or not step:
        data.unlink(missing_ok=True)
        data.parent.rmdir()
        return child.returncode or 1

    def table(sort: str) -> list[dict]:
        report = subprocess.run(["perf", "report", "-i", str(data), "--stdio", "--no-children", "--sort", sort,
                                 "--percent-limit", "0.5"], capture_output=True, text=True).stdout
        rows = []
        for line in report.splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith("%") and not line.startswith("#"):
                rows.append({"percent": float(parts[0].rstrip("%")), sort: " ".join(parts[1:])[:160]})
        return rows[:a.top]

    # Per thread: the engine thread's samples in libgomp are time it waited at a barrier for the others; a
    # helper's are its wait between parallel regions (the engine thread's serial work).
    top, dsos, per_thread = table("symbol"), table("dso"), table("pid,dso")
    res = {"model": Path(a.model).name if a.model else "default", "numerics": a.numerics, "batch": a.batch,
           "kv_cache_dtype": a.kv_cache_dtype,
           "threads": a.threads, "cpu": cpu_name(),
           "step_s": step, "tok_s": a.batch / step if step else 0.0, "top": top, "dso": dsos,
           "thread_dso": per_thread}
    print(f"{res['numerics']} kv {a.kv_cache_dtype} batch {a.batch}: step {step * 1e3:.1f} ms, {res['tok_s']:.1f} tok/s on {res['cpu']}")
    for t in dsos:
        print(f"  {t['percent']:5.1f}%  {t['dso']}")
    for t in per_thread:
        print(f"  {t['percent']:5.1f}%  {t['pid,dso']}")
    for t in top:
        print(f"  {t['percent']:5.1f}%  {t['symbol']}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    if a.perf_data:  # kept for `perf annotate -i PATH` (where in a kernel the samples fall)
        shutil.move(data, a.perf_data)
    else:
        os.unlink(data)
    data.parent.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
