"""Qwen3-30B-A3B's shape (GGUF `qwen3moe`) or gpt-oss-20b's (GGUF `gpt-oss`), from random blocks, at full or
reduced depth, and its c=1 decode rate.

The file: random_blocks_gguf.py's method (llama.cpp's Q4_K_M table, each block random bytes from a fixed seed with
small finite scales, written tensor by tensor: no full-precision copy, nothing the model's size in memory), at the
qwen3moe shape: hidden 2048, 32 heads and 4 KV heads of 128, 128 experts of width 768 of which 8 are used,
vocabulary 151,936, QK-norm; the router (`ffn_gate_inp`) F32 as llama.cpp keeps it, the stacked experts Q4_K with
`ffn_down_exps` Q6_K in llama.cpp's "more bits" layers, as for a dense model's ffn_down. Only `--layers` of the 48
(default 4): the experts are 0.35-0.39 GB a layer at Q4_K_M, so a full file (17 GB) does not fit next to its int8
panels on a 24 GiB machine. The values are not a trained model's (the router picks experts at random): speed only.

`--shape gpt-oss-20b`: 24 layers, hidden 2880, 64 heads of 64 over 8 KV heads, 32 experts of width 2880 of which 4
are used, vocabulary 201,088, biases on attention, router and experts, attention sinks, a 128-token window on even
layers, YaRN; the experts MXFP4 as gpt-oss ships them, the rest Q8_0 (llama-quantize's MXFP4_MOE), the router F32.
The full file is 12.2 GB.

`--decode N` then loads it on the default (int8) path and times N decode steps of one greedy stream after a
warm-up, as benchmarks/step_profile.py does: the mean step, its tokens/s, and per layer (the step less the LM head,
embedding and sampling is not split out: the per-layer figure is the step over the layers, an upper bound).

    .venv/bin/python benchmarks/moe_shape.py [--layers 4] [--out DIR] [--decode 16] [--threads 2]
        [--llama-cpp /tmp/llama/bin --json benchmarks/results/FILE.json]

With `--llama-cpp`, llama-bench decodes the same file, and each rate is set against the read-bandwidth bound (the
bytes a token reads: attention and shared weights, 8 of the 128 experts, the output layer; over torch.sum's
read bandwidth measured right before and after it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable

from peers import cpu_name
from random_blocks_gguf import _more_bits, tokenizer_metadata, write_tensors

SHAPE = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, used=8, expert_ffn=768, vocab=151936,
             context=40960, rope_theta=1000000.0, layers=48)
GPTOSS = dict(hidden=2880, heads=64, kv_heads=8, head_dim=64, experts=32, used=4, expert_ffn=2880, vocab=201088,
              context=131072, rope_theta=150000.0, layers=24, window=128)


def _tensors(s: dict, layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape (row length first), type) in llama.cpp's order for qwen3moe."""
    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    q, kv = s["heads"] * d, s["kv_heads"] * d
    out = [("token_embd.weight", (h, s["vocab"]), "Q4_K")]
    for i in range(layers):
        more = "Q6_K" if _more_bits(i, s["layers"]) else "Q4_K"
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "F32"), (p + "ffn_down_exps.weight", (f, h, e), more),
                (p + "ffn_gate_exps.weight", (h, f, e), "Q4_K"), (p + "ffn_up_exps.weight", (h, f, e), "Q4_K"),
                (p + "ffn_gate_inp.weight", (h, e), "F32"), (p + "ffn_norm.weight", (h,), "F32"),
                (p + "attn_k_norm.weight", (d,), "F32"), (p + "attn_k.weight", (h, kv), "Q4_K"),
                (p + "attn_output.weight", (q, h), "Q4_K"), (p + "attn_q_norm.weight", (d,), "F32"),
                (p + "attn_q.weight", (h, q), "Q4_K"), (p + "attn_v.weight", (h, kv), more)]
    out += [("output_norm.weight", (h,), "F32"), ("output.weight", (h, s["vocab"]), "Q6_K")]
    return out


