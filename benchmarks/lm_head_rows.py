"""What the LM head's residual rows cost: the int8 path's head (q8.h, "Residual rows": each row's rounding residual
multiplied as a second int8 row on the panels near the row's top logits) against the same packed matrix multiplied
with one int8 row per activation row, what the int8 path ran before (numerics q8a2).

The head's input is real: the final hidden states the model computes for the first tokens of int8_accuracy.py's
corpus (which panels the residual rows correct depends on the logits), recorded as the engine scores them. For
each model: M = 1 (a c=1 decode step) to 64 rows (a batch's decode step, or a speculation verify step), both orders
interleaved, best of --repeat passes, in ms; the ratio is residual / one row; the fraction of panels within the
margin, and of those corrected (at most max_panels a row).

--batches B1,B2 also times whole decode steps of the engine at each batch (B sampled streams, speculation off), the
head switched between the two orders step by step in one process, so that the host's drift (which moves served tok/s by 10-20%
between runs here) falls on both alike: the median step time with each and their ratio, what a decode step pays.

    .venv/bin/python benchmarks/lm_head_rows.py --models smollm2,gemma3-270m,PATH.gguf [--threads 2]
        [--batches 16,64] [--steps 60] [--out J]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from steadyserve.kernels.quant import FORMATS, PACKED, QMatrix
from steadyserve.models import known
from steadyserve.models.loader import load_model


def best_ms(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1000.0


def hidden_states(loaded, rows: int) -> torch.Tensor:
    """(rows, hidden): the final hidden states of the corpus's first tokens, as the engine hands them to the head."""
    from int8_accuracy import corpus
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams

    head, seen = loaded.model.lm_head, []

    class Recorder(QMatrix):  # the head, keeping its inputs
        def __init__(self) -> None:
            super().__init__(head.parts, head.residual_margin, head.residual_panels)

        def __call__(self, x, isa=-1, out=None):
            seen.append(x.clone())
            return head(x, isa, out)

    loaded.model.lm_head = Recorder()
    ids = loaded.tokenizer(corpus())["input_ids"][:rows + 1]
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=256 * 1024**2, threads=torch.get_num_threads(),
                                            numerics="int8", max_model_len=2048))
    run_requests(engine, [Request("h", ids, SamplingParams(max_tokens=0, prompt_logprobs=0))])
    loaded.model.lm_head = head
    return torch.cat(seen)[:rows].contiguous()


def decode_steps(loaded, head: QMatrix, one_row: QMatrix, batch: int, steps: int) -> dict:
    """Mean decode step time at `batch` streams with each head, switched every step (see the module's text)."""
    from int8_accuracy import corpus
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.sequence import Request, SamplingParams

    # Speculation off: a draft made after one head's step would be verified in the other's
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=512 * 1024**2, threads=torch.get_num_threads(),
                                            numerics="int8", max_model_len=2048, max_num_seqs=batch,
                                            speculation="off"))
    ids = loaded.tokenizer(corpus())["input_ids"]
    for i in range(batch):  # distinct 32-token prompts, sampled (temperature 0.9, a seed each), never ending early
        engine.add_request(Request(f"r{i}", ids[32 * i:32 * i + 32],
                                   SamplingParams(max_tokens=2 * steps + 16, temperature=0.9, seed=i, ignore_eos=True)))
    while engine.scheduler.waiting or any(s.num_generated_tokens == 0 for s in engine.scheduler.running):
        engine.step()  # the prompts in: every later step decodes `batch` rows
    times: dict[str, list[float]] = {"residual": [], "one_row": []}
    for i in range(2 * steps):
        name = "residual" if i % 2 == 0 else "one_row"
        loaded.model.lm_head = head if name == "residual" else one_row
        t0 = time.perf_counter()
        engine.step()
        times[name].append((time.perf_counter() - t0) * 1000.0)
    loaded.model.lm_head = head
    med = {k: statistics.median(v) for k, v in times.items()}  # a step the host slowed weighs no more than one
    print(f"  batch {batch:3d}: decode step one row {med['one_row']:8.2f} ms, residual rows {med['residual']:8.2f} ms,"
          f" ratio {med['residual'] / med['one_row']:.3f} (medians)", flush=True)
    return {"batch": batch, "steps_each": steps, "one_row_step_ms_median": round(med["one_row"], 3),
            "residual_step_ms_median": round(med["residual"], 3), "ratio": round(med["residual"] / med["one_row"], 4),
            "one_row_step_ms": [round(t, 3) for t in times["one_row"]],
            "residual_step_ms": [round(t, 3) for t in times["residual"]]}


