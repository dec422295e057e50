"""SmolLM3: Llama's block, but the layers config.no_rope_layers marks 0 (every 4th by default) skip RoPE."""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def smollm3_args(cfg: Any) -> ModelArgs:
    bias = bool(getattr(cfg, "attention_bias", False))
    types = list(getattr(cfg, "layer_types", None) or [])
    window = int(getattr(cfg, "sliding_window", None) or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types) if "sliding_attention" in types else ()
    return common_args(cfg, "SmolLM3ForCausalLM", qkv_bias=bias, o_bias=bias, layer_windows=windows,
                       mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
                       layer_use_rope=tuple(bool(u) for u in cfg.no_rope_layers))
