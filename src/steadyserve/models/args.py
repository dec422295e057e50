"""Architecture-neutral hyper-parameters of a decoder-only transformer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ModelArgs:
    architecture: str  # the HF architecture name, e.g. "LlamaForCausalLM"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads; num_heads % num_kv_heads == 0 (grouped-query attention)
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int  # the model's own context length
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool = False  # Qwen2: biases on q/k/v projections
    o_bias: bool = False  # Llama's attention_bias also puts one on o_proj
    mlp_bias: bool = False
    sliding_window: int = 0  # Mistral v0.1: keys older than this are not attended; 0 = none
    hf_config: Any = field(default=None, compare=False, repr=False)  # kept for RoPE init

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")

    @property
    def num_params(self) -> int:
        """Parameter count, counting a tied embedding once."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h


def rope_tables(args: ModelArgs, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_len, head_dim) in float32, as transformers computes them.

    A table lookup by absolute position makes RoPE independent of how tokens are
    batched: the same position always reads the same row.
    """
    cfg = args.hf_config
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = 1.0
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        dim = args.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"))
        inv_freq = inv_freq.float()
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (L, D/2)
    emb = torch.cat([freqs, freqs], dim=-1)  # (L, D)
    return emb.cos() * scaling, emb.sin() * scaling


def common_args(cfg: Any, arch: str, **overrides: Any) -> ModelArgs:
    """The fields every Llama-family config spells the same way."""
    heads = cfg.num_attention_heads
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        hf_config=cfg,
    )
    fields.update(overrides)
    return ModelArgs(**fields)