def _gptoss_tensors(s: dict, layers: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, ggml shape, type) in llama.cpp's order for gpt-oss (its converter's names)."""
    h, d, e, f = s["hidden"], s["head_dim"], s["experts"], s["expert_ffn"]
    q, kv = s["heads"] * d, s["kv_heads"] * d
    out = [("token_embd.weight", (h, s["vocab"]), "Q8_0")]
    for i in range(layers):
        p = f"blk.{i}."
        out += [(p + "attn_norm.weight", (h,), "F32"), (p + "attn_q.weight", (h, q), "Q8_0"),
                (p + "attn_q.bias", (q,), "F32"), (p + "attn_k.weight", (h, kv), "Q8_0"), (p + "attn_k.bias", (kv,), "F32"),
                (p + "attn_v.weight", (h, kv), "Q8_0"), (p + "attn_v.bias", (kv,), "F32"),
                (p + "attn_output.weight", (q, h), "Q8_0"), (p + "attn_output.bias", (h,), "F32"),
                (p + "attn_sinks.weight", (s["heads"],), "F32"), (p + "post_attention_norm.weight", (h,), "F32"),
                (p + "ffn_gate_inp.weight", (h, e), "F32"), (p + "ffn_gate_inp.bias", (e,), "F32"),
                (p + "ffn_gate_exps.weight", (h, f, e), "MXFP4"), (p + "ffn_gate_exps.bias", (f, e), "F32"),
                (p + "ffn_up_exps.weight", (h, f, e), "MXFP4"), (p + "ffn_up_exps.bias", (f, e), "F32"),
                (p + "ffn_down_exps.weight", (f, h, e), "MXFP4"), (p + "ffn_down_exps.bias", (h, e), "F32")]
    out += [("output_norm.weight", (h,), "F32"), ("output.weight", (h, s["vocab"]), "Q8_0")]
    return out


def _write(path: Path, arch: str, s: dict, layers: int, table: list, keys: Callable[[Any], None], seed: int) -> Path:
    """The file at `path` (kept if it exists): the keys both shapes write, `keys(writer)`'s own, then the tensor
    table's random blocks."""
    from gguf import GGUFWriter

    from steadyserve.models.loader import default_model_path

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    writer = GGUFWriter(str(tmp), arch)
    tokenizer_metadata(writer, s["vocab"], Path(default_model_path()))
    writer.add_name("random blocks")
    writer.add_block_count(layers)
    writer.add_context_length(s["context"])
    writer.add_embedding_length(s["hidden"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_rope_freq_base(s["rope_theta"])
    writer.add_key_length(s["head_dim"])
    writer.add_value_length(s["head_dim"])
    writer.add_expert_count(s["experts"])
    writer.add_expert_used_count(s["used"])
    writer.add_expert_feed_forward_length(s["expert_ffn"])
    keys(writer)
    write_tensors(writer, table, seed)
    tmp.rename(path)
    return path


def write_gptoss(layers: int, out: Path, seed: int = 0) -> Path:
    from gguf import RopeScalingType

    s = GPTOSS

    def keys(writer: Any) -> None:
        writer.add_feed_forward_length(s["expert_ffn"])
        writer.add_rope_scaling_type(RopeScalingType.YARN)
        writer.add_rope_scaling_factor(32.0)
        writer.add_rope_scaling_orig_ctx_len(4096)
        writer.add_layer_norm_rms_eps(1e-5)
        writer.add_sliding_window(s["window"])
        writer.add_file_type(38)  # MOSTLY_MXFP4_MOE

    return _write(out / f"gpt-oss-20b-{layers}of{s['layers']}-random-blocks-MXFP4.gguf", "gpt-oss", s, layers,
                  _gptoss_tensors(s, layers), keys, seed)


def write(layers: int, out: Path, seed: int = 0) -> Path:
    s = SHAPE

    def keys(writer: Any) -> None:
        writer.add_feed_forward_length(6144)  # Qwen3-30B-A3B's intermediate_size: written, unused by a sparse layer
        writer.add_layer_norm_rms_eps(1e-6)
        writer.add_file_type(15)  # MOSTLY_Q4_K_M

    return _write(out / f"qwen3-30b-a3b-{layers}of{s['layers']}-random-blocks-Q4_K_M.gguf", "qwen3moe", s, layers,
                  _tensors(s, layers), keys, seed)


def decode_rate(path: Path, steps: int, threads: int, cache: Path) -> dict:
    """Mean c=1 decode step of a greedy stream (64-token prompt) after 3 warm-up steps, on the default path."""
    import random
    import time

    import torch

    from steadyserve.config import EngineConfig
    from steadyserve.engine.engine import LLMEngine
    from steadyserve.engine.sequence import Request, SamplingParams
    from steadyserve.models.loader import load_model

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    lm = load_model(str(path), max_model_len=4096, cache_dir=str(cache))
    load_s = time.perf_counter() - t0
    eng = LLMEngine(lm, EngineConfig(kv_cache_memory=256 * 1024**2, threads=threads, max_num_seqs=1,
                                     speculation="off"))
    rng = random.Random(0)
    eng.add_request(Request("0", [rng.randrange(100, lm.args.vocab_size) for _ in range(64)],
                            SamplingParams(max_tokens=steps + 8, temperature=0, ignore_eos=True)))
    durations = []
    while eng.has_work() and len(durations) < steps + 3:
        _, st = eng.step()
        if st.num_tokens == 1:
            durations.append(st.duration)
    mean = sum(durations[3:]) / len(durations[3:])
    return {"cpu": cpu_name(), "threads": threads, "layers": lm.args.num_layers, "numerics": lm.numerics.mode,
            "load_s": round(load_s, 1), "weights_bytes": lm.weights_bytes, "decode_steps": len(durations) - 3,
            "step_ms": round(mean * 1e3, 2), "tok_s": round(1 / mean, 2),
            "ms_per_layer_upper_bound": round(mean * 1e3 / lm.args.num_layers, 2)}


def _field(r, key: str):  # type: ignore[no-untyped-def]
    """A GGUF metadata value (int or str), or None where the file has no such key."""
    from gguf import GGUFValueType

    f = r.fields.get(key)
    if f is None:
        return None
    v = f.parts[f.data[0]]
    return bytes(v).decode() if f.types[0] == GGUFValueType.STRING else int(v[0])


def bytes_per_token(path: Path) -> int | None:
    """Weight bytes one decoded token reads from a mixture-of-experts GGUF: every tensor whole but the stacked
    experts, of which it reads expert_used_count of expert_count (the file's metadata), and an untied embedding,
    of which it reads one row (a KV cache of a few dozen tokens is noise beside them). None for a file without
    experts, whose bound is its whole size. The bound on c=1 is the read bandwidth over this."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    arch = _field(r, "general.architecture")
    experts, used = _field(r, f"{arch}.expert_count"), _field(r, f"{arch}.expert_used_count")
    if not experts or not used:
        return None
    tied = all(t.name != "output.weight" for t in r.tensors)  # then the embedding is the output layer, read whole
    total = 0
    for t in r.tensors:
        n = int(t.n_bytes)
        if "_exps." in t.name:
            n = n * used // experts
        elif t.name == "token_embd.weight" and not tied:
            n //= int(t.shape[1])  # ggml's ne: (hidden, vocab)
        total += n
    return total


def llama_bench_tg(bin_dir: Path, path: Path, threads: int, tokens: int = 32) -> dict:
    """llama-bench's decode rate on the same file (`-p 0 -n tokens`, 5 repetitions), in tokens/s."""
    import json
    import subprocess

    r = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(path), "-t", str(threads), "-p", "0", "-n",
                        str(tokens), "-r", "5", "-o", "json"], capture_output=True, text=True, timeout=1800,
                       check=True)
    row = json.loads(r.stdout)[0]
    return {"tok_s": round(row["avg_ts"], 2), "stddev": round(row["stddev_ts"], 2), "tokens": tokens}


