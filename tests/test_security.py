"""Issue 8, security: loopback by default, API key on HTTP and gRPC (constant-time), limits, TLS, no paths.

Two real servers on 127.0.0.1, started side by side:
  `locked`: key from STEADYSERVE_API_KEY, TLS (a self-signed certificate made now with openssl),
            --metrics-auth, and small limits (4 KiB bodies, 128-token context, max_tokens cap 64);
  `plain`:  key from --api-key, plaintext, /metrics left open (the default), default --host.
"""

from __future__ import annotations

import hmac
import json
import socket
import ssl
import struct
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from steadyserve.client import Client, pb
from steadyserve.cli import build_parser, config_from_args
from steadyserve.limits import GRPC_MAX_CONCURRENT_STREAMS
from steadyserve.testing.server import ServerProcess, start_servers

KEY = "k3y-" + "x" * 28
PLAIN_KEY = "plain-key-123"
C = "/v1/completions"


@pytest.fixture(scope="module")
def cert(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    crt, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(crt), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1"], check=True, capture_output=True)
    return crt, key


@pytest.fixture(scope="module")
def servers(tiny_model: str, cert):
    crt, key = cert
    locked, plain = start_servers(
        ((tiny_model, "--tls-cert", str(crt), "--tls-key", str(key), "--metrics-auth", "--max-request-bytes", "4096",
          "--max-model-len", "128", "--max-tokens-cap", "64"), {"env": {"STEADYSERVE_API_KEY": KEY}, "threads": 1}),
        ((tiny_model, "--api-key", PLAIN_KEY), {"threads": 1}))
    try:
        yield locked, plain
    finally:
        for s in (locked, plain):
            s.__exit__(None, None, None)


@pytest.fixture(scope="module")
def locked(servers):
    return servers[0]


@pytest.fixture(scope="module")
def plain(servers):
    return servers[1]


@pytest.fixture(scope="module")
def https(locked, cert):
    ctx = ssl.create_default_context(cafile=str(cert[0]))
    with httpx.Client(base_url=f"https://127.0.0.1:{locked.http_port}", verify=ctx, timeout=30) as c:
        yield c


AUTH = {"Authorization": f"Bearer {KEY}"}


# ---- binding ---------------------------------------------------------------------------------------------

def _listen_addresses(port: int) -> set[str]:
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, p = local.rsplit(":", 1)
            if state == "0A" and int(p, 16) == port:  # LISTEN
                out.add(addr)
    return out


def test_binds_loopback_unless_host_says_otherwise(plain, locked):
    for srv in (plain, locked):
        for port in (srv.http_port, srv.grpc_port):
            # 127.0.0.1 only (gRPC listens on an IPv6 socket with the v4-mapped ::ffff:127.0.0.1)
            assert _listen_addresses(port) in ({"0100007F"}, {"0000000000000000FFFF00000100007F"}), \
                (port, _listen_addresses(port))
    args = build_parser().parse_args(["serve"])
    assert config_from_args(args).server.host == "127.0.0.1"
    args = build_parser().parse_args(["serve", "--host", "0.0.0.0"])
    assert config_from_args(args).server.host == "0.0.0.0"


# ---- API key ----------------------------------------------------------------------------------------------

def test_http_api_key_bearer(plain):
    url = plain.http_url
    body = {"prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": PLAIN_KEY},
                    {"Authorization": f"Basic {PLAIN_KEY}"}, {"Authorization": f"Bearer {PLAIN_KEY}x"},
                    {"Authorization": f"Bearer {PLAIN_KEY[:-1]}"}):
        r = httpx.post(url + C, json=body, headers=headers, timeout=30)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(url + "/v1/models", headers=headers).status_code == 401
    good = {"Authorization": f"Bearer {PLAIN_KEY}"}
    assert httpx.post(url + C, json=body, headers=good, timeout=30).status_code == 200
    assert httpx.post(url + C, json=body, headers={"authorization": f"bearer {PLAIN_KEY}"},
                      timeout=30).status_code == 200
    # Health stays open; /metrics is open by default (no --metrics-auth)
    assert httpx.get(url + "/healthz").status_code == 200 and httpx.get(url + "/readyz").status_code == 200
    assert httpx.get(url + "/metrics").status_code == 200
    # WebSocket: no key -> the handshake is refused (HTTP 403) before any work
    with pytest.raises(InvalidStatus) as e:
        with connect(f"ws://127.0.0.1:{plain.http_port}/v1/stream", open_timeout=30):
            pass
    assert e.value.response.status_code == 403
    with connect(f"ws://127.0.0.1:{plain.http_port}/v1/stream", additional_headers=good, open_timeout=30) as ws:
        ws.send(json.dumps(body))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("final", "error"):
            msgs.append(json.loads(ws.recv(timeout=30)))
        assert msgs[-1]["type"] == "final"
    assert plain.metric("steadyserve_requests_rejected_total", reason="unauthenticated") >= 12


