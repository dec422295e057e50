"""GGUF files at Llama-3.1-8B's and Qwen2.5-7B's shapes, made by llama.cpp's own converter and quantizer from
random weights with a fixed seed: speed and memory of the models CPU deployments run, reproducibly.

make_random_gguf.py builds its model in memory with transformers (float32: 32 GB at 8B, more than these machines
have) and random_blocks_gguf.py writes quantized blocks without llama.cpp (loading and memory only). This one writes
the Hugging Face directory tensor by tensor, one bf16 safetensors shard per layer, so no copy of the model is ever
in memory; llama.cpp's convert_hf_to_gguf.py (the copy testing/llama_converter.py caches, with its gguf-py) turns it
into a BF16 GGUF and `llama-quantize` (benchmarks/build_llama_cpp.sh) into the requested types. Each tensor is
N(0, 0.02) from its own generator, seeded by the seed and the tensor's name (so the files do not depend on the
order tensors are written in); norm weights are 1.0 and Qwen2's q/k/v biases N(0, 0.02), which keeps activations
in range through every layer.

The tokenizer has the real vocabulary: 128,000 regular and 256 special tokens (Llama 3's names and ids) for
Llama 3.1, 151,643 regular and 22 special (Qwen2.5's) for Qwen2.5, whose output layer the converter pads to
152,064 rows as the real model's is. The regular tokens are the default model's byte-level BPE (49,152 tokens and
its merges) followed by plain reserved tokens that no merge produces (not added tokens: transformers handles each
added token in Python). The converter names the pre-tokenizer by hashing a fixed text's tokens as transformers
encodes it: the Llama file's is the default model's ("smollm", GPT-2's split), but for a qwen2 config
transformers (5.x) picks Qwen2Tokenizer, which rebuilds Qwen's own pre-tokenizer, and no vocabulary but the
published one can then match a published hash. The converter runs with the one bypass the test files use
(testing/llama_converter.py: an unknown hash gives tokenizer.ggml.pre "default", GPT-2's split, the base
tokenizer's). Chat templates are Llama 3's and ChatML's.

Disk: the bf16 safetensors directory and the BF16 GGUF (about 16 GB each at 8B) exist together only while the
converter runs; the directory is deleted as soon as the GGUF exists and the GGUF once every requested type is
written. Build the
shapes one after the other (Qwen2.5 first keeps the peak lowest: about 37 GB with every file kept).

    python benchmarks/deployed_shapes_gguf.py --shape llama3.1-8b [--types Q4_K_M,Q8_0] [--layers N]
        [--llama-cpp /tmp/llama] [--out ~/.cache/steadyserve/bench-models] [--hf-only DIR]

Prints each step's seconds and the output paths; an existing file is kept. `--layers 2` makes a small file of the
same widths (a quick check of the pipeline).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zlib
from pathlib import Path

SEED = 0
STD = 0.02
SHAPES = {
    "llama3.1-8b": dict(
        arch="LlamaForCausalLM", model_type="llama", hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, intermediate_size=14336, vocab_size=128256, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, bos_token_id=128000, eos_token_id=[128001, 128008, 128009], hidden_act="silu"),
    "qwen2.5-7b": dict(
        arch="Qwen2ForCausalLM", model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
        num_key_value_heads=4, intermediate_size=18944, vocab_size=152064, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=False, use_sliding_window=False,
        sliding_window=131072, max_window_layers=28, bos_token_id=151643, eos_token_id=151645, hidden_act="silu"),
}
# The special tokens at the end of each vocabulary: (first id, names), and the tokenizer's bos/eos/pad.
LLAMA3_SPECIALS = (["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                    "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                    "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>"]
                   + [f"<|reserved_special_token_{i}|>" for i in range(3, 248)])
QWEN2_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                  "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>",
                  "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
                  "<|repo_name|>", "<|file_sep|>"]
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{{ message['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
CHATML_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOKENIZERS = {
    "llama3.1-8b": dict(regular=128000, specials=LLAMA3_SPECIALS, bos="<|begin_of_text|>", eos="<|eot_id|>",
                        pad=None, template=LLAMA3_TEMPLATE),
    "qwen2.5-7b": dict(regular=151643, specials=QWEN2_SPECIALS, bos=None, eos="<|im_end|>", pad="<|endoftext|>",
                       template=CHATML_TEMPLATE),
}


def write_tokenizer(out: Path, shape: str) -> None:
    """tokenizer.json and tokenizer_config.json with the shape's vocabulary (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    from steadyserve.models.loader import convert_gguf, default_model_path

    t = TOKENIZERS[shape]
    base_dir, _ = convert_gguf(Path(default_model_path()), with_weights=False)
    spec = json.loads((base_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    # The base's own special tokens (ids 0-16) become plain reserved tokens: their names are the new specials'.
    for a in spec["added_tokens"]:
        del vocab[a["content"]]
        vocab[f"<reserved_{a['id']}>"] = a["id"]
    spec["added_tokens"] = []
    for i in range(len(vocab), t["regular"]):
        vocab[f"<reserved_{i}>"] = i
    assert sorted(vocab.values()) == list(range(t["regular"]))
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in t["specials"]])
    assert tok.get_vocab_size() == t["regular"] + len(t["specials"])
    assert tok.token_to_id(t["specials"][0]) == t["regular"]
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=t["bos"], eos_token=t["eos"],
                                   pad_token=t["pad"], model_max_length=SHAPES[shape]["max_position_embeddings"])
    fast.chat_template = t["template"]
    fast.save_pretrained(out)


