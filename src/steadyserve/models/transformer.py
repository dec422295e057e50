"""The decoder-only transformer forward pass, on a paged KV cache.

One class runs every registered architecture's layers: what a layer computes is its LayerSpec
(layer_spec.py: where the norms sit, q/k norm, activation, score scale and soft-cap, residual
multiplier, per-layer windows and RoPE tables), read here by the per-op path and by the native
one-call layers alike (native_forward.py). extended.py adds only what happens at load (Phi-3's fused
matrices, Gemma's (1 + w) norms) and around the layers (embedding scale, logit soft-cap and divisor).
Weights keep the Hugging Face names on load and are fused here (q|k|v, gate|up) so that each
layer makes two projection calls per tile instead of five.

Two numerics paths (numerics.py) share the structure:
* native (portable): matrices are QMatrix objects over the weights as stored
  (kernels/quant.py), and norms, SiLU·mul and log-softmax are native too: every
  row's bits are fixed by construction, so the row tiler is off.
* host: float32 matrices, F.linear (MKL) and PyTorch's ops, run through the row
  tiler in verified row counts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

from ..kernels.build import NATIVE_KERNEL_ID
from ..kernels.quant import QMatrix, QWeight
from .args import ModelArgs, rope_tables
from .attention import AttentionFn, write_kv
from .gptoss import split_gptoss_experts, swiglu_oai
from .layer_spec import LayerSpec, layer_spec
from .layers import RowProbe, RowTiler, apply_rope, rms_norm
from .moe import MoeWeights, load_moe, moe_block, moe_slots, pack_moe, split_fused_experts
from .native_forward import build_native_layers

# Rows of one LM-head call at most: (64, V) float32 logits, and a calibration that stays cheap.
MAX_HEAD_TILE = 64
# Rows of one expert call at most on the host path (moe.py): an expert sees the few rows that chose it, so its calls
# are padded to counts verified on its own probe, not to the layers' (up to 512 rows for each of E experts).
MAX_EXPERT_TILE = 64
# Vocabulary entries per LM-head GEMM. One (64, 576) x (576, 49152) GEMM ran 33 ms on an AMD EPYC
# (2 threads); 24 GEMMs of 2048 columns each, 27 ms; at 4 rows, 11.4 vs 7.9 ms (a weight slice
# of 4.5 MiB stays in cache while MKL sweeps it). The split is fixed, so every logit is always
# computed by the same call shape; calibration checks rows stay independent of the row count.
HEAD_COLUMNS = 2048
# A layer's matrices the int8 path repacks (use_int8_activations), in the order it repacks them.
_INT8_SLOTS = ("wqkv", "wo", "w_gate_up", "w_down")


@dataclass
class ForwardBatch:
    """The tokens of one engine step, flattened across S sequences (T tokens)."""

    input_ids: torch.Tensor  # (T,) int64
    positions: torch.Tensor  # (T,) int64, absolute position of each token in its sequence
    slot_blocks: torch.Tensor  # (G, T) int64, KV block the token's K/V is written to, in each group's table
    slot_offsets: torch.Tensor  # (T,) int64, offset inside that block
    block_tables: torch.Tensor  # (G, S, NBmax) int64, each group's block table of each sequence, padded with 0
    seq_of: torch.Tensor  # (T,) int64, the token's row in block_tables
    kv_group: tuple[int, ...]  # (L,) the group (first index of block_tables) layer i reads (KVLayout.group)
    kv_slot: tuple[int, ...]  # (L,) layer i's slot in the cache tensors' first dimension (KVLayout.slot)


Matrix = torch.Tensor | QMatrix  # a float tensor (host path) or the stored weights (native path)


@dataclass
class LayerWeights:
    """One layer's weights; a norm is None where the LayerSpec has none."""

    input_norm: torch.Tensor | None  # (hidden,), before attention (spec.pre_norm)
    wqkv: Matrix  # ((H + 2*Hkv) * D, hidden)
    bqkv: torch.Tensor | None  # ((H + 2*Hkv) * D,)
    wo: Matrix  # (hidden, H * D)
    bo: torch.Tensor | None
    post_norm: torch.Tensor | None  # (hidden,), before the MLP (spec.pre_norm)
    w_gate_up: Matrix | None  # (2 * inter, hidden); None in a sparse layer (moe)
    b_gate_up: torch.Tensor | None
    w_down: Matrix | None  # (hidden, inter); None in a sparse layer
    b_down: torch.Tensor | None
    q_norm: torch.Tensor | None = None  # (D,) per head, or (H * D,) over all heads (spec.qk_norm)
    k_norm: torch.Tensor | None = None  # (D,) or (Hkv * D,)
    attn_out_norm: torch.Tensor | None = None  # (hidden,), on the attention output before its residual add
    mlp_out_norm: torch.Tensor | None = None  # (hidden,), on the MLP output before its residual add (spec.post_norms)
    moe: MoeWeights | None = None  # a sparse layer's router and experts (spec.moe_layers), in place of the MLP
    sinks: torch.Tensor | None = None  # (H,) attention-sink logits (spec.attn_sinks), float32 on the native path


