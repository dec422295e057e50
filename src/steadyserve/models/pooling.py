"""How a model turns a prompt's hidden states into one embedding: the pooling and whether it is L2-normalised.

Decided once at load, from the model's own metadata where it has one, else from `--pooling`:

* a GGUF file's `<arch>.pooling_type` (llama.cpp's enum: 1 mean, 3 last; 0 "none" states nothing);
* a Hugging Face directory with sentence-transformers' `modules.json`: its Pooling module's `config.json`
  (`pooling_mode_lasttoken`, `pooling_mode_mean_tokens`) and whether a Normalize module follows;
* else `--pooling last|mean`, or `auto`: last-token pooling, the one a causal decoder's hidden states carry
  the whole text in (Qwen3-Embedding and the other decoder embedders use it).

An explicit `--pooling last|mean` wins over the metadata (logged when they disagree): an operator may know a
converted file's metadata is wrong. Metadata asking for a pooling steadyserve does not compute (cls, max, rank)
refuses to load unless `--pooling` says which to use. Normalisation follows sentence-transformers' Normalize
module where modules.json exists; everywhere else it is on (OpenAI's embeddings are unit vectors, llama.cpp's
server normalises by default).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("steadyserve.models")

POOLING_CHOICES = ("auto", "last", "mean")  # --pooling
POOLING_MODES = ("last", "mean")  # what the engine computes (engine/pooler.py)
# llama.cpp's enum llama_pooling_type, as GGUF files store it in `<arch>.pooling_type`.
GGUF_POOLING = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
# sentence-transformers' Pooling config keys -> the pooling's name (only POOLING_MODES are computed).
ST_POOLING = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
              "pooling_mode_max_tokens": "max", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len",
              "pooling_mode_weightedmean_tokens": "weightedmean"}
ST_NORMALIZE = "sentence_transformers.models.Normalize"
ST_POOLING_MODULE = "sentence_transformers.models.Pooling"


class PoolingError(ValueError):
    """The model's metadata asks for a pooling steadyserve does not compute; the message says what to pass."""


@dataclass(frozen=True)
class Pooling:
    """A model's embedding definition, fixed at load (LoadedModel.pooling)."""

    mode: str  # last | mean: the last prompt token's final-norm hidden state, or the mean of all of them
    normalize: bool  # L2-normalise the pooled vector (and again after `dimensions` truncates it)
    source: str  # where the choice came from, for the start-up log: --pooling, the GGUF key, modules.json, default


@dataclass(frozen=True)
class _Stated:
    """What a model's own metadata says, if anything."""

    mode: str | None  # last | mean, an unsupported name (cls, max, ...), or None: nothing stated
    normalize: bool | None  # None: not stated
    where: str  # the file and key that said it


def gguf_pooling(metadata: dict) -> _Stated:
    """`<arch>.pooling_type` of a GGUF file's metadata."""
    arch = metadata.get("general.architecture", "?")
    key = f"{arch}.pooling_type"
    value = metadata.get(key)
    if value is None:
        return _Stated(None, None, key)
    name = GGUF_POOLING.get(int(value), f"unknown ({value})")
    return _Stated(None if name == "none" else name, None, f"GGUF {key}={value}")


def sentence_transformers_pooling(model_dir: Path) -> _Stated:
    """A sentence-transformers directory's Pooling module and Normalize module (modules.json)."""
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return _Stated(None, None, "")
    modules = json.loads(modules_file.read_text())
    types = [m.get("type", "") for m in modules]
    normalize = ST_NORMALIZE in types
    pool = next((m for m in modules if m.get("type") == ST_POOLING_MODULE), None)
    if pool is None:
        return _Stated(None, normalize, "modules.json")
    cfg_file = model_dir / pool.get("path", "1_Pooling") / "config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    where = f"{cfg_file.relative_to(model_dir)}"
    on = [k for k in ST_POOLING if cfg.get(k)]
    if len(on) != 1:
        return _Stated(f"a combination of {on}" if on else None, normalize, where)
    return _Stated(ST_POOLING[on[0]], normalize, f"{where} {on[0]}")


def resolve_pooling(flag: str, src: Path, model_dir: Path) -> Pooling:
    """The model's Pooling. `flag`: --pooling (auto | last | mean); `src`: what --model named (a .gguf file
    or a directory); `model_dir`: its HF directory. Raises PoolingError."""
    if flag not in POOLING_CHOICES:
        raise PoolingError(f"--pooling must be one of {', '.join(POOLING_CHOICES)}, not {flag!r}")
    if src.is_file():
        from .gguf_file import read_gguf

        stated = gguf_pooling(dict(read_gguf(src).metadata))
    else:
        stated = sentence_transformers_pooling(model_dir)
    normalize = True if stated.normalize is None else stated.normalize
    if flag != "auto":
        if stated.mode is not None and stated.mode != flag:
            log.warning("--pooling overrides the model's own pooling", extra={"fields": {
                "pooling": flag, "model_says": stated.mode, "where": stated.where}})
        return Pooling(flag, normalize, "--pooling")
    if stated.mode is None:
        return Pooling("last", normalize, "default (the model states none; --pooling auto)")
    if stated.mode not in POOLING_MODES:
        raise PoolingError(f"{stated.where}: the model asks for {stated.mode} pooling, which steadyserve does not "
                           f"compute; pass --pooling last or --pooling mean to serve it anyway")
    return Pooling(stated.mode, normalize, stated.where)
