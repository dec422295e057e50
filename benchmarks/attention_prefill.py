"""One prefill chunk's attention: the native paged-attention op alone, one layer, T tokens of one sequence.

The chunk's T tokens sit at positions ctx - T .. ctx - 1 of one sequence (an f16 cache, or --kv's, blocks of 32) and
attend causally to every key before them: the shape of the last chunk of a ctx-token prompt. Each shape is given as
query heads / kv heads / head dim (SmolLM2-1.7B's 32/32/64 by default, Llama 3.1 8B's 32/8/128, Qwen2.5 7B's
28/4/128, SmolLM2-135M's 9/3/64, Gemma 3's 4/1/256). Prints, per shape, the best of --repeat calls in ms and the
multiply-adds per second of QK^T and PV (2 per head dim per query and key), with a checksum of the output (the same
in every build and tree: the op's bits do not depend on how it is computed); writes JSON with --out. Run it from two
trees for a before/after, and under STEADYSERVE_ISA=avx2 (or scalar) for another build.

    PYTHONPATH=src .venv/bin/python benchmarks/attention_prefill.py [--shapes 32/32/64,32/8/128] [--ctx 2048]
        [--tokens 512] [--threads 2] [--repeat 5] [--kv f16|q8_0|bf16|fp32] [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path

import torch
from peers import cpu_name

from steadyserve.engine.kv_cache import STORAGE
from steadyserve.kernels.build import float_build, load
from steadyserve.models.attention import write_kv

BS = 32  # tokens per KV block


def cache(kv: str, nb: int, hkv: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """nb blocks of random keys and values, written by the engine's own KV write in format `kv`."""
    k = torch.empty(nb, hkv, d + d // 16 if kv == "q8_0" else d, BS, dtype=STORAGE[kv])
    v = torch.empty(nb, hkv, BS, d + d // 16 if kv == "q8_0" else d, dtype=STORAGE[kv])
    slots = torch.arange(nb * BS)
    write_kv(k, v, torch.randn(nb * BS, hkv, d, generator=g), torch.randn(nb * BS, hkv, d, generator=g),
             slots // BS, slots % BS)
    return k, v


def measure(h: int, hkv: int, d: int, ctx: int, tokens: int, repeat: int, kv: str) -> dict:
    g = torch.Generator().manual_seed(0)
    nb = (ctx + BS - 1) // BS
    k, v = cache(kv, nb, hkv, d, g)
    tables = torch.arange(nb, dtype=torch.long)[None]
    q = torch.randn(tokens, h, d, generator=g)
    pos = torch.arange(ctx - tokens, ctx, dtype=torch.long)
    seq_of = torch.zeros(tokens, dtype=torch.long)
    out = torch.empty_like(q)

    def call() -> None:
        torch.ops.steadyserve.paged_attention(q, k, v, tables, seq_of, pos, out, d ** -0.5, 0)

    call()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - t0)
    fmas = int((pos + 1).sum()) * h * d * 2
    return {"shape": f"{h}/{hkv}/{d}", "ms": round(best * 1e3, 2), "gfma_per_s": round(fmas / best / 1e9, 1),
            "checksum": round(out.double().sum().item(), 6)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="32/32/64,32/8/128,28/4/128,9/3/64,4/1/256")
    p.add_argument("--ctx", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--kv", choices=sorted(STORAGE), default="f16", help="the cache's storage format")
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    assert load().available, "the native kernels did not load"
    torch.set_num_threads(a.threads)
    rows = []
    for shape in a.shapes.split(","):
        h, hkv, d = (int(x) for x in shape.split("/"))
        rows.append(measure(h, hkv, d, a.ctx, a.tokens, a.repeat, a.kv))
        print(json.dumps(rows[-1]), flush=True)
    res = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
           "cpu": cpu_name(),
           "build": float_build(), "isa_cap": os.environ.get("STEADYSERVE_ISA", ""), "threads": a.threads,
           "ctx": a.ctx, "tokens": a.tokens, "kv_dtype": a.kv, "rows": rows}
    if a.out:
        a.out.write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