# Tokens whose logit is within this of the row's largest (in log-probabilities) get the LM head's residual rows
# (q8.h, "Residual rows"). Every other token holds below e^-5 of the top token's probability, so its one-row rounding
# moves the log-softmax's normalizer little; its own logprob keeps one row's error. Chosen by measurement
# (benchmarks/HISTORY.md, "The LM head's residual rows near each row's top"): on SmolLM2-135M 5 keeps about four
# fifths of what correcting every panel takes off the error, for a few percent of the panels; 10 keeps nearly all
# of it but corrects several times more, and the corrections' weight reads then cost as much as the head.
HEAD_MARGIN_LOGPROB = 5.0
# At most this many panels of 16 tokens per row get them, those with the largest logits: a row whose logits are flat
# (random weights; a model unsure of its next token) has thousands of tokens within the margin, each improbable, and
# correcting them all cost more than the head itself. On SmolLM2-135M the rows hold 22 on average (some hundreds),
# and 8, 16, 32 or no cap take the same off the error within 1% (benchmarks/HISTORY.md, ibid.).
HEAD_MAX_PANELS = 8


def head_margin(args: ModelArgs) -> float:
    """The residual rows' margin in the head's raw logits: HEAD_MARGIN_LOGPROB after the division a model applies
    before its log-softmax (Granite); every panel (inf) under a soft cap (Gemma 2), whose tanh narrows gaps."""
    if args.final_softcap:
        return math.inf
    return HEAD_MARGIN_LOGPROB * args.logits_divisor


