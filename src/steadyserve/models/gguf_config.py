"""A GGUF file's metadata as a transformers config dict, where transformers' GGUF loader has no map.

transformers reads the config of a llama, qwen2, qwen3, qwen3moe, gemma2, gemma3 or phi3 file
(modeling_gguf_pytorch_utils.load_gguf_checkpoint); it refuses olmo2, smollm3 and granite files, fails on the
gpt-oss files llama.cpp's converter writes (it reads the array behind a rope.scaling.* key as a scalar),
and it drops Qwen3's `attention.key_length` (every Qwen3 file then gets Qwen3Config's head_dim
of 128). This module is the project's own map for those, from the keys llama.cpp's
convert_hf_to_gguf.py writes (gguf-py's `Keys`), to the fields of transformers' config class for
the architecture, so that a file loads on its own, without a config.json:

- every file: `{arch}.context_length`, `embedding_length`, `block_count`, `feed_forward_length`,
  `attention.head_count(_kv)`, `attention.layer_norm_rms_epsilon`, `rope.freq_base`, and
  `attention.key_length` (written only when the HF config has a head_dim); the vocabulary's
  length and BOS/EOS/PAD ids from `tokenizer.ggml.*`; tied embeddings where there is no
  `output.weight` (llama.cpp writes it only when it differs from the embedding);
- granite: `embedding_scale`, `residual_scale`, `attention.scale` and `logit_scale` (the
  converter's names for the four *_multiplier/logits_scaling fields, each written only when
  nonzero; absent, llama.cpp applies none, and 1/sqrt(head_dim) as the score scale);
- gpt-oss: `expert_count`, `expert_used_count`, `expert_feed_forward_length` (the experts' width is the config's
  intermediate_size), `attention.sliding_window`, and YaRN's `rope.scaling.yarn_beta_fast` / `_slow`. llama.cpp
  hardcodes the rest: the window on even layers (its swa pattern of 2, transformers' default layer_types), the
  SwiGLU's alpha 1.702 and limit 7.0, biases on attention; and YaRN as gpt-oss defines it (`truncate` false:
  the correction range unrounded, as the model's own config.json says);
- smollm3: no key. llama.cpp hardcodes the no-RoPE step (`hparams.n_no_rope_layer_step = 4`:
  layer i rotates unless (i + 1) % 4 == 0), which is SmolLM3Config's `no_rope_layer_interval`.

Where llama.cpp has a default for an absent key, that default is used (rope.freq_base 10000),
not the config class's: a class default is one checkpoint's value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass(frozen=True)
class GgufArch:
    """One GGUF architecture (`general.architecture`) that steadyserve serves."""

    hf_architecture: str  # the transformers class it loads as (config.architectures[0])
    model_type: str  # transformers' model_type, for AutoConfig.for_model
    own_map: bool  # True: the config comes from this module; False: from transformers' GGUF loader
    permuted: bool  # llama.cpp's converter interleaved the q/k rows (LlamaModel.permute, RoPE type NORM)


# gguf.MODEL_ARCH_NAMES -> what loads it. Mistral files are "llama" (transformers tells them by name).
GGUF_ARCHITECTURES: dict[str, GgufArch] = {
    "llama": GgufArch("LlamaForCausalLM", "llama", own_map=False, permuted=True),
    "qwen2": GgufArch("Qwen2ForCausalLM", "qwen2", own_map=False, permuted=False),
    "qwen3": GgufArch("Qwen3ForCausalLM", "qwen3", own_map=False, permuted=False),
    "qwen3moe": GgufArch("Qwen3MoeForCausalLM", "qwen3_moe", own_map=False, permuted=False),
    "gemma2": GgufArch("Gemma2ForCausalLM", "gemma2", own_map=False, permuted=False),
    "gemma3": GgufArch("Gemma3ForCausalLM", "gemma3_text", own_map=False, permuted=False),
    "phi3": GgufArch("Phi3ForCausalLM", "phi3", own_map=False, permuted=False),
    "olmo2": GgufArch("Olmo2ForCausalLM", "olmo2", own_map=True, permuted=False),  # Olmo2Model(TextModel): NEOX
    "smollm3": GgufArch("SmolLM3ForCausalLM", "smollm3", own_map=True, permuted=True),  # SmolLM3Model(LlamaModel)
    "granite": GgufArch("GraniteForCausalLM", "granite", own_map=True, permuted=True),  # GraniteModel(LlamaModel)
    "gpt-oss": GgufArch("GptOssForCausalLM", "gpt_oss", own_map=True, permuted=False),  # GptOssModel(TextModel)
}

_SMOLLM3_NO_ROPE_STEP = 4  # llama.cpp src/llama-model.cpp, LLM_ARCH_SMOLLM3: no GGUF key holds it
_GPTOSS_SWIGLU = {"swiglu_alpha": 1.702, "swiglu_limit": 7.0}  # llama.cpp's LLM_ARCH_OPENAI_MOE graph: no key
_ROPE_FREQ_BASE_DEFAULT = 10000.0  # llama.cpp's default where a file has no rope.freq_base


class GgufConfigError(ValueError):
    """The file's metadata cannot be mapped; str() names the file's architecture and the problem."""


def supported_gguf() -> list[str]:
    return sorted(GGUF_ARCHITECTURES)


def gguf_arch(architecture: str) -> GgufArch:
    """The entry for `general.architecture`; GgufConfigError naming it and the supported list otherwise."""
    if architecture not in GGUF_ARCHITECTURES:
        raise GgufConfigError(f"unsupported GGUF architecture {architecture!r}; "
                              f"supported: {', '.join(supported_gguf())}")
    return GGUF_ARCHITECTURES[architecture]


def read_metadata(path: Path) -> tuple[dict[str, Any], tuple[str, ...]]:
    """The file's metadata and its tensor names (gguf_file.read_gguf, gguf-py's layout). Arrays of strings
    (the vocabulary, the merges) are left as their lengths, as transformers' own fast reader leaves them;
    numeric arrays are lists."""
    from .gguf_file import read_gguf

    f = read_gguf(path)
    return dict(f.metadata), tuple(t.name for t in f.tensors)


def _common(md: dict[str, Any], names: tuple[str, ...], arch: str) -> dict[str, Any]:
    """The fields every llama-shaped file states (TextModel.set_gguf_parameters writes them)."""

    def key(name: str) -> Any:
        full = f"{arch}.{name}"
        if full not in md:
            raise GgufConfigError(f"GGUF architecture {arch!r}: metadata key {full!r} is missing")
        return md[full]

    heads = key("attention.head_count")
    cfg: dict[str, Any] = {
        "max_position_embeddings": key("context_length"),
        "hidden_size": key("embedding_length"),
        "intermediate_size": key("feed_forward_length"),
        "num_hidden_layers": key("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": md.get(f"{arch}.attention.head_count_kv", heads),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon"),
        "rope_parameters": _rope(md, arch),
        # LlamaModel writes vocab_size; otherwise the vocabulary's length (the reader leaves it as a count)
        "vocab_size": md.get(f"{arch}.vocab_size", md.get("tokenizer.ggml.tokens")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": any(n.endswith(".attn_q.bias") for n in names),
        # absent ids stay None, as on a config by default
        "bos_token_id": md.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": md.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": md.get("tokenizer.ggml.padding_token_id"),
    }
    if isinstance(cfg["num_key_value_heads"], list):  # per-layer counts: hybrid files, none of ours
        raise GgufConfigError(f"GGUF architecture {arch!r}: per-layer attention.head_count_kv is not supported")
    if (head_dim := md.get(f"{arch}.attention.key_length")) is not None:
        cfg["head_dim"] = head_dim
    return cfg


def _rope(md: dict[str, Any], arch: str) -> dict[str, Any]:
    """rope_parameters from rope.freq_base and rope.scaling.* (the converter writes linear and yarn)."""
    theta = float(md.get(f"{arch}.rope.freq_base", _ROPE_FREQ_BASE_DEFAULT))
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return {"rope_type": "default", "rope_theta": theta}
    factor = float(md[f"{arch}.rope.scaling.factor"])
    if kind == "linear":
        return {"rope_type": "linear", "rope_theta": theta, "factor": factor}
    if kind == "yarn":
        params = {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                  "original_max_position_embeddings": md[f"{arch}.rope.scaling.original_context_length"]}
        if (attn := md.get(f"{arch}.rope.scaling.yarn_attn_factor")) is not None:
            params["attention_factor"] = float(attn)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (beta := md.get(f"{arch}.rope.scaling.{key}")) is not None:
                params[name] = float(beta)
        return params
    raise GgufConfigError(f"GGUF architecture {arch!r}: rope.scaling.type {kind!r} is not supported")


def _olmo2(md: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    if "olmo2.attention.sliding_window" in md:  # the converter writes OLMo 3 as olmo2, with a window
        raise GgufConfigError("GGUF architecture 'olmo2' with a sliding window (an OLMo 3 file) is not supported")
    return _common(md, names, "olmo2")


def _smollm3(md: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    return {**_common(md, names, "smollm3"), "no_rope_layer_interval": _SMOLLM3_NO_ROPE_STEP,
            "use_sliding_window": False, "mlp_bias": any(n.endswith(".ffn_up.bias") for n in names)}


def _granite(md: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    cfg = _common(md, names, "granite")
    cfg.pop("head_dim", None)  # GraniteModel drops head_dim: it is hidden / heads
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return {**cfg, "mlp_bias": any(n.endswith(".ffn_up.bias") for n in names),
            "embedding_multiplier": float(md.get("granite.embedding_scale", 1.0)),
            "residual_multiplier": float(md.get("granite.residual_scale", 1.0)),
            "attention_multiplier": float(md.get("granite.attention.scale", head_dim ** -0.5)),
            "logits_scaling": float(md.get("granite.logit_scale", 1.0))}


def _gptoss(md: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    cfg = _common(md, names, "gpt-oss")  # the three expert keys are there: gguf_check.check_metadata
    n = cfg["num_hidden_layers"]
    rope = {**cfg["rope_parameters"], "truncate": False}
    return {**cfg, "rope_parameters": rope, "num_local_experts": md["gpt-oss.expert_count"],
            "num_experts_per_tok": md["gpt-oss.expert_used_count"],
            "intermediate_size": md["gpt-oss.expert_feed_forward_length"],
            "sliding_window": md.get("gpt-oss.attention.sliding_window", 0),
            "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)],
            **_GPTOSS_SWIGLU}


_OWN_MAPS: dict[str, Callable[[dict[str, Any], tuple[str, ...]], dict[str, Any]]] = {
    "olmo2": _olmo2, "smollm3": _smollm3, "granite": _granite, "gpt-oss": _gptoss}


def own_config(md: dict[str, Any], names: tuple[str, ...]) -> dict[str, Any]:
    """The config dict (model_type and architectures included) of a file whose architecture has own_map."""
    arch = md["general.architecture"]
    entry = gguf_arch(arch)
    cfg = _OWN_MAPS[arch](md, names)
    return {"model_type": entry.model_type, "architectures": [entry.hf_architecture], **cfg}


def fix_transformers_config(md: dict[str, Any], cfg: dict[str, Any],
                            rope_freqs: list[float] | None = None) -> dict[str, Any]:
    """transformers' config dict for a file, with what its GGUF map drops put back: Qwen3's head_dim
    (`qwen3.attention.key_length`, which transformers ignores, so every Qwen3 file got 128); Qwen3-MoE's
    expert width (`qwen3moe.expert_feed_forward_length`, which it ignores too: every file got Qwen3MoeConfig's
    768, Qwen3-30B-A3B's, and a file of another width did not load; transformers' map already sets
    norm_topk_prob, which llama.cpp hardcodes for qwen3moe (there is no key), and every layer sparse); and the
    `rope_freqs.weight` tensor's per-frequency divisors as `rope_freq_factors` (args.rope_tables). That tensor is
    how convert_hf_to_gguf.py stores Llama 3's rope_scaling ("llama3": factor, low/high_freq_factor,
    original_max_position_embeddings), with no metadata key, and llama.cpp divides each frequency by it; without
    it a Llama 3.1 file ran with unscaled RoPE."""
    arch = md["general.architecture"]
    if arch == "qwen3" and (head_dim := md.get("qwen3.attention.key_length")) is not None:
        cfg = {**cfg, "head_dim": int(head_dim)}
    if arch == "qwen3moe" and (width := md.get("qwen3moe.expert_feed_forward_length")) is not None:
        cfg = {**cfg, "moe_intermediate_size": int(width), "norm_topk_prob": True, "decoder_sparse_step": 1,
               "mlp_only_layers": []}
    if rope_freqs is not None:
        cfg = {**cfg, "rope_freq_factors": list(rope_freqs)}
    return cfg
