"""Qwen3: Llama's block with an RMSNorm over each q and k head before RoPE; optional sliding layers."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def qwen3_args(cfg: Any) -> ModelArgs:
    bias = bool(getattr(cfg, "attention_bias", False))
    types = list(getattr(cfg, "layer_types", None) or [])
    window = int(getattr(cfg, "sliding_window", None) or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types) if any(
        t == "sliding_attention" for t in types) else ()
    return common_args(cfg, "Qwen3ForCausalLM", qkv_bias=bias, o_bias=bias, qk_norm=True, layer_windows=windows)
