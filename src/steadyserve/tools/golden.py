"""Golden logprob vectors for the portable numerics paths: made on one machine, checked bitwise on any other.

    python -m steadyserve.tools.golden --write tests/golden/portable_smollm2.json
    python -m steadyserve.tools.golden --check tests/golden/portable_smollm2.json [--threads N]
    python -m steadyserve.tools.golden --numerics int8 --write tests/golden/int8_smollm2.json

STEADYSERVE_ISA=scalar|avx2|avx512|amx caps the native kernels' vector build (as a CPU without the wider
ISA would; avx512 leaves the int8 family's AMX tiles out), so one machine can check every build against the file. The vectors are the
default model's (SmolLM2-135M-Instruct) prompt logprobs when scoring and its greedy tokens and
logprobs when generating, for a fixed set of prompts, stored as float32 hex so that equality means
equal bits. The file records the machine it was made on; a check prints the first differing value
and both machines.
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path
from typing import Any

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "In 1905, Albert Einstein published four papers that",
    "Q: What is 17 times 23?\nA:",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker who",
]
NUM_GENERATED = 12


def f32hex(x: float) -> str:
    return struct.pack("<f", x).hex()  # exact: engine logprobs are float32 values widened to float


def compute(threads: int, numerics_mode: str = "portable") -> dict[str, Any]:
    """Run the golden prompts through an engine with `numerics_mode` (portable | int8), in this process."""
    import torch

    from ..config import EngineConfig
    from ..engine.engine import LLMEngine
    from ..engine.offline import run_requests
    from ..engine.selftest import run_selftest
    from ..engine.sequence import Request, SamplingParams
    from ..kernels.build import float_build, int8_build
    from ..models.loader import load_model
    from ..platform_info import platform_info

    torch.set_num_threads(threads)
    loaded = load_model("", numerics=numerics_mode)
    numerics = loaded.numerics
    assert numerics is not None
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=64 * 1024**2, threads=threads, numerics=numerics_mode))
    selftest = run_selftest(engine)
    if not selftest.passed:
        raise RuntimeError(f"self-test failed: {selftest.detail}")
    cases = []
    for i, text in enumerate(PROMPTS):
        ids = loaded.tokenizer.encode(text)
        done = run_requests(engine, [
            Request(f"score{i}", ids, SamplingParams(max_tokens=0, prompt_logprobs=0)),
            Request(f"gen{i}", ids, SamplingParams(max_tokens=NUM_GENERATED, temperature=0, logprobs=0,
                                                   ignore_eos=True)),
        ])
        score, gen = done[f"score{i}"], done[f"gen{i}"]
        cases.append({"prompt": text, "prompt_token_ids": ids,
                      "prompt_logprobs": [f32hex(v) for v in score.prompt_logprob_values],
                      "generated_token_ids": gen.token_ids, "logprobs": [f32hex(v) for v in gen.logprob_values]})
    p = platform_info()
    kv = engine.fingerprint(True).kv  # the fingerprint's KV part: "" where the cache stores float32
    return {"numerics_id": numerics.numerics_id, "weights": loaded.weights_hash[:12], "kv": kv,
            "made_on": {"cpu_model": p.cpu_model, "cpu_flags": list(p.cpu_flags), "host_isa_of_torch": p.isa,
                        "native_build": float_build(),
                        "int8_build": int8_build(),
                        "threads": threads, "kernel": loaded.model.kernel_id},
            "cases": cases}


def first_difference(golden: dict[str, Any], got: dict[str, Any]) -> str | None:
    """None when bitwise equal; else a sentence naming the first differing value and both machines."""
    for key in ("numerics_id", "weights", "kv"):
        if golden.get(key, "") != got[key]:
            return f"{key} differs: golden {golden.get(key, '')!r}, here {got[key]!r} (compare like with like)"
    for g, h in zip(golden["cases"], got["cases"]):
        for field in ("prompt_token_ids", "prompt_logprobs", "generated_token_ids", "logprobs"):
            for j, (a, b) in enumerate(zip(g[field], h[field])):
                if a != b:
                    def show(v: Any) -> str:
                        return f"{v} ({struct.unpack('<f', bytes.fromhex(v))[0]!r})" if isinstance(v, str) else str(v)
                    return (f"prompt {g['prompt']!r}: {field}[{j}] golden {show(a)}, here {show(b)}; golden made on "
                            f"{_machine(golden['made_on'])}, checked on {_machine(got['made_on'])}")
            if len(g[field]) != len(h[field]):
                return f"prompt {g['prompt']!r}: {field} has {len(h[field])} values here, {len(g[field])} golden"
    if len(golden["cases"]) != len(got["cases"]):
        return f"{len(got['cases'])} cases here, {len(golden['cases'])} golden"
    return None


def _machine(m: dict[str, Any]) -> str:
    return (f"{m['cpu_model']} (torch {m['host_isa_of_torch']}, native {m.get('native_build', '?')} build; "
            f"{' '.join(m['cpu_flags'])}; {m['threads']} threads)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m steadyserve.tools.golden", description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="PATH")
    mode.add_argument("--check", metavar="PATH")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--numerics", choices=["portable", "int8"], default="portable")
    a = p.parse_args(argv)
    got = compute(a.threads, a.numerics)
    if a.write:
        Path(a.write).parent.mkdir(parents=True, exist_ok=True)
        Path(a.write).write_text(json.dumps(got, indent=1) + "\n")
        print(f"wrote {a.write}: {len(got['cases'])} cases, numerics {got['numerics_id']}, "
              f"made on {_machine(got['made_on'])}")
        return 0
    problem = first_difference(json.loads(Path(a.check).read_text()), got)
    if problem:
        print(f"GOLDEN MISMATCH: {problem}")
        return 1
    print(f"golden vectors bitwise equal ({len(got['cases'])} cases, numerics {got['numerics_id']}) on "
          f"{_machine(got['made_on'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
