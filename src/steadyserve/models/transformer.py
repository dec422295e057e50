"""The decoder-only transformer forward pass (Llama family), on a paged KV cache.

One class serves every registered architecture; their differences are flags in
ModelArgs (q/k/v bias, tied embeddings, sliding window). Weights keep the
Hugging Face names on load and are fused here (q|k|v, gate|up) so that each
layer makes two projection calls per tile instead of five.

Two numerics paths (numerics.py) share the structure:
* native (portable): matrices are QMatrix objects over the weights as stored
  (kernels/quant.py), and norms, SiLU·mul and log-softmax are native too: every
  row's bits are fixed by construction, so the row tiler is off.
* host: float32 matrices, F.linear (MKL) and PyTorch's ops, run through the row
  tiler in verified row counts.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from ..kernels.build import NATIVE_KERNEL_ID
from ..kernels.quant import QMatrix, QWeight
from .args import ModelArgs, rope_tables
from .attention import AttentionFn, write_kv
from .layers import RowProbe, RowTiler, apply_rope, rms_norm
from .native_forward import build_native_layers

# Rows of one LM-head call at most: (64, V) float32 logits, and a calibration that stays cheap.
MAX_HEAD_TILE = 64
# Vocabulary entries per LM-head GEMM. One (64, 576) x (576, 49152) GEMM ran 33 ms on an AMD EPYC
# (2 threads); 24 GEMMs of 2048 columns each, 27 ms; at 4 rows, 11.4 vs 7.9 ms (a weight slice
# of 4.5 MiB stays in cache while MKL sweeps it). The split is fixed, so every logit is always
# computed by the same call shape; calibration checks rows stay independent of the row count.
HEAD_COLUMNS = 2048


@dataclass
class ForwardBatch:
    """The tokens of one engine step, flattened across S sequences (T tokens)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute position of each token in its sequence
    slot_blocks: torch.Tensor  # (T,) int64, KV block the token's K/V is written to
    slot_offsets: torch.Tensor  # (T,) int64, offset inside that block
    block_tables: torch.Tensor  # (S, NBmax) int64, each sequence's block table, padded with block 0
    seq_of: torch.Tensor  # (T,) int64, the token's row in block_tables


Matrix = torch.Tensor | QMatrix  # a float tensor (host path) or the stored weights (native path)


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # (hidden,)
    wqkv: Matrix  # ((H + 2*Hkv) * D, hidden)
    bqkv: torch.Tensor | None  # ((H + 2*Hkv) * D,)
    wo: Matrix  # (hidden, H * D)
    bo: torch.Tensor | None
    post_norm: torch.Tensor  # (hidden,)
    w_gate_up: Matrix  # (2 * inter, hidden)
    b_gate_up: torch.Tensor | None
    w_down: Matrix  # (hidden, inter)
    b_down: torch.Tensor | None


