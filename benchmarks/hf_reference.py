"""Reference rows for engine_throughput.py: transformers on the same model and shapes.

Runs in its own process (engine_throughput.py starts it), without steadyserve
imported, so MKL and PyTorch run exactly as a plain transformers user gets them
(no MKL_CBWR). Prints one JSON object:
  * decode tok/s of `generate()` at batch 1 and with a static batch of `--batch`
    (padding-free prompts of equal length), from the time of a full
    `generate()` minus one forward over the prompts;
  * prefill tok/s of one forward over one `--prefill-len`-token prompt.

Every forward here computes the logits of the last position only
(`logits_to_keep=1`), as `generate()` does for its own prefill and as
steadyserve's prefill does for a request without prompt logprobs. Subtracting a
full-vocabulary forward (8192 x 49152 logits at batch 64) would overstate the
prefill inside `generate()` by 3.6 s (AMD EPYC, 2 threads) and credit transformers' decode
with time it never spent.

    .venv/bin/python benchmarks/hf_reference.py MODEL_DIR [--batch 64] [--prompt-len 128] [--output-len 64]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("model_dir")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    a = p.parse_args()
    if "steadyserve" in sys.modules or os.environ.get("MKL_CBWR"):
        print("hf_reference must run without steadyserve and without MKL_CBWR", file=sys.stderr)
        return 2
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(a.threads)
    model = AutoModelForCausalLM.from_pretrained(a.model_dir, dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    out: dict = {"torch": torch.__version__, "threads": a.threads, "attn_implementation":
                 model.config._attn_implementation}

    def timed(fn) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    with torch.inference_mode():
        for batch in (1, a.batch):
            ids = torch.randint(0, vocab, (batch, a.prompt_len), generator=g)
            mask = torch.ones_like(ids)

            def gen(n: int = a.output_len) -> None:
                model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                               pad_token_id=0)

            gen(4)  # warm-up: first-call allocations and kernel selection
            prefill = min(timed(lambda: model(ids, attention_mask=mask, logits_to_keep=1)) for _ in range(2))
            total = timed(gen)
            decode_s = total - prefill
            out[f"batch{batch}"] = {"batch": batch, "prompt_len": a.prompt_len, "output_len": a.output_len,
                                    "generate_s": total, "prefill_s": prefill,
                                    "decode_tokens_per_s": batch * (a.output_len - 1) / decode_s,
                                    "e2e_tokens_per_s": batch * a.output_len / total}
            print(f"transformers generate batch {batch}: decode {out[f'batch{batch}']['decode_tokens_per_s']:.1f} "
                  f"tok/s", file=sys.stderr)
        ids = torch.randint(0, vocab, (1, a.prefill_len), generator=g)
        model(ids, logits_to_keep=1)
        best = min(timed(lambda: model(ids, logits_to_keep=1)) for _ in range(3))
        out["prefill"] = {"tokens": a.prefill_len, "seconds": best, "tokens_per_s": a.prefill_len / best}
        print(f"transformers forward {a.prefill_len} tokens: {a.prefill_len / best:.0f} tok/s", file=sys.stderr)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
