"""Sub-commands `validate`, `bench`, `verify` and `hash-key` of the `steadyserve` command."""

from __future__ import annotations

import argparse
import os


def add_tool_commands(sub: argparse._SubParsersAction) -> None:
    key = os.environ.get("STEADYSERVE_API_KEY", "")
    v = sub.add_parser("validate", help="N identical requests at once; logprobs compared bitwise")
    v.add_argument("--http", help="server URL, e.g. http://127.0.0.1:8000")
    v.add_argument("--grpc", help="gRPC address(es), comma-separated, e.g. 127.0.0.1:50051")
    v.add_argument("-n", type=int, default=1000, help="identical probes (default: %(default)s)")
    v.add_argument("-c", "--concurrency", type=int, default=250, help="in flight at once (default: %(default)s)")
    v.add_argument("--background", type=float, default=0.5,
                   help="random background requests per probe, to vary batches (default: %(default)s)")
    v.add_argument("--prompt", default=None, help="probe text")
    v.add_argument("--max-tokens", type=int, default=16, help="tokens per generation probe")
    v.add_argument("--api-key", default=key)
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--receipts", type=int, default=0, metavar="N", help="also collect N receipts (scoring, greedy, "
                   "unseeded sampling) under the background load and verify them on this machine (default: none)")
    v.add_argument("--model", default="", help="with --receipts: the served model's file or directory, to replay "
                   "with (default: the packaged model whose weights hash the receipts name)")
    v.set_defaults(fn=_validate)

    b = sub.add_parser("bench", help="token- and stream-aware load generator")
    b.add_argument("--url", help="HTTP base URL, e.g. http://127.0.0.1:8000")
    b.add_argument("--grpc", help="gRPC address(es), comma-separated")
    b.add_argument("--mode", choices=["generate", "score"], default="generate")
    b.add_argument("--transport", choices=["sse", "ws", "grpc"], default="sse")
    b.add_argument("-c", "--concurrency", type=int, default=16, help="closed loop: clients")
    b.add_argument("-n", type=int, default=200, help="closed loop: total requests")
    b.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    b.add_argument("--duration", type=float, default=30.0, help="open loop: seconds")
    b.add_argument("--prompt-words", default="8-64", help="prompt length in words, N or LO-HI")
    b.add_argument("--output-tokens", default="16-128", help="max_tokens, N or LO-HI")
    b.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    b.add_argument("--slow-readers", type=float, default=0.0, help="fraction of clients reading slowly")
    b.add_argument("--slow-rate", type=float, default=2000.0, help="bytes/s of a slow reader")
    b.add_argument("--disconnect", type=float, default=0.0, help="fraction of clients hanging up mid-stream")
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--api-key", default=key)
    b.add_argument("--json", action="store_true")
    b.add_argument("--output", help="also write the JSON report here")
    b.add_argument("--plot", help="write latency CDF and throughput PNGs into this directory")
    b.set_defaults(fn=_bench)

    r = sub.add_parser("verify", help="replay receipts offline and check every bit (exit 0 only if all verify)")
    r.add_argument("receipts", nargs="+", metavar="RECEIPT", help="receipt files (a receipt, a list, a response "
                   "body with receipts, or JSON lines); - reads stdin")
    r.add_argument("--model", default="", help="the model the receipts name (HF directory or .gguf); default: the "
                   "packaged model whose weights hash the receipt names")
    r.add_argument("--threads", type=int, default=0, help="intra-op threads (default: the CPU budget); the bits "
                   "do not depend on it")
    r.add_argument("--one-at-a-time", action="store_true", help="replay each receipt alone instead of all "
                   "together (the verdicts must be the same)")
    r.add_argument("--json", action="store_true", help="print the verdicts as JSON")
    r.set_defaults(fn=_verify)

    h = sub.add_parser("hash-key", help="print the sha256 digest of an API key, as a keys file (--api-keys) "
                       "stores it; the key is read from stdin")
    h.add_argument("--new", action="store_true", help="make a new random key instead, and print it and its "
                   "digest (the key is shown once: give it to the tenant, store only the digest)")
    h.set_defaults(fn=_hash_key)


def _validate(a: argparse.Namespace) -> int:
    from .validate import DEFAULT_PROMPT, main

    a.prompt = a.prompt or DEFAULT_PROMPT
    return main(a)


def _verify(a: argparse.Namespace) -> int:
    from .verify import main

    return main(a)


def _bench(a: argparse.Namespace) -> int:
    from .bench import main

    return main(a)


def _hash_key(a: argparse.Namespace) -> int:
    import getpass
    import sys

    from ..tenants import hash_key, new_key

    if a.new:
        key = new_key()
        print(f"key     {key}\nsha256  {hash_key(key)}")
        return 0
    key = getpass.getpass("API key: ") if sys.stdin.isatty() else sys.stdin.readline().rstrip("\r\n")
    if not key:
        print("steadyserve: error: no key on stdin (or use --new)", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0
