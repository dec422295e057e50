"""Who is calling: the tenants of a keys file (`--api-keys FILE`), and the one place a key is resolved to one.

A keys file is TOML (docs/tenants.md):

    [[tenant]]
    name = "chat"                          # [A-Za-z0-9_.-], at most 64: the metrics' `tenant` label
    keys = ["<sha256 hex of a key>"]       # `steadyserve hash-key` makes one; the key itself is never stored
    weight = 3                             # share of the engine against other tenants (default 1)
    max_concurrent = 32                    # requests in flight at once (default: no limit of its own)
    prompt_tokens_per_minute = 200000      # optional
    output_tokens_per_minute = 50000       # optional
    priority = "interactive"               # interactive (default) | batch
    endpoints = ["chat", "completions"]    # default: every endpoint but the admin ones
    roles = ["admin"]                      # admin: the console and /metrics

`--api-key KEY` is one tenant, `default`, with every endpoint and the admin role. A key is compared as its
sha256 digest against every stored digest with hmac.compare_digest (constant time, no early exit), so
neither the key nor how much of it matched leaks through timing, and nothing but digests is ever held.

This module imports nothing of the package but the config's error type: the front ends and the command line
share it, and the engine reads only the names and weights it puts on each Request.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .config import ConfigError

PRIORITIES = ("interactive", "batch")  # queue classes: interactive requests are picked first
ROLES = ("admin",)  # admin: the console's API and /metrics (which a keys file always guards)
# Endpoint names a tenant may be allowed, and what each covers (HTTP routes, gRPC methods): ENDPOINT_OF.
ENDPOINTS = ("completions", "chat", "responses", "messages", "embeddings", "stream", "tokenize", "models",
             "generate", "score")
ADMIN_ENDPOINTS = ("console", "metrics")  # need the admin role, whatever `endpoints` says
NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
DIGEST_RE = re.compile(r"^(sha256:)?[0-9a-f]{64}$")
TENANT_FIELDS = ("name", "keys", "weight", "max_concurrent", "prompt_tokens_per_minute", "output_tokens_per_minute",
                 "priority", "endpoints", "roles")
SINGLE_KEY_TENANT = "default"  # the tenant --api-key makes

# HTTP path (or path prefix, ending in /) and gRPC method -> endpoint name; a path not here needs no endpoint.
_HTTP = {"/v1/completions": "completions", "/v1/chat/completions": "chat", "/v1/responses": "responses",
         "/v1/responses/": "responses", "/v1/messages": "messages", "/v1/messages/": "messages",
         "/v1/embeddings": "embeddings", "/v1/stream": "stream", "/tokenize": "tokenize", "/detokenize": "tokenize",
         "/v1/models": "models", "/v1/console/": "console", "/metrics": "metrics"}
_GRPC = {"Generate": "generate", "Score": "score", "Embed": "embeddings", "Tokenize": "tokenize",
         "GetModelInfo": "models"}


class KeysFileError(ConfigError):
    """The keys file cannot be used; the message names the file and the field at fault."""


def hash_key(key: str) -> str:
    """The sha256 hex digest a keys file stores for `key`."""
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def keys_file_entry(name: str, key: str, extra: str = "") -> str:
    """One `[[tenant]]` table of a keys file: `name` holding `key` (stored as its hash), then `extra` TOML lines."""
    return f'[[tenant]]\nname = "{name}"\nkeys = ["{hash_key(key)}"]\n{extra}\n'


def new_key() -> str:
    """A fresh random key (256 bits) for `steadyserve hash-key --new`."""
    return "ss-" + secrets.token_urlsafe(32)


def endpoint_of_path(path: str) -> str | None:
    """The endpoint an HTTP path belongs to; None for one no endpoint covers (health, the console's pages)."""
    if path in _HTTP:
        return _HTTP[path]
    return next((name for prefix, name in _HTTP.items() if prefix.endswith("/") and path.startswith(prefix)), None)


def endpoint_of_method(method: str) -> str | None:
    """The endpoint a gRPC method name (Generate, Score, ...) belongs to."""
    return _GRPC.get(method)


@dataclass(frozen=True)
class Tenant:
    """One caller identity of the keys file, with its share and its limits (each None: no limit of its own)."""

    name: str  # the tenant's name: logs, metrics labels, error messages (never a key)
    weight: float = 1.0  # its share of the engine against other waiting tenants (engine/fair_share.py)
    max_concurrent: int | None = None  # engine requests (choices) it may have in flight at once
    prompt_tokens_per_minute: int | None = None  # prompt tokens admitted per minute (api/quotas.py)
    output_tokens_per_minute: int | None = None  # generated tokens per minute (api/quotas.py)
    priority: str = "interactive"  # interactive | batch: interactive requests leave the queue first
    endpoints: frozenset[str] = frozenset(ENDPOINTS)  # the endpoints (ENDPOINTS) it may call
    roles: frozenset[str] = frozenset()  # admin: the console and the guarded /metrics too

    def may(self, endpoint: str | None) -> bool:
        """Whether this tenant may call `endpoint` (None: a route no endpoint covers)."""
        if endpoint is None:
            return True
        if endpoint in ADMIN_ENDPOINTS:
            return "admin" in self.roles
        return endpoint in self.endpoints


class Keyring:
    """Key digests -> tenants, from a keys file or one --api-key; immutable (a reload builds a new one)."""

    def __init__(self, tenants: list[Tenant], digests: list[tuple[bytes, Tenant]], source: str) -> None:
        self.tenants = {t.name: t for t in tenants}  # name -> tenant, in the file's order
        self._digests = digests  # (sha256 hex digest as bytes, its tenant)
        self.source = source  # the file it was read from, or "--api-key"

    def resolve(self, key: str) -> Tenant | None:
        """The tenant `key` belongs to, or None. Compares the key's digest with every stored one in constant
        time, never stopping at a match."""
        digest = hash_key(key).encode()
        found: Tenant | None = None
        for stored, tenant in self._digests:
            if hmac.compare_digest(digest, stored):
                found = tenant
        return found if key else None


def single_key(key: str) -> Keyring:
    """--api-key: one tenant with every endpoint and the admin role."""
    tenant = Tenant(SINGLE_KEY_TENANT, roles=frozenset(ROLES))
    return Keyring([tenant], [(hash_key(key).encode(), tenant)], "--api-key")


def load_keys_file(path: str) -> Keyring:
    """Read and check a keys file. Raises KeysFileError naming the file and the field."""
    try:
        data = tomllib.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise KeysFileError(f"--api-keys {path}: cannot read it: {e.strerror or e}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise KeysFileError(f"--api-keys {path}: not valid TOML: {e}") from None
    return parse_keys(data, path)


def parse_keys(data: dict[str, Any], path: str) -> Keyring:
    """The Keyring of a parsed keys file; `path` names it in errors."""
    extra = sorted(set(data) - {"tenant"})
    if extra:
        raise KeysFileError(f"--api-keys {path}: unknown top-level field {extra[0]!r}; list tenants as [[tenant]]")
    items = data.get("tenant")
    if not isinstance(items, list) or not items:
        raise KeysFileError(f"--api-keys {path}: no tenants: list at least one as [[tenant]]")
    tenants: list[Tenant] = []
    digests: list[tuple[bytes, Tenant]] = []
    owner: dict[str, str] = {}
    for i, item in enumerate(items):
        tenant, keys = _tenant(item, f"--api-keys {path}: tenant[{i}]")
        where = f"--api-keys {path}: tenant[{i}] ({tenant.name})"
        if tenant.name in (t.name for t in tenants):
            raise KeysFileError(f"{where}: name {tenant.name!r} is used twice")
        for j, k in enumerate(keys):
            if k in owner:
                raise KeysFileError(f"{where}: keys[{j}] is also a key of tenant {owner[k]!r}")
            owner[k] = tenant.name
            digests.append((k.encode(), tenant))
        tenants.append(tenant)
    return Keyring(tenants, digests, path)


def _tenant(item: Any, where: str) -> tuple[Tenant, list[str]]:
    if not isinstance(item, dict):
        raise KeysFileError(f"{where}: must be a table ([[tenant]])")
    extra = sorted(set(item) - set(TENANT_FIELDS))
    if extra:
        raise KeysFileError(f"{where}: unknown field {extra[0]!r} (fields: {', '.join(TENANT_FIELDS)})")
    name = item.get("name")
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise KeysFileError(f"{where}: name must be 1-64 characters of A-Z a-z 0-9 _ . - (it labels metrics)")
    where = f"{where} ({name})"
    keys = item.get("keys")
    if not isinstance(keys, list) or not keys:
        raise KeysFileError(f"{where}: keys must be a list of at least one sha256 hex digest "
                            "(`steadyserve hash-key` makes one)")
    digests = []
    for j, k in enumerate(keys):
        if not isinstance(k, str) or not DIGEST_RE.match(k.strip().lower()):
            raise KeysFileError(f"{where}: keys[{j}] is not a sha256 hex digest: store `steadyserve hash-key`'s "
                                "output, never the key itself")
        digests.append(k.strip().lower().removeprefix("sha256:"))
    weight = item.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 < weight <= 1e6:
        raise KeysFileError(f"{where}: weight must be a number in (0, 1000000]")
    limits = {f: _limit(item, f, where) for f in ("max_concurrent", "prompt_tokens_per_minute",
                                                   "output_tokens_per_minute")}
    priority = item.get("priority", "interactive")
    if priority not in PRIORITIES:
        raise KeysFileError(f"{where}: priority must be one of {', '.join(PRIORITIES)}, not {priority!r}")
    endpoints = _names(item, "endpoints", ENDPOINTS, where, ENDPOINTS)
    roles = _names(item, "roles", ROLES, where, ())
    return Tenant(name, float(weight), priority=priority, endpoints=endpoints, roles=roles, **limits), digests


def _limit(item: dict[str, Any], field: str, where: str) -> int | None:
    value = item.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise KeysFileError(f"{where}: {field} must be an integer >= 1 (leave it out for no limit)")
    return value


def _names(item: dict[str, Any], field: str, allowed: tuple[str, ...], where: str,
           default: tuple[str, ...]) -> frozenset[str]:
    value = item.get(field, list(default))
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise KeysFileError(f"{where}: {field} must be a list of names ({', '.join(allowed)})")
    bad = next((v for v in value if v not in allowed), None)
    if bad is not None:
        raise KeysFileError(f"{where}: {field}: unknown name {bad!r} (one of {', '.join(allowed)})")
    return frozenset(value)
