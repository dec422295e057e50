"""A keys-file reload during 64 open streams drops none of them (issue 61): a real server on 127.0.0.1.

Two tenants, "stays" and "goes", open 32 streams each (the TEST-ONLY slow-request fault keeps each step of them
>= 64 x 5 ms, so a 24-token stream lasts seconds on any CPU). Two tenants share the server, so a step starts at
most a quarter of the 64 seats' prompts, 8 of each tenant (engine/seating.py prompt_limits): every stream has its
first token by the 4th step of prompts, and the first streams end 24 steps after theirs, a margin of 20 steps
(>= 6.4 s) for the reload and the polls that see it. (With 12 tokens, a margin of 8 steps, one stream ended before
the refusal was seen once on a 2-core AMD EPYC.) Once every stream has its first token, the keys file loses "goes"
and the server gets SIGHUP: a new request with that key is 401 while all 64 are still open, and every one of them
then ends with its finish reason and [DONE].
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from http_util import parse_stream, post_request, wait_for
from steadyserve.tenants import keys_file_entry
from steadyserve.testing.faults import SLOW_REQUEST_MARKER
from steadyserve.testing.server import ServerProcess

KEYS = {"stays": "key-stays-" + "s" * 20, "goes": "key-goes-" + "g" * 20}
C = "/v1/completions"
STREAMS = 64
MAX_TOKENS = 24


def keys_file(*names: str) -> str:
    return "".join(keys_file_entry(n, KEYS[n]) for n in names)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys64") / "keys.toml"
    path.write_text(keys_file("stays", "goes"))
    return path


@pytest.fixture(scope="module")
def server(tiny_model: str, keys_path: Path):
    # --speculation off: drafts accepted on the tiny model's repetitive text would end streams in a few steps.
    with ServerProcess(tiny_model, "--api-keys", str(keys_path), "--max-num-seqs", str(STREAMS),
                       "--speculation", "off", threads=1, test_faults=True) as s:
        yield s


def _dechunk(body: bytes) -> bytes:
    """An HTTP/1.1 chunked body's bytes."""
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2:]
    return out


def test_a_reload_during_64_open_streams_drops_none(server, keys_path) -> None:
    """The 64 requests are written on raw sockets in one quick loop (a client library's per-request start-up
    would spread them over a second, and the first would be done before the last began), then read by a thread
    each."""
    first_tokens = threading.Barrier(STREAMS + 1, timeout=120)
    ended: list[float] = []
    socks = []
    for i in range(STREAMS):
        name = "stays" if i % 2 else "goes"
        body = json.dumps({"prompt": f"{SLOW_REQUEST_MARKER} stream {i}", "max_tokens": MAX_TOKENS,
                           "ignore_eos": True, "stream": True, "temperature": 0.8, "seed": i}).encode()
        s = socket.create_connection(("127.0.0.1", server.http_port), timeout=120)
        s.sendall(post_request(server.http_port, C, body, f"Authorization: Bearer {KEYS[name]}\r\n"))
        socks.append(s)

    def read(s: socket.socket) -> bytes:
        raw, waited = b"", False
        with s:
            while chunk := s.recv(65536):
                raw += chunk
                if not waited and b'"text"' in raw:  # its first token is out: the stream is open and running
                    waited = True
                    first_tokens.wait()
        if not waited:
            first_tokens.wait()  # a stream that failed early must not leave the others waiting
        ended.append(time.monotonic())
        return raw

    with ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(read, s) for s in socks]
        first_tokens.wait()  # all 64 have their first token
        keys_path.write_text(keys_file("stays"))
        server.signal(signal.SIGHUP)
        wait_for(lambda: httpx.post(server.http_url + C, json={"prompt": "hi", "max_tokens": 1},
                                    headers=auth("goes"), timeout=30).status_code == 401, 30,
                 what="the removed key refused")
        reloaded = time.monotonic()
        open_at_reload = STREAMS - len(ended)
        results = [f.result(timeout=120) for f in futures]
    for i, raw in enumerate(results):
        assert raw.startswith(b"HTTP/1.1 200"), (i, raw[:300])
    assert open_at_reload == STREAMS, f"only {open_at_reload} streams were open at the reload: slow them down"
    for i, raw in enumerate(results):
        chunks, done = parse_stream(_dechunk(raw.partition(b"\r\n\r\n")[2]))
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and
                   c["choices"][0]["finish_reason"]]
        assert done and reasons == ["length"], (i, raw[-300:])
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]), i
    assert min(ended) >= reloaded  # every one of them ended after the removed key was already refused
    assert httpx.post(server.http_url + C, json={"prompt": "hi", "max_tokens": 1}, headers=auth("stays"),
                      timeout=30).status_code == 200
    assert json.loads(httpx.post(server.http_url + C, json={"prompt": "hi", "max_tokens": 1}, headers=auth("goes"),
                                 timeout=30).text)["error"]["code"] == "invalid_api_key"
