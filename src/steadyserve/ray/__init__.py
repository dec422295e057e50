"""steadyserve on Ray Serve (the optional extra `steadyserve[ray]`).

    serve run deploy/ray/serve.yaml         # or: serve deploy deploy/ray/serve.yaml

An Ingress deployment (Ray's HTTP and gRPC proxies route to it) forwards every request through
Ray's router to EngineReplica deployments, each of which owns one engine: a `steadyserve serve`
process with the same flags. See app.py for the defaults that keep the project's guarantees.
"""

from __future__ import annotations

from typing import Any


def build_app(args: dict[str, Any]) -> Any:
    """Ray Serve's application builder; imported lazily so `import steadyserve.ray` needs no Ray."""
    from .app import build_app as build

    return build(args)


__all__ = ["build_app"]
