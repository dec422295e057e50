"""Llama 2/3 (incl. Llama 3 RoPE scaling) and SmolLM/SmolLM2, which are Llama."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def llama_args(cfg: Any) -> ModelArgs:
    bias = bool(getattr(cfg, "attention_bias", False))
    return common_args(cfg, "LlamaForCausalLM", qkv_bias=bias, o_bias=bias,
                       mlp_bias=bool(getattr(cfg, "mlp_bias", False)))
