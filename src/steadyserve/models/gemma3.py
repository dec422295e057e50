"""Gemma 3 (text-only, Gemma3ForCausalLM) and Gemma 2: extended.py's block, configured as transformers does.

Local (sliding-window) layers and global ones follow `config.layer_types` (transformers derives it
from `sliding_window_pattern` when a config only gives the pattern), each type with its own
rope_parameters entry; norms scale by (1 + w); the MLP is GELU-tanh; the embedding is scaled by
sqrt(hidden); scores by query_pre_attn_scalar ** -0.5; Gemma 2 soft-caps scores and logits (Gemma 3's
config may too; it is honoured wherever set). Bidirectional attention is refused by name.
"""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args

_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "silu": "silu"}


def layer_windows(cfg: Any) -> tuple[int, ...]:
    """Per layer: the config's sliding window for a "sliding_attention" layer, 0 for a global one."""
    window = int(getattr(cfg, "sliding_window", None) or 0)
    return tuple(window if t == "sliding_attention" else 0 for t in cfg.layer_types)


def _gemma_args(cfg: Any, arch: str, **fields: Any) -> ModelArgs:
    """What Gemma 2 and 3 share: (1 + w) sandwich norms, GELU-tanh, the scaled embedding and score scale."""
    if getattr(cfg, "use_bidirectional_attention", False):
        raise ValueError(f"{arch}: use_bidirectional_attention is not supported")
    act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
    if act not in _ACTIVATIONS:
        raise ValueError(f"{arch}: hidden_activation {act!r} is not supported")
    bias = bool(getattr(cfg, "attention_bias", False))
    return common_args(cfg, arch, qkv_bias=bias, o_bias=bias, norm_offset=1.0, sandwich_norm=True,
                       hidden_act=_ACTIVATIONS[act], embed_scale=cfg.hidden_size ** 0.5,
                       attn_scale=float(cfg.query_pre_attn_scalar) ** -0.5, layer_windows=layer_windows(cfg),
                       attn_softcap=float(getattr(cfg, "attn_logit_softcapping", None) or 0.0),
                       final_softcap=float(getattr(cfg, "final_logit_softcapping", None) or 0.0), **fields)


def gemma3_args(cfg: Any) -> ModelArgs:
    """Gemma 3 adds q/k norm and a RoPE per layer type (local and global bases)."""
    return _gemma_args(cfg, "Gemma3ForCausalLM", qk_norm=True, layer_rope=tuple(cfg.layer_types))


def gemma2_args(cfg: Any) -> ModelArgs:
    """Gemma 2: alternating local and global layers with one RoPE, and soft-capped scores and logits."""
    return _gemma_args(cfg, "Gemma2ForCausalLM")
