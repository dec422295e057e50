"""Qwen3-MoE (Qwen3-30B-A3B and family): Qwen3's attention (q/k norm, GQA) with sparse MoE blocks (moe.py).

A layer is sparse as transformers' Qwen3MoeDecoderLayer decides: not in `mlp_only_layers`, experts configured, and
(i + 1) % decoder_sparse_step == 0; the other layers keep the dense MLP of `intermediate_size`. A GGUF file
(llama.cpp's `qwen3moe`) has no key for either, and llama.cpp makes every layer sparse: gguf_check refuses a file
whose tensors say otherwise. Qwen3-MoE's sliding-window settings are unused by transformers (every layer attends
globally), and so here.
"""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def qwen3moe_args(cfg: Any) -> ModelArgs:
    # Qwen's config.json says num_experts; transformers v5 saves it as num_local_experts (its attribute_map), and a
    # generic config read back from the conversion cache knows only the name that was saved
    experts = int(getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None) or 0)
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    dense = set(getattr(cfg, "mlp_only_layers", None) or [])
    n = cfg.num_hidden_layers
    sparse = tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n))
    bias = bool(getattr(cfg, "attention_bias", False))
    return common_args(cfg, "Qwen3MoeForCausalLM", qkv_bias=bias, o_bias=bias, qk_norm=True,
                       num_experts=experts, num_experts_per_tok=int(getattr(cfg, "num_experts_per_tok", 0) or 0),
                       moe_intermediate_size=int(getattr(cfg, "moe_intermediate_size", 0) or 0),
                       norm_topk_prob=bool(getattr(cfg, "norm_topk_prob", False)),
                       layer_moe=sparse if any(sparse) else ())