def test_grpc_api_key_metadata(plain):
    with grpc.insecure_channel(plain.grpc_addr) as ch:
        from steadyserve.api.protos.steadyserve.v1 import inference_pb2_grpc as pb_grpc
        stub = pb_grpc.InferenceStub(ch)
        for md in ((), (("authorization", "Bearer nope"),), (("authorization", PLAIN_KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Score(pb.ScoreRequest(text="x"), metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, md
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(pb.GenerateRequest(text="x"), metadata=md, timeout=10))
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with Client(plain.grpc_addr, api_key=PLAIN_KEY, timeout=30, retries=False) as c:
        assert c.score("with the key").usage.prompt_tokens > 0
        assert c.health() == "SERVING"
    with Client(plain.grpc_addr, timeout=30, retries=False) as c:
        assert c.health() == "SERVING"  # health is open


def test_key_comparison_is_constant_time(monkeypatch):
    """Both front ends ask the one owner of identity (api/tenancy.py's gate, steadyserve/tenants.py's Keyring),
    and hmac.compare_digest (constant-time) alone decides whether a key matches, never ==, over the sha256
    digests (the key itself is never compared or held): with compare_digest made to answer True for every key,
    a wrong key gets in; made to answer False, the right key does not. An extra == before or beside it would
    change one of those answers."""
    from steadyserve import tenants
    from steadyserve.api.grpc import interceptor as gi
    from steadyserve.api.http import envelope as http_app
    from steadyserve.api.tenancy import Gate

    calls = []
    state = SimpleNamespace(gate=Gate(tenants.single_key("secret")), fingerprint="fp", metrics=None)

    def http_ok(key: bytes | None) -> bool:
        headers = [(b"authorization", b"Bearer " + key)] if key is not None else []
        access = http_app.Envelope(None, state)._access({"type": "http", "path": "/v1/completions",
                                                         "headers": headers})
        return access.refusal is None

    def grpc_ok(key: str | None) -> bool:
        md = (("authorization", f"Bearer {key}"),) if key is not None else ()
        access = gi.ServerInterceptor(state)._access(SimpleNamespace(invocation_metadata=md),
                                                     "steadyserve.v1.Inference", "Score")
        return access.refusal is None

    for verdict in (True, False):
        def spy(a, b, verdict=verdict):
            calls.append((a, b))
            return verdict

        monkeypatch.setattr(tenants.hmac, "compare_digest", spy)
        for key in ("secret", "secreT", "wrong key"):
            assert http_ok(key.encode()) is verdict, (key, verdict)
            assert grpc_ok(key) is verdict, (key, verdict)
    digest = tenants.hash_key("secret").encode()
    assert len(calls) == 12 and all(b == digest for _, b in calls)
    assert all(a == tenants.hash_key(k).encode() for (a, _), k in
               zip(calls, [k for _ in range(2) for k in ("secret", "secret", "secreT", "secreT", "wrong key",
                                                          "wrong key")]))
    monkeypatch.undo()  # the real compare_digest: the right key only
    assert http_ok(b"secret") and grpc_ok("secret")
    assert not http_ok(None) and not http_ok(b"") and not http_ok(b"secreT")
    assert not grpc_ok(None) and not grpc_ok("") and not grpc_ok("secreT")


# ---- TLS, env-var key, --metrics-auth ------------------------------------------------------------------

def test_tls_http_env_key_and_metrics_auth(locked, https, cert):
    assert https.post(C, json={"prompt": "hi", "max_tokens": 2}).status_code == 401
    r = https.post(C, json={"prompt": "hi", "max_tokens": 2}, headers=AUTH)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    assert https.get("/healthz").status_code == 200 and https.get("/readyz").status_code == 200
    assert https.get("/metrics").status_code == 401  # --metrics-auth
    assert https.get("/metrics", headers=AUTH).status_code == 200
    # Plain HTTP to the TLS port gets no HTTP answer; an unverified certificate is refused by a verifying client.
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://127.0.0.1:{locked.http_port}/healthz", timeout=5)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"https://127.0.0.1:{locked.http_port}/healthz", timeout=5)  # system CAs: not ours
    # wss:// with the key as a header
    ctx = ssl.create_default_context(cafile=str(cert[0]))
    with connect(f"wss://127.0.0.1:{locked.http_port}/v1/stream", ssl=ctx, additional_headers=AUTH,
                 open_timeout=30) as ws:
        ws.send(json.dumps({"prompt": "hi", "max_tokens": 3}))
        msgs = []
        while not msgs or msgs[-1]["type"] not in ("final", "error"):
            msgs.append(json.loads(ws.recv(timeout=30)))
        assert msgs[-1]["type"] == "final" and msgs[-1]["usage"]["completion_tokens"] == 3


def test_tls_grpc(locked, cert):
    root = cert[0].read_bytes()
    with Client(locked.grpc_addr, api_key=KEY, root_certificates=root, tls=True, timeout=30, retries=False) as c:
        assert c.score("over tls").usage.prompt_tokens > 0
        assert c.health() == "SERVING"
    with Client(locked.grpc_addr, root_certificates=root, tls=True, timeout=30, retries=False) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.score("no key")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(locked.grpc_addr) as ch:  # plaintext to a TLS port: UNAVAILABLE, not a hang
        with pytest.raises(grpc.RpcError) as e:
            from grpc_health.v1 import health_pb2_grpc
            health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        # UNAVAILABLE (the TLS port drops the plaintext HTTP/2 preface) well inside the 5 s deadline:
        # DEADLINE_EXCEEDED would be the very hang this rules out.
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value


# ---- limits ---------------------------------------------------------------------------------------------

def test_limits_http(https):
    def post(body: dict) -> httpx.Response:
        return https.post(C, json=body, headers=AUTH)

    r = post({"prompt": "x" * 5000, "max_tokens": 1})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"  # --max-request-bytes 4096
    r = post({"prompt": list(range(5, 135)), "max_tokens": 1})
    assert r.status_code == 400 and "128" in r.json()["error"]["message"]  # prompt tokens > --max-model-len
    r = post({"prompt": "hi", "max_tokens": 65})
    assert r.status_code == 400 and "--max-tokens-cap" in r.json()["error"]["message"]
    assert post({"prompt": "hi", "max_tokens": 64}).status_code == 200
    assert post({"prompt": "hi", "max_tokens": 1, "logprobs": 21}).status_code == 400
    assert post({"prompt": "hi", "max_tokens": 1, "logprobs": 20}).status_code == 200
    r = https.post("/v1/chat/completions", headers=AUTH, json={
        "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"


def test_limits_grpc(locked, cert):
    root = cert[0].read_bytes()
    code = grpc.StatusCode
    with Client(locked.grpc_addr, api_key=KEY, root_certificates=root, tls=True, timeout=30, retries=False) as c:
        for call, expect in ((lambda: c.score("x" * 5000), code.RESOURCE_EXHAUSTED),  # message > 4096 bytes
                             (lambda: c.score(token_ids=list(range(5, 135))), code.INVALID_ARGUMENT),
                             (lambda: list(c.generate("hi", max_tokens=65)), code.INVALID_ARGUMENT),
                             (lambda: c.score("hi", top_logprobs=21), code.INVALID_ARGUMENT)):
            with pytest.raises(grpc.RpcError) as e:
                call()
            assert e.value.code() == expect, e.value.details()
        assert len(c.score("hi", top_logprobs=20).tokens) >= 1
        assert c.score("still fine").usage.prompt_tokens > 0


def test_grpc_per_connection_stream_limit_is_advertised(plain):
    """HTTP/2 SETTINGS_MAX_CONCURRENT_STREAMS from the server, read off a raw socket."""
    s = socket.create_connection(("127.0.0.1", plain.grpc_port), timeout=10)
    try:
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        head = b""
        while len(head) < 9:
            head += s.recv(9 - len(head))
        length, ftype = int.from_bytes(head[:3], "big"), head[3]
        assert ftype == 4  # the server's first frame is SETTINGS
        payload = b""
        while len(payload) < length:
            payload += s.recv(length - len(payload))
    finally:
        s.close()
    settings = dict(struct.unpack(">HI", payload[i:i + 6]) for i in range(0, length, 6))
    print(f"\ngRPC SETTINGS: {settings}")
    assert settings.get(3) == GRPC_MAX_CONCURRENT_STREAMS == 256


# ---- no path can be chosen through the API ---------------------------------------------------------------

def test_no_model_or_file_path_through_the_api(plain, tiny_model):
    h = {"Authorization": f"Bearer {PLAIN_KEY}"}
    url = plain.http_url
    for model in (tiny_model, "/etc/passwd", "../../../../etc/passwd", str(Path(tiny_model).parent)):
        r = httpx.post(url + C, json={"prompt": "hi", "max_tokens": 1, "model": model}, headers=h, timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", model
        with Client(plain.grpc_addr, api_key=PLAIN_KEY, timeout=30, retries=False) as c:
            with pytest.raises(grpc.RpcError) as e:
                c.score("hi", model=model)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for path in ("/static/../../../../etc/passwd", "/static/%2e%2e/%2e%2e/etc/passwd", "/static//etc/passwd"):
        r = httpx.get(url + path, headers=h)
        assert r.status_code == 404 and "root:" not in r.text, path
    # The served model's file-system path is never revealed.
    models = httpx.get(url + "/v1/models", headers=h).json()
    assert tiny_model not in json.dumps(models)
    # No request field in the published schemas names a path, file, directory or tokenizer.
    spec = httpx.get(url + "/openapi.json", headers=h).json()
    props = set()
    for schema in spec.get("components", {}).get("schemas", {}).values():
        props |= set(schema.get("properties", {}))
    assert props and not {p for p in props if any(w in p.lower() for w in ("path", "file", "dir", "tokenizer"))}
