"""`steadyserve` command line. Flags of `serve` map one-to-one onto config.Config."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from typing import Any, Sequence

from .config import (KV_CACHE_DTYPES, NUMERICS_MODES, Config, ConfigError, EngineConfig, ModelConfig, ServerConfig,
                     parse_kv_cache_memory, parse_size)
from .tools.cli import add_tool_commands  # a real import: a broken tools package must fail loudly

EXIT_USAGE = 2


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    d = ModelConfig()
    g = p.add_argument_group("model")
    g.add_argument("--model", default=d.path, help="HF model directory or .gguf file (default: SmolLM2-135M-Instruct)")
    g.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N | auto (default: %(default)s)")
    g.add_argument("--dtype", default=d.dtype, help="float32 | bfloat16 | float16 | auto (default: %(default)s)")
    g.add_argument("--cache-dir", default=d.cache_dir, help="converted-weight cache (default: ~/.cache/steadyserve)")
    g.add_argument("--served-model-name", default=d.name, help="model id clients send (default: from the path)")


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    d = EngineConfig()
    g = p.add_argument_group("engine")
    g.add_argument("--kv-cache-memory", default="256MiB",
                   help="KV cache budget, allocated once: a size, auto (fit it into the memory limit) or a fraction "
                        "such as 0.5 of what the limit leaves after weights and overhead (default: %(default)s)")
    g.add_argument("--kv-cache-dtype", default=d.kv_cache_dtype, choices=list(KV_CACHE_DTYPES),
                   help="KV cache storage: fp32, f16 or bf16 (half the bytes), q8_0 (int8 per 32 values with an f16 "
                        "scale, 3.76x the tokens of fp32 per byte); auto: the activations' dtype, fp32 on the CPU; "
                        "named in the fingerprint (default: %(default)s)")
    g.add_argument("--memory-limit", default="",
                   help="memory this server may use, e.g. 2GiB; the cgroup limit and MemAvailable + RSS apply too, "
                        "the smallest wins (default: none)")
    g.add_argument("--memory-overhead", default=f"{d.memory_overhead // 1024**2}MiB",
                   help="runtime memory beyond weights and KV cache that the start-up check counts "
                        "(default: %(default)s)")
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs, help="running sequences (default: %(default)s)")
    g.add_argument("--max-queue", type=int, default=d.max_queue, help="waiting requests (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="per-step token budget (default: %(default)s)")
    g.add_argument("--max-model-len", type=int, default=d.max_model_len, help="context cap; 0 = model's own")
    g.add_argument("--threads", type=int, default=d.threads,
                   help="torch intra-op threads; 0 = the CPU budget: the cgroup CPU quota (rounded down, at least "
                        "1) or the CPU affinity mask, whichever is smaller (default: %(default)s)")
    g.add_argument("--adaptive-threads", action=argparse.BooleanOptionalAction, default=d.adaptive_threads,
                   help="run fewer threads while starved of CPU (the engine thread waits on a run queue, or the "
                        "cgroup quota throttles), back up to --threads / the CPU budget when not; the output is "
                        "bitwise the same (default: on)")
    g.add_argument("--batch-invariant", action=argparse.BooleanOptionalAction, default=d.batch_invariant,
                   help="bitwise batch-invariant numerics (default: on)")
    g.add_argument("--row-tile", type=int, default=d.row_tile,
                   help="most rows per row-wise kernel call (default: %(default)s)")
    g.add_argument("--attention", default=d.attention, choices=["auto", "native", "python"],
                   help="attention kernel: native C++ when built (auto), required (native), or Python")
    g.add_argument("--numerics", default=d.numerics, choices=list(NUMERICS_MODES),
                   help="portable: steadyserve's native kernels on the weights as stored, the same bits on every "
                        "x86-64 host; int8: portable with int8 activations in the matmuls (faster, the same promises, "
                        "a quantization error); host: weights dequantized to float32, MKL and PyTorch kernels for this CPU; "
                        "auto: portable where the native kernels run, else host (default: %(default)s)")
    g.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=d.prefix_caching,
                   help="reuse the cached K/V of shared prompt prefixes, bitwise-safe (default: on)")
    g.add_argument("--speculation", default=d.speculation, choices=["auto", "off", "ngram"],
                   help="speculative decoding: ngram drafts tokens by prompt lookup and verifies them in one "
                        "pass, bitwise the output of off, where it pays; auto: ngram with --batch-invariant "
                        "and the native kernels, else off (default: %(default)s)")


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    d = ServerConfig()
    g = p.add_argument_group("server")
    g.add_argument("--host", default=d.host, help="bind address (default: %(default)s)")
    g.add_argument("--http-port", type=int, default=d.http_port, help="HTTP port; 0 = any free (default: %(default)s)")
    g.add_argument("--grpc-port", type=int, default=d.grpc_port, help="gRPC port; 0 = any free, -1 = off")
    g.add_argument("--stall-timeout", type=float, default=d.stall_timeout, help="seconds (default: %(default)s)")
    g.add_argument("--drain-timeout", type=float, default=d.drain_timeout, help="seconds (default: %(default)s)")
    g.add_argument("--max-request-bytes", default=str(d.max_request_bytes), help="largest request body")
    g.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap, help="largest max_tokens accepted")
    g.add_argument("--api-key", default=os.environ.get("STEADYSERVE_API_KEY", ""),
                   help="require this bearer token (or set STEADYSERVE_API_KEY)")
    g.add_argument("--metrics-auth", action="store_true", help="/metrics requires the API key too")
    g.add_argument("--log-format", default=d.log_format, choices=["text", "json"],
                   help="log lines as text or as one JSON object each (default: %(default)s)")
    g.add_argument("--tls-cert", default=d.tls_cert, help="PEM certificate: serve HTTPS and gRPC over TLS")
    g.add_argument("--tls-key", default=d.tls_key, help="PEM private key of --tls-cert")
    g.add_argument("--ready-file", default=d.ready_file, help="write bound ports as JSON here once serving")
    g.add_argument("--responses-store-size", type=int, default=d.responses_store_size,
                   help="responses /v1/responses keeps for previous_response_id and GET, in memory; the oldest "
                        "is evicted first (default: %(default)s; also at most 64 MiB)")


def config_from_args(a: argparse.Namespace) -> Config:
    cfg = Config(
        model=ModelConfig(path=a.model, device=a.device, dtype=a.dtype, cache_dir=a.cache_dir,
                          name=a.served_model_name),
        engine=EngineConfig(kv_cache_memory=parse_kv_cache_memory(a.kv_cache_memory),
                            memory_limit=parse_size(a.memory_limit, "--memory-limit") if a.memory_limit else 0,
                            memory_overhead=parse_size(a.memory_overhead, "--memory-overhead"),
                            block_size=a.block_size, max_num_seqs=a.max_num_seqs, max_queue=a.max_queue,
                            max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.max_model_len,
                            threads=a.threads, adaptive_threads=a.adaptive_threads,
                            batch_invariant=a.batch_invariant, row_tile=a.row_tile,
                            attention=a.attention, prefix_caching=a.prefix_caching, numerics=a.numerics,
                            speculation=a.speculation, kv_cache_dtype=a.kv_cache_dtype),
        server=ServerConfig(host=a.host, http_port=a.http_port, grpc_port=a.grpc_port,
                            stall_timeout=a.stall_timeout, drain_timeout=a.drain_timeout,
                            max_request_bytes=parse_size(a.max_request_bytes, "--max-request-bytes"),
                            max_tokens_cap=a.max_tokens_cap, api_key=a.api_key, metrics_public=not a.metrics_auth,
                            log_format=a.log_format, tls_cert=a.tls_cert, tls_key=a.tls_key,
                            ready_file=a.ready_file, responses_store_size=a.responses_store_size),
    )
    cfg.validate()
    return cfg


def cmd_serve(a: argparse.Namespace, hooks: Any = None) -> int:
    """Serve; `hooks` (api.server.EngineHooks) only from the test suite's entry point, steadyserve.testing.serve."""
    from .api.server import Server
    from .logs import setup_logging
    from .models.loader import LoadError

    cfg = config_from_args(a)
    setup_logging(cfg.server.log_format)
    server = Server(cfg, hooks)
    try:
        server.load()
    except LoadError as e:
        print(f"steadyserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    return asyncio.run(server.serve())


def cmd_info(a: argparse.Namespace) -> int:
    """Load the model, run the self-test, print what a server would stamp on its responses."""
    from .api.startup import build_state
    from .logs import setup_logging
    from .models.loader import LoadError

    setup_logging("text")
    cfg = config_from_args(a)
    try:
        state = build_state(cfg)
    except LoadError as e:
        print(f"steadyserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    lm = state.loaded
    print(f"model         {lm.name} ({lm.args.architecture}, {lm.args.num_params / 1e6:.1f}M params)")
    print(f"fingerprint   {state.fingerprint}")
    print(f"context       {lm.max_model_len} tokens")
    print(f"kv cache      {state.engine.engine.kv.num_blocks} blocks x {cfg.engine.block_size} tokens")
    print(f"self-test     {state.selftest.detail if state.selftest else 'skipped (batch invariance off)'}")
    print(f"load time     {lm.load_seconds:.2f} s ({'cached' if lm.from_cache else 'converted' if lm.from_cache is False and str(lm.name).endswith('gguf') else 'read'})")
    from .platform_info import platform_info, row_tiles_of

    for label, value in platform_info(row_tiles_of(lm), state.memory.limit, state.cpu).lines():
        print(f"{label:<14}{value}")
    print(f"{'memory':<14}{state.memory.line()}")
    return 0 if (state.selftest is None or state.selftest.passed) else 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="steadyserve", description="A language-model server that stays correct under load.")
    sub = p.add_subparsers(dest="command", required=True)
    for name, fn, help_ in (("serve", cmd_serve, "serve a model over HTTP and gRPC"),
                            ("info", cmd_info, "load a model, run the self-test, print its fingerprint")):
        sp = sub.add_parser(name, help=help_)
        _add_model_flags(sp)
        _add_engine_flags(sp)
        _add_server_flags(sp)
        sp.set_defaults(fn=fn)
    add_tool_commands(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return a.fn(a)
    except ConfigError as e:
        print(f"steadyserve: error: {e}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    from .process_exit import exit_process

    exit_process(main())
