"""Registry of supported architectures: a plain table from HF architecture name to config adapter.

To add an architecture, write its adapter (a function from a transformers config to ModelArgs) in a module
of this package and add it to ARCHITECTURES. Model modules never import this one.
"""

from __future__ import annotations

from typing import Any, Callable

from .args import ModelArgs
from .llama import llama_args
from .mistral import mistral_args
from .qwen2 import qwen2_args

ArgsFromConfig = Callable[[Any], ModelArgs]
ARCHITECTURES: dict[str, ArgsFromConfig] = {
    "LlamaForCausalLM": llama_args,
    "MistralForCausalLM": mistral_args,
    "Qwen2ForCausalLM": qwen2_args,
}


def supported() -> list[str]:
    return sorted(ARCHITECTURES)


def model_args(hf_config: Any) -> ModelArgs:
    """Translate a transformers config into ModelArgs; ValueError if unsupported."""
    archs = list(getattr(hf_config, "architectures", None) or [])
    for arch in archs:
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch](hf_config)
    raise ValueError(f"unsupported architecture {archs or getattr(hf_config, 'model_type', '?')}; "
                     f"supported: {', '.join(supported())}")