def _in_child(fn, *args):  # type: ignore[no-untyped-def]
    """fn(*args) in a fresh process, so the model it loads is freed before the next run: a full-depth file's panels
    and llama-bench's mapping of the same file do not fit in 24 GiB together."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as ex:
        return ex.submit(fn, *args).result()


def bound(path: Path, decode: int, threads: int, cache: Path, llama_cpp: Path | None) -> dict:
    """c=1 of steadyserve and of llama-bench on one file, each against the read-bandwidth bound measured right
    before and after it (the host's bandwidth drifts), as the issue counts it."""
    from gguf_serving import read_bandwidth_gb_s

    per_token = bytes_per_token(path)
    assert per_token is not None, f"{path} has no experts"
    out: dict = {"file": path.name, "file_bytes": path.stat().st_size, "bytes_per_token": per_token}
    runs = {"steadyserve": lambda: _in_child(decode_rate, path, decode, threads, cache)}
    if llama_cpp is not None:
        runs["llama-bench"] = lambda: llama_bench_tg(llama_cpp, path, threads)
    for name, run in runs.items():
        before = read_bandwidth_gb_s(threads)
        got = run()
        after = read_bandwidth_gb_s(threads)
        bw = (before + after) / 2
        got.update({"read_bandwidth_gb_s": [round(before, 2), round(after, 2)],
                    "bound_tok_s": round(bw * 1e9 / per_token, 2)})
        got["of_bound"] = round(got["tok_s"] / got["bound_tok_s"], 3)
        out[name] = got
    if llama_cpp is not None:
        out["steadyserve / llama-bench"] = round(out["steadyserve"]["tok_s"] / out["llama-bench"]["tok_s"], 3)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=["qwen3-30b-a3b", "gpt-oss-20b"], default="qwen3-30b-a3b")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--out", type=Path, default=Path.home() / ".cache" / "steadyserve" / "bench-models")
    p.add_argument("--decode", type=int, default=0, help="time this many c=1 decode steps (0: only write the file)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--llama-cpp", type=Path, default=None,
                   help="with --decode: llama.cpp's bin/ (benchmarks/build_llama_cpp.sh): llama-bench on the same "
                   "file, both against the read-bandwidth bound (--json then names the results file)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    path = (write_gptoss if a.shape == "gpt-oss-20b" else write)(a.layers, a.out)
    print(path)
    if a.decode:
        import datetime
        import json
        import os

        got = bound(path, a.decode, a.threads, a.out / "cache", a.llama_cpp)
        got.update({"cpu": cpu_name(), "threads": a.threads, "load_before": os.getloadavg(),
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="minutes"),
                    "sampling": "greedy", "command": "benchmarks/moe_shape.py " + " ".join(sys.argv[1:])})
        print(json.dumps(got, indent=1))
        if a.json:
            a.json.write_text(json.dumps(got, indent=2) + "\n")


if __name__ == "__main__":
    main()
