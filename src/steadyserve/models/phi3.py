"""Phi-3 (Phi3ForCausalLM; also Phi-4-mini's class): Llama's block with fused q|k|v and gate|up matrices.

Its sliding window (Phi-3-mini-4k: 2047) applies to every layer, as in transformers. LongRoPE
(the 128k variants): transformers switches every position of a forward pass to `long_factor` once
the sequence passes original_max_position_embeddings, so a token's rotation depends on how long its
sequence has grown; a table by absolute position cannot follow that, so the context is capped at
original_max_position_embeddings, where `short_factor` holds for every token in both. A partial
rotary factor is refused.
"""

from __future__ import annotations

from typing import Any

from .args import ModelArgs, common_args


def phi3_args(cfg: Any) -> ModelArgs:
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"Phi3ForCausalLM: partial_rotary_factor={rope['partial_rotary_factor']} is not supported")
    limit = cfg.max_position_embeddings
    if rope.get("rope_type") == "longrope":
        original = rope.get("original_max_position_embeddings") or cfg.original_max_position_embeddings
        limit = min(limit, int(original))
    return common_args(cfg, "Phi3ForCausalLM", fused_weights=True, max_position_embeddings=limit,
                       sliding_window=int(getattr(cfg, "sliding_window", None) or 0))
