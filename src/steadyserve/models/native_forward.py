"""All decoder layers of a forward pass in one native call, for every architecture whose LayerSpec it runs.

`Transformer.forward` on the native path runs each layer as about twenty op calls from Python. At one
stream a decode step is a few milliseconds and those calls were a fifth of it, so the loop over layers
moves into C++ (kernels/csrc/forward.cpp, `steadyserve.NativeLayers`): the same kernels in the same
order on the same tensors, hence the same bits, which tests/test_native_forward.py checks against the
per-op path for prefill and decode, per architecture. Both read the model's LayerSpec (layer_spec.py);
which specs this call runs is layer_spec.native_supports' decision alone. The per-op path stays the
reference and serves the rest: the host numerics path and Python attention.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.quant import QMatrix
from .layer_spec import LayerSpec, native_supports

_QK_NORM_HEADS = {"none": 0, "per_head": 1, "all_heads": 2}  # NativeLayers' qk_norm_heads argument
_ACTIVATIONS = {"silu": 0, "gelu_tanh": 1, "swiglu_oai": 2}  # its act argument (ops.h's GatedAct kinds)


def build_native_layers(model: Any, spec: LayerSpec | None = None) -> Any | None:
    """A steadyserve.NativeLayers holding a Transformer's layers, or None where the per-op path must run.

    `spec`: what the layers compute, model.spec unless a test drops a feature to show its bitwise check fails;
    a norm the spec does not place is not passed. (`model` is the Transformer being built; typed Any because
    transformer.py imports this module.)"""
    spec = spec or model.spec
    if not (model.native and model.native_rope and native_supports(spec)):
        return None
    layers = torch.classes.steadyserve.NativeLayers(
        spec.num_heads, spec.num_kv_heads, spec.head_dim, float(spec.eps), float(spec.attn_scale),
        float(spec.attn_softcap), spec.pre_norm, _QK_NORM_HEADS[spec.qk_norm], _ACTIVATIONS[spec.activation],
        float(spec.act_alpha), float(spec.act_limit), float(spec.residual_scale))
    kinds = list(model.rope)  # the order Transformer.forward passes the tables in
    empty = torch.empty(0)
    for i, lw in enumerate(model.layers):
        mats = [lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down]  # a sparse layer has no gate|up or down
        pre, qk, post = spec.pre_norm, spec.qk_norm != "none", spec.post_norms
        norms = (lw.input_norm if pre else None, lw.post_norm if pre else None, lw.q_norm if qk else None,
                 lw.k_norm if qk else None, lw.attn_out_norm if post else None, lw.mlp_out_norm if post else None)
        rope = spec.rope[i]
        layers.add_layer([n if n is not None else empty for n in norms], *_parts(mats),
                         [b if b is not None else empty for b in (lw.bqkv, lw.bo, lw.b_gate_up, lw.b_down)],
                         int(spec.windows[i]), kinds.index(rope) if rope is not None else -1,
                         lw.sinks if spec.attn_sinks and lw.sinks is not None else empty)
        if lw.moe is not None and spec.moe is not None:
            layers.add_experts(spec.moe.top_k, spec.moe.norm_topk_prob, spec.moe.routing == "topk_softmax",
                               spec.moe.expert_size, *_parts(lw.moe.matrices()),
                               [b if b is not None else empty for b in lw.moe.biases])
    return layers


def _parts(mats: list[Any]) -> tuple[list[torch.Tensor], list[int], list[int]]:
    """NativeLayers' flat form of matrices (QMatrix, or None for one it does not have): every part's data and
    format id, and how many parts each matrix has."""
    assert all(m is None or isinstance(m, QMatrix) for m in mats)
    parts = [p for m in mats if m is not None for p in m.parts]
    return [p.data for p in parts], [p.fmt for p in parts], [len(m.parts) if m is not None else 0 for m in mats]
