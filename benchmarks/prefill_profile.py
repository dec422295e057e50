"""Where a long prompt's prefill time goes (issue 44 item 5): the whole step against its attention share.

Loads the model, times the prefill of one `--prompt`-token request (chunked by --max-num-batched-tokens as the
server does; prompt logprobs off, one token generated), then times the paged-attention kernel alone on the
same shapes: every layer, every chunk, each chunk's tokens attending to the keys before them within the
layer's window (all of them where it has none). The rest of the
step is the matmuls, norms, RoPE and the KV write. Repeated per --kv-cache-dtype format, since the format
changes the bytes attention reads. Prints one JSON object per format.

    .venv/bin/python benchmarks/prefill_profile.py [--model smollm2] [--prompt 2048] [--formats fp32,f16,q8_0]
        [--threads 2] [--chunk 512] [--repeat 2]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--prompt", type=int, default=2048)
    p.add_argument("--formats", default="fp32,f16,q8_0")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--chunk", type=int, default=512, help="--max-num-batched-tokens")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per format (the best is kept)")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.kv_cache import allocate_kv_cache, bytes_per_block, kv_layout
    from steadyserve.engine.offline import run_requests
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models.attention import attention_native, write_kv
    from steadyserve.models.loader import load_model

    loaded = load_model(a.model, max_model_len=a.prompt + 64)
    args = loaded.args
    rng = random.Random(0)
    ids = [rng.randrange(100, args.vocab_size) for _ in range(a.prompt)]
    groups = kv_layout(args).num_groups
    for fmt in a.formats.split(","):
        blocks = a.prompt // 32 + 4
        # every group of layers (kv_layout.py: Gemma 3's local and global layers) holds the prompt's blocks
        engine = LLMEngine(loaded, EngineConfig(kv_cache_memory=groups * blocks * bytes_per_block(args, 32, fmt),
                                                threads=a.threads, max_num_batched_tokens=a.chunk,
                                                kv_cache_dtype=fmt, speculation="off", prefix_caching=False,
                                                max_model_len=a.prompt + 64))
        step = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            run_requests(engine, [Request("p", ids, SamplingParams(max_tokens=1, temperature=0))])
            step.append(time.perf_counter() - t0)
        # The attention kernel alone on the same shapes: one layer's cache, every layer's calls.
        one = allocate_kv_cache(args, blocks * bytes_per_block(args, 32, fmt), 32, fmt, torch.device("cpu"))
        del engine  # its cache: two at once would double the memory
        k_cache, v_cache = one.k[0], one.v[0]
        g = torch.Generator().manual_seed(0)
        pos = torch.arange(a.prompt)
        table = torch.arange(blocks, dtype=torch.int64)[None, :]
        kx = torch.randn(a.prompt, args.num_kv_heads, args.head_dim, generator=g)
        write_kv(k_cache, v_cache, kx, kx, pos // 32, pos % 32)
        q = torch.randn(a.prompt, args.num_heads, args.head_dim, generator=g)
        scale = args.head_dim ** -0.5
        attn = []
        for _ in range(a.repeat):
            t0 = time.perf_counter()
            for layer in range(args.num_layers):  # each with its own window (0: full attention)
                for c0 in range(0, a.prompt, a.chunk):
                    rows = slice(c0, min(c0 + a.chunk, a.prompt))
                    attention_native(q[rows], k_cache, v_cache, table, torch.zeros(rows.stop - rows.start,
                                     dtype=torch.int64), pos[rows], scale, args.window(layer))
            attn.append(time.perf_counter() - t0)
        best_step, best_attn = min(step), min(attn)
        print(json.dumps({"model": a.model, "kv_dtype": fmt, "prompt_tokens": a.prompt, "threads": a.threads,
                          "chunk": a.chunk, "prefill_s": round(best_step, 3), "attention_s": round(best_attn, 3),
                          "attention_share": round(best_attn / best_step, 3),
                          "rest_s": round(best_step - best_attn, 3)}), flush=True)


if __name__ == "__main__":
    main()
