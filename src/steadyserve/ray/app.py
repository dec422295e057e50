"""build_app: the Ray Serve application (an Ingress in front of EngineReplica deployments).

`serve run` / `serve deploy` name it as `import_path: steadyserve.ray:build_app`; its `args` are
RayAppArgs. The engine's settings are `steadyserve serve`'s own flags (`serve_args`), parsed by the
CLI's own parser and validated by the one config tree before anything deploys; Ray's options of the
two deployments pass through as Ray Serve's LLM deployments take theirs (`deployment_config`).

Defaults that keep the project's guarantees behind Ray's router:
- max_ongoing_requests = --max-num-seqs + --max-queue: Ray never sends a replica more than its
  engine admits, so a replica's own 429 only happens when clients bypass Ray;
- max_queued_requests = --max-num-seqs + --max-queue (one replica's admission): beyond that, Ray's
  router refuses (429 / RESOURCE_EXHAUSTED) instead of queueing without bound. Ray counts a request
  as queued until it is assigned, even while a replica has room (Router.wrap_request_assignment), so
  a bound below one replica's admission refused bursts an idle replica could take (24 streams at
  once against one replica with 32 seats, on a loaded 2-core machine: a 429);
- graceful_shutdown_timeout_s = --drain-timeout: a replica scaled down finishes its streams first;
- autoscaling, when asked for, targets --max-num-seqs ongoing requests per replica;
- with --api-keys the ingress holds each tenant to its share of that whole admission (shares.py), since Ray's
  queue in front of the replicas is shared by every tenant; Ray's own queue bound then goes a quarter above it
  (with_tenant_headroom), so that the tenants' own 429s come first.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application

from ..cli import build_parser, config_from_args
from ..config import Config
from .child import refuse_owned_flags
from .ingress import Ingress
from .replica import EngineReplica

_INGRESS_DEFAULTS: dict[str, Any] = {
    "num_replicas": 1,
    # The ingress only forwards; Ray's bound that matters is the engine deployment's.
    "max_ongoing_requests": 4096,
    "ray_actor_options": {"num_cpus": 0.1},
}


class RayAppArgs(BaseModel):
    """The `args:` of a Serve config's application (deploy/ray/serve.yaml)."""

    model_config = ConfigDict(extra="forbid")

    serve_args: list[str] = Field(default_factory=list, description="flags of `steadyserve serve`, as on the "
                                  "command line (--model, --kv-cache-memory, --max-queue, ...); --host and the "
                                  "ports are each replica's own")
    deployment_config: dict[str, Any] = Field(default_factory=dict, description="Ray Serve options of the engine "
                                              "deployment (num_replicas or autoscaling_config, "
                                              "max_ongoing_requests, max_queued_requests, ray_actor_options, ...)")
    ingress_config: dict[str, Any] = Field(default_factory=dict, description="Ray Serve options of the ingress")


def parse_serve_args(serve_args: list[str]) -> Config:
    """The config tree of `steadyserve serve <serve_args>`; raises ValueError naming the flag."""
    refuse_owned_flags(serve_args)
    try:
        return config_from_args(build_parser().parse_args(["serve", *serve_args]))
    except SystemExit:  # argparse printed the problem to stderr
        raise ValueError(f"serve_args: not valid `steadyserve serve` flags: {serve_args}") from None


def engine_options(cfg: Config, given: dict[str, Any]) -> dict[str, Any]:
    """Ray options of the engine deployment: the defaults above, overridden by `given`."""
    ec, sc = cfg.engine, cfg.server
    options: dict[str, Any] = {
        "max_ongoing_requests": ec.max_num_seqs + ec.max_queue,
        "max_queued_requests": ec.max_num_seqs + ec.max_queue,
        "graceful_shutdown_timeout_s": sc.drain_timeout + 5,
        "graceful_shutdown_wait_loop_s": 0.5,
        "health_check_period_s": 2.0,
        "health_check_timeout_s": 10.0,
        "ray_actor_options": {"num_cpus": ec.threads or 1},
    }
    options.update(given)
    auto = options.get("autoscaling_config")
    if isinstance(auto, dict):
        options["autoscaling_config"] = {"target_ongoing_requests": ec.max_num_seqs, **auto}
        options.pop("num_replicas", None)
    return options


def deployment_capacity(options: dict[str, Any]) -> int:
    """Requests Ray admits to the engine deployment at once: replicas x max_ongoing_requests + max_queued_requests
    (with autoscaling, at its max_replicas: the ingress's tenant shares then never refuse what Ray would admit;
    max_queued_requests -1, Ray's unbounded queue, counts nothing)."""
    auto = options.get("autoscaling_config")
    replicas = options.get("num_replicas")
    if not isinstance(replicas, int):
        replicas = int(auto.get("max_replicas", 1)) if isinstance(auto, dict) else 1
    return replicas * int(options["max_ongoing_requests"]) + max(0, int(options["max_queued_requests"]))


def with_tenant_headroom(options: dict[str, Any], capacity: int) -> dict[str, Any]:
    """With a keys file the ingress's shares bound what the deployment holds at `capacity`; Ray's queue bound goes
    a quarter of that above it, so Ray's own count, which holds a request until its replica reports it finished
    (after the ingress has released it), never refuses first: its 429 `overloaded` would fall on any tenant
    (measured through a real cluster: 1 of 1240 refusals of a flooding tenant was Ray's without the headroom)."""
    if options["max_queued_requests"] < 0:  # Ray's unbounded queue: nothing to raise
        return options
    return {**options, "max_queued_requests": options["max_queued_requests"] + max(1, capacity // 4)}


def build_app(args: dict[str, Any]) -> Application:
    """Ray Serve's application builder (`import_path: steadyserve.ray:build_app`)."""
    a = RayAppArgs.model_validate(args or {})
    cfg = parse_serve_args(a.serve_args)
    options = engine_options(cfg, a.deployment_config)
    capacity = deployment_capacity(options)
    if cfg.server.api_keys:
        options = with_tenant_headroom(options, capacity)
    engine = serve.deployment(EngineReplica, name="EngineReplica").options(**options)
    ingress = serve.deployment(Ingress, name="Ingress").options(**{**_INGRESS_DEFAULTS, **a.ingress_config})
    return ingress.bind(engine.bind(a.serve_args, cfg.server.drain_timeout), cfg.server.max_request_bytes,
                        cfg.server.api_keys, capacity)
