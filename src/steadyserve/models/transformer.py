"""The decoder-only transformer forward pass (Llama family), on a paged KV cache.

One class serves every registered architecture; their differences are flags in
ModelArgs (q/k/v bias, tied embeddings, sliding window). Weights keep the
Hugging Face names on load and are fused here (q|k|v, gate|up) so that each
layer makes two GEMM calls per tile instead of five.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .args import ModelArgs, rope_tables
from .layers import RowTiler, apply_rope, attention_invariant, attention_plain, rms_norm, write_kv


@dataclass
class ForwardBatch:
    """The tokens of one engine step, flattened across sequences (T tokens)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute position of each token in its sequence
    slot_blocks: torch.Tensor  # (T,) int64, KV block the token's K/V is written to
    slot_offsets: torch.Tensor  # (T,) int64, offset inside that block
    block_tables: torch.Tensor  # (T, NBmax) int64, the block table of the token's sequence


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    wqkv: torch.Tensor  # ((H + 2*Hkv) * D, hidden)
    bqkv: torch.Tensor | None  # ((H + 2*Hkv) * D,)
    wo: torch.Tensor  # (hidden, H * D)
    bo: torch.Tensor | None
    post_norm: torch.Tensor  # (hidden,)
    w_gate_up: torch.Tensor  # (2 * inter, hidden)
    b_gate_up: torch.Tensor | None
    w_down: torch.Tensor  # (hidden, inter)
    b_down: torch.Tensor | None


class Transformer:
    """Forward pass only; no autograd, no module state beyond weights."""

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor], device: torch.device,
                 dtype: torch.dtype, tiler: RowTiler, max_len: int) -> None:
        self.args = args
        self.device = device
        self.dtype = dtype
        self.tiler = tiler
        self.attention = attention_invariant if tiler.enabled else attention_plain

        def w(name: str) -> torch.Tensor:
            return weights[name].to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return w(name) if name in weights else None

        def cat(names: list[str]) -> torch.Tensor | None:
            parts = [maybe(n) for n in names]
            if all(p is None for p in parts):
                return None
            if any(p is None for p in parts):
                raise ValueError(f"some but not all of {names} are present")
            return torch.cat(parts).contiguous()  # type: ignore[arg-type]

        self.embed = w("model.embed_tokens.weight")  # (V, hidden)
        self.lm_head = self.embed if args.tie_word_embeddings or "lm_head.weight" not in weights \
            else w("lm_head.weight")  # (V, hidden)
        self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                wqkv=cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),  # type: ignore[arg-type]
                bqkv=cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                wo=w(a + "o_proj.weight"), bo=maybe(a + "o_proj.bias"),
                post_norm=w(p + "post_attention_layernorm.weight"),
                w_gate_up=cat([m + "gate_proj.weight", m + "up_proj.weight"]),  # type: ignore[arg-type]
                b_gate_up=cat([m + "gate_proj.bias", m + "up_proj.bias"]),
                w_down=w(m + "down_proj.weight"), b_down=maybe(m + "down_proj.bias"),
            ))
        cos, sin = rope_tables(args, max_len)
        self.cos = cos.to(device=device, dtype=dtype)  # (max_len, D)
        self.sin = sin.to(device=device, dtype=dtype)
        self.scale = args.head_dim ** -0.5

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Run the layers over a step's tokens, filling the KV cache.

        k_cache: (L, NB, Hkv, D, Bs); v_cache: (L, NB, Hkv, Bs, D).
        Returns the final-normed hidden states, (T, hidden).
        """
        a = self.args
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        x = F.embedding(batch.input_ids, self.embed)  # (T, hidden)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # (T, D)
        for i, lw in enumerate(self.layers):
            def qkv_fn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                       lw: LayerWeights = lw) -> tuple[torch.Tensor, ...]:
                qkv = F.linear(rms_norm(x, lw.input_norm, a.rms_norm_eps), lw.wqkv, lw.bqkv)
                q, k, v = qkv.split([h * d, hkv * d, hkv * d], dim=-1)
                q = apply_rope(q.view(-1, h, d), cos, sin)
                k = apply_rope(k.view(-1, hkv, d), cos, sin)
                return q, k, v.reshape(-1, hkv, d)

            q, k, v = self.tiler(qkv_fn, x, cos, sin)  # (T, H, D), (T, Hkv, D), (T, Hkv, D)
            write_kv(k_cache[i], v_cache[i], k, v, batch.slot_blocks, batch.slot_offsets)
            attn = self.attention(q, k_cache[i], v_cache[i], batch.block_tables, batch.positions,
                                  self.scale, a.sliding_window)  # (T, H, D)

            def out_mlp_fn(x: torch.Tensor, attn: torch.Tensor, lw: LayerWeights = lw) -> torch.Tensor:
                x = x + F.linear(attn.reshape(attn.shape[0], -1), lw.wo, lw.bo)
                gate, up = F.linear(rms_norm(x, lw.post_norm, a.rms_norm_eps), lw.w_gate_up,
                                    lw.b_gate_up).chunk(2, dim=-1)
                return x + F.linear(F.silu(gate) * up, lw.w_down, lw.b_down)

            x = self.tiler(out_mlp_fn, x, attn)  # (T, hidden)
        return self.tiler(lambda x: rms_norm(x, self.final_norm, a.rms_norm_eps), x)

    def gemm_weights(self) -> list[torch.Tensor]:
        """One weight of each GEMM shape the forward pass uses (for tile calibration)."""
        lw = self.layers[0]
        return [lw.wqkv, lw.wo, lw.w_gate_up, lw.w_down, self.lm_head]

    @torch.inference_mode()
    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(R, hidden) -> (R, V) float32 log-probabilities, row by row in fixed tiles."""
        return self.tiler(lambda x: torch.log_softmax(F.linear(x, self.lm_head).float(), dim=-1), hidden)
