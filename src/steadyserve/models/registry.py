"""Registry of supported architectures: HF architecture name -> config adapter.

To add an architecture, add one file in this package that calls `register` and
import it at the bottom of this module.
"""

from __future__ import annotations

from typing import Any, Callable

from .args import ModelArgs

ArgsFromConfig = Callable[[Any], ModelArgs]
_ARCHITECTURES: dict[str, ArgsFromConfig] = {}


def register(*names: str) -> Callable[[ArgsFromConfig], ArgsFromConfig]:
    def deco(fn: ArgsFromConfig) -> ArgsFromConfig:
        for n in names:
            _ARCHITECTURES[n] = fn
        return fn
    return deco


def supported() -> list[str]:
    return sorted(_ARCHITECTURES)


def model_args(hf_config: Any) -> ModelArgs:
    """Translate a transformers config into ModelArgs; ValueError if unsupported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in _ARCHITECTURES:
            return _ARCHITECTURES[arch](hf_config)
    raise ValueError(f"unsupported architecture {archs or getattr(hf_config, 'model_type', '?')}; "
                     f"supported: {', '.join(supported())}")


def common_args(cfg: Any, arch: str, **overrides: Any) -> ModelArgs:
    """The fields every Llama-family config spells the same way."""
    heads = cfg.num_attention_heads
    fields: dict[str, Any] = dict(
        architecture=arch,
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
        rms_norm_eps=cfg.rms_norm_eps,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        hf_config=cfg,
    )
    fields.update(overrides)
    return ModelArgs(**fields)


from . import llama, mistral, qwen2  # noqa: E402,F401  (registration side effects)
