"""One configuration tree for the whole server.

Every CLI flag of `steadyserve serve` maps one-to-one onto a field here (see
cli.py); validation lives next to the fields so a bad value is refused with a
message that names the flag.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the flag."""


# The settings of --numerics (numerics.py describes each path; auto picks numerics.DEFAULT_NATIVE_PATH).
NUMERICS_MODES = ("auto", "portable", "int8", "host")

# The settings of --kv-cache-dtype (engine/kv_cache.py owns what each stores; kernels/csrc/kv_format.h how).
KV_CACHE_DTYPES = ("auto", "fp32", "f16", "bf16", "q8_0")

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4,
          "KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}


def parse_size(text: str | int, flag: str) -> int:
    """Parse a byte size such as `2GiB`, `512MiB` or `1000000` into bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ConfigError(f"{flag}: cannot parse size {text!r} (examples: 2GiB, 512MiB, 1000000)")
    unit = (m.group(2) or "").upper().rstrip("B")
    return int(float(m.group(1)) * _UNITS[unit])


_FRACTION_RE = re.compile(r"^\s*\d*\.\d+\s*$")


def parse_kv_cache_memory(text: str | int | float) -> int | float | str:
    """--kv-cache-memory: a size (`2GiB`, bytes as a plain integer), `auto`, or a fraction (`0.5`: a number
    with a decimal point and no unit) of what the memory limit leaves after the weights and the overhead."""
    if not isinstance(text, str):
        return text
    if text.strip().lower() == "auto":
        return "auto"
    if _FRACTION_RE.match(text):
        return float(text)  # its range is checked by EngineConfig.validate, with the flag named
    if not _SIZE_RE.match(text):
        raise ConfigError(f"--kv-cache-memory: cannot parse {text!r}: give a size (2GiB, 512MiB), auto, "
                          "or a fraction in (0, 1] such as 0.5")
    return parse_size(text, "--kv-cache-memory")


@dataclass
class ModelConfig:
    path: str = ""  # --model: HF directory or .gguf file; empty means the default model
    device: str = "cpu"  # --device: cpu | cuda | cuda:N | auto; asking for a missing device is an error
    dtype: str = "auto"  # --dtype: float32 | bfloat16 | float16 | auto (float32 on CPU)
    cache_dir: str = ""  # --cache-dir: converted-weight cache; default ~/.cache/steadyserve
    name: str = ""  # --served-model-name: the id clients send; default derives from the path


@dataclass
class EngineConfig:
    # A size in bytes, a fraction in (0, 1] (float) or "auto"; memory.plan_memory turns the last two into bytes.
    kv_cache_memory: int | float | str = 256 * 1024**2  # --kv-cache-memory: the paged KV cache, allocated once: bytes, auto (what the memory limit leaves after weights, overhead and 10% headroom) or a fraction in (0, 1] of what it leaves after weights and overhead
    memory_limit: int = 0  # --memory-limit: bytes this server may use; the effective limit is the smallest of this, the cgroup limit and MemAvailable + RSS; 0 = no operator limit
    memory_overhead: int = 768 * 1024**2  # --memory-overhead: bytes beyond weights and KV cache the start-up check counts for the runtime (interpreter, libraries, tokenizer, activations)
    block_size: int = 32  # --block-size: tokens per KV block; also the attention reduction block
    max_num_seqs: int = 64  # --max-num-seqs: sequences running in one step
    max_queue: int = 256  # --max-queue: requests waiting for admission; beyond it, overload
    max_num_batched_tokens: int = 512  # --max-num-batched-tokens: per-step token budget (chunked prefill)
    max_model_len: int = 0  # --max-model-len: context cap; 0 = the model's own
    threads: int = 0  # --threads: torch intra-op threads; 0 = the CPU budget: the smallest of the cgroup CPU quota (rounded down, at least 1) and the CPU affinity mask
    adaptive_threads: bool = True  # --adaptive-threads / --no-adaptive-threads: run fewer intra-op threads while the engine thread waits on a CPU run queue or the cgroup quota throttles it (a busy neighbour, a CPU limit), back up to the thread count above when it stops; bitwise the same output (engine/threads.py)
    batch_invariant: bool = True  # --batch-invariant / --no-batch-invariant: bitwise batch-invariant numerics, self-tested at start-up
    row_tile: int = 512  # --row-tile: most rows per row-wise kernel call; fewer only in counts verified at start-up
    attention: str = "auto"  # --attention: auto | native (C++ kernel, else refuse to start) | python
    prefix_caching: bool = True  # --prefix-caching / --no-prefix-caching: reuse cached K/V of shared prompt prefixes
    speculation: str = "auto"  # --speculation: auto | off | ngram (ngram: prompt lookup drafts up to 7 tokens per sequence from its prompt and output, verified in one pass, bitwise the output of off, drafted only where the expected tokens pay for the rows; auto: ngram with --batch-invariant and the native kernels, else off)
    kv_cache_dtype: str = "auto"  # --kv-cache-dtype: how the KV cache stores keys and values: auto (the activations' dtype: float32 on the CPU, the cache as it always was) | fp32 | f16 | bf16 (IEEE round to nearest even; half the bytes) | q8_0 (llama.cpp's int8 per 32 values with an f16 scale; 34 bytes per 128 of fp32, native attention kernel only); every format keeps the bitwise promises
    numerics: str = "auto"  # --numerics: auto (portable where the native kernels run, else host) | portable (same bits on every x86-64 host, native kernels on the stored weights) | int8 (portable, with int8 activations in the matmuls: faster, same promises, quantization error) | host (fp32 weights, MKL and PyTorch for this CPU)

    def validate(self) -> None:
        kv = self.kv_cache_memory
        if isinstance(kv, str) and kv != "auto":
            raise ConfigError(f"--kv-cache-memory must be a size, auto or a fraction in (0, 1], not {kv!r}")
        if isinstance(kv, float) and not 0 < kv <= 1:
            raise ConfigError(f"--kv-cache-memory: a fraction must be in (0, 1] (0.5 = half of what the memory "
                              f"limit leaves after weights and overhead), not {kv!r}")
        if isinstance(kv, int) and kv <= 0:
            raise ConfigError("--kv-cache-memory must be positive")
        if self.memory_limit < 0:
            raise ConfigError("--memory-limit must be a size, or 0 for none")
        if self.memory_overhead < 0:
            raise ConfigError("--memory-overhead must be a size (0 or more)")
        if self.block_size < 1 or self.block_size > 1024:
            raise ConfigError("--block-size must be in 1..1024")
        if self.max_num_seqs < 1:
            raise ConfigError("--max-num-seqs must be at least 1")
        if self.max_queue < 0:
            raise ConfigError("--max-queue must be 0 or more")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("--max-num-batched-tokens must be at least --max-num-seqs "
                              "(every running sequence needs one token per step)")
        if self.max_model_len < 0:
            raise ConfigError("--max-model-len must be 0 (model default) or positive")
        if self.threads < 0:
            raise ConfigError("--threads must be 0 (the CPU budget) or positive")
        if self.row_tile < 1:
            raise ConfigError("--row-tile must be at least 1")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                              f"not {self.kv_cache_dtype!r}")
        if self.numerics not in NUMERICS_MODES:
            raise ConfigError(f"--numerics must be one of {', '.join(NUMERICS_MODES)}, not {self.numerics!r}")
        if self.numerics in ("portable", "int8") and not self.batch_invariant:
            raise ConfigError(f"--no-batch-invariant: {self.numerics} numerics are batch-invariant by construction; "
                              "the plain (variant) path is --numerics host --no-batch-invariant")
        if self.speculation not in ("auto", "off", "ngram"):
            raise ConfigError(f"--speculation must be auto, off or ngram, not {self.speculation!r}")
        if self.speculation == "ngram" and not self.batch_invariant:
            raise ConfigError("--speculation ngram needs --batch-invariant: its output equals --speculation off "
                              "because a verified chunk's rows are bitwise those of one-token steps")
        if self.attention not in ("auto", "native", "python"):
            raise ConfigError(f"--attention must be auto, native or python, not {self.attention!r}")

    @property
    def num_threads(self) -> int:
        """--threads, or when 0 the CPU budget read now (cpu_budget.py). The server reads the budget once at
        start-up and passes the engine its count, so this fallback serves offline engines (tools, tests)."""
        from .cpu_budget import read_cpu_budget  # torch-free, but not needed until a default is asked for

        return self.threads or read_cpu_budget().threads


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"  # --host: bind address; loopback unless said otherwise
    http_port: int = 8000  # --http-port: HTTP (and WebSocket) listen port; 0 picks a free one
    grpc_port: int = 50051  # --grpc-port: gRPC listen port; 0 picks a free one, -1 disables gRPC
    stall_timeout: float = 30.0  # --stall-timeout: seconds a stream's client may accept nothing
    drain_timeout: float = 120.0  # --drain-timeout: seconds SIGTERM waits for in-flight work
    max_request_bytes: int = 1024 * 1024  # --max-request-bytes: largest accepted request body
    max_tokens_cap: int = 4096  # --max-tokens-cap: largest max_tokens a request may ask for
    api_key: str = ""  # --api-key (or STEADYSERVE_API_KEY): bearer token; empty = open
    metrics_public: bool = True  # --metrics-auth: sets this false, and /metrics then needs the API key too
    log_format: str = "text"  # --log-format: text | json
    tls_cert: str = ""  # --tls-cert: PEM certificate for HTTP and gRPC
    tls_key: str = ""  # --tls-key: PEM private key
    ready_file: str = ""  # --ready-file: written with the bound ports once serving (for tests, scripts)
    responses_store_size: int = 1024  # --responses-store-size: stored /v1/responses kept, oldest evicted first

    def validate(self) -> None:
        if not 0 <= self.http_port <= 65535:
            raise ConfigError("--http-port must be in 0..65535")
        if not -1 <= self.grpc_port <= 65535:
            raise ConfigError("--grpc-port must be in 0..65535, or -1 to disable gRPC")
        if self.stall_timeout <= 0:
            raise ConfigError("--stall-timeout must be positive")
        if self.drain_timeout < 0:
            raise ConfigError("--drain-timeout must be 0 or more")
        if self.max_request_bytes < 1024:
            raise ConfigError("--max-request-bytes must be at least 1024")
        if self.max_tokens_cap < 1:
            raise ConfigError("--max-tokens-cap must be at least 1")
        if self.responses_store_size < 1:
            raise ConfigError("--responses-store-size must be at least 1")
        if self.log_format not in ("text", "json"):
            raise ConfigError("--log-format must be text or json")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key must be given together")


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def validate(self) -> None:
        if self.model.device not in ("cpu", "cuda", "auto") and not self.model.device.startswith("cuda:"):
            raise ConfigError(f"--device must be cpu, cuda, cuda:N or auto, not {self.model.device!r}")
        if self.model.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ConfigError(f"--dtype must be float32, bfloat16, float16 or auto, not {self.model.dtype!r}")
        self.engine.validate()
        self.server.validate()
