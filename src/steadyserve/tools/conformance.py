"""The conformance table: published receipts of the packaged models, which any build on any x86-64 CPU must
reproduce bitwise (`steadyserve verify docs/conformance/*.json`; tests/test_conformance.py on every run).

    python -m steadyserve.tools.conformance --write docs/conformance     # regenerate (numerics changed on purpose)

For each packaged model and each native numerics path (PATHS: int8, the default, in <model>-int8.json, and
portable in <model>.json), a few short prompts: scoring (prompt logprobs with one alternative), greedy generation
and seeded sampling, each with logprobs, built by the same receipt code the server uses (receipts/format.py),
on the path's default KV cache. A file records the machine it was made on.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PROMPTS = ["The capital of France is", "def add(a, b):\n    return"]
CHAT = [{"role": "user", "content": "Name one prime number."}]
NUM_TOKENS = 6
MODELS = ("smollm2", "gemma3-270m")  # models/known.py names
PATHS = {"portable": "", "int8": "-int8"}  # numerics path -> the file name's suffix


def file_name(model: str, numerics: str) -> str:
    return f"{model}{PATHS[numerics]}.json"


def cases(tokenizer: Any) -> list[tuple[str, list[int], Any]]:
    """(label, prompt ids, SamplingParams) of every conformance receipt of one model."""
    from ..api.protocol import render_chat
    from ..engine.sequence import SamplingParams

    out = []
    for i, text in enumerate(PROMPTS):
        ids = list(tokenizer(text)["input_ids"])
        out += [(f"score{i}", ids, SamplingParams(max_tokens=0, prompt_logprobs=1)),
                (f"greedy{i}", ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, logprobs=1)),
                (f"seeded{i}", ids, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.8, top_p=0.95, seed=42 + i,
                                                   logprobs=1))]
    if getattr(tokenizer, "chat_template", None):  # the ids after templating, as the chat endpoint makes them
        out.append(("chat", render_chat(tokenizer, CHAT), SamplingParams(max_tokens=NUM_TOKENS, temperature=0,
                                                                         logprobs=1)))
    return out


def make(name: str, threads: int = 0, numerics: str = "portable") -> dict[str, Any]:
    """The conformance file of packaged model `name` on numerics path `numerics`, computed in this process."""
    import torch

    from ..config import EngineConfig
    from ..cpu_budget import read_cpu_budget
    from ..engine.engine import LLMEngine
    from ..engine.offline import run_requests
    from ..engine.selftest import run_selftest
    from ..engine.sequence import Request
    from ..kernels.build import float_build
    from ..models.loader import load_model
    from ..platform_info import platform_info
    from ..receipts.format import identity_of, make_receipt

    threads = threads or read_cpu_budget(0).threads
    torch.set_num_threads(threads)
    loaded = load_model(name, numerics=numerics)
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=64 * 1024**2, threads=threads, numerics=numerics,
                                            adaptive_threads=False))
    selftest = run_selftest(engine)
    if not selftest.passed:
        raise RuntimeError(f"self-test failed: {selftest.detail}")
    assert loaded.numerics is not None
    fp = engine.fingerprint(True)
    identity = identity_of(loaded, fp)
    todo = cases(loaded.tokenizer)
    done = run_requests(engine, [Request(f"conformance-{name}-{label}", ids, p) for label, ids, p in todo])
    receipts = []
    for label, ids, p in todo:
        rid = f"conformance-{name}-{label}"
        acc = done[rid]
        # Every sampled case is seeded: the receipt's seed is the one given (no seed is drawn here).
        receipts.append(make_receipt(identity, rid, 0, ids, p, p.seed, acc.token_ids, acc.finish_reason,
                                     acc.prompt_logprobs, acc.logprobs))
    plat = platform_info()
    return {"model": name, "fingerprint": str(fp),
            "made_on": {"cpu_model": plat.cpu_model, "cpu_flags": list(plat.cpu_flags), "threads": threads,
                        "native_build": float_build()},
            "receipts": receipts}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m steadyserve.tools.conformance", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", required=True, metavar="DIR", help="write DIR/<model>.json (portable) and DIR/<model>-int8.json for each packaged model")
    ap.add_argument("--model", action="append", choices=MODELS, help="only these models (default: all)")
    ap.add_argument("--numerics", action="append", choices=list(PATHS), help="only these paths (default: all)")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args(argv)
    out = Path(a.write)
    out.mkdir(parents=True, exist_ok=True)
    for name, numerics in [(m, n) for m in a.model or MODELS for n in a.numerics or PATHS]:
        data = make(name, a.threads, numerics)
        path = out / file_name(name, numerics)
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}: {len(data['receipts'])} receipts, fingerprint {data['fingerprint']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
