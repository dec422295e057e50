"""One description of the decoder layer, which every path that runs it reads.

The per-op path (Transformer._qkv, _out_mlp and forward's loop, on either numerics path) and the native
one-call layers (native_forward.py, kernels/csrc/forward.cpp) compute a layer from the same LayerSpec,
derived once per model from its ModelArgs (what the architecture adapters read from the config). A
numerics change to the layer is made in one place per path, and the choice between the two paths is
made in one function from the spec, `native_supports`, never by architecture name.

What is not in the spec, and why:
* Gemma's (1 + w) norms: the offset is added to the norm weights once at load (extended.py), so every
  path runs the plain RMSNorm on the shifted weight; no layer code knows of it.
* Biases: a layer has the ones its weights hold (q|k|v, o, gate|up, down); every path adds whichever it
  was given, elementwise.
* Phi-3's fused matrices: cut into q, k, v, gate, up at load (extended.py), then fused again as for every
  architecture; the layer sees the same matrices either way.
* What happens before the first layer and after the last (the embedding scale, logit soft-cap and divisor,
  the final norm): model-level, in Transformer and ExtendedTransformer, shared by both layer paths.

Every architecture's spec runs natively today: each feature is a kernel the per-op path also calls through its torch
op (qrms_norm for every norm including q/k, qsilu_mul and qgelu_tanh_mul, rope_, paged_attention with its window and
soft-cap), one exact IEEE operation per element (the residual multiplier, adds, copies), or, for a sparse MoE block,
moe.py's routing and expert groups written op for op in kernels/csrc/moe.cpp, so the native call gives the per-op
path's bits (tests/test_native_forward.py, per architecture).
The host numerics path (PyTorch's ops: F.gelu, F.silu, rms_norm) has no native counterpart by design and
always runs per op.
"""

from __future__ import annotations

from dataclasses import dataclass

from .args import ModelArgs
from .moe import MoeSpec

ACTIVATIONS = ("silu", "gelu_tanh", "swiglu_oai")  # the gated MLP activations the per-op path runs
QK_NORMS = ("none", "per_head", "all_heads")


@dataclass(frozen=True)
class LayerSpec:
    """What one decoder layer computes, on top of the fixed skeleton: (norm) → q|k|v (+bias) → (q/k norm) →
    (RoPE) → KV write → attention (+sinks) → o (+bias) → (norm) → ×residual_scale → residual add → (norm) →
    gate|up (+bias) → act(gate)·up → down (+bias) → (norm) → ×residual_scale → residual add; in a sparse layer
    (moe_layers) the gated MLP is moe.py's router and experts."""

    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (grouped-query attention)
    head_dim: int  # D
    eps: float  # every RMSNorm's epsilon (pre-, post-, q/k norms alike)
    pre_norm: bool  # an RMSNorm before attention and before the MLP (every model but OLMo 2)
    post_norms: bool  # an RMSNorm on the attention and on the MLP output, before each residual add (Gemma, OLMo 2)
    qk_norm: str  # "none"; "per_head": one RMSNorm row per q and per k head (Qwen3, Gemma 3); "all_heads" (OLMo 2)
    activation: str  # the gated MLP's: "silu", "gelu_tanh" (Gemma) or "swiglu_oai" (gpt-oss: act_alpha, act_limit)
    attn_scale: float  # the attention score scale, resolved: head_dim ** -0.5 unless the config sets one
    attn_softcap: float  # scores become tanh(s / cap) * cap (Gemma 2); 0 = none
    residual_scale: float  # each block's output is multiplied by this before its residual add (Granite); 1 = none
    windows: tuple[int, ...]  # per layer: its sliding window in tokens, 0 = global
    rope: tuple[str | None, ...]  # per layer: the key of its RoPE table ("" = the model's one table), None = no RoPE
    moe_layers: tuple[bool, ...] = ()  # per layer: a sparse MoE block (moe.py) replaces the gated MLP; () = none
    moe: MoeSpec | None = None  # what every sparse block computes; None where no layer is sparse
    attn_sinks: bool = False  # a learned logit per query head joins every row's softmax (gpt-oss)
    act_alpha: float = 0.0  # swiglu_oai: (clamped up + 1) * gate * sigmoid(act_alpha * gate)
    act_limit: float = 0.0  # swiglu_oai: gate clamped above at act_limit, up to +-act_limit

    @property
    def num_layers(self) -> int:
        return len(self.windows)

    @property
    def rope_kinds(self) -> tuple[str, ...]:
        """The RoPE tables the layers read, in first-use order (layer 0's first where it has one)."""
        return tuple(dict.fromkeys(k for k in self.rope if k is not None))


def layer_spec(args: ModelArgs) -> LayerSpec:
    """The spec of `args`' layers. Raises ValueError for an activation or q/k norm no path runs."""
    if args.hidden_act not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden activation {args.hidden_act!r}")
    n = args.num_layers
    kinds = args.layer_rope or ("",) * n
    use_rope = args.layer_use_rope or (True,) * n
    if len(kinds) != n or len(use_rope) != n or (args.layer_windows and len(args.layer_windows) != n) or (
            args.layer_moe and len(args.layer_moe) != n):
        raise ValueError(f"per-layer settings do not cover the {n} layers")
    return LayerSpec(
        num_heads=args.num_heads, num_kv_heads=args.num_kv_heads, head_dim=args.head_dim, eps=args.rms_norm_eps,
        pre_norm=args.pre_norm, post_norms=args.sandwich_norm,
        qk_norm=("per_head" if args.qk_norm_per_head else "all_heads") if args.qk_norm else "none",
        activation=args.hidden_act, attn_scale=args.attn_scale or args.head_dim ** -0.5,
        attn_softcap=args.attn_softcap, residual_scale=args.residual_scale,
        windows=tuple(args.window(i) for i in range(n)),
        rope=tuple(k if u else None for k, u in zip(kinds, use_rope)),
        moe_layers=args.layer_moe,
        moe=MoeSpec(args.num_experts, args.num_experts_per_tok, args.norm_topk_prob,
                    args.moe_intermediate_size, args.moe_routing) if any(args.layer_moe) else None,
        attn_sinks=args.attn_sinks, act_alpha=args.swiglu_alpha, act_limit=args.swiglu_limit,
    )


# The spec features forward.cpp's NativeLayers computes (its constructor's and add_layer's arguments).
NATIVE_ACTIVATIONS = frozenset(ACTIVATIONS)
NATIVE_QK_NORMS = frozenset(QK_NORMS)


def native_supports(spec: LayerSpec) -> bool:
    """Whether NativeLayers computes `spec`'s layers with the per-op path's bits: the one place that decides
    which layer path a model's spec may take (the numerics path and the attention kernel decide the rest,
    native_forward.build_native_layers). A feature joins only with its bitwise test."""
    # Sparse blocks: kernels/csrc/moe.cpp, moe.py's routing and expert groups op for op
    return spec.activation in NATIVE_ACTIVATIONS and spec.qk_norm in NATIVE_QK_NORMS