def _tensors(cfg: dict, layer: int | None) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of one layer's tensors, or with layer None those outside the layers."""
    h, ffn, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    if layer is None:
        return [("model.embed_tokens.weight", (cfg["vocab_size"], h)), ("model.norm.weight", (h,)),
                ("lm_head.weight", (cfg["vocab_size"], h))]
    p = f"model.layers.{layer}."
    out = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
           (p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
           (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
           (p + "mlp.gate_proj.weight", (ffn, h)), (p + "mlp.up_proj.weight", (ffn, h)),
           (p + "mlp.down_proj.weight", (h, ffn))]
    if cfg["model_type"] == "qwen2":  # q/k/v bias
        out += [(p + f"self_attn.{x}_proj.bias", (n,)) for x, n in (("q", h), ("k", kv), ("v", kv))]
    return out


def _tensor(name: str, shape: tuple[int, ...]):
    """The bf16 tensor `name`: 1.0 for norms, else N(0, STD) from a generator seeded by SEED and the name, drawn in
    slabs of rows so that float32 temporaries stay small."""
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(SEED * 2**32 + zlib.crc32(name.encode()))
    out = torch.empty(shape, dtype=torch.bfloat16)
    rows = max(1, (1 << 24) // (shape[-1] if len(shape) > 1 else 1))
    for r in range(0, shape[0], rows):
        n = min(rows, shape[0] - r)
        out[r:r + n] = (torch.randn((n, *shape[1:]), generator=g) * STD).to(torch.bfloat16)
    return out


def write_hf_dir(out: Path, shape: str, layers: int) -> None:
    """config.json, the tokenizer and the weights, one shard per layer (and one for the rest), one at a time."""
    from safetensors.torch import save_file

    cfg = {**SHAPES[shape], "num_hidden_layers": layers}
    arch = cfg.pop("arch")
    out.mkdir(parents=True, exist_ok=True)
    write_tokenizer(out, shape)
    groups = [None, *range(layers)]
    weight_map, total = {}, 0
    for i, layer in enumerate(groups):
        shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {name: _tensor(name, s) for name, s in _tensors(cfg, layer)}
        save_file(tensors, out / shard, metadata={"format": "pt"})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map.update({name: shard for name in tensors})
        del tensors
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (out / "config.json").write_text(json.dumps({**cfg, "architectures": [arch], "torch_dtype": "bfloat16"},
                                                indent=1))


def _step(what: str, t0: float) -> float:
    print(f"{what}: {time.monotonic() - t0:.0f} s", flush=True)
    return time.monotonic()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), required=True)
    p.add_argument("--types", default="Q4_K_M")
    p.add_argument("--layers", type=int, default=None, help="fewer layers, same widths (a pipeline check)")
    p.add_argument("--llama-cpp", type=Path, default=Path(os.environ.get("LLAMA_CPP_DIR", "/tmp/llama")))
    p.add_argument("--out", type=Path, default=Path.home() / ".cache" / "steadyserve" / "bench-models")
    p.add_argument("--hf-only", type=Path, default=None,
                   help="write only the Hugging Face directory, here, and keep it (the bf16 weights vLLM's CPU build "
                        "serves: the same values the GGUF files are made from)")
    a = p.parse_args()
    layers = a.layers or SHAPES[a.shape]["num_hidden_layers"]
    if a.hf_only is not None:
        t = time.monotonic()
        write_hf_dir(a.hf_only, a.shape, layers)
        _step(f"Hugging Face directory {a.hf_only}", t)
        return
    stem = f"{a.shape}-shape" + ("" if layers == SHAPES[a.shape]["num_hidden_layers"] else f"-{layers}l")
    wanted = {t: a.out / f"{stem}-{t}.gguf" for t in a.types.split(",")}
    quantize = a.llama_cpp / "bin" / "llama-quantize"
    if not all(f.exists() for f in wanted.values()):
        if not quantize.exists():
            sys.exit(f"no {quantize}: run benchmarks/build_llama_cpp.sh {a.llama_cpp} first")
        a.out.mkdir(parents=True, exist_ok=True)
        hf, bf16 = a.out / f"{stem}-hf", a.out / f"{stem}-BF16.gguf"
        t = time.monotonic()
        if not bf16.exists():
            shutil.rmtree(hf, ignore_errors=True)  # a directory left by an interrupted run may be partial
            write_hf_dir(hf, a.shape, layers)
            t = _step(f"safetensors shards ({hf})", t)
            from steadyserve.testing.llama_converter import run_converter

            tmp = bf16.with_suffix(".tmp")
            run_converter([(hf, tmp)], "bf16", capture=False).check_returncode()
            tmp.rename(bf16)
            shutil.rmtree(hf)  # the BF16 GGUF holds every weight now
            t = _step(f"convert_hf_to_gguf.py --outtype bf16 ({bf16})", t)
        for typ, f in wanted.items():
            if not f.exists():
                tmp = f.with_suffix(".tmp")
                subprocess.run([str(quantize), str(bf16), str(tmp), typ, "2"], check=True,
                               stdout=subprocess.DEVNULL)
                tmp.rename(f)
                t = _step(f"llama-quantize {typ} ({f}, {f.stat().st_size / 1e9:.2f} GB)", t)
        bf16.unlink()
    print("\n".join(str(f) for f in wanted.values()))


if __name__ == "__main__":
    main()
