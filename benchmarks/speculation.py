"""Speculative decoding (--speculation ngram) against --speculation off, on the default model.

One run, one process, one machine: the default SmolLM2-135M-Instruct GGUF loaded once, two engines on it
(the same flags but --speculation), each request run through one and then the other, greedy:
- c=1, input-grounded tasks of four kinds: rename a function or method and repeat the code (2 requests),
  correct a JSON document (2), summarise a passage quoting it (3 passages), list a passage's quotations
  (1). Also a summary that was asked to quote but paraphrases (reported, no target). Decode tok/s: tokens
  after the first / time of the steps after the first token; a kind's figure is its requests' mean.
- c=1, free-form chat (nothing in the prompt to copy): the same figure.
- c=64: 64 chat and grounded requests at once, generated tokens / wall time of the whole run (best of
  --repeats, alternating).
Every request's tokens and logprobs must be bitwise equal between the two engines (the exactness
claim; the run fails otherwise). Ratios and the issue's targets (every grounded kind >= 2x, chat >=
0.95x, c=64 >= 0.97x) are in the JSON. Timings are this machine's: nothing here is asserted in the test suite.

    .venv/bin/python benchmarks/speculation.py [--threads 2] [--repeats 3] [--max-tokens 160]

Writes benchmarks/results/speculation.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path

import torch

from steadyserve.config import EngineConfig
from steadyserve.engine.engine import LLMEngine
from steadyserve.engine.offline import Completed
from steadyserve.engine.sequence import Request, SamplingParams
from steadyserve.models.loader import load_model

HERE = Path(__file__).parent

CODE = '''def compute_total(items, tax_rate=0.2):
    """Return the total price of items, tax included."""
    total = 0.0
    for item in items:
        price = item["price"] * item.get("quantity", 1)
        if item.get("discount"):
            price -= price * item["discount"]
        total += price
    return round(total * (1 + tax_rate), 2)


def print_receipt(items):
    for item in items:
        print(f"{item['name']:<20} {item['price']:>8.2f}")
    print(f"{'TOTAL':<20} {compute_total(items):>8.2f}")
'''

JSON_DOC = '''{
  "name": "steadyserve",
  "version": "1.4.0",
  "description": "A language-model server that stays correct under load',
  "keywords": ["llm", "server", "batching", "inference",],
  "author": {"name": "Ada Lovelace", "email": "ada@example.com"},
  "dependencies": {"torch": ">=2.3", "fastapi": ">=0.110", "grpcio": ">=1.60"}
  "license": "Apache-2.0"
}'''

CODE_2 = '''class RateLimiter:
    """Allow at most `rate` calls per `period` seconds."""

    def __init__(self, rate, period=1.0):
        self.rate = rate
        self.period = period
        self.calls = []

    def allow(self, now):
        self.calls = [t for t in self.calls if now - t < self.period]
        if len(self.calls) < self.rate:
            self.calls.append(now)
            return True
        return False


def check_limit(limiter, now):
    if not limiter.allow(now):
        raise RuntimeError("rate limit exceeded")
'''

JSON_DOC_2 = '''{
  "id": 4821,
  "status": "shipped",
  "customer": {"name": "Grace Hopper", "city": "Arlington", "zip": "22201"},
  "items": [
    {"sku": "KB-104", "qty": 2, "price": 49.90},
    {"sku": "MS-220", "qty": 1, "price": 19.50},
  ],
  "shipping": {"method": 'express', "cost": 12.00}
  "notes": "Leave at the front desk"
}'''

PASSAGE = ("The committee met on Tuesday to review the bridge inspection. The chief engineer said that \"the "
           "north pier shows cracks wider than two millimetres, which is beyond the tolerance set in 1998.\" "
           "The mayor replied that \"no traffic restriction will be imposed until the second survey is "
           "complete.\" A resident asked whether the school buses would still use the bridge, and the engineer "
           "answered that \"buses weigh less than the limit and may continue to cross.\" The committee agreed "
           "to publish the full report on the city website by the end of the month.")
PASSAGE_RECALL = ("The company announced on Monday that it is recalling 40,000 electric kettles sold since March. Its "
                  "safety director said that \"a faulty switch can keep the kettle heating after the water has boiled "
                  "away.\" Customers were told that \"the kettles should be unplugged and returned to any store for a "
                  "full refund.\" A reporter asked whether anyone had been hurt, and the director replied that \"two "
                  "minor burns have been reported, and no fires.\" The company expects to finish the recall before "
                  "the end of the year.")
PASSAGE_REEFS = ("Researchers at the coastal institute published a study of coral reefs on Thursday. The lead author "
                 "said that \"reefs that were shaded by clouds during the heatwave lost half as much coral as those in "
                 "full sun.\" Her colleague added that \"shading is not a cure, but it buys the reefs time to "
                 "recover.\" When asked about the cost, the team said that \"a floating shade cloth for one reef costs "
                 "less than a single research vessel.\" The institute plans to test the shades on three more reefs "
                 "next summer.")


def rename(kind: str, old: str, new: str, code: str) -> str:
    return (f"Rename the {kind} {old} to {new} everywhere and repeat the rest of the code unchanged."
            f"\n\n```python\n{code}```")


def correct(doc: str) -> str:
    return f"This JSON document has syntax errors. Output the corrected document only.\n\n{doc}"


def quote_summary(passage: str) -> str:
    return (f"Summarise this passage in three sentences. Each sentence must contain one of its quotations, copied "
            f"word for word in quotation marks.\n\n{passage}")


# Input-grounded tasks, by kind. One request is one output, a noisy sample of its kind, so a kind's figure
# is the mean over its requests. The second and third requests of a kind were written before they were
# first measured, and are kept whatever they give.
GROUNDED_KINDS = {
    "rename": {"rename_function": rename("function", "compute_total", "sum_prices", CODE),
               "rename_method": rename("method", "allow", "try_acquire", CODE_2)},
    "json": {"correct_json": correct(JSON_DOC), "correct_json_order": correct(JSON_DOC_2)},
    "quote_summary": {"quote_summary": quote_summary(PASSAGE),
                      "quote_summary_recall": quote_summary(PASSAGE_RECALL),
                      "quote_summary_reefs": quote_summary(PASSAGE_REEFS)},
    "quote_list": {"quote_list": f"List every quotation in this passage, each on its own line, with who said "
                                 f"it.\n\n{PASSAGE}"},
}
GROUNDED = {name: text for kind in GROUNDED_KINDS.values() for name, text in kind.items()}
# A summary asked to quote, which the default model writes without a single quotation (32 tokens of
# paraphrase): input-grounded in its request, not in its output, so there is little to copy. Measured and
# reported, outside the grounded mean.
PARAPHRASE = {
    "summary_paraphrased": f"Summarise this passage in three sentences, quoting what each person said word for "
                           f"word.\n\n{PASSAGE}",
}
CHAT = {
    "story": "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "advice": "What are some good habits for staying focused while working from home?",
    "explain": "Explain why the sky is blue to a ten-year-old.",
}


def engine(lm, threads: int, mode: str) -> LLMEngine:  # noqa: ANN001 - a LoadedModel
    """An engine on the loaded model that differs from the others of a run only in --speculation."""
    return LLMEngine(lm, EngineConfig(kv_cache_memory=1024**3, threads=threads, max_num_seqs=64, speculation=mode))


def prompt_ids(tokenizer, text: str) -> list[int]:
    """A user message through the model's chat template, tokenized as the chat API does (api/protocol.py)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                         add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run_one(engine: LLMEngine, rid: str, ids: list[int], max_tokens: int) -> tuple[Completed, float, int]:
    """One greedy request alone: (its outputs, seconds of the steps after its first token, tokens they made)."""
    engine.add_request(Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0)))
    done = Completed()
    took = 0.0
    made = 0
    while engine.has_work():
        outs, stats = engine.step()
        if done.token_ids:  # the first token's step includes the prefill
            took += stats.duration
            made += stats.num_generated
        for o in outs:
            done.add(o)
    return done, took, made


