"""testing/llama_converter.py: llama.cpp's own converter, run once for many models, caching its outputs.

What it promises: a run that fails raises with the converter's own words and leaves nothing in the output cache
(one process converts every model, so a later model's failure came after an earlier one's file was written: CI
once kept such a partial file)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from steadyserve.testing import build_tiny_model
from steadyserve.testing import llama_converter


def test_a_failed_run_raises_and_leaves_no_partial_output_in_the_cache(tmp_path: Path) -> None:
    good = build_tiny_model(tmp_path / "tiny-good", arch="qwen2", seed=int.from_bytes(os.urandom(3), "little"))
    bad = tmp_path / "tiny-bad"  # an architecture the converter does not know: it fails after `good` is written
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForCausalLM"]}))
    cache = llama_converter.CACHE / "converted-gguf"
    good_out = cache / f"{good.name}-{llama_converter._input_hash(good)}.gguf"  # random weights: never cached
    try:
        with pytest.raises(RuntimeError, match="llama.cpp's converter failed"):
            llama_converter.convert({good: tmp_path / "good.gguf", bad: tmp_path / "bad.gguf"})
        assert list(cache.glob(f"*.tmp{os.getpid()}")) == [], "a failed run left a partial output in the cache"
        assert not good_out.exists() and not (tmp_path / "good.gguf").exists()
    finally:
        good_out.unlink(missing_ok=True)
