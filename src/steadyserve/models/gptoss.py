"""gpt-oss (OpenAI's gpt-oss-20b and -120b): GQA attention with biases, attention sinks and a sliding window on
alternate layers, YaRN RoPE, and a sparse MoE block in every layer (moe.py) whose router picks the top k logits before
its softmax, with biased experts and a clamped SwiGLU.

What differs from Qwen3-MoE, and where it is computed:
* attention sinks: one learned logit per query head that joins each row's softmax as a key with no value
  (paged_attention.cpp's reduction order, step 4; models/attention.py for the Python paths);
* `layer_types`: "sliding_attention" layers attend to the last `sliding_window` tokens, "full_attention" to all;
* the router (moe.route, "topk_softmax"): bias added to the logits, the k largest taken (ties to the lower index),
  then the softmax over those k only (so the weights always sum to 1, with no renormalization step);
* experts (moe.MoeWeights' biases, layers' swiglu_oai): gate|up and down carry a bias each, and the activation is
  transformers' GptOssExperts._apply_gate: gate clamped above at `swiglu_limit`, up clamped to +-limit,
  (up + 1) * gate * sigmoid(alpha * gate), alpha = `swiglu_alpha` (1.702);
* checkpoints store each layer's experts fused and transposed (`experts.gate_up_proj` (E, hidden, 2 I) with gate
  and up interleaved along the last axis; `experts.down_proj` (E, I, hidden)): split_gptoss_experts turns them into
  the per-expert (N, K) matrices every path reads.
"""

from __future__ import annotations

from typing import Any

import torch

from .args import ModelArgs, common_args
from .moe import MoeSpec, expert_names

SWIGLU_ALPHA = 1.702  # GptOssConfig's default; a config may state its own (swiglu_alpha)


def gptoss_args(cfg: Any) -> ModelArgs:
    n = cfg.num_hidden_layers
    window = int(getattr(cfg, "sliding_window", 0) or 0)
    types = list(getattr(cfg, "layer_types", None) or ["full_attention"] * n)
    if len(types) != n or not set(types) <= {"sliding_attention", "full_attention"}:
        raise ValueError(f"layer_types {types} must name sliding_attention or full_attention for each of {n} layers")
    bias = bool(getattr(cfg, "attention_bias", True))
    return common_args(cfg, "GptOssForCausalLM", qkv_bias=bias, o_bias=bias,
                       layer_windows=tuple(window if t == "sliding_attention" else 0 for t in types),
                       attn_sinks=True, hidden_act="swiglu_oai",
                       swiglu_alpha=float(getattr(cfg, "swiglu_alpha", SWIGLU_ALPHA) or SWIGLU_ALPHA),
                       swiglu_limit=float(cfg.swiglu_limit),
                       num_experts=int(cfg.num_local_experts), num_experts_per_tok=int(cfg.num_experts_per_tok),
                       moe_intermediate_size=int(cfg.intermediate_size), moe_routing="topk_softmax", experts_layout="gptoss",
                       layer_moe=(True,) * n)


def split_gptoss_experts(weights: dict[str, Any], prefix: str, spec: MoeSpec) -> None:
    """A layer's fused gpt-oss experts under `prefix` ("model.layers.3.mlp.") become the names every path reads:
    the router `mlp.router.*` as `mlp.gate.*`, and per expert e gate, up and down (N, K) matrices with their biases
    (gate = the even columns of gate_up_proj[e], up = the odd ones, as GptOssExperts._apply_gate takes them).
    A layer already in per-expert names is left as it is."""
    for kind in ("weight", "bias"):
        if (t := weights.pop(prefix + f"router.{kind}", None)) is not None:
            weights[prefix + f"gate.{kind}"] = t
    gate_up = weights.pop(prefix + "experts.gate_up_proj", None)
    if gate_up is None:
        return
    down = weights.pop(prefix + "experts.down_proj")
    gu_bias = weights.pop(prefix + "experts.gate_up_proj_bias")
    d_bias = weights.pop(prefix + "experts.down_proj_bias")
    e, i = spec.num_experts, spec.expert_size
    if gate_up.shape[0] != e or gate_up.shape[2] != 2 * i or tuple(down.shape[:2]) != (e, i):
        raise ValueError(f"{prefix}experts: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
                         f"do not hold {e} experts of width {i}")
    for x in range(e):
        g, u, d = expert_names(prefix, x)
        weights[g] = gate_up[x, :, 0::2].t().contiguous()  # (I, hidden)
        weights[u] = gate_up[x, :, 1::2].t().contiguous()
        weights[d] = down[x].t().contiguous()  # (hidden, I)
        weights[g.replace(".weight", ".bias")] = gu_bias[x, 0::2].contiguous()
        weights[u.replace(".weight", ".bias")] = gu_bias[x, 1::2].contiguous()
        weights[d.replace(".weight", ".bias")] = d_bias[x].contiguous()


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """(T, 2 I) gate|up -> (T, I): transformers' GptOssExperts._apply_gate on de-interleaved halves, in PyTorch's
    ops (the host path; the native paths run kernels/csrc's qswiglu_oai_mul)."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))
