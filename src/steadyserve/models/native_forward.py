"""All decoder layers of a forward pass in one native call, where the layers are the plain Llama shape.

`Transformer.forward` on the native path runs each layer as about twenty op calls from Python. At one
stream a decode step is a few milliseconds and those calls were a fifth of it, so the loop over layers
moves into C++ (kernels/csrc/forward.cpp, `steadyserve.NativeLayers`): the same kernels in the same
order on the same tensors, hence the same bits, which tests/test_native_forward.py checks against the
per-op path for prefill and decode. The per-op path stays the reference and serves whatever this does
not: the host numerics path, Python attention, and architectures whose layers differ from Llama's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..kernels.quant import QMatrix

# Architectures whose layer is exactly norm → q|k|v (+bias) → RoPE → attention → o → norm → gate|up → SiLU·mul
# → down, which is all NativeLayers computes. A new architecture joins only with a bitwise test.
PLAIN_LAYER_ARCHITECTURES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})


def build_native_layers(model: Any) -> Any | None:
    """A steadyserve.NativeLayers holding a Transformer's layers, or None where the per-op path must run.

    (`model` is the Transformer being built; typed Any because transformer.py imports this module.)"""
    a = model.args
    if not (model.native and model.native_rope and a.architecture in PLAIN_LAYER_ARCHITECTURES):
        return None
    layers = torch.classes.steadyserve.NativeLayers(a.num_heads, a.num_kv_heads, a.head_dim, float(a.rms_norm_eps),
                                                    float(model.scale), int(a.sliding_window or 0))
    empty = torch.empty(0)
    for lw in model.layers:
        mats = (lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down)
        assert all(isinstance(m, QMatrix) for m in mats)
        parts = [p for m in mats for p in m.parts]  # type: ignore[union-attr]
        layers.add_layer(lw.input_norm, lw.post_norm, [p.data for p in parts], [p.fmt for p in parts],
                         [len(m.parts) for m in mats],  # type: ignore[union-attr]
                         [b if b is not None else empty for b in (lw.bqkv, lw.bo, lw.b_gate_up, lw.b_down)])
    return layers
