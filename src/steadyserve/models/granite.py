"""Granite: Llama's block with four multipliers: embedding, residual, attention (the score scale) and logits."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def granite_args(cfg: Any) -> ModelArgs:
    bias = bool(getattr(cfg, "attention_bias", False))
    return common_args(cfg, "GraniteForCausalLM", qkv_bias=bias, o_bias=bias,
                       mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                       embed_scale=float(cfg.embedding_multiplier), residual_scale=float(cfg.residual_multiplier),
                       attn_scale=float(cfg.attention_multiplier), logits_divisor=float(cfg.logits_scaling))
