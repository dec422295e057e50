"""The block variants beyond Llama's (Gemma 2 and 3, Qwen3, Phi-3, OLMo 2, SmolLM3, Granite), on the same weights,
kernels and cache.

What differs from transformer.py's Llama block, each switched by a ModelArgs field:
* q/k norm (Qwen3, Gemma 3): an RMSNorm over each q and k head, before RoPE;
* (1 + w) norms (Gemma): the offset is added to each norm weight once at load, in float32, exactly
  as transformers computes `1.0 + weight.float()` in every forward, so the norm is the plain
  RMSNorm kernel with that weight;
* sandwich norms (Gemma): the attention and MLP outputs are normed before their residual adds, and
  the MLP input has its own norm (pre_feedforward_layernorm);
* GELU-tanh MLP (Gemma): the native qgelu_tanh_mul kernel, or F.gelu on the host path;
* a scaled embedding (Gemma: sqrt(hidden), rounded to the model dtype as transformers does), an
  attention scale of its own (query_pre_attn_scalar ** -0.5);
* per-layer sliding windows and RoPE tables (Gemma 3: local layers with a window and base 10k,
  global layers with neither);
* fused q|k|v and gate|up matrices (Phi-3), cut into row ranges at load (views of the same rows);
* Gemma 2: soft-capped attention scores (in the attention kernels) and logits (the attention
  extension's softcap_, the same deterministic tanh);
* OLMo 2: norms only after attention and MLP, q/k norm over all heads at once; SmolLM3: layers
  without RoPE; Granite: embedding, residual, attention and logit multipliers (elementwise, exact).

It is a subclass so that the Llama path and its bits stay exactly as they are. Every new step is
row-wise and either a native kernel (norms, GELU) or one exact IEEE operation per element (the
embedding scale, copies), so batch invariance holds by the same argument as for Llama; the window
is a mask inside the attention kernels, whose reduction order it does not change.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from ..kernels.build import NATIVE_KERNEL_ID
from ..kernels.quant import QMatrix, QWeight
from .args import ModelArgs, rope_tables
from .attention import AttentionFn, write_kv
from .layers import RowTiler, apply_rope
from .transformer import ForwardBatch, LayerWeights, Transformer


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


@dataclass
class ExtendedLayerWeights(LayerWeights):
    q_norm: torch.Tensor | None = None  # (D,), shared by every q head
    k_norm: torch.Tensor | None = None  # (D,)
    attn_out_norm: torch.Tensor | None = None  # (hidden,), on the attention output before its residual add
    mlp_out_norm: torch.Tensor | None = None  # (hidden,), on the MLP output before its residual add


class ExtendedTransformer(Transformer):
    """Transformer with the block variants of the module docstring. Same interface, same cache layout."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor | QWeight], device: torch.device,
                 dtype: torch.dtype, tiler: RowTiler, max_len: int, attention: AttentionFn, kernel_id: str,
                 native: bool = False) -> None:
        if args.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden activation {args.hidden_act!r}")
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

        def vec(name: str) -> torch.Tensor | None:
            t = weights.pop(name, None)
            if t is None:
                return None
            assert isinstance(t, torch.Tensor), name
            return t.to(device=device, dtype=torch.float32 if native else dtype, copy=True).contiguous()

        extra: list[dict[str, Any]] = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            e = {"q_norm": vec(p + "self_attn.q_norm.weight"), "k_norm": vec(p + "self_attn.k_norm.weight")}
            if args.qk_norm and (e["q_norm"] is None or e["k_norm"] is None):
                raise KeyError(f"{p}self_attn.q_norm.weight / k_norm.weight")
            if args.sandwich_norm:
                # post_attention_layernorm norms the attention output here (Gemma, OLMo 2). Gemma's MLP input
                # norm, pre_feedforward_layernorm, takes the slot the Llama block reads as its pre-MLP norm.
                e["attn_out_norm"] = vec(p + "post_attention_layernorm.weight")
                e["mlp_out_norm"] = vec(p + "post_feedforward_layernorm.weight")
                if args.pre_norm:
                    weights[p + "post_attention_layernorm.weight"] = weights.pop(p + "pre_feedforward_layernorm.weight")
            if not args.pre_norm:  # OLMo 2: no norm before attention or MLP; placeholders the block never reads
                for name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
                    weights[p + name] = torch.ones(args.hidden_size)
            extra.append(e)
        super().__init__(args, weights, device, dtype, tiler, max_len, attention, kernel_id, native)
        self.layers = [ExtendedLayerWeights(**{f.name: getattr(lw, f.name) for f in fields(LayerWeights)}, **e)
                       for lw, e in zip(self.layers, extra)]
        # Per layer: a key into self.rope and a window. The base class built layer 0's table.
        self.layer_rope = list(args.layer_rope) or [""] * args.num_layers
        self.rope = {self.layer_rope[0]: (self.cos, self.sin)}
        for kind in dict.fromkeys(self.layer_rope):
            if kind not in self.rope:
                cos, sin = rope_tables(args, max_len, kind)
                self.rope[kind] = (cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype))
        self.windows = [args.window(i) for i in range(args.num_layers)]
        self.use_rope = list(args.layer_use_rope) or [True] * args.num_layers  # SmolLM3's NoPE layers: False
        if args.attn_scale:
            self.scale = args.attn_scale
        # transformers multiplies by the scale as a tensor cast to the weights' dtype
        self.embed_scale = torch.tensor(args.embed_scale, dtype=torch.float32).to(device=device, dtype=dtype)

    def _qkv(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             rope: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row-wise: norm, fused q|k|v projection, q/k norm, RoPE. x: (T, hidden) -> (T, H, D), (T, Hkv, D) x 2."""
        assert isinstance(lw, ExtendedLayerWeights)
        a = self.args
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self._linear(self._norm(x, lw.input_norm) if a.pre_norm else x, lw.wqkv, lw.bqkv)  # (T, (H+2Hkv)*D)
        t = qkv.shape[0]
        if lw.q_norm is not None and lw.k_norm is not None:  # per head: each head its own row of the norm kernel
            qh, kh = (h, hkv) if a.qk_norm_per_head else (1, 1)
            qkv[:, :h * d] = self._norm(qkv[:, :h * d].reshape(t * qh, -1), lw.q_norm).view(t, h * d)
            qkv[:, h * d:(h + hkv) * d] = self._norm(qkv[:, h * d:(h + hkv) * d].reshape(t * kh, -1),
                                                     lw.k_norm).view(t, hkv * d)
        v = qkv[:, (h + hkv) * d:].view(-1, hkv, d)
        if not rope:
            return qkv[:, :h * d].view(-1, h, d), qkv[:, h * d:(h + hkv) * d].view(-1, hkv, d), v
        if self.native_rope:  # q and k heads in place, one pass; the same bits as apply_rope
            torch.ops.steadyserve.rope_(qkv, cos, sin, h + hkv)
            return qkv[:, :h * d].view(-1, h, d), qkv[:, h * d:(h + hkv) * d].view(-1, hkv, d), v
        qk = apply_rope(qkv[:, :(h + hkv) * d].view(-1, h + hkv, d), cos, sin)
        return qk[:, :h], qk[:, h:], v

    def _gated_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2 * inter) -> act(gate) * up, (T, inter)."""
        gelu = self.args.hidden_act == "gelu_tanh"
        if self.native:
            op = torch.ops.steadyserve.qgelu_tanh_mul if gelu else torch.ops.steadyserve.qsilu_mul
            return op(gate_up, -1)
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up

    def _out_mlp(self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Row-wise: output projection (+ norm) + residual, norm, gated MLP (+ norm) + residual."""
        assert isinstance(lw, ExtendedLayerWeights)
        o = self._linear(attn.reshape(attn.shape[0], -1), lw.wo, lw.bo)  # (T, hidden)
        if lw.attn_out_norm is not None:
            o = self._norm(o, lw.attn_out_norm)
        rs = self.args.residual_scale
        x = x + (o * rs if rs != 1.0 else o)  # Granite's residual multiplier: one exact multiply per element
        pre = self._norm(x, lw.post_norm) if self.args.pre_norm else x
        gate_up = self._linear(pre, lw.w_gate_up, lw.b_gate_up)  # (T, 2 * inter)
        m = self._linear(self._gated_act(gate_up), lw.w_down, lw.b_down)  # (T, hidden)
        if lw.mlp_out_norm is not None:
            m = self._norm(m, lw.mlp_out_norm)
        return x + (m * rs if rs != 1.0 else m)

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
            if self.kernel_id == NATIVE_KERNEL_ID:  # the attention extension's deterministic tanh, elementwise
                torch.ops.steadyserve.softcap_(logits, cap)
            else:
                logits = torch.tanh(logits / cap) * cap
        if div != 1.0:
            logits = logits.div_(div) if isinstance(self.lm_head, QMatrix) else logits / div  # in place: the same bits
        if isinstance(self.lm_head, QMatrix):
            torch.ops.steadyserve.qlog_softmax_(logits, -1)  # in place, in the caller's buffer
            return logits
        return torch.log_softmax(logits, dim=-1)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """As Transformer.forward, with each layer's own RoPE table and window. Returns (T, hidden)."""
        x = self._embed(batch.input_ids)  # (T, hidden)
        if self.args.embed_scale != 1.0:
            x = x * self.embed_scale  # one exact multiply per element
        trig = {kind: (cos[batch.positions], sin[batch.positions]) for kind, (cos, sin) in self.rope.items()}
        for i, lw in enumerate(self.layers):
            cos, sin = trig[self.layer_rope[i]]  # (T, D)
            q, k, v = self.tiler(partial(self._qkv, lw, rope=self.use_rope[i]), x, cos, sin)  # (T,H,D), (T,Hkv,D) x2
            write_kv(k_cache[i], v_cache[i], k, v, batch.slot_blocks, batch.slot_offsets)
            softcap = (self.args.attn_softcap,) if self.args.attn_softcap else ()
            attn = self.attention(q, k_cache[i], v_cache[i], batch.block_tables, batch.seq_of, batch.positions,
                                  self.scale, self.windows[i], *softcap)  # (T, H, D)
            x = self.tiler(partial(self._out_mlp, lw), x, attn)  # (T, hidden)
        return self.tiler(self._final_norm, x)
