"""Every metric steadyserve exports, defined in one place.

Names follow existing conventions where they exist (grpc_server_* as in
go-grpc-prometheus, http_requests_total), and `steadyserve_*` otherwise. One
registry per server, so tests can run several in one process.
"""

from __future__ import annotations

import asyncio
import os
import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .engine.engine import StepStats
from .engine.threads import CHANGE_REASONS
from .limits import REJECT_REASONS
from .engine.sequence import RequestOutput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
FAST_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
ACCEPTANCE_BUCKETS = (0.0, 0.25, 0.5, 0.75, 1.0)

FINISH_REASONS = ("stop", "length", "abort", "error")
ABORT_REASONS = ("client_disconnect", "stall", "deadline", "drain_timeout", "engine_error")
TRACE_DROP_REASONS = ("queue_full", "export_failed")  # api/otel.py counts each


class _ProcessCollector:
    """RSS and CPU of this process (and CUDA memory when on a GPU), read at scrape time."""

    def __init__(self, device: str) -> None:
        self.device = device
        self.memory_limit = 0  # bytes; the effective limit read at start-up (steadyserve/memory.py)

    def collect(self):
        rss = 0
        try:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
        yield GaugeMetricFamily("steadyserve_process_resident_memory_bytes", "Resident set size.", value=rss)
        yield GaugeMetricFamily("steadyserve_memory_limit_bytes",
                                "Effective memory limit read at start-up: the smallest of the cgroup limit, "
                                "MemAvailable + RSS and --memory-limit (0 = none could be read).",
                                value=self.memory_limit)
        t = os.times()
        yield GaugeMetricFamily("steadyserve_process_cpu_seconds", "User + system CPU time.", value=t.user + t.system)
        if self.device.startswith("cuda"):
            import torch

            yield GaugeMetricFamily("steadyserve_cuda_memory_allocated_bytes", "torch.cuda.memory_allocated",
                                    value=torch.cuda.memory_allocated(self.device))
            yield GaugeMetricFamily("steadyserve_cuda_memory_reserved_bytes", "torch.cuda.memory_reserved",
                                    value=torch.cuda.memory_reserved(self.device))


