"""Qwen2: biases on q/k/v (not o), usually untied embeddings."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def qwen2_args(cfg: Any) -> ModelArgs:
    window = int(getattr(cfg, "sliding_window", None) or 0) if getattr(cfg, "use_sliding_window", False) else 0
    return common_args(cfg, "Qwen2ForCausalLM", qkv_bias=True, sliding_window=window)
