"""How far prompt-lookup speculation can go on the default model's own outputs: a bound, not a timing.

A verification of r rows costs about 1 + row_cost * (r - 1) one-row steps (engine/speculation.py ROW_COST),
and the tokens it yields are what the output copies from its context. So the speed-up a drafter can reach
on one output is fixed by that output and row_cost, whatever the allocation. This script
1. measures row_cost on the engine itself: steps of 1 row against steps of 8 (7 drafts, every row drafted);
2. generates each task of benchmarks/speculation.py once, greedy, with --speculation off;
3. replays each output through
   - `engine`: the engine's own Speculator (its drafts, allocation and acceptance), which predicts what
     benchmarks/speculation.py measures;
   - `perfect allocation`: the engine's n-gram lookup, drafting exactly the tokens that will be accepted
     (no draft where its first token is wrong): the most any allocation can get from that lookup;
   - `perfect allocation, 1-token suffixes`: the same for a lookup that also matches a single token (more
     proposals, most of them wrong, which only a perfect allocator can afford);
   - `oracle`: at each step, the longest run of the next tokens (up to 7) found anywhere in the context,
     drafted exactly: the most any drafter that copies from the prompt and output can get;
   - `early exit`: the one drafter that is not a copier and exists for this tokenizer (no smaller model
     shares it, none comes from a hub here): the model's own first L layers, final norm and LM head. How
     often their argmax is the model's token, on the output itself (an upper bound on a draft's acceptance:
     a real draft conditions on its own guesses), and so the most a drafter of one token a step, costing
     L / num_layers of a step, can get: (1 + agreement) / (1 + L / num_layers + row_cost).
Every figure is tokens per one-row step at the measured row_cost (the decode tok/s ratio to off).

    .venv/bin/python benchmarks/speculation_bound.py [--threads 2] [--max-tokens 160] [--row-cost X]

Writes benchmarks/results/speculation_bound.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from speculation import CHAT, GROUNDED, GROUNDED_KINDS, PARAPHRASE, _cpu, engine, prompt_ids, run_one
from steadyserve.engine.sequence import Request, SamplingParams, Sequence, SequenceStatus
from steadyserve.engine.speculation import MAX_DRAFT_TOKENS, NgramIndex, Speculator
from steadyserve.models.loader import default_model_path, load_model

HERE = Path(__file__).parent


def measure_row_cost(lm, threads: int, text: str) -> tuple[float, float, float]:
    """(row_cost, median ms of 1-row steps, of 8-row steps): the same request decoded plainly, then with
    every row drafted (row_cost 0, 7 drafts a step)."""
    eng = engine(lm, threads, "ngram")
    ids = prompt_ids(lm.tokenizer, text)
    ms: dict[int, list[float]] = {1: [], 8: []}
    for rep in range(3):
        for drafts in (0, 7):
            eng.speculator.enabled = drafts > 0
            eng.speculator.max_draft_tokens, eng.speculator.row_cost = drafts, 0.0
            eng.add_request(Request(f"rows-{rep}-{drafts}", ids, SamplingParams(max_tokens=64, temperature=0)))
            first = True
            while eng.has_work():
                _, st = eng.step()
                if not first and st.num_tokens in ms:
                    ms[st.num_tokens].append(st.duration * 1000)
                first = False
    one, eight = statistics.median(ms[1]), statistics.median(ms[8])
    return (eight / one - 1) / 7, one, eight


def replay_engine(prompt: list[int], out: list[int], spec: Speculator, cost: float) -> float:
    """The engine's Speculator (its draft, allocation and acceptance record) on one decoding sequence, fed the
    output's own tokens: what a run with it emits per step, at `cost` per draft row."""
    seq = Sequence(0, Request("replay", list(prompt), SamplingParams(max_tokens=len(out), temperature=0)))
    seq.status = SequenceStatus.RUNNING
    drafter = spec.new_drafter()
    i, steps = 0, 0.0
    while i < len(out):
        seq.num_computed_tokens = seq.num_tokens - 1  # decoding: its last token is the one left to compute
        spec.draft([(seq, drafter)])
        draft = seq.draft_token_ids
        accepted = _run(draft, out, i)
        spec.record(drafter, len(draft), accepted)
        steps += 1 + cost * len(draft)
        seq.token_ids += out[i:i + accepted + 1]
        i += accepted + 1
    return len(out) / steps


def replay_perfect(prompt: list[int], out: list[int], index: NgramIndex, cost: float) -> float:
    """The lookup's proposals, each drafted exactly as far as it will be accepted."""
    tokens, i, steps = list(prompt), 0, 0.0
    while i < len(out):
        room = min(len(out) - i - 1, MAX_DRAFT_TOKENS)
        accepted = _run(index.propose(tokens, room) if room >= 1 else [], out, i)
        steps += 1 + cost * accepted
        tokens += out[i:i + accepted + 1]
        i += accepted + 1
    return len(out) / steps


def replay_oracle(prompt: list[int], out: list[int], cost: float) -> float:
    """The longest run of the next tokens found anywhere in the context, each step."""
    tokens, i, steps = list(prompt), 0, 0.0
    while i < len(out):
        best = 0
        for length in range(min(len(out) - i - 1, MAX_DRAFT_TOKENS), 0, -1):
            run = out[i:i + length]
            if any(tokens[j:j + length] == run for j in range(len(tokens) - length + 1)):
                best = length
                break
        steps += 1 + cost * best
        tokens += out[i:i + best + 1]
        i += best + 1
    return len(out) / steps