def measure(path: str, ms: list[int], repeat: int, batches: list[int], steps: int) -> dict:
    loaded = load_model(path, numerics="int8", max_model_len=2048)
    head = loaded.model.lm_head
    assert isinstance(head, QMatrix) and head.residual_margin is not None, "the int8 path's head has residual rows"
    one_row = QMatrix(head.parts)  # the same panels, one int8 row per activation row
    fmts = sorted({FORMATS[p.fmt - PACKED][0] if p.fmt >= PACKED else FORMATS[p.fmt][0] for p in head.parts})
    hidden = hidden_states(loaded, max(ms))
    y = one_row(hidden)
    near = (y >= y.max(1, keepdim=True).values - head.residual_margin).view(y.shape[0], -1, 16).any(-1)
    within = float(near.float().mean())  # panels within the margin; the op corrects at most residual_panels a row
    frac = float(near.sum(1).clamp(max=head.residual_panels).sum()) / near.numel()
    print(f"  margin {head.residual_margin}: {within:.3f} of the panels within it, {frac:.4f} corrected (at most "
          f"{head.residual_panels} a row) over {hidden.shape[0]} rows", flush=True)
    rows = []
    for m in ms:
        x = hidden[:m].contiguous()
        out = torch.empty(m, head.n)
        for _ in range(2):  # warm: workspaces, pages of out
            head(x, out=out)
            one_row(x, out=out)
        t_res, t_one = float("inf"), float("inf")
        for _ in range(3):  # the two orders interleaved, so a slow moment of the host hits both
            t_one = min(t_one, best_ms(lambda: one_row(x, out=out), repeat))
            t_res = min(t_res, best_ms(lambda: head(x, out=out), repeat))
        rows.append({"m": m, "one_row_ms": round(t_one, 3), "residual_ms": round(t_res, 3),
                     "ratio": round(t_res / t_one, 3)})
        print(f"  M = {m:3d}: one row {t_one:8.3f} ms, residual rows {t_res:8.3f} ms, ratio {t_res / t_one:.2f}",
              flush=True)
    decode = [decode_steps(loaded, head, one_row, b, steps) for b in batches]
    return {"model": path, "vocab": head.n, "hidden": head.k, "formats": fmts, "margin": head.residual_margin,
            "max_panels": head.residual_panels, "panels_within_margin": round(within, 4),
            "panels_corrected": round(frac, 5), "rows": rows, "decode_steps": decode}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2,gemma3-270m", help="known names or GGUF paths, comma-separated")
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--batches", default="", help="decode batches to time whole steps at, e.g. 16,64")
    ap.add_argument("--steps", type=int, default=60, help="decode steps per head and batch")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    results = []
    for name in a.models.split(","):
        path = name if name.endswith(".gguf") else str(known.resolve(name))
        print(f"{name}:", flush=True)
        results.append(measure(path, [int(m) for m in a.ms.split(",")], a.repeat,
                               [int(b) for b in a.batches.split(",") if b], a.steps))
    doc = {"cpu": platform.processor() or platform.machine(), "threads": a.threads, "models": results}
    try:
        with open("/proc/cpuinfo") as f:
            doc["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
