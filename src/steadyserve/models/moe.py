"""The sparse mixture-of-experts block (Qwen3-MoE), with a routing that is a pure function of the row's own logits.

Which experts a token uses is a discrete choice, so a last-bit difference in the router's logits between a lone
request and a batched one could switch an expert and change everything after it. Every step here therefore keeps
each row's bits independent of the other rows, of the thread count and of the CPU:

* logits: the router matrix through the path's matmul (`linear`), plus its bias where it has one (gpt-oss): the
  native float32 family on the native paths
  (one fixed reduction order; the router is never repacked for int8 activations, so the choice is made from
  float32 activations, as llama.cpp keeps `ffn_gate_inp` unquantized), F.linear under the row tiler on the host.
* softmax over the E experts as transformers' Qwen3MoeTopKRouter computes it, in float32, with a fixed order:
  an exact max, `exp_fixed` (IEEE multiplies and adds only, the kernels' polynomial: libm's and PyTorch's
  vectorized exp may differ between machines, and PyTorch's between a vector body and its scalar tail, which
  moves with the row count), and a sum folded in one fixed tree (`fold_sum`).
* top-k: the k largest probabilities, **ties broken by the lower expert index** (a stable descending sort), so
  two experts with equal probabilities are chosen in the same way in every batch. gpt-oss ("topk_softmax") takes
  the k largest logits by the same sort first, then the softmax above over those k.
* with `norm_topk_prob` the k weights are divided by their sum, folded in the same fixed tree (by rank).
* experts: each a SwiGLU MLP (gate|up, act, down) on the path's matmuls. Rows are grouped by expert, so an
  expert's matmul sees whichever rows chose it; the kernels' per-row order (no kernel looks at how many rows it
  was given: qmm.h, q8.h) makes each row's result independent of them (tests/test_moe.py checks it).
* the token's output: the weighted expert outputs added **by expert index, ascending**, from +0, as transformers'
  Qwen3MoeExperts adds them (its loop over experts and index_add_), one exact IEEE add per element each.

This module is the reference and the host path's block; the native paths run the same steps, op for op, inside
the one-call layers (kernels/csrc/moe.cpp; tests/test_native_forward.py and tests/test_moe.py check the bits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..kernels.quant import QMatrix

_F32 = torch.float32
# exp_fixed's constants (Cephes expf, as kernels/csrc/lanes_math.h fexp_bounded), as float32 scalars
_LOG2E, _ROUND = torch.tensor(1.44269504088896341, dtype=_F32), torch.tensor(12582912.0, dtype=_F32)
_LN2_HI, _LN2_LO = torch.tensor(0.693359375, dtype=_F32), torch.tensor(-2.12194440e-4, dtype=_F32)
_POLY = [torch.tensor(c, dtype=_F32) for c in (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2,
                                               1.6666665459e-1, 5.0000001201e-1)]
_ONE = torch.tensor(1.0, dtype=_F32)
EXP_LOW = -87.0  # exp_fixed's domain is [-87, 0] here (x - max); below it the probability is < 2e-38 of the top


@dataclass(frozen=True)
class MoeSpec:
    """What a sparse block computes (the same for every sparse layer of a model)."""

    num_experts: int  # E: experts per sparse layer, rows of the router
    top_k: int  # experts each token uses (num_experts_per_tok)
    norm_topk_prob: bool  # the k chosen probabilities renormalized to sum to 1 (Qwen3-30B-A3B; llama.cpp always)
    expert_size: int  # each expert's SwiGLU width (moe_intermediate_size)
    routing: str = "softmax_topk"  # "softmax_topk" (Qwen3), or "topk_softmax": the k largest logits, then their
    # softmax (gpt-oss: the weights sum to 1 with no renormalization)

    def __post_init__(self) -> None:
        if self.routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"unknown MoE routing {self.routing!r}")


@dataclass
class MoeWeights:
    """One sparse layer's weights: the router and E experts, each expert's gate|up fused as for a dense MLP."""

    router: Any  # (E, hidden): a QMatrix (native paths) or a float tensor (host)
    gate_up: list[Any]  # E matrices of (2 * expert_size, hidden): gate rows, then up rows
    down: list[Any]  # E matrices of (hidden, expert_size)
    # gpt-oss's biases, in matrices()' order (router, each gate|up, each down), each a float tensor; () = none
    biases: tuple[Any, ...] = ()

    def matrices(self) -> list[Any]:
        """Every matrix, router first (the self-test's list of weight formats)."""
        return [self.router, *self.gate_up, *self.down]

    def bias(self, kind: str, e: int = 0) -> Any:
        """The bias of the router ("router") or of expert e's "gate_up" or "down", or None."""
        if not self.biases:
            return None
        n = len(self.gate_up)
        return self.biases[{"router": 0, "gate_up": 1 + e, "down": 1 + n + e}[kind]]


def exp_fixed(x: torch.Tensor) -> torch.Tensor:
    """exp(x) for float32 x in [-87, 0], elementwise, from IEEE multiplies, adds and an exponent-field scale only:
    the same bits on every CPU and at every tensor size (kernels/csrc/lanes_math.h's fexp_bounded, op for op)."""
    n = (x * _LOG2E + _ROUND) - _ROUND  # round(x log2 e), exact
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = r * _POLY[0] + _POLY[1]
    for c in _POLY[2:]:
        p = p * r + c
    y = (p * (r * r) + r) + _ONE
    scale = ((n.to(torch.int32) + 127) << 23).view(_F32)  # 2^n, n in [-126, 0]
    return y * scale


def fold_sum(v: torch.Tensor) -> torch.Tensor:
    """(T, E) -> (T, 1): each row's sum in one fixed tree (padded with +0 to a power of two, then halves added
    elementwise: [i] + [i + half]), whatever T, the threads or the vector width."""
    width = 1 << max(v.shape[-1] - 1, 0).bit_length()
    if width != v.shape[-1]:
        v = torch.cat([v, v.new_zeros(v.shape[0], width - v.shape[-1])], dim=-1)
    while width > 1:
        width //= 2
        v = v[:, :width] + v[:, width:]
    return v


def _softmax(v: torch.Tensor) -> torch.Tensor:
    """(T, n) -> (T, n) float32: an exact max, exp_fixed, the fold's sum, one division per element."""
    m = v.amax(dim=-1, keepdim=True)  # exact
    e = exp_fixed((v - m).clamp(min=EXP_LOW))
    return e / fold_sum(e)


def route(logits: torch.Tensor, spec: MoeSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits (T, E) -> (weights (T, k) float32, experts (T, k) int64), by rank (the best first): softmax,
    top-k with ties to the lower index, renormalized when spec.norm_topk_prob; or, for "topk_softmax" (gpt-oss),
    the top-k of the logits by the same sort, then the softmax over those k. Each row from its own logits alone."""
    lf = logits.float()
    if spec.routing == "topk_softmax":
        experts = torch.sort(lf, dim=-1, descending=True, stable=True).indices[:, :spec.top_k]  # ties: lower index
        return _softmax(lf.gather(-1, experts)), experts
    probs = _softmax(lf)  # (T, E): transformers' softmax, in a fixed order
    experts = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :spec.top_k]  # ties: lower index
    weights = probs.gather(-1, experts)
    if spec.norm_topk_prob:
        weights = weights / fold_sum(weights)  # the k by rank, in the same fixed tree
    return weights, experts


Linear = Callable[[torch.Tensor, Any], torch.Tensor]  # (x (R, K), matrix (N, K)) -> (R, N)
RowFn = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]  # runs a row-wise fn on rows


def moe_block(x: torch.Tensor, w: MoeWeights, spec: MoeSpec, linear: Linear,
              act: Callable[[torch.Tensor], torch.Tensor], rows_fn: RowFn) -> torch.Tensor:
    """(T, hidden) normed input -> (T, hidden): the module docstring's steps. `linear` and `act` are the path's
    matmul and gated activation; `rows_fn(fn, rows)` runs each expert's row-wise MLP (the host path's row tiler,
    which pads a call to a verified row count; the native paths' kernels need none)."""
    weights, experts = route(_biased(linear(x, w.router), w.bias("router")), spec)  # (T, k), (T, k)
    k = spec.top_k
    flat = experts.reshape(-1)  # (T * k,): token t's rank-j expert at t * k + j
    order = torch.argsort(flat, stable=True)  # grouped by expert, ascending; tokens ascending inside a group
    counts = torch.bincount(flat, minlength=spec.num_experts).tolist()
    tokens, scale = order // k, weights.reshape(-1, 1)[order].to(x.dtype)  # (T * k,), (T * k, 1) in that order
    out = torch.zeros_like(x)
    start = 0
    for e, count in enumerate(counts):  # ascending expert index: each token's terms are added in that order
        if not count:
            continue
        end = start + count
        rows = tokens[start:end]
        gate_up, down, b_gu, b_d = w.gate_up[e], w.down[e], w.bias("gate_up", e), w.bias("down", e)
        y = rows_fn(lambda xe: _biased(linear(act(_biased(linear(xe, gate_up), b_gu)), down), b_d),
                    x.index_select(0, rows))  # (count, hidden)
        out.index_add_(0, rows, y.mul_(scale[start:end]))  # its weight, then one add per element
        start = end
    return out


def _biased(y: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """y + b as Transformer._linear adds a bias: in place, one exact add per element."""
    return y.add_(b) if b is not None else y


def expert_names(prefix: str, e: int) -> tuple[str, str, str]:
    """The HF names of expert e's gate, up and down weights under `prefix` ("model.layers.3.mlp.")."""
    p = f"{prefix}experts.{e}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


def split_fused_experts(weights: dict[str, Any], prefix: str, spec: MoeSpec) -> None:
    """transformers' fused 3-D expert tensors (its GGUF loader's, and v5 checkpoints: `experts.gate_up_proj`
    (E, 2I, H), `experts.down_proj` (E, H, I)) become the per-expert names a checkpoint saves (views, no copy).
    A layer already in per-expert names is left as it is."""
    gate_up, down = weights.pop(prefix + "experts.gate_up_proj", None), weights.pop(prefix + "experts.down_proj", None)
    if gate_up is None and down is None:
        return
    if gate_up is None or down is None:
        raise ValueError(f"{prefix}experts: gate_up_proj and down_proj must both be present")
    i, e = spec.expert_size, spec.num_experts
    if gate_up.shape[0] != e or down.shape[0] != e or gate_up.shape[1] != 2 * i or down.shape[2] != i:
        raise ValueError(f"{prefix}experts: gate_up_proj {tuple(gate_up.shape)} and down_proj {tuple(down.shape)} "
                         f"do not hold {e} experts of width {i}")
    for x in range(e):
        g, u, d = expert_names(prefix, x)
        weights[g], weights[u], weights[d] = gate_up[x, :i], gate_up[x, i:], down[x]


def load_moe(weights: dict[str, Any], prefix: str, spec: MoeSpec, mat: Callable[[list[str]], Any],
             cat: Callable[[list[str]], Any],
             split: Callable[[dict[str, Any], str, MoeSpec], None] = split_fused_experts) -> MoeWeights:
    """One sparse layer's weights, taken out of `weights` by `mat` (the builder's: stored parts or owned tensors),
    each expert's gate and up fused along N as a dense layer's are, and their biases where the layer has them by
    `cat` (the builder's: the named vectors fused, or None where none is present). `split`: the checkpoint's fused
    expert layout into per-expert names (transformers' stacked one, or gptoss.split_gptoss_experts). KeyError names
    a missing tensor."""
    split(weights, prefix, spec)
    gate_up, down, b_gu, b_d = [], [], [], []
    for e in range(spec.num_experts):
        g, u, d = expert_names(prefix, e)
        gate_up.append(mat([g, u]))
        down.append(mat([d]))
        b_gu.append(cat([g.replace(".weight", ".bias"), u.replace(".weight", ".bias")]))
        b_d.append(cat([d.replace(".weight", ".bias")]))
    b_router = cat([prefix + "gate.bias"])
    biases = (b_router, *b_gu, *b_d)
    return MoeWeights(router=mat([prefix + "gate.weight"]), gate_up=gate_up, down=down,
                      biases=biases if any(b is not None for b in biases) else ())


def pack_moe(w: MoeWeights, layer: int, make: Callable[[str, QMatrix], QMatrix]) -> None:
    """The int8 path: each expert's matrices repacked into panels by `make(slot, matrix)` (the loader's: the cache
    or q8pack), one at a time, replacing the stored ones (so each GGUF view is let go as its panels arrive: no
    second resident copy). The router stays on the float32 family (module docstring)."""
    for e in range(len(w.gate_up)):
        w.gate_up[e] = make(f"layers.{layer}.experts.{e}.gate_up", w.gate_up[e])
        w.down[e] = make(f"layers.{layer}.experts.{e}.down", w.down[e])


def moe_slots(w: MoeWeights, layer: int) -> dict[str, Any]:
    """The expert matrices by the slot names pack_moe gives them (the packed-weight cache files them so)."""
    out = {}
    for e in range(len(w.gate_up)):
        out[f"layers.{layer}.experts.{e}.gate_up"] = w.gate_up[e]
        out[f"layers.{layer}.experts.{e}.down"] = w.down[e]
    return out