class Transformer:
    """Forward pass only; no autograd, no module state beyond weights.

    The constructor consumes `weights`: every tensor it uses is removed from the dict.
    """

    def __init__(self, args: ModelArgs, weights: dict[str, torch.Tensor | QWeight], device: torch.device,
                 dtype: torch.dtype, tiler: RowTiler, max_len: int, attention: AttentionFn, kernel_id: str,
                 native: bool = False) -> None:
        self.args = args
        self.spec: LayerSpec = layer_spec(args)  # what every layer computes, on both layer paths
        self.native = native  # the portable path: native kernels on the stored weights (module docstring)
        self.device = device
        self.dtype = dtype
        self.tiler = tiler  # the layers' row-wise functions
        self.head_tiler = RowTiler(min(tiler.max_tile, MAX_HEAD_TILE), tiler.enabled)  # LM head + log-softmax
        self.expert_tiler = RowTiler(min(tiler.max_tile, MAX_EXPERT_TILE), tiler.enabled)  # a sparse layer's experts
        self.attention = attention
        self.kernel_id = kernel_id  # names the attention kernel in the fingerprint: its bits differ per kernel
        # Whether this model runs the native extension's attention (and so has its other ops: softcap_, rope_): the
        # one place the kernel id is compared; the engine and the model variants ask this, not the id.
        self.native_attention = kernel_id == NATIVE_KERNEL_ID
        # The native extension's in-place RoPE (kernels/csrc/rope.cpp) where it is loaded: bitwise equal to
        # apply_rope, five tensor ops in one pass. float32 on the CPU only.
        self.native_rope = self.native_attention and dtype == torch.float32 and device.type == "cpu"

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

        def norm(name: str, present: bool) -> torch.Tensor | None:
            """A norm the spec places (a KeyError if the weights lack it), or None where it places none."""
            return vec(name) if present else None

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
        spec = self.spec
        qk, pre, post = spec.qk_norm != "none", spec.pre_norm, spec.post_norms
        split = split_gptoss_experts if args.experts_layout == "gptoss" else split_fused_experts
        self.layers: list[LayerWeights] = []
        for i in range(args.num_layers):
            p = f"model.layers.{i}."
            a, m = p + "self_attn.", p + "mlp."
            sparse = bool(spec.moe_layers) and spec.moe_layers[i]
            dense = not sparse
            self.layers.append(LayerWeights(
                input_norm=norm(p + "input_layernorm.weight", pre),
                wqkv=mat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
                bqkv=cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
                wo=mat([a + "o_proj.weight"]), bo=maybe(a + "o_proj.bias"),
                # With output norms (Gemma, OLMo 2) post_attention_layernorm norms the attention output, and
                # Gemma's MLP input norm is pre_feedforward_layernorm.
                post_norm=norm(p + ("pre_feedforward_layernorm.weight" if post else "post_attention_layernorm.weight"),
                               pre),
                w_gate_up=mat([m + "gate_proj.weight", m + "up_proj.weight"]) if dense else None,
                b_gate_up=cat([m + "gate_proj.bias", m + "up_proj.bias"]),
                w_down=mat([m + "down_proj.weight"]) if dense else None, b_down=maybe(m + "down_proj.bias"),
                q_norm=norm(a + "q_norm.weight", qk), k_norm=norm(a + "k_norm.weight", qk),
                attn_out_norm=norm(p + "post_attention_layernorm.weight", post),
                mlp_out_norm=norm(p + "post_feedforward_layernorm.weight", post),
                moe=load_moe(weights, m, spec.moe, mat, cat, split) if sparse and spec.moe is not None else None,
                sinks=norm(a + "sinks", spec.attn_sinks),
            ))
        for i, lw in enumerate(self.layers):
            _check_attention_shapes(args, lw, i)
        cos, sin = rope_tables(args, max_len)  # layer 0's kind: the row probes' table
        self.cos = cos.to(device=device, dtype=dtype)  # (max_len, D)
        self.sin = sin.to(device=device, dtype=dtype)
        # Every RoPE table a layer reads, by kind (spec.rope; Gemma 3: local and global), in spec.rope_kinds' order.
        first = (args.layer_rope or ("",))[0]
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for kind in spec.rope_kinds:
            tables = (cos, sin) if kind == first else rope_tables(args, max_len, kind or None)
            self.rope[kind] = (tables[0].to(device=device, dtype=dtype), tables[1].to(device=device, dtype=dtype))
        self.scale = spec.attn_scale
        # Every layer in one native call where native_forward.py can (layer_spec.native_supports): the same bits.
        self.native_layers = build_native_layers(self)

    def int8_matrices(self) -> dict[str, Matrix]:
        """The matrices use_int8_activations repacks, by slot name ("layers.3.wqkv", "lm_head"): the names the
        packed-weight cache (packed_cache.py) files them under."""
        out: dict[str, Matrix] = {}
        for i, lw in enumerate(self.layers):
            for name in _INT8_SLOTS:
                if getattr(lw, name) is not None:  # a sparse layer has no dense MLP
                    out[f"layers.{i}.{name}"] = getattr(lw, name)
            if lw.moe is not None:
                out.update(moe_slots(lw.moe, i))
        out["lm_head"] = self.lm_head
        return out

    def use_int8_activations(self, pack: Callable[[str, QMatrix], QMatrix] | None = None) -> None:
        """The int8 numerics path (numerics.py): every stored matrix the int8 family reads is repacked into its
        panels, once, and multiplies int8 activations from then on; embeddings keep the GGUF rows. The GGUF's
        views are dropped, so their pages are no longer touched after loading.

        `pack(slot, matrix)` makes each packed matrix (default: QMatrix.packed; the loader's reads the packed-weight
        cache or repacks, repack.py). Matrices are replaced one at a time, and the one-call layers, which hold
        the unpacked ones, are dropped first: each unpacked matrix is freed as its panels arrive, so the peak
        holds one matrix twice, not the model."""
        assert self.native, "int8 activations run on the native path only"
        make = pack or (lambda _slot, m: m.packed())
        self.native_layers = None
        for i, lw in enumerate(self.layers):
            for name in _INT8_SLOTS:
                if getattr(lw, name) is not None:
                    setattr(lw, name, make(f"layers.{i}.{name}", getattr(lw, name)))
            if lw.moe is not None:
                pack_moe(lw.moe, i, make)
        # The head's activations as two int8 rows near each row's top logits, the value and its rounding residual
        # (q8.h, "Residual rows"): its logits are the logprobs, so their rounding is most of this path's error on
        # a small model
        self.lm_head = make("lm_head", self.lm_head).with_residual_rows(head_margin(self.args), HEAD_MAX_PANELS)  # type: ignore[arg-type]
        self.native_layers = build_native_layers(self)

    def _qkv(self, lw: LayerWeights, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             rope: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Row-wise: (norm), fused q|k|v projection, (q/k norm), (RoPE), as self.spec says.
        x: (T, hidden) -> (T, H, D), (T, Hkv, D), (T, Hkv, D). NativeLayers.forward computes the same."""
        s = self.spec
        h, hkv, d = s.num_heads, s.num_kv_heads, s.head_dim
        x_in = self._norm(x, lw.input_norm) if lw.input_norm is not None else x  # OLMo 2: no pre-norm
        qkv = self._linear(x_in, lw.wqkv, lw.bqkv)  # (T, (H + 2*Hkv) * D)
        t = qkv.shape[0]
        if lw.q_norm is not None and lw.k_norm is not None:  # per head: each head its own row of the norm kernel
            qh, kh = (h, hkv) if s.qk_norm == "per_head" else (1, 1)
            qkv[:, :h * d] = self._norm(qkv[:, :h * d].reshape(t * qh, -1), lw.q_norm).view(t, h * d)
            qkv[:, h * d:(h + hkv) * d] = self._norm(qkv[:, h * d:(h + hkv) * d].reshape(t * kh, -1),
                                                     lw.k_norm).view(t, hkv * d)
        v = qkv[:, (h + hkv) * d:].view(-1, hkv, d)
        if not rope:  # SmolLM3's NoPE layers
            return qkv[:, :h * d].view(-1, h, d), qkv[:, h * d:(h + hkv) * d].view(-1, hkv, d), v
        if self.native_rope:  # q and k heads in place, one pass; the same bits as apply_rope
            torch.ops.steadyserve.rope_(qkv, cos, sin, h + hkv)
            return qkv[:, :h * d].view(-1, h, d), qkv[:, h * d:(h + hkv) * d].view(-1, hkv, d), v
        qk = apply_rope(qkv[:, :(h + hkv) * d].view(-1, h + hkv, d), cos, sin)  # q and k heads in one call
        return qk[:, :h], qk[:, h:], v

    def _gated_act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(T, 2 * inter) -> act(gate) * up, (T, inter), or gpt-oss's clamped form: the native kernel, or PyTorch's
        ops on the host path."""
        s = self.spec
        if s.activation == "swiglu_oai":
            if self.native:
                return torch.ops.steadyserve.qswiglu_oai_mul(gate_up, s.act_alpha, s.act_limit, -1)
            return swiglu_oai(gate_up, s.act_alpha, s.act_limit)
        gelu = s.activation == "gelu_tanh"
        if self.native:
            op = torch.ops.steadyserve.qgelu_tanh_mul if gelu else torch.ops.steadyserve.qsilu_mul
            return op(gate_up, -1)
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if gelu else F.silu(gate)) * up

    def _residual(self, out: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """A block's output as its residual add takes it: normed (Gemma, OLMo 2), then scaled (Granite)."""
        if norm is not None:
            out = self._norm(out, norm)
        rs = self.spec.residual_scale
        return out * rs if rs != 1.0 else out  # one exact multiply per element

    def _out_mlp(self, lw: LayerWeights, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Row-wise: output projection (+ norm, scale) + residual, (norm), gated MLP (+ norm, scale) + residual.
        (T, hidden), (T, H, D) -> (T, hidden). NativeLayers.forward computes the same."""
        x = x + self._residual(self._linear(attn.reshape(attn.shape[0], -1), lw.wo, lw.bo), lw.attn_out_norm)
        pre = self._norm(x, lw.post_norm) if lw.post_norm is not None else x
        if lw.moe is not None and self.spec.moe is not None:  # a sparse layer: router and experts (moe.py)
            m = moe_block(pre, lw.moe, self.spec.moe, lambda v, w: self._linear(v, w, None), self._gated_act,
                          self.expert_tiler)  # (T, hidden)
            return x + self._residual(m, lw.mlp_out_norm)
        assert lw.w_gate_up is not None and lw.w_down is not None
        gate_up = self._linear(pre, lw.w_gate_up, lw.b_gate_up)  # (T, 2 * inter)
        m = self._linear(self._gated_act(gate_up), lw.w_down, lw.b_down)  # (T, hidden)
        return x + self._residual(m, lw.mlp_out_norm)

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

        k_cache: (Lg, NB, Hkv, D, Bs); v_cache: (Lg, NB, Hkv, Bs, D): layer i's are slot batch.kv_slot[i].
        Returns the final-normed hidden states, (T, hidden).
        """
        x = self._embed(batch.input_ids)  # (T, hidden)
        trig = {kind: (cos[batch.positions], sin[batch.positions]) for kind, (cos, sin) in self.rope.items()}  # (T, D)
        if self.native_layers is not None:  # tables in spec.rope_kinds' order, as build_native_layers indexes them
            x = self.native_layers.forward(x, [c for c, _ in trig.values()], [s for _, s in trig.values()], k_cache,
                                           v_cache, batch.slot_blocks, batch.slot_offsets, batch.block_tables,
                                           batch.seq_of, batch.positions, list(batch.kv_slot),
                                           list(batch.kv_group))
            return self._final_norm(x)
        spec = self.spec
        softcap = (spec.attn_softcap,) if spec.attn_softcap else ()
        unrotated = next(iter(trig.values()), (x[:, :0], x[:, :0]))  # rows the tiler slices; a NoPE layer ignores them
        for i, lw in enumerate(self.layers):
            kind = spec.rope[i]
            cos, sin = trig[kind] if kind is not None else unrotated
            q, k, v = self.tiler(partial(self._qkv, lw, rope=kind is not None), x, cos, sin)  # (T,H,D), (T,Hkv,D) x2
            s, g = batch.kv_slot[i], batch.kv_group[i]
            write_kv(k_cache[s], v_cache[s], k, v, batch.slot_blocks[g], batch.slot_offsets)
            sinks = {"sinks": lw.sinks} if lw.sinks is not None else {}
            attn = self.attention(q, k_cache[s], v_cache[s], batch.block_tables[g], batch.seq_of, batch.positions,
                                  self.scale, spec.windows[i], *softcap, **sinks)  # (T, H, D)
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
        sparse = next((lw.moe for lw in self.layers if lw.moe is not None), None)
        if sparse is not None:  # first: the layers' probes run the experts in its verified counts
            gate_up, down = sparse.gate_up[0], sparse.down[0]
            expert = (lambda x: self._linear(self._gated_act(self._linear(x, gate_up, None)), down, None),
                      lambda n, g: (torch.randn(n, self.args.hidden_size, generator=g).to(self.device, self.dtype),))
            self.expert_tiler.calibrate([expert])
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
