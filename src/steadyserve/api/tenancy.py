"""Who a request is, for every transport: the one owner of authentication and of what a caller may call.

The HTTP envelope (HTTP and WebSocket) and the gRPC interceptor hand the key a request carries and the
endpoint it asks for to `Gate.check`, which resolves the key through the Keyring (steadyserve/tenants.py:
--api-keys FILE, or --api-key as one tenant) and answers with the tenant, or why not: `unauthenticated` (no key,
or one no tenant has: 401 / UNAUTHENTICATED) or `forbidden` (an endpoint the tenant's entry does not allow:
403 / PERMISSION_DENIED). The tenant then is the context's current one (a ContextVar: each HTTP request,
WebSocket and RPC runs in its own task) until the transport's handler returns, so the request path
(ServerState.submit_all) reads it without every handler passing it on.

`Gate.reload` (SIGHUP, or the keys file changing) swaps in a new Keyring: requests already admitted keep the
tenant they were admitted as and finish; the next request with a removed key gets 401. A file that does not
load leaves the old keys in force.
"""

from __future__ import annotations

import logging
import os
from contextvars import ContextVar, Token
from dataclasses import dataclass
from typing import Any, Iterable

from ..config import ServerConfig
from ..tenants import Keyring, Tenant, endpoint_of_method, endpoint_of_path, load_keys_file, single_key

log = logging.getLogger("steadyserve.tenants")

_current: ContextVar[Tenant | None] = ContextVar("steadyserve_tenant", default=None)

OPEN_PATHS = ("/healthz", "/readyz")  # HTTP paths that need no key
# Without a key the console's pages load (they carry no data) and ask for one; its API and every model route need it.
KEYED_PREFIXES = ("/v1/",)
KEYED_PATHS = ("/metrics", "/tokenize", "/detokenize")
# gRPC services reachable without a key: health probes and schema listing carry no model data.
OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")


def current() -> Tenant | None:
    """The tenant of the request this task serves; None on a server without keys."""
    return _current.get()


def bind(tenant: Tenant | None) -> Token:
    """Make `tenant` the current one (until `unbind` with the token returned)."""
    return _current.set(tenant)


def unbind(token: Token) -> None:
    """Undo `bind`. A streaming handler's generator may be closed from another context than it ran in: the
    binding then dies with the task that made it."""
    try:
        _current.reset(token)
    except ValueError:
        pass


@dataclass(frozen=True)
class Access:
    """The gate's answer for one request."""

    tenant: Tenant | None  # who it is; None when no key is needed (an open server or an open route)
    refusal: str | None = None  # None: let it through; unauthenticated | forbidden
    message: str = ""  # with a refusal: what the client is told (never a key)


class Gate:
    """The keys in force (None: an open server) and the checks every transport runs against them."""

    def __init__(self, keyring: Keyring | None, keys_file: str = "", metrics_public: bool = True) -> None:
        self.keyring = keyring  # replaced whole by reload
        self.keys_file = keys_file  # --api-keys, reloaded on SIGHUP; "" with --api-key or none
        self.metrics_public = metrics_public  # /metrics needs no key (the default; --metrics-auth: admin role)
        self._mtime = _mtime(keys_file)

    @classmethod
    def from_config(cls, sc: ServerConfig) -> "Gate":
        """The gate of --api-keys (read now: a bad file fails start-up, naming the file and field), or of
        --api-key, or an open one."""
        if sc.api_keys:  # /metrics names the tenants: with a keys file it always needs the admin role
            return cls(load_keys_file(sc.api_keys), sc.api_keys, metrics_public=False)
        return cls(single_key(sc.api_key) if sc.api_key else None, "", sc.metrics_public)

    @property
    def tenant_names(self) -> list[str]:
        """The names of the tenants in force (the bound on the metrics' tenant label)."""
        return list(self.keyring.tenants) if self.keyring is not None else []

    @property
    def total_weight(self) -> float:
        """The sum of the weights of the tenants in force (what a tenant's share of a full server is out of)."""
        return sum(t.weight for t in self.keyring.tenants.values()) if self.keyring is not None else 1.0

    def reload(self) -> Keyring | None:
        """Read the keys file again and put it in force. Raises KeysFileError (the old keys stay in force)."""
        if not self.keys_file:
            return self.keyring
        self._mtime = _mtime(self.keys_file)
        self.keyring = load_keys_file(self.keys_file)
        log.info("keys file reloaded", extra={"fields": {"file": self.keys_file,
                                                         "tenants": len(self.keyring.tenants)}})
        return self.keyring

    def changed_on_disk(self) -> bool:
        """Whether the keys file's modification time differs from the one last loaded."""
        return bool(self.keys_file) and _mtime(self.keys_file) != self._mtime

    def check(self, key: str, endpoint: str | None) -> Access:
        """The tenant of `key` if it may call `endpoint` (tenants.ENDPOINTS, or console / metrics)."""
        keyring = self.keyring
        if keyring is None:
            return Access(None)
        tenant = keyring.resolve(key)
        if tenant is None:
            return Access(None, "unauthenticated", "missing or invalid API key")
        if not tenant.may(endpoint):
            need = "the admin role" if endpoint in ("console", "metrics") else f"{endpoint!r} in its endpoints"
            return Access(tenant, "forbidden", f"tenant {tenant.name!r} may not call {endpoint} (its keys-file "
                          f"entry needs {need})")
        return Access(tenant)

    def http(self, path: str, headers: dict[bytes, bytes], websocket: bool) -> Access:
        """Access for an HTTP request or WebSocket handshake to `path`."""
        if self.keyring is None or path in OPEN_PATHS or (path == "/metrics" and self.metrics_public):
            return Access(None)
        if not (path.startswith(KEYED_PREFIXES) or path in KEYED_PATHS):
            return Access(None)  # the console's static files carry no data; its API calls need the key
        return self.check(http_key(headers, websocket), endpoint_of_path(path))

    def grpc(self, service: str, method: str, metadata: Iterable[tuple[str, Any]] | None) -> Access:
        """Access for an RPC (`service`, `method`) with its invocation metadata."""
        if self.keyring is None or service in OPEN_SERVICES:
            return Access(None)
        return self.check(grpc_key(metadata), endpoint_of_method(method))


def http_key(headers: dict[bytes, bytes], websocket: bool) -> str:
    """The key of `Authorization: Bearer`, else `x-api-key` (Anthropic's clients), else (a browser's WebSocket,
    which cannot set headers) the subprotocol `bearer.<key>`; "" when none."""
    auth = headers.get(b"authorization", b"").decode("latin-1")
    key = auth[7:] if auth.lower().startswith("bearer ") else ""
    if not key:
        key = headers.get(b"x-api-key", b"").decode("latin-1")
    if not key and websocket:
        for proto in headers.get(b"sec-websocket-protocol", b"").decode("latin-1").split(","):
            proto = proto.strip()
            if proto.startswith("bearer."):
                key = proto[7:]
    return key


def grpc_key(metadata: Iterable[tuple[str, Any]] | None) -> str:
    """The key of the `authorization: Bearer` metadata, else `x-api-key`; "" when none."""
    md = dict(metadata or ())
    auth = md.get("authorization", "")
    key = auth[7:] if isinstance(auth, str) and auth.lower().startswith("bearer ") else ""
    if not key:
        value = md.get("x-api-key", "")
        key = value if isinstance(value, str) else ""
    return key


def _mtime(path: str) -> float | None:
    try:
        return os.stat(path).st_mtime_ns if path else None
    except OSError:
        return None
