"""Registry of supported architectures: a plain table from HF architecture name to config adapter.

To add an architecture, write its adapter (a function from a transformers config to ModelArgs) in a module
of this package and add it to ARCHITECTURES. Model modules never import this one.
"""

from __future__ import annotations

from typing import Any, Callable

from .args import ModelArgs
from .extended import ExtendedTransformer
from .gemma3 import gemma2_args, gemma3_args
from .gptoss import gptoss_args
from .granite import granite_args
from .llama import llama_args
from .mistral import mistral_args
from .olmo2 import olmo2_args
from .phi3 import phi3_args
from .qwen2 import qwen2_args
from .qwen3 import qwen3_args
from .qwen3moe import qwen3moe_args
from .smollm3 import smollm3_args
from .transformer import Transformer

ArgsFromConfig = Callable[[Any], ModelArgs]
ARCHITECTURES: dict[str, ArgsFromConfig] = {
    "LlamaForCausalLM": llama_args,
    "MistralForCausalLM": mistral_args,
    "Qwen2ForCausalLM": qwen2_args,
    "Qwen3ForCausalLM": qwen3_args,
    "Qwen3MoeForCausalLM": qwen3moe_args,
    "Gemma2ForCausalLM": gemma2_args,
    "Gemma3ForCausalLM": gemma3_args,
    "Phi3ForCausalLM": phi3_args,
    "Olmo2ForCausalLM": olmo2_args,
    "SmolLM3ForCausalLM": smollm3_args,
    "GraniteForCausalLM": granite_args,
    "GptOssForCausalLM": gptoss_args,
}


def model_class(args: ModelArgs) -> type[Transformer]:
    """The class that runs `args`: Transformer, or extended.py's where loading or the model's ends differ from
    Llama's (the layers are Transformer's for both, from the LayerSpec)."""
    return ExtendedTransformer if args.extended else Transformer


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
