"""Mistral: Llama with an optional sliding attention window."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def mistral_args(cfg: Any) -> ModelArgs:
    return common_args(cfg, "MistralForCausalLM", sliding_window=int(getattr(cfg, "sliding_window", None) or 0))