def early_exit(path: str, requests: dict[str, tuple[list[int], list[int]]], row_cost: float,
               layers: tuple[int, ...] = (4, 8, 12, 16, 20, 24)) -> dict[str, dict]:
    """Per request, per L: how often the first L layers' argmax equals the token the model generated next, and
    the one-token-a-step bound above. The transformers model on the same GGUF (float32 weights): a bound on
    predictions, not on bits, so the engine's kernels are not needed."""
    from transformers import AutoModelForCausalLM

    gguf = Path(path)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    found: dict[str, dict] = {}
    for name, (prompt, out) in requests.items():
        with torch.no_grad():
            hidden = model(torch.tensor([prompt + out]), output_hidden_states=True).hidden_states
        # row P - 1 + j predicts out[j]; out[0] follows the prompt, so j from 1 on is output predicting output
        rows = slice(len(prompt), len(prompt) + len(out) - 1)
        target = torch.tensor(out[1:])
        row = {}
        for n in layers:
            guess = model.lm_head(model.model.norm(hidden[n][0, rows])).argmax(-1)  # (len(out) - 1,)
            agree = (guess == target).float().mean().item()
            row[f"L={n}"] = {"agreement": round(agree, 3),
                             "bound": round((1 + agree) / (1 + n / num_layers + row_cost), 3)}
        found[name] = row
    return found


def _run(draft: list[int], out: list[int], i: int) -> int:
    """How many of draft's tokens out has from position i on."""
    n = 0
    while n < len(draft) and draft[n] == out[i + n]:
        n += 1
    return n


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--row-cost", type=float, default=None,
                   help="replay at this row cost (the engine's allocation too) instead of the one measured: what "
                        "a faster kernel would give")
    p.add_argument("--out", type=Path, default=None, help="default: results/speculation_bound.json, or "
                                                          "speculation_bound_row_cost_<x>.json with --row-cost")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    lm = load_model("")
    if a.row_cost is None:
        row_cost, one_ms, eight_ms = measure_row_cost(lm, a.threads, GROUNDED["quote_list"])
        print(f"row_cost {row_cost:.3f} (1 row {one_ms:.2f} ms, 8 rows {eight_ms:.2f} ms)", file=sys.stderr)
    else:
        row_cost, one_ms, eight_ms = a.row_cost, float("nan"), float("nan")
    out_path = a.out or HERE / "results" / ("speculation_bound.json" if a.row_cost is None
                                            else f"speculation_bound_row_cost_{a.row_cost}.json")
    off, ngram = engine(lm, a.threads, "off"), engine(lm, a.threads, "ngram")
    keys = ngram.speculator.keys
    replays: dict[str, Callable[[list[int], list[int]], float]] = {
        "engine": lambda pr, o: replay_engine(pr, o, Speculator("ngram", ngram.speculator.cheap_rows, keys=keys,
                                                                **({} if a.row_cost is None else
                                                                   {"row_cost": a.row_cost})), row_cost),
        "perfect allocation": lambda pr, o: replay_perfect(pr, o, NgramIndex(keys=keys), row_cost),
        "perfect allocation, 1-token suffixes": lambda pr, o: replay_perfect(pr, o, NgramIndex(1, keys=keys),
                                                                             row_cost),
        "oracle": lambda pr, o: replay_oracle(pr, o, row_cost),
    }
    res: dict = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                 "cpu": _cpu(), "threads": a.threads, "row_cost": round(row_cost, 4),
                 "row_cost_measured": a.row_cost is None,
                 "step_ms": {"1 row": round(one_ms, 2), "8 rows": round(eight_ms, 2)} if a.row_cost is None else None,
                 "command": " ".join([".venv/bin/python benchmarks/speculation_bound.py", *sys.argv[1:]]),
                 "requests": {}}
    outputs: dict[str, tuple[list[int], list[int]]] = {}
    for name, text in {**GROUNDED, **PARAPHRASE, **CHAT}.items():
        ids = prompt_ids(lm.tokenizer, text)
        out = run_one(off, name, ids, a.max_tokens)[0].token_ids
        outputs[name] = (ids, out)
        row = {"generated_tokens": len(out), **{k: round(f(ids, out), 3) for k, f in replays.items()}}
        res["requests"][name] = row
        print(f"{name:22} " + "  ".join(f"{k} {v}" for k, v in row.items()), file=sys.stderr)
    for name, row in early_exit(default_model_path(), outputs, row_cost).items():
        res["requests"][name]["early exit"] = row
        print(f"{name:22} early exit " + "  ".join(f"{k} {v['agreement']} ({v['bound']})" for k, v in row.items()),
              file=sys.stderr)
    res["kinds"] = {kind: {k: round(statistics.mean(res["requests"][n][k] for n in names), 3) for k in replays}
                    for kind, names in GROUNDED_KINDS.items()}
    for kind, names in {**GROUNDED_KINDS, "chat": list(CHAT)}.items():  # the best L's mean bound, of each kind
        exits = [res["requests"][n]["early exit"] for n in names]
        res["kinds"].setdefault(kind, {})["early exit"] = round(
            max(statistics.mean(e[layer]["bound"] for e in exits) for layer in exits[0]), 3)
    for kind, v in res["kinds"].items():
        print(f"{kind:14} " + "  ".join(f"{k} {x:.2f}" for k, x in v.items()))
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
