"""The architectures beyond Llama (Gemma 2 and 3, Qwen3, Phi-3, OLMo 2, SmolLM3, Granite): what differs at load and
around the layers, on the same weights, kernels and cache.

Their layers are not here: a layer is its LayerSpec (layer_spec.py: q/k norm, norms after attention and
MLP or only there, GELU-tanh, the score scale and soft-cap, the residual multiplier, per-layer windows
and RoPE tables or none), which Transformer's per-op path and the native one-call layers both run.
What this subclass adds:
* (1 + w) norms (Gemma): the offset is added to each norm weight once at load, in float32, exactly
  as transformers computes `1.0 + weight.float()` in every forward, so the norm is the plain
  RMSNorm kernel with that weight;
* fused q|k|v and gate|up matrices (Phi-3), cut into row ranges at load (views of the same rows);
* a scaled embedding (Gemma: sqrt(hidden), rounded to the model dtype as transformers does; Granite);
* Gemma 2's soft-capped logits (the attention extension's softcap_, the same deterministic tanh) and
  Granite's logit divisor (elementwise, exact).

Every step is row-wise and either a native kernel or one exact IEEE operation per element, so batch
invariance holds by the same argument as for Llama.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels.quant import QMatrix, QWeight
from .args import ModelArgs
from .attention import AttentionFn
from .layers import RowTiler
from .transformer import Transformer


def _split(weights: dict[str, torch.Tensor | QWeight], fused: str, names: list[str], sizes: list[int]) -> None:
    """Replace `fused`.weight/.bias by consecutive row ranges named `names`: views, no value changes."""
    for kind in ("weight", "bias"):
        t = weights.pop(f"{fused}.{kind}", None)
        if t is None:
            continue
        if (t.n if isinstance(t, QWeight) else t.shape[0]) != sum(sizes):
            raise ValueError(f"{fused}.{kind}: {sum(sizes)} rows expected")
        start = 0
        for name, size in zip(names, sizes):
            rows = slice(start, start + size)
            weights[f"{name}.{kind}"] = (QWeight(t.data[rows], t.fmt, t.k, f"{t.name}[{start}:{start + size}]")
                                         if isinstance(t, QWeight) else t[rows])
            start += size


class ExtendedTransformer(Transformer):
    """Transformer with the load-time and model-level variants of the module docstring. Same interface, same cache
    layout, the same layers (Transformer's, from the LayerSpec)."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor | QWeight], device: torch.device,
                 dtype: torch.dtype, tiler: RowTiler, max_len: int, attention: AttentionFn, kernel_id: str,
                 native: bool = False) -> None:
        h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
        for i in range(args.num_layers):  # Phi-3's fused matrices, cut into the names the builder fuses again
            a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            _split(weights, a + "qkv_proj", [a + "q_proj", a + "k_proj", a + "v_proj"], [h * d, hkv * d, hkv * d])
            _split(weights, m + "gate_up_proj", [m + "gate_proj", m + "up_proj"], [args.intermediate_size] * 2)
        if args.norm_offset:  # (offset + w) in float32, once: transformers' `1.0 + weight.float()`
            for name in [n for n in weights if n.endswith("norm.weight")]:
                t = weights[name]
                assert isinstance(t, torch.Tensor)
                weights[name] = t.float() + args.norm_offset
        super().__init__(args, weights, device, dtype, tiler, max_len, attention, kernel_id, native)
        # transformers multiplies by the scale as a tensor cast to the weights' dtype
        self.embed_scale = torch.tensor(args.embed_scale, dtype=torch.float32).to(device=device, dtype=dtype)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The embedding rows, scaled (Gemma, Granite): one exact multiply per element."""
        x = super()._embed(input_ids)
        return x * self.embed_scale if self.args.embed_scale != 1.0 else x

    def _head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Row-wise: (R, hidden) -> (R, V) float32 log-probabilities (into `out` on the native path);
        logits soft-capped (Gemma 2) or divided (Granite) first."""
        div, cap = self.args.logits_divisor, self.args.final_softcap
        if div == 1.0 and not cap:
            return super()._head(hidden, out)
        if isinstance(self.lm_head, QMatrix):
            logits = self.lm_head(hidden.contiguous(), out=out)  # (R, V) float32
        else:
            logits = torch.cat([F.linear(hidden, part) for part in self.lm_head_parts], dim=1).float()  # (R, V)
        if cap:
            if self.native_attention:  # the attention extension's deterministic tanh, elementwise
                torch.ops.steadyserve.softcap_(logits, cap)
            else:
                logits = torch.tanh(logits / cap) * cap
        if div != 1.0:
            logits = logits.div_(div) if isinstance(self.lm_head, QMatrix) else logits / div  # in place: the same bits
        if isinstance(self.lm_head, QMatrix):
            torch.ops.steadyserve.qlog_softmax_(logits, -1)  # in place, in the caller's buffer
            return logits
        return torch.log_softmax(logits, dim=-1)
