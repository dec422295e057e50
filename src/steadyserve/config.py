"""One configuration tree for the whole server, and the one owner of every `steadyserve serve` flag.

Each field that a flag sets says so in its metadata (`flag(...)`): the flag's name, its --help text, how its
text is parsed and its allowed values. The field's default is the flag's default. cli.py builds the parser
from these fields and the docs reference (docs/docgen.py) reads them too, so a flag is written once, here.
Validation lives next to the fields so a bad value is refused with a message that names the flag; the
allowed values of a choice are checked in one place (check_choices).
"""

from __future__ import annotations

import re
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable

from .limits import GRPC_MAX_CONCURRENT_STREAMS, MAX_HEADER_BYTES, MAX_HEADER_COUNT, MAX_JSON_DEPTH


class ConfigError(ValueError):
    """A configuration value is invalid. The message names the flag."""


# The settings of --numerics (numerics.py describes each path; auto picks numerics.DEFAULT_NATIVE_PATH).
NUMERICS_MODES = ("auto", "portable", "int8", "host")
ATTENTION_CHOICES = ("auto", "native", "python")  # --attention (models/loader.py attention_for)
SPECULATION_CHOICES = ("auto", "off", "ngram")  # --speculation (auto resolves in engine.py)


@dataclass(frozen=True)
class Flag:
    """How the command line sets one config field (the field's metadata["flag"]; cli.py reads it)."""

    name: str  # the option, e.g. "--kv-cache-memory"; a negatable bool also gets --no-<name>
    help: str  # the --help text; "%(default)s" becomes the field's default, as `shown` writes it
    parse: Callable[[str, str], Any] | None = None  # (text, flag name) -> the value; None: by the field's type
    choices: tuple[str, ...] = ()  # allowed values: shown in --help, checked by check_choices
    negatable: bool = False  # a bool field: --name and --no-name
    sets_false: bool = False  # a bool field that this store-true flag turns off (--metrics-auth)
    env: str = ""  # an environment variable that replaces the default (--api-key: STEADYSERVE_API_KEY)
    shown: Callable[[Any], str] = str  # the default as --help and the docs show it


def flag(default: Any = MISSING, /, *, name: str, help: str, **how: Any) -> Any:
    """A config field set by the command-line flag `name` (see Flag for the rest). Adding a flag is adding one
    such field (with its comment, and its range check in validate() naming the flag): the parser, --help and
    the docs reference follow."""
    return field(default=default, metadata={"flag": Flag(name, help, **how)})


def flag_of(f: Any) -> Flag | None:
    """The Flag of a dataclasses.Field, or None for a field no flag sets."""
    return f.metadata.get("flag")


def choice_error(flag_name: str, value: Any, choices: tuple[str, ...]) -> str:
    """The one wording of a refused choice, wherever a layer checks one."""
    return f"{flag_name} must be one of {', '.join(choices)}, not {value!r}"


def check_choices(section: Any) -> None:
    """Every choice field of a config section holds one of its flag's choices. Raises ConfigError."""
    for f in fields(section):
        spec = flag_of(f)
        if spec is not None and spec.choices and getattr(section, f.name) not in spec.choices:
            raise ConfigError(choice_error(spec.name, getattr(section, f.name), spec.choices))


def _mib(n: int) -> str:
    return f"{n // 1024**2}MiB"

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


def _parse_kv(text: str, _flag: str) -> int | float | str:
    return parse_kv_cache_memory(text)