def run_many(engine: LLMEngine, reqs: list[tuple[str, list[int]]], max_tokens: int) -> tuple[dict, float, int]:
    """All at once: (outputs by id, wall seconds, generated tokens)."""
    done = {rid: Completed() for rid, _ in reqs}
    for rid, ids in reqs:
        engine.add_request(Request(rid, ids, SamplingParams(max_tokens=max_tokens, temperature=0, logprobs=0)))
    t0 = time.perf_counter()
    made = 0
    while engine.has_work():
        outs, stats = engine.step()
        made += stats.num_generated
        for o in outs:
            done[o.request_id].add(o)
    return done, time.perf_counter() - t0, made


def same(a: Completed, b: Completed) -> bool:
    return (a.token_ids == b.token_ids and [lp.logprob for lp in a.logprobs] == [lp.logprob for lp in b.logprobs]
            and a.finish_reason == b.finish_reason and a.text == b.text)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3, help="runs per request and mode, alternating; the best counts")
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--c64-max-tokens", type=int, default=64)
    p.add_argument("--numerics", default="auto", help="the engines' numerics path (auto, portable, int8)")
    p.add_argument("--out", type=Path, default=HERE / "results" / "speculation.json")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model("", numerics=a.numerics)
    engines = {mode: engine(lm, a.threads, mode) for mode in ("off", "ngram")}
    tok = lm.tokenizer
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                 "cpu": _cpu(), "cpus": os.cpu_count(), "threads": a.threads, "max_tokens": a.max_tokens,
                 "numerics": lm.numerics.mode if lm.numerics is not None else a.numerics,
                 "command": " ".join([".venv/bin/python benchmarks/speculation.py", *sys.argv[1:]]),
                 "c1": {}, "c64": {}, "identical": True}
    run_one(engines["off"], "warm", prompt_ids(tok, "Hello"), 8)
    run_one(engines["ngram"], "warm", prompt_ids(tok, "Hello"), 8)
    for group, tasks in (("grounded", GROUNDED), ("paraphrase", PARAPHRASE), ("chat", CHAT)):
        for name, text in tasks.items():
            ids = prompt_ids(tok, text)
            row: dict = {"prompt_tokens": len(ids)}
            outs = {}
            best = {"off": 0.0, "ngram": 0.0}
            for r in range(a.repeats):  # the modes alternate, so a burst of other load hits both alike
                for mode in ("off", "ngram"):
                    eng = engines[mode]
                    d0, a0 = eng.speculator.total_drafted, eng.speculator.total_accepted
                    done, took, made = run_one(eng, f"{name}-{r}", ids, a.max_tokens)
                    best[mode] = max(best[mode], made / took if took else 0.0)
                    outs[mode] = done
                    if mode == "ngram":
                        row["drafted"] = eng.speculator.total_drafted - d0
                        row["accepted"] = eng.speculator.total_accepted - a0
            for mode in ("off", "ngram"):
                row[f"{mode}_tok_s"] = round(best[mode], 1)
            row["generated_tokens"] = len(outs["off"].token_ids)
            row["speedup"] = round(row["ngram_tok_s"] / row["off_tok_s"], 3)
            row["identical"] = same(outs["off"], outs["ngram"])
            res["identical"] &= row["identical"]
            res["c1"].setdefault(group, {})[name] = row
            print(f"c=1 {group:8} {name:16} off {row['off_tok_s']:7.1f}  ngram {row['ngram_tok_s']:7.1f} tok/s  "
                  f"x{row['speedup']:.2f}  accepted {row.get('accepted')}/{row.get('drafted')}  "
                  f"identical {row['identical']}", file=sys.stderr)
    texts = list(GROUNDED.values()) + list(PARAPHRASE.values()) + list(CHAT.values())
    reqs = [(f"c64-{i}", prompt_ids(tok, texts[i % len(texts)] + f" (request {i})")) for i in range(64)]
    outs = {}
    best = {"off": 0.0, "ngram": 0.0}
    drafted0 = engines["ngram"].speculator.total_drafted
    for r in range(a.repeats):  # alternating, as at c=1
        for mode in ("off", "ngram"):
            done, secs, made = run_many(engines[mode], [(f"{rid}-{r}", ids) for rid, ids in reqs], a.c64_max_tokens)
            outs[mode] = {rid.rsplit("-", 1)[0]: c for rid, c in done.items()}
            best[mode] = max(best[mode], made / secs)
            if mode == "ngram":
                res["c64"]["drafted"] = engines[mode].speculator.total_drafted - drafted0
    for mode in ("off", "ngram"):
        res["c64"][f"{mode}_tok_s"] = round(best[mode], 1)
    res["c64"]["identical"] = all(same(outs["off"][rid], outs["ngram"][rid]) for rid, _ in reqs)
    res["identical"] &= res["c64"]["identical"]
    print(f"c=64 off {res['c64']['off_tok_s']} ngram {res['c64']['ngram_tok_s']} tok/s", file=sys.stderr)

    def mean_speedup(group: str) -> float:
        rows = res["c1"][group].values()
        return sum(r["speedup"] for r in rows) / len(rows)

    grounded = res["c1"]["grounded"]
    res["kinds"] = {kind: round(sum(grounded[n]["speedup"] for n in names) / len(names), 3)
                    for kind, names in GROUNDED_KINDS.items()}
    res["ratios"] = {
        "c1 grounded ngram / off, lowest kind's mean (target >= 2)": min(res["kinds"].values()),
        "c1 grounded ngram / off, mean of the kinds": round(sum(res["kinds"].values()) / len(res["kinds"]), 3),
        "c1 grounded ngram / off, lowest request": round(min(r["speedup"] for r in grounded.values()), 3),
        "c1 paraphrased summary ngram / off (no target: little to copy)": round(mean_speedup("paraphrase"), 3),
        "c1 chat ngram / off, mean (target >= 0.95)": round(mean_speedup("chat"), 3),
        "c64 ngram / off (target >= 0.97)": round(res["c64"]["ngram_tok_s"] / res["c64"]["off_tok_s"], 3),
    }
    for kind, v in res["kinds"].items():
        print(f"{v:8.3f}  c1 {kind} (mean of {len(GROUNDED_KINDS[kind])})")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2) + "\n")
    for k, v in res["ratios"].items():
        print(f"{v:8.3f}  {k}")
    print(f"outputs bitwise identical: {res['identical']}")
    return 0 if res["identical"] else 1


def _cpu() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    sys.exit(main())
