"""Architecture-neutral hyper-parameters of a decoder-only transformer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from .rope_trig import cos_sin


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
    # The variants below default to the Llama block. The layer's are read through one LayerSpec (layer_spec.py) by
    # every layer path; the load-time and model-level ones (norm_offset, fused_weights, embed_scale, the logits'
    # softcap and divisor) run in extended.py.
    qk_norm: bool = False  # an RMSNorm over each q and each k head, before RoPE
    norm_offset: float = 0.0  # every norm scales by (norm_offset + w): Gemma's (1 + w)
    sandwich_norm: bool = False  # Gemma: norms on the attention and MLP outputs too, before each residual add
    hidden_act: str = "silu"  # the gated MLP's activation: "silu" or "gelu_tanh"
    embed_scale: float = 1.0  # the embedding rows are multiplied by this (Gemma: sqrt(hidden))
    attn_scale: float = 0.0  # attention score scale; 0 means head_dim ** -0.5
    layer_windows: tuple[int, ...] = ()  # per layer: its sliding window, 0 = global; () = sliding_window for all
    layer_rope: tuple[str, ...] = ()  # per layer: its key in rope_parameters (Gemma 3's layer types); () = one RoPE
    fused_weights: bool = False  # Phi-3: q|k|v and gate|up stored as one matrix each (qkv_proj, gate_up_proj)
    pre_norm: bool = True  # norms before attention and MLP; OLMo 2 has only the ones after (sandwich_norm)
    qk_norm_per_head: bool = True  # q/k norm per head (Qwen3, Gemma 3), or over all heads at once (OLMo 2)
    layer_use_rope: tuple[bool, ...] = ()  # per layer: whether it rotates q and k (SmolLM3: not every 4th); () = all
    residual_scale: float = 1.0  # Granite: each block's output is multiplied by this before its residual add
    logits_divisor: float = 1.0  # Granite: logits are divided by this before the log-softmax
    attn_softcap: float = 0.0  # Gemma 2: scaled scores become tanh(s / cap) * cap; 0 = none
    final_softcap: float = 0.0  # Gemma 2: logits become tanh(l / cap) * cap; 0 = none
    # Sparse mixture-of-experts layers (Qwen3-MoE, moe.py): the MLP of a layer in layer_moe is a router and experts.
    num_experts: int = 0  # experts per sparse layer; 0 = every layer has the dense MLP
    num_experts_per_tok: int = 0  # experts each token uses (top-k)
    moe_intermediate_size: int = 0  # each expert's SwiGLU width
    norm_topk_prob: bool = False  # the top-k probabilities renormalized to sum to 1
    layer_moe: tuple[bool, ...] = ()  # per layer: a sparse block instead of the dense MLP; () = none
    moe_routing: str = "softmax_topk"  # moe.route's order: softmax then top-k (Qwen3), or "topk_softmax" (gpt-oss)
    experts_layout: str = "stacked"  # a checkpoint's fused experts: transformers' (E, 2I, H) gate|up, or "gptoss"
    # gpt-oss (gptoss.py): attention sinks, and the clamped SwiGLU of hidden_act "swiglu_oai"
    attn_sinks: bool = False  # one learned logit per query head joins each row's softmax (self_attn.sinks)
    swiglu_alpha: float = 0.0  # the swish's slope: gate * sigmoid(alpha * gate)
    swiglu_limit: float = 0.0  # gate clamped above at this, up to +-this

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) is not a multiple of "
                             f"num_key_value_heads ({self.num_kv_heads})")
        if any(self.layer_moe) and not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.num_experts_per_tok}) must be 1 to num_experts "
                             f"({self.num_experts})")

    @property
    def extended(self) -> bool:
        """Whether loading or the model's ends differ from Llama's, so extended.py must run it (the layers' variants
        are the LayerSpec's, which Transformer runs for every architecture)."""
        return (self.norm_offset != 0.0 or self.fused_weights or self.embed_scale != 1.0 or self.logits_divisor != 1.0
                or self.final_softcap != 0.0)

    def window(self, layer: int) -> int:
        """The sliding window of `layer`, 0 for a global layer."""
        return self.layer_windows[layer] if self.layer_windows else self.sliding_window

    @property
    def num_params(self) -> int:
        """Parameter count, counting a tied embedding once."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        sparse = sum(self.layer_moe)
        mlp = 3 * h * i * (self.num_layers - sparse)
        mlp += sparse * (self.num_experts * 3 * h * self.moe_intermediate_size + self.num_experts * h)
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + 2 * h) + mlp + emb + h


def rope_tables(args: ModelArgs, max_len: int, layer_type: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables (max_len, head_dim) in float32: transformers' angles, their cos and sin by rope_trig's
    fixed method (the same bits on every machine and in every process, whatever PyTorch's math library does).

    A table lookup by absolute position makes RoPE independent of how tokens are
    batched: the same position always reads the same row. Models whose RoPE differs
    per layer type (Gemma 3: local and global bases) keep one rope_parameters entry
    per type; `layer_type` picks one (default: layer 0's).
    """
    cfg = args.hf_config
    if layer_type is None and args.layer_rope:
        layer_type = args.layer_rope[0]
    params = dict(getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {})
    if layer_type is not None:
        params = dict(params[layer_type])
    rope_type = params.get("rope_type", params.get("type", "default"))
    scaling = 1.0
    if rope_type == "default":
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        dim = args.head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        if (factors := getattr(cfg, "rope_freq_factors", None)) is not None:  # a GGUF's rope_freqs (gguf_config)
            inv_freq = inv_freq / torch.tensor(factors, dtype=torch.float32)
    else:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        if rope_type not in ROPE_INIT_FUNCTIONS:
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        extra = {"layer_type": layer_type} if layer_type is not None else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](cfg, torch.device("cpu"), **extra)
        inv_freq = inv_freq.float()
    pos = torch.arange(max_len, dtype=torch.float32)
    freqs = pos[:, None] * inv_freq[None, :]  # (L, D/2) float32, as transformers' angles
    cos, sin = cos_sin(freqs, float(scaling))  # (L, D/2) each: fixed float64 method, not the library's cos
    return torch.cat([cos, cos], dim=-1), torch.cat([sin, sin], dim=-1)  # (L, D)


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
