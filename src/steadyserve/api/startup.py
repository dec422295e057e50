"""Process wiring: load the model, size the KV cache, self-test, and assemble what the front ends share.

`build_state` runs on the model thread that will then run the engine (see engine/model_thread.py), and
returns the ServerState the HTTP and gRPC servers are built on; api/server.py serves it.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import Config, EngineConfig
from ..cpu_budget import CpuBudget, read_cpu_budget
from ..engine.async_engine import AsyncEngine
from ..engine.engine import LLMEngine
from ..engine.kv_cache import bytes_per_block, resolve_kv_dtype
from ..engine.model_thread import ModelThread
from ..engine.selftest import SelfTestResult, run_selftest
from ..memory import MemoryLimit, MemoryPlan, plan_memory, read_memory_limit, release_free_memory
from ..metrics import Metrics
from ..models.loader import LoadedModel, load_model
from ..numerics import activate as activate_numerics
from .state import ServerState
from .tenancy import Gate
from .streams import OpenChannels

log = logging.getLogger("steadyserve.server")


@dataclass
class EngineHooks:
    """Functions run on the engine while the server starts, on the model thread. Production passes none; the
    test suite's entry point (steadyserve.testing.serve) installs its fault and drift hooks through them."""

    after_engine: list[Callable[[LLMEngine], None]] = field(default_factory=list)  # before the self-test
    after_selftest: list[Callable[[LLMEngine], None]] = field(default_factory=list)  # after it


def _fit_memory(loaded: LoadedModel, ec: EngineConfig, limit: MemoryLimit) -> MemoryPlan:
    """Measure the weights and check (or, for auto / a fraction, derive) the KV budget against the limit,
    before the cache is allocated: a budget that cannot fit raises MemoryBudgetError here, not the OOM killer."""
    per_block = bytes_per_block(loaded.args, ec.block_size, resolve_kv_dtype(
        ec.kv_cache_dtype, loaded.dtype, loaded.numerics.mode if loaded.numerics else ""))
    plan = plan_memory(limit, loaded.weights_bytes, ec.memory_overhead, ec.kv_cache_memory, per_block,
                       on_host=loaded.device.type == "cpu")
    log.info("memory budget", extra={"fields": {
        "weights_bytes": plan.weights, "kv_cache_bytes": plan.kv, "kv_cache_memory": plan.kv_request,
        "derived": plan.derived, "overhead_bytes": plan.overhead, "total_bytes": plan.total,
        "limit_bytes": limit.limit, "limit_source": limit.source, "summary": plan.line()}})
    return plan


