"""Gemma 3 (text-only, Gemma3ForCausalLM): the block is extended.py's, configured as transformers does.

Local (sliding-window) layers and global ones follow `config.layer_types` (transformers derives it
from `sliding_window_pattern` when a config only gives the pattern), each type with its own
rope_parameters entry; norms scale by (1 + w); the MLP is GELU-tanh; the embedding is scaled by
sqrt(hidden); scores by query_pre_attn_scalar ** -0.5. Soft-capping (Gemma 2, off in Gemma 3) and
bidirectional attention are refused by name rather than ignored.
"""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def layer_windows(cfg: Any) -> tuple[int, ...]:
    """Per layer: the config's sliding window for a "sliding_attention" layer, 0 for a global one."""
    window = int(getattr(cfg, "sliding_window", None) or 0)
    return tuple(window if t == "sliding_attention" else 0 for t in cfg.layer_types)


def gemma3_args(cfg: Any) -> ModelArgs:
    for name in ("final_logit_softcapping", "attn_logit_softcapping"):
        if getattr(cfg, name, None):
            raise ValueError(f"Gemma3ForCausalLM: {name}={getattr(cfg, name)} is not supported")
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError("Gemma3ForCausalLM: use_bidirectional_attention is not supported")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"Gemma3ForCausalLM: hidden_activation {act!r} is not supported")
    bias = bool(getattr(cfg, "attention_bias", False))
    return common_args(cfg, "Gemma3ForCausalLM", qkv_bias=bias, o_bias=bias,
                       qk_norm=True, norm_offset=1.0, sandwich_norm=True, hidden_act=_ACTIVATIONS[act],
                       embed_scale=cfg.hidden_size ** 0.5, attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5,
                       layer_windows=layer_windows(cfg), layer_rope=tuple(cfg.layer_types))
