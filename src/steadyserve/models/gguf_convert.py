"""A GGUF file's config, tokenizer and (host path) float32 tensors, checked before any of it is made.

loader.convert_gguf caches what `convert` returns; `convert` writes nothing. The file is untrusted input
(issue 58), so the order is: the header (gguf_file.read_gguf), the architecture, the metadata values
(gguf_check.check_metadata), the config, then every tensor against that config and the data layout
(gguf_check.check_tensors), and only then the tensors and the tokenizer. A damaged file so ends in one
error naming the field or tensor at fault, before the conversion cache holds anything of it.

The config comes from transformers' GGUF loader, plus what it drops (gguf_config.fix_transformers_config),
or from gguf_config.py where transformers has no map.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from .gguf_config import GgufArch, GgufConfigError

_READER_SWAP = threading.Lock()


@contextmanager
def one_gguf_reader() -> Iterator[None]:
    """While it lasts, gguf-py's GGUFReader is an lru_cache(maxsize=1) of the real class: transformers parses a
    file with it at each call (a conversion's config, tensors and tokenizer; a from_pretrained(gguf_file=...)
    twice), ~17 s each over Gemma 3's 262k-token vocabulary, and imports it from gguf at each call, so one
    reader object, which none of the calls changes, serves them all. Nested uses share the outermost one.
    `gguf.GGUFReader.cache_clear()` frees the reader early. Only the swap is locked: a conversion in another
    thread meanwhile shares the cache (keyed by the file) or, once it is restored, parses for itself."""
    import gguf

    with _READER_SWAP:
        real = gguf.GGUFReader
        outermost = not hasattr(real, "cache_clear")
        if outermost:
            gguf.GGUFReader = functools.lru_cache(maxsize=1)(real)
    try:
        yield
    finally:
        if outermost:
            with _READER_SWAP:
                gguf.GGUFReader = real


def convert(path: Path, with_weights: bool, native: bool) -> tuple[Any, dict[str, torch.Tensor], Any]:
    """(HF config, float32 tensors by HF name (empty unless with_weights), tokenizer) of a file that passed the
    checks; `native`: the tensors will be read by the native kernels, so a type they lack is refused here too.
    Raises GgufFormatError, GgufConfigError or UnsupportedFormat naming the field or tensor."""
    from .gguf_check import check_metadata, check_tensors
    from .gguf_config import gguf_arch
    from .gguf_file import read_gguf
    from .registry import model_args

    gfile = read_gguf(path, text=True)  # the tokenizer's conversion reads the vocabulary's strings
    metadata, names = gfile.metadata, tuple(t.name for t in gfile.tensors)
    rope_freqs = next((t.data.astype("float32").tolist() for t in gfile.tensors if t.name == "rope_freqs.weight"), None)
    arch = str(metadata.get("general.architecture", "?"))
    entry = gguf_arch(arch)  # refused here, before any tensor
    check_metadata(metadata, arch, len(names))
    with one_gguf_reader():
        hf_config, skeleton = _config(path, metadata, names, entry, rope_freqs)
        try:
            args = model_args(hf_config)
        except ValueError as e:
            raise GgufConfigError(f"the config its metadata gives: {e}") from None
        check_tensors(gfile, args, native)
        del gfile  # its mapping: the readers below open the file themselves
        if entry.own_map:
            tensors, tokenizer = _own_tensors_and_tokenizer(path, args.num_heads, args.num_kv_heads, with_weights)
        else:
            tensors, tokenizer = _transformers_tensors_and_tokenizer(path, skeleton, with_weights)
    return hf_config, tensors, tokenizer


def _config(path: Path, metadata: dict[str, Any], names: tuple[str, ...], entry: GgufArch,
            rope_freqs: list[float] | None = None) -> tuple[Any, Any]:
    """The HF config, and for transformers' map its model skeleton on the meta device (its tensor-name map; no
    weights), whose class names the architecture as transformers' loader does."""
    from transformers import AutoConfig

    from .gguf_config import fix_transformers_config, own_config

    if entry.own_map:
        cfg_dict = own_config(metadata, names)
        return AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict), None
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    meta = load_gguf_checkpoint(str(path), return_tensors=False)
    cfg_dict = fix_transformers_config(metadata, dict(meta["config"]), rope_freqs)
    hf_config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(hf_config)
    hf_config.architectures = [type(skeleton).__name__]
    return hf_config, skeleton


def _transformers_tensors_and_tokenizer(path: Path, skeleton: Any,
                                        with_weights: bool) -> tuple[dict[str, torch.Tensor], Any]:
    from transformers import AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"] \
        if with_weights else {}
    return tensors, AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _own_tensors_and_tokenizer(path: Path, num_heads: int, num_kv_heads: int,
                               with_weights: bool) -> tuple[dict[str, torch.Tensor], Any]:
    """Tensors dequantized by our own reader (gguf.read_float32), and the tokenizer as transformers converts a GGUF
    vocabulary (whatever the architecture), in the generic class (transformers picks no class for a file it
    cannot read)."""
    import transformers

    from .gguf import read_float32

    tensors = read_float32(path, num_heads, num_kv_heads) if with_weights else {}
    generic = getattr(transformers, "TokenizersBackend", None) or transformers.PreTrainedTokenizerFast  # v5, v4
    return tensors, generic.from_pretrained(str(path.parent), gguf_file=path.name)