def _load_and_check(config: Config, hooks: EngineHooks, limit: MemoryLimit,
                    cpu: CpuBudget) -> tuple[LoadedModel, LLMEngine, SelfTestResult, MemoryPlan]:
    """Load the model, fit and size the KV cache, run the self-test (on the model thread), all with the CPU
    budget's thread count: loading and the row-tile calibration run as many threads as serving will."""
    mc, ec = config.model, config.engine
    torch.set_num_threads(cpu.threads)
    loaded = load_model(mc.path, mc.device, mc.dtype, batch_invariant=ec.batch_invariant, row_tile=ec.row_tile,
                        max_model_len=ec.max_model_len, name=mc.name, cache_dir=mc.cache_dir,
                        attention=ec.attention, block_size=ec.block_size, numerics=ec.numerics,
                        pooling=mc.pooling)
    assert loaded.numerics is not None
    log.info("cpu budget", extra={"fields": {
        "threads": cpu.threads, "source": cpu.source, "quota_cpus": cpu.quota, "quota": cpu.quota_detail,
        "affinity": cpu.affinity, "cpu_count": cpu.cpu_count}})
    if cpu.warning:
        log.warning(cpu.warning, extra={"fields": {"threads": cpu.threads, "quota_cpus": cpu.quota}})
    release_free_memory()  # before the KV cache is allocated, so the peak never holds load-time garbage
    activate_numerics(loaded.numerics)
    log.info("model loaded", extra={"fields": {
        "numerics": loaded.numerics.mode, "numerics_id": loaded.numerics.numerics_id,
        "weights_bytes": loaded.weights_bytes,
        "model": loaded.name, "architecture": loaded.args.architecture, "params": loaded.args.num_params,
        "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch."),
        "load_s": round(loaded.load_seconds, 2), "cached": loaded.from_cache, "context": loaded.max_model_len}})
    log.info("embedding pooling", extra={"fields": {
        "pooling": loaded.pooling.mode, "normalize": loaded.pooling.normalize, "source": loaded.pooling.source}})
    plan = _fit_memory(loaded, ec, limit)
    # KV in bytes, whatever was asked; threads as the CPU budget chose them (--threads when given).
    engine = LLMEngine(loaded, dataclasses.replace(ec, kv_cache_memory=plan.kv, threads=cpu.threads))
    for hook in hooks.after_engine:
        hook(engine)
    log.info("kv cache allocated", extra={"fields": {
        "budget_bytes": plan.kv, "blocks": engine.kv.num_blocks, "block_size": ec.block_size, "kv_dtype": engine.kv.fmt,
        "token_capacity": engine.limits.kv_tokens, "kv_groups": list(engine.kv.layout.windows),
        "max_num_seqs": ec.max_num_seqs,
        "max_queue": ec.max_queue, "threads": torch.get_num_threads()}})
    selftest = run_selftest(engine)
    if ec.batch_invariant:
        (log.info if selftest.passed else log.error)("batch-invariance self-test", extra={"fields": {
            "passed": selftest.passed, "detail": selftest.detail}})
    else:
        log.warning("batch invariance is OFF (--no-batch-invariant): logprobs depend on batch composition",
                    extra={"fields": {"selftest": selftest.detail}})
    provisional = engine.speculator.enabled
    speculating = engine.settle_speculation(selftest.passed)  # the engine's one decision, now with the self-test
    fields_ = {"speculation": ec.speculation, "speculating": speculating,
               "speculation_cheap_rows": engine.speculator.cheap_rows}
    if provisional and not speculating:
        log.error("speculation turned off: the batch-invariance self-test failed", extra={"fields": fields_})
    else:
        log.info("speculation", extra={"fields": fields_})
    for hook in hooks.after_selftest:
        hook(engine)
    engine.reset_threads()  # serving starts at the budget, whatever a starved self-test made of it
    release_free_memory()
    # What is alive now (modules, the model, the tokenizer: millions of objects) lives as long as the process:
    # out of the collector's generations, so a full collection during an engine step walks only what requests
    # allocate (gc_collect_main was 5-8% of a decode step's perf samples on the AMD EPYC before).
    gc.freeze()
    return loaded, engine, selftest, plan


def build_state(config: Config, hooks: EngineHooks | None = None) -> ServerState:
    """Load the model and self-test it on the model thread that will run the engine (see model_thread.py)."""
    hooks = hooks or EngineHooks()
    ec = config.engine
    gate = Gate.from_config(config.server)  # a bad keys file fails here, before the model loads
    # Read before loading: MemAvailable + our RSS is what the machine can give us in all, weights included.
    limit = read_memory_limit(ec.memory_limit)
    log.debug("memory limit", extra={"fields": {
        "limit_bytes": limit.limit, "source": limit.source, "detail": limit.detail,
        "terms": {t.source: t.limit for t in limit.terms}}})
    cpu = read_cpu_budget(ec.threads)  # logged once the model has loaded: a refused model is one line
    model_thread = ModelThread()
    try:
        loaded, engine, selftest, plan = model_thread.call(lambda: _load_and_check(config, hooks, limit, cpu))
    except BaseException:
        model_thread.close()
        raise
    fp = engine.fingerprint(ec.batch_invariant and selftest.passed)
    log.info("model fingerprint", extra={"fields": {"fingerprint": str(fp)}})
    async_engine = AsyncEngine(engine, ec.max_queue, model_thread)
    metrics = Metrics(loaded.name, str(fp), fp.device, fp.dtype, fp.batch_invariant)
    async_engine.step_observers.append(metrics.on_step)
    async_engine.state_observers.append(metrics.on_state)
    metrics.device_mismatch.set(0 if _device_matches(config.model.device, fp.device) else 1)
    metrics.set_memory_limit(limit.limit)
    metrics.set_kv_cache(engine.kv.fmt, engine.kv.num_blocks, engine.kv.block_size, engine.kv.nbytes)
    metrics.set_cpu_budget(cpu.threads, cpu.quota)
    state = ServerState(config=config, loaded=loaded, engine=async_engine, fingerprint=fp,
                        selftest=selftest if ec.batch_invariant else None, limits=engine.limits, metrics=metrics,
                        streams=OpenChannels(metrics), memory=plan, cpu=cpu, gate=gate)
    metrics.add_tenants(gate.tenant_names)
    metrics.backlog_sources[0] = state.streams.backlog_bytes
    return state


def _device_matches(asked: str, actual: str) -> bool:
    """`auto` matches anything; `cuda` matches any CUDA device; otherwise exactly."""
    return asked == "auto" or actual == asked or (asked == "cuda" and actual.startswith("cuda:"))
