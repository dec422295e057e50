"""Print the bits one engine computes for a fixed request: run by scripts/fleet_check.py, natively and
under qemu-user emulating other CPUs.

    python scripts/numerics_probe.py MODEL_DIR

Prints one JSON line: the float32 hex of the prompt logprobs and of 6 greedy tokens' logprobs, the greedy
token ids, the torch dispatch ISA and MKL's own line naming the branch it runs (MKL_VERBOSE's header).
The numerics path comes from the environment: STEADYSERVE_NUMERICS=portable (the default), int8 or host.
"""

from __future__ import annotations

import json
import os
import struct
import sys


def main() -> int:
    os.environ["MKL_VERBOSE"] = "1"  # MKL prints its branch at its first call (fleet_check reads that line)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
    import torch

    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models.loader import load_model

    mode = os.environ.get("STEADYSERVE_NUMERICS", "portable")
    torch.set_num_threads(1)
    loaded = load_model(sys.argv[1], numerics=mode)
    numerics = loaded.numerics
    engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=16 * 1024**2, threads=1, numerics=mode))
    ids = loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog, and the model server")
    done = run_requests(engine, [
        Request("score", ids, SamplingParams(max_tokens=0, prompt_logprobs=0)),
        Request("gen", ids, SamplingParams(max_tokens=6, temperature=0, logprobs=0, ignore_eos=True)),
    ])
    hexes = [struct.pack("<f", v).hex() for v in done["score"].prompt_logprob_values + done["gen"].logprob_values]
    sys.stdout.flush()
    print("\nPROBE " + json.dumps({"numerics_id": numerics.numerics_id, "isa": torch.backends.cpu.get_cpu_capability(),
                                   "tokens": done["gen"].token_ids, "logprobs": hexes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
