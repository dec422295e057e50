"""OLMo 2: norms after attention and after the MLP (none before), and a q/k norm over all heads at once."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def olmo2_args(cfg: Any) -> ModelArgs:
    bias = bool(getattr(cfg, "attention_bias", False))
    return common_args(cfg, "Olmo2ForCausalLM", qkv_bias=bias, o_bias=bias, qk_norm=True, qk_norm_per_head=False,
                       sandwich_norm=True, pre_norm=False)