@dataclass
class ModelConfig:
    path: str = flag("", name="--model",  # HF directory or .gguf file; empty means the default model
                     help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    device: str = flag("cpu", name="--device",  # cpu | cuda | cuda:N | auto; asking for a missing device is an error
                       help="cpu | cuda | cuda:N | auto (default: %(default)s)")
    dtype: str = flag("auto", name="--dtype",  # float32 | bfloat16 | float16 | auto (float32 on CPU)
                      choices=("float32", "bfloat16", "float16", "auto"),
                      help="float32 | bfloat16 | float16 | auto (default: %(default)s)")
    cache_dir: str = flag("", name="--cache-dir",  # converted-weight cache; default ~/.cache/steadyserve
                          help="converted-weight cache (default: ~/.cache/steadyserve)")
    name: str = flag("", name="--served-model-name",  # the id clients send; default derives from the path
                     help="model id clients send (default: from the path)")
    pooling: str = flag("auto", name="--pooling", choices=("auto", "last", "mean"),  # how /v1/embeddings pools a prompt's hidden states; auto takes the model's own metadata (GGUF pooling_type, sentence-transformers modules.json), else last; last or mean overrides it (models/pooling.py)
        help="how /v1/embeddings pools a prompt's hidden states: the last token's or their mean; auto takes the "
             "model's own metadata (GGUF pooling_type, sentence-transformers modules.json), else last "
             "(default: %(default)s)")


@dataclass
class EngineConfig:
    # A size in bytes, a fraction in (0, 1] (float) or "auto"; memory.plan_memory turns the last two into bytes.
    kv_cache_memory: int | float | str = flag(256 * 1024**2, name="--kv-cache-memory", parse=_parse_kv, shown=_mib,  # the paged KV cache, allocated once: bytes, auto (what the memory limit leaves after weights, overhead and 10% headroom) or a fraction in (0, 1] of what it leaves after weights and overhead
        help="KV cache budget, allocated once: a size, auto (fit it into the memory limit) or a fraction such as "
             "0.5 of what the limit leaves after weights and overhead (default: %(default)s)")
    memory_limit: int = flag(0, name="--memory-limit", parse=parse_size,  # bytes this server may use; the effective limit is the smallest of this, the cgroup limit and MemAvailable + RSS; 0 = no operator limit
        help="memory this server may use, e.g. 2GiB; the cgroup limit and MemAvailable + RSS apply too, the "
             "smallest wins (default: none)")
    memory_overhead: int = flag(768 * 1024**2, name="--memory-overhead", parse=parse_size, shown=_mib,  # bytes beyond weights and KV cache the start-up check counts for the runtime (interpreter, libraries, tokenizer, activations)
        help="runtime memory beyond weights and KV cache that the start-up check counts (default: %(default)s)")
    block_size: int = flag(32, name="--block-size",  # tokens per KV block; also the attention reduction block
                           help="tokens per KV block (default: %(default)s)")
    max_num_seqs: int = flag(64, name="--max-num-seqs",  # sequences running in one step
                             help="running sequences (default: %(default)s)")
    max_queue: int = flag(256, name="--max-queue",  # requests waiting for admission; beyond it, overload
                          help="waiting requests (default: %(default)s)")
    max_num_batched_tokens: int = flag(512, name="--max-num-batched-tokens",  # per-step token budget (chunked prefill)
                                       help="per-step token budget (default: %(default)s)")
    max_model_len: int = flag(0, name="--max-model-len",  # context cap; 0 = the model's own
                              help="context cap; 0 = model's own")
    threads: int = flag(0, name="--threads",  # torch intra-op threads; 0 = the CPU budget: the smallest of the cgroup CPU quota (rounded down, at least 1) and the CPU affinity mask
        help="torch intra-op threads; 0 = the CPU budget: the cgroup CPU quota (rounded down, at least 1) or the "
             "CPU affinity mask, whichever is smaller (default: %(default)s)")
    adaptive_threads: bool = flag(True, name="--adaptive-threads", negatable=True,  # run fewer intra-op threads while the engine thread waits on a CPU run queue or the cgroup quota throttles it (a busy neighbour, a CPU limit), back up to the thread count above when it stops; bitwise the same output (engine/threads.py)
        help="run fewer threads while starved of CPU (the engine thread waits on a run queue, or the cgroup quota "
             "throttles), back up to --threads / the CPU budget when not; the output is bitwise the same "
             "(default: on)")
    batch_invariant: bool = flag(True, name="--batch-invariant", negatable=True,  # bitwise batch-invariant numerics, self-tested at start-up
                                 help="bitwise batch-invariant numerics (default: on)")
    row_tile: int = flag(512, name="--row-tile",  # most rows per row-wise kernel call; fewer only in counts verified at start-up
                         help="most rows per row-wise kernel call (default: %(default)s)")
    attention: str = flag("auto", name="--attention", choices=ATTENTION_CHOICES,  # auto | native (C++ kernel, else refuse to start) | python
                          help="attention kernel: native C++ when built (auto), required (native), or Python")
    numerics: str = flag("auto", name="--numerics", choices=NUMERICS_MODES,  # auto (int8 where the native kernels run, else host) | portable (same bits on every x86-64 host, native kernels on the stored weights, float32 activations: exact-parity scoring) | int8 (portable, with int8 activations in the matmuls: faster, same promises, quantization error) | host (fp32 weights, MKL and PyTorch for this CPU)
        help="portable: steadyserve's native kernels on the weights as stored, float32 activations, the same "
             "bits on every x86-64 host (exact-parity scoring); int8: portable with int8 activations in the "
             "matmuls (faster, the same promises, a measured quantization error); host: weights dequantized to "
             "float32, MKL and PyTorch kernels for this CPU; auto: int8 where the native kernels run, else host "
             "(default: %(default)s)")
    prefix_caching: bool = flag(True, name="--prefix-caching", negatable=True,  # reuse cached K/V of shared prompt prefixes
                                help="reuse the cached K/V of shared prompt prefixes, bitwise-safe (default: on)")
    speculation: str = flag("auto", name="--speculation", choices=SPECULATION_CHOICES,  # auto | off | ngram (ngram: prompt lookup drafts up to 7 tokens per sequence from its prompt and output, verified in one pass, bitwise the output of off, drafted only where the expected tokens pay for the rows; auto: ngram with --batch-invariant and the native kernels, else off)
        help="speculative decoding: ngram drafts tokens by prompt lookup and verifies them in one pass, bitwise "
             "the output of off, where it pays; auto: ngram with --batch-invariant and the native kernels, else "
             "off (default: %(default)s)")
    kv_cache_dtype: str = flag("auto", name="--kv-cache-dtype", choices=KV_CACHE_DTYPES,  # how the KV cache stores keys and values: auto (f16 on --numerics int8; elsewhere the activations' dtype: float32 on the CPU) | fp32 | f16 | bf16 (IEEE round to nearest even; half the bytes) | q8_0 (llama.cpp's int8 per 32 values with an f16 scale; 34 bytes per 128 of fp32, native attention kernel only; its scores are exact integer dot products with the queries in q8_0, as llama.cpp's); every format keeps the bitwise promises
        help="KV cache storage: fp32, f16 or bf16 (half the bytes), q8_0 (int8 per 32 values with an f16 scale, "
             "3.76x the tokens of fp32 per byte; integer attention scores, the queries rounded to q8_0); auto: f16 "
             "on --numerics int8 (the default), else the activations' dtype; named in the fingerprint "
             "(default: %(default)s)")

    def validate(self) -> None:
        check_choices(self)
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
        if self.numerics in ("portable", "int8") and not self.batch_invariant:
            raise ConfigError(f"--no-batch-invariant: {self.numerics} numerics are batch-invariant by construction; "
                              "the plain (variant) path is --numerics host --no-batch-invariant")
        if self.speculation == "ngram" and not self.batch_invariant:
            raise ConfigError("--speculation ngram needs --batch-invariant: its output equals --speculation off "
                              "because a verified chunk's rows are bitwise those of one-token steps")

    @property
    def num_threads(self) -> int:
        """--threads, or when 0 the CPU budget read now (cpu_budget.py). The server reads the budget once at
        start-up and passes the engine its count, so this fallback serves offline engines (tools, tests)."""
        from .cpu_budget import read_cpu_budget  # torch-free, but not needed until a default is asked for

        return self.threads or read_cpu_budget().threads


@dataclass
class ServerConfig:
    host: str = flag("127.0.0.1", name="--host",  # bind address; loopback unless said otherwise
                     help="bind address (default: %(default)s)")
    http_port: int = flag(8000, name="--http-port",  # HTTP (and WebSocket) listen port; 0 picks a free one
                          help="HTTP port; 0 = any free (default: %(default)s)")
    grpc_port: int = flag(50051, name="--grpc-port",  # gRPC listen port; 0 picks a free one, -1 disables gRPC
                          help="gRPC port; 0 = any free, -1 = off")
    stall_timeout: float = flag(30.0, name="--stall-timeout",  # seconds a stream's client may accept nothing
                                help="seconds (default: %(default)s)")
    drain_timeout: float = flag(120.0, name="--drain-timeout",  # seconds SIGTERM waits for in-flight work
                                help="seconds (default: %(default)s)")
    max_request_bytes: int = flag(1024 * 1024, name="--max-request-bytes", parse=parse_size, shown=_mib,  # largest accepted request body; also a WebSocket frame or message (close 1009) and a gRPC message (RESOURCE_EXHAUSTED)
        help="largest request body, WebSocket message and gRPC message (default: %(default)s); fixed beside it: "
             f"request headers {MAX_HEADER_BYTES // 1024} KiB and {MAX_HEADER_COUNT} lines (431), JSON "
             f"{MAX_JSON_DEPTH} levels deep, {GRPC_MAX_CONCURRENT_STREAMS} gRPC streams per connection (docs: "
             "tenants, limits at the edge)")
    header_timeout: float = flag(10.0, name="--header-timeout",  # seconds from a connection's start (or its previous response) to the end of a request's headers: a slow-headers client is answered 408 and closed
        help="seconds a client has to send a request's headers, from connecting or from its previous response; "
             "past it: 408 and the connection is closed (default: %(default)s)")
    body_timeout: float = flag(30.0, name="--body-timeout",  # seconds from the end of a request's headers to the end of its body (and from a WebSocket's handshake to its request message): a slow-body client is answered 408 and closed
        help="seconds a client has to send a request's body once its headers are in (and a WebSocket its "
             "request message); past it: 408 (WebSocket: close 1008) and the connection is closed "
             "(default: %(default)s)")
    max_idle_connections: int = flag(256, name="--max-idle-connections",  # kept-alive HTTP connections waiting for a request; past it the longest idle is closed (each also closes after 5 s idle)
        help="HTTP connections kept alive with no request in progress; past it the longest idle one is closed "
             "(each also closes after 5 s idle) (default: %(default)s)")
    max_tokens_cap: int = flag(4096, name="--max-tokens-cap",  # largest max_tokens a request may ask for
                               help="largest max_tokens accepted")
    api_key: str = flag("", name="--api-key", env="STEADYSERVE_API_KEY",  # bearer token (or STEADYSERVE_API_KEY); empty = open
                        help="require this bearer token (or set STEADYSERVE_API_KEY)")
    api_keys: str = flag("", name="--api-keys",  # TOML keys file of tenants (steadyserve/tenants.py): key digests, share, limits, priority, endpoints; reloaded on SIGHUP; empty = --api-key or open
        help="TOML file of tenants: each a name, sha256 digests of its keys (steadyserve hash-key), a weight, "
             "its own limits (max_concurrent, prompt/output tokens per minute), a priority (interactive, batch) "
             "and the endpoints it may call; reloaded on SIGHUP or when it changes (docs: tenants)")
    metrics_public: bool = flag(True, name="--metrics-auth", sets_false=True,  # sets this false, and /metrics then needs the API key too (an admin tenant's, with --api-keys)
                                help="/metrics requires the API key too (with --api-keys: an admin tenant's)")
    log_format: str = flag("text", name="--log-format", choices=("text", "json"),  # text | json
                           help="log lines as text or as one JSON object each (default: %(default)s)")
    tls_cert: str = flag("", name="--tls-cert",  # PEM certificate for HTTP and gRPC
                         help="PEM certificate: serve HTTPS and gRPC over TLS")
    tls_key: str = flag("", name="--tls-key",  # PEM private key
                        help="PEM private key of --tls-cert")
    ready_file: str = flag("", name="--ready-file",  # written with the bound ports once serving (for tests, scripts)
                           help="write bound ports as JSON here once serving")
    responses_store_size: int = flag(1024, name="--responses-store-size",  # stored /v1/responses kept, oldest evicted first
        help="responses /v1/responses keeps for previous_response_id and GET, in memory; the oldest is evicted "
             "first (default: %(default)s; also at most 64 MiB)")
    otlp_traces_endpoint: str = flag("", name="--otlp-traces-endpoint",  # OTLP/HTTP collector URL for one trace span per request; empty = the OTEL_EXPORTER_OTLP_* variables, else no tracing
        help="export an OpenTelemetry trace per request to this OTLP/HTTP collector, e.g. http://127.0.0.1:4318 "
             "(/v1/traces is added to a URL without a path); default: the OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or "
             "OTEL_EXPORTER_OTLP_ENDPOINT variable, else off")

    def validate(self) -> None:
        check_choices(self)
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
        if not 0 < self.header_timeout <= 3600 or not 0 < self.body_timeout <= 3600:
            raise ConfigError("--header-timeout and --body-timeout must be in (0, 3600] seconds")
        if self.max_idle_connections < 1:
            raise ConfigError("--max-idle-connections must be at least 1")
        if self.max_tokens_cap < 1:
            raise ConfigError("--max-tokens-cap must be at least 1")
        if self.responses_store_size < 1:
            raise ConfigError("--responses-store-size must be at least 1")
        if self.otlp_traces_endpoint and not re.match(r"^https?://[^/\s:]+", self.otlp_traces_endpoint):
            raise ConfigError("--otlp-traces-endpoint must be an http:// or https:// URL of an OTLP/HTTP collector "
                              f"(e.g. http://127.0.0.1:4318), not {self.otlp_traces_endpoint!r}")
        if self.api_keys and self.api_key:
            raise ConfigError("--api-key (or STEADYSERVE_API_KEY) and --api-keys cannot be used together: list the "
                              "key's digest in the keys file as a tenant of its own")
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
        check_choices(self.model)
        self.engine.validate()
        self.server.validate()