class Metrics:
    def __init__(self, model: str, fingerprint: str, device: str, dtype: str, batch_invariant: bool) -> None:
        r = self.registry = CollectorRegistry()
        # gRPC, as go-grpc-prometheus names them.
        grpc_labels = ["grpc_type", "grpc_service", "grpc_method"]
        self.grpc_started = Counter("grpc_server_started_total", "RPCs started.", grpc_labels, registry=r)
        self.grpc_handled = Counter("grpc_server_handled_total", "RPCs completed, by status code.",
                                    grpc_labels + ["grpc_code"], registry=r)
        self.grpc_seconds = Histogram("grpc_server_handling_seconds", "RPC handling time.", grpc_labels,
                                      buckets=LATENCY_BUCKETS, registry=r)
        # HTTP.
        self.http_requests = Counter("http_requests_total", "HTTP requests by route and status.",
                                     ["method", "route", "status"], registry=r)
        self.http_seconds = Histogram("http_request_duration_seconds", "HTTP handling time (to the last byte).",
                                      ["method", "route"], buckets=LATENCY_BUCKETS, registry=r)
        # Engine and streams.
        p = "steadyserve_"
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Arrival to first generated token.",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between tokens of one request (0 between "
                             "the tokens of one speculative verification, which arrive together).",
                             buckets=FAST_BUCKETS + (5, 10), registry=r)
        self.duration = Histogram(p + "request_duration_seconds", "Arrival to finish.", buckets=LATENCY_BUCKETS,
                                  registry=r)
        self.queue_wait = Histogram(p + "queue_wait_seconds", "Arrival to first scheduled step.",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.running = Gauge(p + "requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge(p + "requests_waiting", "Requests admitted but not yet running.", registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", registry=r)
        self.batch_size = Histogram(p + "batch_size", "Sequences per engine step.", buckets=BATCH_BUCKETS, registry=r)
        self.step_seconds = Histogram(p + "step_duration_seconds", "Engine step time.", buckets=FAST_BUCKETS + (5,),
                                      registry=r)
        self.prompt_tokens = Counter(p + "prompt_tokens_total", "Prompt tokens of finished requests.", registry=r)
        self.generated_tokens = Counter(p + "generated_tokens_total", "Tokens generated.", registry=r)
        self.finished = Counter(p + "requests_finished_total", "Finished requests by reason.", ["finish_reason"],
                                registry=r)
        self.rejected = Counter(p + "requests_rejected_total", "Requests refused at admission.", ["reason"],
                                registry=r)
        self.aborted = Counter(p + "streams_aborted_total", "Streams ended early by the server or client.",
                               ["reason"], registry=r)
        self.preemptions = Counter(p + "preemptions_total", "Sequences preempted for KV space.", registry=r)
        self.edge_refusals = Counter(p + "http_edge_refusals_total", "HTTP connections answered and closed by the "
                                     "edge limits before any route ran (api/http/edge.py), by reason: "
                                     "header_too_large, too_many_headers, request_timeout, invalid_http; "
                                     "idle_evicted: an idle connection closed past --max-idle-connections.",
                                     ["reason"], registry=r)
        self.prefix_queried = Counter(p + "prefix_cache_queried_tokens_total",
                                      "Prompt tokens looked up in the prefix cache at admission.", registry=r)
        self.prefix_hits = Counter(p + "prefix_cache_hit_tokens_total",
                                   "Prompt tokens whose K/V came from the prefix cache (hit rate: this / queried).",
                                   registry=r)
        self.kv_blocks = Gauge(p + "kv_cache_blocks", "KV blocks allocated at start-up, in the cache's storage "
                               "format (--kv-cache-dtype).", ["kv_dtype"], registry=r)
        self.kv_capacity = Gauge(p + "kv_cache_capacity_tokens", "Tokens the KV cache holds: blocks x block size.",
                                 ["kv_dtype"], registry=r)
        self.kv_bytes = Gauge(p + "kv_cache_bytes", "Bytes of the KV cache tensors.", ["kv_dtype"], registry=r)
        self.cached_blocks = Gauge(p + "kv_cache_cached_blocks",
                                   "KV blocks holding a cached prefix, in use or reclaimable.", registry=r)
        self.spec_drafted = Counter(p + "speculation_drafted_tokens_total",
                                    "Speculative draft tokens verified (--speculation ngram).", registry=r)
        self.spec_accepted = Counter(p + "speculation_accepted_tokens_total",
                                     "Of the draft tokens verified, those accepted: sampling picked the same token "
                                     "(acceptance rate: this / drafted).", registry=r)
        self.spec_acceptance = Histogram(p + "speculation_acceptance_ratio",
                                         "Accepted / drafted tokens of each speculative verification.",
                                         buckets=ACCEPTANCE_BUCKETS, registry=r)
        self.backlog = Gauge(p + "stream_backlog_bytes", "Bytes produced for streams not yet taken by sockets.",
                             registry=r)
        self.loop_lag = Histogram(p + "event_loop_lag_seconds", "Event-loop scheduling lag, sampled.",
                                  buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1), registry=r)
        self.model_info = Gauge(p + "model_info", "The served model; the labels are the point.",
                                ["model", "fingerprint", "device", "dtype", "batch_invariant"], registry=r)
        self.engine_alive = Gauge(p + "engine_alive", "1 while the engine loop runs.", registry=r)
        self.device_mismatch = Gauge(p + "device_mismatch", "1 if the serving device is not the configured one.",
                                     registry=r)
        self.admitted = Counter(p + "requests_admitted_total", "Requests admitted, by transport.", ["transport"],
                                registry=r)
        self.tracked = Gauge(p + "requests_tracked", "Requests the metrics hold per-request state for (their last "
                             "token's time); back to 0 whenever the server is idle, or state leaks.", registry=r)
        self.tracked.set_function(lambda: len(self._last_token_time))
        self.threads = Gauge(p + "threads", "torch intra-op threads the engine runs with now: the budget "
                             "(steadyserve_threads_budget), or fewer while it is starved of CPU "
                             "(--adaptive-threads).", registry=r)
        self.threads_budget = Gauge(p + "threads_budget", "The most intra-op threads, from the CPU budget read at "
                                    "start-up: --threads, else the smaller of the cgroup CPU quota (rounded down, "
                                    "at least 1) and the CPU affinity mask.", registry=r)
        self.thread_changes = Counter(p + "thread_changes_total", "Changes of the engine's thread count "
                                      "(--adaptive-threads), by reason: run_queue_delay and cgroup_throttled go "
                                      "down, probe goes back up.", ["reason"], registry=r)
        self.run_delay = Counter(p + "engine_cpu_wait_seconds_total", "Seconds the engine thread waited on a CPU "
                                 "run queue during steps (a busy neighbour or CFS throttling; /proc schedstat); "
                                 "over steadyserve_step_duration_seconds_sum: the share of step time starved.",
                                 registry=r)
        self.throttled = Counter(p + "cgroup_cpu_throttled_seconds_total", "Seconds the cgroup CPU quota "
                                 "throttled the server during steps (cpu.stat throttled_usec / throttled_time of "
                                 "the cgroup whose quota binds, summed over CPUs; 0 without a quota).", registry=r)
        self.cpu_quota = Gauge(p + "cpu_quota_cpus", "CPUs the cgroup CPU quota allows (quota / period, the "
                               "smallest up the cgroup tree), read at start-up; 0 = no quota.", registry=r)
        self.trace_spans_exported = Counter(p + "trace_spans_exported_total", "Trace spans the OTLP collector "
                                            "accepted (--otlp-traces-endpoint).", registry=r)
        self.trace_spans_dropped = Counter(p + "trace_spans_dropped_total", "Trace spans lost instead of waited "
                                           "for: queue_full (the export queue, OTEL_BSP_MAX_QUEUE_SIZE, was full) "
                                           "or export_failed (the collector did not take the batch in time, "
                                           "retries included).", ["reason"], registry=r)
        # Per tenant (--api-keys): the label is a tenant's name from the keys file, so its values are bounded by it.
        self.tenant_admitted = Counter(p + "tenant_requests_admitted_total", "Engine requests admitted, by tenant "
                                       "(--api-keys).", ["tenant"], registry=r)
        self.tenant_rejected = Counter(p + "tenant_requests_rejected_total", "Requests of a known tenant refused, "
                                       "by tenant and reason: its own limits (tenant_concurrency, "
                                       "tenant_prompt_tokens, tenant_output_tokens), overloaded, forbidden.",
                                       ["tenant", "reason"], registry=r)
        self.tenant_tokens = Counter(p + "tenant_tokens_total", "Tokens by tenant: kind prompt (admitted) or output "
                                     "(generated).", ["tenant", "kind"], registry=r)
        self.tenant_in_flight = Gauge(p + "tenant_requests_in_flight", "Engine requests in flight, by tenant "
                                      "(what max_concurrent counts).", ["tenant"], registry=r)
        self.tenant_ttft = Histogram(p + "tenant_time_to_first_token_seconds", "Admission to first token, by "
                                     "tenant.", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self.tenant_queue_wait = Histogram(p + "tenant_queue_wait_seconds", "Admission to first scheduled step, by "
                                           "tenant.", ["tenant"], buckets=LATENCY_BUCKETS, registry=r)
        self._process = _ProcessCollector(device)
        r.register(self._process)
        self.model_info.labels(model, fingerprint, device, dtype, str(batch_invariant).lower()).set(1)
        for reason in FINISH_REASONS:
            self.finished.labels(reason)
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        for reason in ABORT_REASONS:
            self.aborted.labels(reason)
        for reason in CHANGE_REASONS:
            self.thread_changes.labels(reason)
        for reason in TRACE_DROP_REASONS:
            self.trace_spans_dropped.labels(reason)
        self.engine_alive.set(0)
        self._last_token_time: dict[str, float] = {}
        self.backlog_sources: dict[int, object] = {}  # id -> callable returning bytes, summed at scrape

    def set_memory_limit(self, limit_bytes: int) -> None:
        self._process.memory_limit = limit_bytes

    def set_kv_cache(self, kv_dtype: str, blocks: int, block_size: int, nbytes: int) -> None:
        """The KV cache as allocated: its storage format, blocks, token capacity and bytes."""
        self.kv_blocks.labels(kv_dtype).set(blocks)
        self.kv_capacity.labels(kv_dtype).set(blocks * block_size)
        self.kv_bytes.labels(kv_dtype).set(nbytes)

    def set_cpu_budget(self, threads: int, quota_cpus: float | None) -> None:
        """The CPU budget read at start-up (cpu_budget.py): threads run, and the quota (None = no quota)."""
        self.threads.set(threads)
        self.threads_budget.set(threads)
        self.cpu_quota.set(quota_cpus or 0.0)

    # ---- hooks, called from the engine thread (prometheus-client is thread-safe) ----
    def on_step(self, s: StepStats) -> None:
        self.batch_size.observe(s.num_seqs)
        self.step_seconds.observe(s.duration)
        self.running.set(s.num_running)
        self.waiting.set(s.num_waiting)
        self.kv_usage.set(s.kv_usage)
        self.generated_tokens.inc(s.num_generated)
        if s.num_preempted:
            self.preemptions.inc(s.num_preempted)
        self.prefix_queried.inc(s.num_prefix_queried_tokens)
        self.prefix_hits.inc(s.num_prefix_hit_tokens)
        self.cached_blocks.set(s.num_cached_blocks)
        if s.threads:
            self.threads.set(s.threads)
        if s.thread_change:
            self.thread_changes.labels(s.thread_change).inc()
        if s.run_delay > 0:
            self.run_delay.inc(s.run_delay)
        if s.throttled > 0:
            self.throttled.inc(s.throttled)
        if s.num_drafted_tokens:
            self.spec_drafted.inc(s.num_drafted_tokens)
            self.spec_accepted.inc(s.num_accepted_tokens)
            for ratio in s.acceptance_ratios:
                self.spec_acceptance.observe(ratio)

    def on_state(self, num_running: int, num_waiting: int, kv_usage: float) -> None:
        self.running.set(num_running)
        self.waiting.set(num_waiting)
        self.kv_usage.set(kv_usage)

    def on_output(self, out: RequestOutput, arrival: float) -> None:
        """Per-request latency bookkeeping; called on the event loop for every output."""
        now = time.monotonic()
        if out.queue_wait is not None:
            self.queue_wait.observe(out.queue_wait)
        if out.new_token_ids:
            last = self._last_token_time.get(out.request_id)
            if last is None:
                self.ttft.observe(now - arrival)
            else:
                self.itl.observe(now - last)
            for _ in out.new_token_ids[1:]:  # a speculative verification's tokens arrive together
                self.itl.observe(0.0)
            self._last_token_time[out.request_id] = now
        if out.finished:
            self._last_token_time.pop(out.request_id, None)
            self.duration.observe(now - arrival)
            self.finished.labels(out.finish_reason or "error").inc()
            self.prompt_tokens.inc(out.num_prompt_tokens)

    def on_admitted(self, transport: str) -> None:
        self.admitted.labels(transport).inc()

    # ---- per tenant (called on the event loop; `tenant` is a keys-file name) ----
    def add_tenants(self, names: list[str]) -> None:
        """Show every tenant of the keys file from the start (zeros), so a rate over it is defined."""
        for name in names:
            self.tenant_admitted.labels(name)
            self.tenant_in_flight.labels(name)
            for kind in ("prompt", "output"):
                self.tenant_tokens.labels(name, kind)

    def on_tenant_admitted(self, tenant: str, num_requests: int, prompt_tokens: int, in_flight: int) -> None:
        self.tenant_admitted.labels(tenant).inc(num_requests)
        self.tenant_tokens.labels(tenant, "prompt").inc(prompt_tokens)
        self.tenant_in_flight.labels(tenant).set(in_flight)

    def on_tenant_refused(self, tenant: str, reason: str) -> None:
        self.tenant_rejected.labels(tenant, reason).inc()

    def on_tenant_output(self, tenant: str, out: RequestOutput, arrival: float, first: bool,
                         in_flight: int) -> None:
        """One output of a tenant's request: its tokens, its queue wait and TTFT (`first`: its first token)."""
        if out.new_token_ids:
            self.tenant_tokens.labels(tenant, "output").inc(len(out.new_token_ids))
            if first:
                self.tenant_ttft.labels(tenant).observe(time.monotonic() - arrival)
        if out.queue_wait is not None:
            self.tenant_queue_wait.labels(tenant).observe(out.queue_wait)
        if out.finished:
            self.tenant_in_flight.labels(tenant).set(in_flight)

    def render(self) -> bytes:
        self.backlog.set(sum(fn() for fn in list(self.backlog_sources.values())))  # type: ignore[operator]
        return generate_latest(self.registry)


async def sample_loop_lag(metrics: Metrics, interval: float = 0.1) -> None:
    """Measure how late the event loop wakes us up; runs until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        t = loop.time()
        await asyncio.sleep(interval)
        metrics.loop_lag.observe(max(0.0, loop.time() - t - interval))