class Transformer:
    """Forward pass only; no autograd, no module state beyond weights.

    The constructor consumes `weights`: every tensor it uses is removed from the dict.
    """

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor | QWeight], device: torch.device,
                 dtype: torch.dtype, tiler: RowTiler, max_len: int, attention: AttentionFn, kernel_id: str,
                 native: bool = False) -> None:
        self.args = args
        self.native = native  # the portable path: native kernels on the stored weights (module docstring)
        self.device = device
        self.dtype = dtype
        self.tiler = tiler  # the layers' row-wise functions
        self.head_tiler = RowTiler(min(tiler.max_tile, MAX_HEAD_TILE), tiler.enabled)  # LM head + log-softmax
        self.attention = attention
        self.kernel_id = kernel_id  # names the attention kernel in the fingerprint: its bits differ per kernel
        # The native extension's in-place RoPE (kernels/csrc/rope.cpp) where it is loaded: bitwise equal to
        # apply_rope, five tensor ops in one pass. float32 on the CPU only.
        self.native_rope = kernel_id == NATIVE_KERNEL_ID and dtype == torch.float32 and device.type == "cpu"

        # Loaded weights may be views of the safetensors file's mmap: pages touched through it stay
        # in RSS as long as any view lives. Every weight is taken out of `weights` and copied into
        # memory the model owns, so the mapping is released once loading ends (RSS = one model copy).
        def w(name: str) -> torch.Tensor:
            t = weights.pop(name)
            if isinstance(t, QWeight):  # a GGUF matrix on the host path: its exact values, as float
                t = t.dequantize().view(t.n, t.k)
            return t.to(device=device, dtype=dtype, copy=True).contiguous()

        def vec(name: str) -> torch.Tensor:  # norms and biases: float32 on the native path
            t = w(name)
            return t.float() if native else t

        def q(name: str) -> QWeight:
            t = weights.pop(name)
            return t if isinstance(t, QWeight) else QWeight.from_tensor(t, name)

        def mat(names: list[str]) -> Matrix:
            """The named matrices fused along N: stored parts (native) or one owned tensor (host)."""
            if native:
                return QMatrix([q(n) for n in names])
            return w(names[0]) if len(names) == 1 else torch.cat([w(n) for n in names]).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return vec(name) if name in weights else None

        def cat(names: list[str]) -> torch.Tensor | None:
            """Fuse the named weights (all or none present) into one owned tensor."""
            present = [n for n in names if n in weights]
            if not present:
                return None
            if len(present) != len(names):
                raise ValueError(f"some but not all of {names} are present")
            return torch.cat([vec(n) for n in names]).contiguous()

        tied = args.tie_word_embeddings or "lm_head.weight" not in weights
        self.embed: Matrix = mat(["model.embed_tokens.weight"])  # (V, hidden)
        self.lm_head: Matrix = self.embed if tied else mat(["lm_head.weight"])  # (V, hidden)
        # Host path: views of (HEAD_COLUMNS, hidden) each, the last shorter (see HEAD_COLUMNS).
        self.lm_head_parts = [] if native else self.lm_head.split(HEAD_COLUMNS)  # type: ignore[union-attr]
        self.final_norm = vec("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            self.layers.append(LayerWeights(
                input_norm=vec(p + "input_layernorm.weight"),
                wqkv=mat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                bqkv=cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                wo=mat([a + "o_proj.weight"]), bo=maybe(a + "o_proj.bias"),
                post_norm=vec(p + "post_attention_layernorm.weight"),
                w_gate_up=mat([m + "gate_proj.weight", m + "up_proj.weight"]),
                b_gate_up=cat([m + "gate_proj.bias", m + "up_proj.bias"]),
                w_down=mat([m + "down_proj.weight"]), b_down=maybe(m + "down_proj.bias"),
            ))
        for i, lw in enumerate(self.layers):
            _check_attention_shapes(args, lw, i)
        cos, sin = rope_tables(args, max_len)
        self.cos = cos.to(device=device, dtype=dtype)  # (max_len, D)
        self.sin = sin.to(device=device, dtype=dtype)
        self.scale = args.head_dim ** -0.5
        # Every layer in one native call where the layers are Llama's shape (native_forward.py): the same bits.
        self.native_layers = build_native_layers(self)

    def use_int8_activations(self) -> None:
        """The int8 numerics path (numerics.py): every stored matrix the int8 family reads is repacked into its
        panels, once, and multiplies int8 activations from then on; embeddings keep the GGUF rows. The GGUF's
        views are dropped, so their pages are no longer touched after loading."""
        assert self.native, "int8 activations run on the native path only"
        for lw in self.layers:
            for name in ("wqkv", "wo", "w_gate_up", "w_down"):
                setattr(lw, name, getattr(lw, name).packed())
        self.lm_head = self.lm_head.packed()  # type: ignore[union-attr]
        self.native_layers = build_native_layers(self)

    def _qkv(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row-wise: norm, fused q|k|v projection, RoPE. x: (T, hidden) -> (T, H, D), (T, Hkv, D), (T, Hkv, D)."""
        a = self.args
        h, hkv, d = a.num_heads, a.num_kv_heads, a.head_dim
        qkv = self._linear(self._norm(x, lw.input_norm), lw.wqkv, lw.bqkv)  # (T, (H + 2*Hkv) * D)
        v = qkv[:, (h + hkv) * d:].view(-1, hkv, d)
        if self.native_rope:  # q and k heads in place, one pass; the same bits as apply_rope
            torch.ops.steadyserve.rope_(qkv, cos, sin, h + hkv)
            return qkv[:, :h * d].view(-1, h, d), qkv[:, h * d:(h + hkv) * d].view(-1, hkv, d), v
        qk = apply_rope(qkv[:, :(h + hkv) * d].view(-1, h + hkv, d), cos, sin)  # q and k heads in one call
        return qk[:, :h], qk[:, h:], v

    def _out_mlp(self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Row-wise: output projection + residual, norm, gated MLP + residual. (T, hidden), (T, H, D) -> (T, hidden)."""
        x = x + self._linear(attn.reshape(attn.shape[0], -1), lw.wo, lw.bo)
        gate_up = self._linear(self._norm(x, lw.post_norm), lw.w_gate_up, lw.b_gate_up)  # (T, 2 * inter)
        if self.native:
            return x + self._linear(torch.ops.steadyserve.qsilu_mul(gate_up, -1), lw.w_down, lw.b_down)
        gate, up = gate_up.chunk(2, dim=-1)
        return x + self._linear(F.silu(gate) * up, lw.w_down, lw.b_down)

    def _linear(self, x: torch.Tensor, w: Matrix, b: torch.Tensor | None) -> torch.Tensor:
        """x · wᵀ + b: the native matmul family on the stored weights, or F.linear."""
        if isinstance(w, QMatrix):
            y = w(x)
            return y.add_(b) if b is not None else y  # an exact elementwise add
        return F.linear(x, w, b)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if self.native:
            return torch.ops.steadyserve.qrms_norm(x, weight, self.args.rms_norm_eps, -1)
        return rms_norm(x, weight, self.args.rms_norm_eps)

    def _final_norm(self, x: torch.Tensor) -> torch.Tensor:
        return self._norm(x, self.final_norm)

    def _head(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Row-wise: (R, hidden) -> (R, V) float32 log-probabilities (into `out` on the native path)."""
        if isinstance(self.lm_head, QMatrix):
            y = self.lm_head(hidden.contiguous(), out=out)  # (R, V) logits
            torch.ops.steadyserve.qlog_softmax_(y, -1)  # in place: no second (R, V) buffer
            return y
        logits = torch.cat([F.linear(hidden, part) for part in self.lm_head_parts], dim=1)  # (R, V)
        return torch.log_softmax(logits.float(), dim=-1)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) token ids -> (T, hidden): dequantized rows of the stored table, or an embedding lookup."""
        if isinstance(self.embed, QMatrix):
            return self.embed.rows(input_ids)
        return F.embedding(input_ids, self.embed)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, k_cache: torch.Tensor, v_cache: torch.Tensor) -> torch.Tensor:
        """Run the layers over a step's tokens, filling the KV cache.

        k_cache: (L, NB, Hkv, D, Bs); v_cache: (L, NB, Hkv, Bs, D).
        Returns the final-normed hidden states, (T, hidden).
        """
        x = self._embed(batch.input_ids)  # (T, hidden)
        cos, sin = self.cos[batch.positions], self.sin[batch.positions]  # (T, D)
        if self.native_layers is not None:
            x = self.native_layers.forward(x, cos, sin, k_cache, v_cache, batch.slot_blocks, batch.slot_offsets,
                                           batch.block_tables, batch.seq_of, batch.positions)
            return self._final_norm(x)
        for i, lw in enumerate(self.layers):
            q, k, v = self.tiler(partial(self._qkv, lw), x, cos, sin)  # (T, H, D), (T, Hkv, D), (T, Hkv, D)
            write_kv(k_cache[i], v_cache[i], k, v, batch.slot_blocks, batch.slot_offsets)
            attn = self.attention(q, k_cache[i], v_cache[i], batch.block_tables, batch.seq_of, batch.positions,
                                  self.scale, self.args.sliding_window)  # (T, H, D)
            x = self.tiler(partial(self._out_mlp, lw), x, attn)  # (T, hidden)
        return self.tiler(self._final_norm, x)

    @torch.inference_mode()
    def logprobs(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """(R, hidden) -> (R, V) float32 log-probabilities, in verified row counts.

        `out` (R, V), on the native path: the result is written there and returned (the caller's buffer, reused
        step after step, so the largest tensor of a decode step is never allocated again)."""
        if out is not None and isinstance(self.lm_head, QMatrix):
            return self._head(hidden, out)  # native kernels: row-wise by construction, no tiler
        return self.head_tiler(self._head, hidden)

    def row_probes(self) -> tuple[list[RowProbe], list[RowProbe]]:
        """The row-wise functions as run, with random inputs: (layer tiler probes, LM head probes).

        Every layer has the same shapes, so layer 0's weights stand for all.
        """
        a, lw = self.args, self.layers[0]
        hidden, h, d = a.hidden_size, a.num_heads, a.head_dim

        def rand(n: int, g: torch.Generator, *shape: int) -> torch.Tensor:
            return torch.randn(n, *shape, generator=g).to(self.device, self.dtype)

        def trig(n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
            pos = torch.randint(0, self.cos.shape[0], (n,), generator=g).to(self.device)
            return self.cos[pos], self.sin[pos]

        layer = [(partial(self._qkv, lw), lambda n, g: (rand(n, g, hidden), *trig(n, g))),
                 (partial(self._out_mlp, lw), lambda n, g: (rand(n, g, hidden), rand(n, g, h, d))),
                 (self._final_norm, lambda n, g: (rand(n, g, hidden),))]
        head = [(self._head, lambda n, g: (rand(n, g, hidden),))]
        return layer, head

    @torch.inference_mode()
    def calibrate(self) -> tuple[list[int], list[int]]:
        """Find the row counts that keep every row bitwise the same (see RowTiler)."""
        layer, head = self.row_probes()
        return self.tiler.calibrate(layer), self.head_tiler.calibrate(head)


def _check_attention_shapes(args: ModelArgs, lw: LayerWeights, layer: int) -> None:
    """Refuse weights whose attention widths are not the config's: the forward takes views of the fused q|k|v
    by heads and head_dim, so a wrong head_dim (a GGUF's key_length ignored) would compute garbage, not fail."""
    h, hkv, d = args.num_heads, args.num_kv_heads, args.head_dim
    rows = lw.wqkv.n if isinstance(lw.wqkv, QMatrix) else lw.wqkv.shape[0]
    cols = lw.wo.k if isinstance(lw.wo, QMatrix) else lw.wo.shape[1]
    if (rows, cols) != ((h + 2 * hkv) * d, h * d):
        raise ValueError(f"layer {layer}: q|k|v has {rows} rows and o_proj {cols} columns, but {h} heads, {hkv} kv "
                         f"heads and head_dim {d} make {(h + 2 * hkv) * d} and {h * d}")
