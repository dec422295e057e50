"""The synchronous engine core: one `step()` = schedule, execute, sample, process, update.

    batch = scheduler.schedule()              who computes how many tokens (speculative drafts sized too)
    results = runner.execute(batch)           the model: each sequence's (V,) rows (model_runner.py)
    sampled = sampler.sample(batch, results)  a token per row, from that row alone (batch_sampler.py)
    outputs = output_processor.process(...)   text, stop strings, logprobs: RequestOutputs (output_processor.py)
    scheduler.update(batch, outputs)          kept tokens counted, drafts settled, finished sequences out

Admission (check, add_request) and the thread budget live here too. `LLMEngine` is owned by exactly one
thread (see async_engine.py); nothing in it is locked because nothing else touches it.
"""

from __future__ import annotations

import itertools
import logging
import threading
from typing import Callable

import torch

from ..config import ConfigError, EngineConfig
from ..kernels import register_rows
from ..kernel_versions import kv_format_id
from ..models.loader import Fingerprint, LoadedModel
from .admission import ModelLimits
from .batch_sampler import BatchSampler
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer, token_text
from .kv_cache import activations_kv_dtype, allocate_kv_cache, check_kv_dtype, resolve_kv_dtype
from .model_runner import ModelRunner
from .output_processor import OutputProcessor
from .pooler import PoolState
from .sampler import make_generator
from .scheduler import Scheduler
from .speculation import Speculator, TokenKeys
from .step_stats import StepMeter, StepStats
from .stop import end_token_ids
from .sequence import Request, RequestOutput, SeqState, Sequence
from .structured import Grammars
from .threads import CpuSignals, ThreadChange, ThreadPolicy
from ..cpu_budget import read_cpu_quota

__all__ = ["LLMEngine", "StepStats"]  # StepStats: re-exported, its home is step_stats.py

log = logging.getLogger("steadyserve.engine")


class LLMEngine:
    def __init__(self, loaded: LoadedModel, cfg: EngineConfig) -> None:
        # The thread budget: never more threads than this; fewer while starved with --adaptive-threads.
        self.thread_budget = cfg.num_threads
        self.num_threads = self.thread_budget
        torch.set_num_threads(self.num_threads)
        adaptive = cfg.adaptive_threads and self.thread_budget > 1
        self.thread_policy: ThreadPolicy | None = ThreadPolicy(self.thread_budget) if adaptive else None
        # The waits are read with or without the policy: steadyserve_engine_cpu_wait_seconds_total shows them.
        quota_dir = read_cpu_quota().directory
        cpu_signals = CpuSignals(quota_dir / "cpu.stat" if quota_dir else None)  # the meter reads them (cpu_signals)
        # The thread that built the engine (and, in the server, loaded the model): stepping it from
        # another one costs a second OpenMP worker pool (see model_thread.py). AsyncEngine checks.
        self.owner_thread_id = threading.get_ident()
        self.loaded = loaded
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.grammars = Grammars(loaded.tokenizer, loaded.args.vocab_size)  # structured output
        self.max_model_len = loaded.max_model_len
        if loaded.model.native_attention and cfg.block_size % 16:
            raise ConfigError("--block-size must be a multiple of 16 for the native attention kernel "
                              "(or use --attention python)")
        kv_fmt = resolve_kv_dtype(cfg.kv_cache_dtype, loaded.dtype, loaded.numerics.mode if loaded.numerics else "")
        check_kv_dtype(kv_fmt, loaded.args, loaded.model.native_attention)
        self.kv = allocate_kv_cache(loaded.args, cfg.kv_cache_memory, cfg.block_size, kv_fmt, loaded.device)
        # The prefix cache's hashes start from what determines a block's contents besides its tokens.
        root = f"{loaded.weights_hash}-{loaded.dtype}-{loaded.model.kernel_id}-{cfg.batch_invariant}-{kv_fmt}"
        # One block table per group of layers; a windowed group's blocks leave as its window passes (kv_layout.py).
        self.block_manager = BlockManager(self.kv.num_blocks, cfg.block_size, cfg.prefix_caching, root,
                                          self.kv.layout.windows, cfg.max_num_batched_tokens)
        cheap_rows = _cheap_rows(loaded.model)
        self.speculator = Speculator(_speculation_mode(cfg, cheap_rows), cheap_rows, keys=TokenKeys(self._token_text))
        # The step's four parts (step() below): who runs, the model, the token choices, what requests are told.
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens, self.speculator)
        self.runner = ModelRunner(loaded.model, self.kv)
        self.sampler = BatchSampler(self.max_model_len)
        self.output_processor = OutputProcessor(self.max_model_len)
        self.meter = StepMeter(self.scheduler, self.block_manager, self.speculator, cpu_signals)
        self.eos_token_ids = _eos_ids(loaded)
        # What a request must fit, built once here and handed to the request builders (engine/admission.py).
        self.limits = ModelLimits(vocab_size=loaded.args.vocab_size, context=self.max_model_len,
                                  kv_blocks=self.kv.num_blocks, block_size=cfg.block_size,
                                  kv_tokens=self.block_manager.token_capacity(self.max_model_len),
                                  grammars=self.grammars, eos_token_ids=frozenset(self.eos_token_ids))
        self._seq_ids = itertools.count()

    # ---- identity --------------------------------------------------------
    def fingerprint(self, batch_invariant: bool) -> Fingerprint:
        """What computes this engine's bits, as every response is stamped: the model's weights, dtype, device,
        numerics path and attention kernel, and the KV cache's format where it is not the activations' own.
        `batch_invariant`: the promise as the caller confirmed it (the server: the flag and its self-test)."""
        m = self.loaded
        return Fingerprint(m.weights_hash[:12], str(m.dtype).removeprefix("torch."), str(m.device), batch_invariant,
                           m.model.kernel_id, m.numerics.numerics_id if m.numerics else "",
                           kv_format_id(self.kv.fmt, activations_kv_dtype(m.dtype)))

    # ---- admission -------------------------------------------------------
    def check(self, request: Request) -> None:
        """Refuse at once what can never run: every check of ModelLimits.check (engine/admission.py). Raises
        Refused. For offline callers (add_request, receipts' replay); the server's request builders check
        against the same ModelLimits once, and submit without calling this."""
        self.limits.check(request)

    def add_request(self, request: Request) -> Sequence:
        """Check and queue a request (offline use: every check, ModelLimits.check). Raises Refused."""
        self.check(request)
        return self.add_checked(request)

    def add_checked(self, request: Request) -> Sequence:
        """Queue a request that passed ModelLimits' checks already: the server's request builder ran them
        (api/requests.py), before AsyncEngine.submit_all, which only counts capacity."""
        seq = Sequence(next(self._seq_ids), request)
        pooling = self.loaded.pooling.mode
        seq.needs_prompt_rows = request.embed and pooling == "mean"  # every row: no prefix-cache hits
        p = request.params
        seq.state = SeqState(end_ids=end_token_ids(self.eos_token_ids, p.ignore_eos, set(p.stop_token_ids)),
                             generator=make_generator(p.seed, torch.device("cpu")),
                             matcher=self.grammars.matcher(p.grammar) if p.grammar is not None else None,
                             detok=IncrementalDetokenizer(self.tokenizer, p.stop, p.skip_special_tokens),
                             pool=PoolState(pooling, seq.num_prompt_tokens) if request.embed else None)
        seq.drafter = None if request.embed else self.speculator.new_drafter()
        self.scheduler.add(seq)
        return seq

    def settle_speculation(self, selftest_passed: bool) -> bool:
        """Final say on speculation once the start-up self-test has run (it runs with the provisional mode, the
        same decision before any test): _speculation_mode with its result. Returns whether this engine speculates."""
        self.speculator.enabled = _speculation_mode(self.cfg, self.speculator.cheap_rows, selftest_passed) == "ngram"
        return self.speculator.enabled

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.scheduler.abort(request_id)
        if seq is None:
            return None
        return self.output_processor.abort(seq)

    def _token_text(self, token_id: int) -> str:
        """A token's own text, for the n-gram lookup's keys (speculation.TokenKeys); an id without text (past
        the tokenizer's vocabulary, in the model's padding) is its own."""
        return token_text(self.tokenizer, token_id) or f"\0{token_id}"

    @property
    def cpu_signals(self) -> CpuSignals | None:
        """The CPU waits each step's stats carry (StepMeter): the run queue's and the cgroup quota's."""
        return self.meter.cpu_signals

    @cpu_signals.setter
    def cpu_signals(self, signals: CpuSignals | None) -> None:
        self.meter.cpu_signals = signals

    @property
    def fault_hook(self) -> Callable[[Sequence], None] | None:
        """TEST-ONLY fault injection: called with each sequence a step computed (OutputProcessor); may raise."""
        return self.output_processor.fault_hook

    @fault_hook.setter
    def fault_hook(self, hook: Callable[[Sequence], None] | None) -> None:
        self.output_processor.fault_hook = hook

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step --------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        """Schedule, execute, sample row-wise, say what each request gets, settle the scheduler."""
        start = self.meter.start()
        batch = self.scheduler.schedule()  # with speculation, each decoding sequence's draft too
        results = self.runner.execute(batch)  # (V,) rows: each sequence's next token and its drafts'
        sampled = self.sampler.sample(batch, results)  # a token per row, each from its own row
        outputs = self.output_processor.process(batch, results, sampled)  # text, stops, logprobs
        self.scheduler.update(batch, outputs)  # what was kept counts; finished sequences leave
        emitted = [out for out in outputs if out is not None]
        return emitted, self._adapt_threads(self.meter.stop(start, batch, emitted))

    def _adapt_threads(self, stats: StepStats) -> StepStats:
        """Let the thread policy (--adaptive-threads) see the step's CPU waits; the stats get the count the next
        step runs with and why it changed."""
        if self.thread_policy is not None and stats.num_seqs:
            change = self.thread_policy.observe(stats.duration, stats.run_delay, stats.throttled)
            if change is not None:
                self.set_threads(change)
                stats.thread_change = change.reason
        stats.threads = self.num_threads
        return stats

    def reset_threads(self) -> None:
        """Back to the budget with a fresh policy (the server calls it once the start-up self-test is done, so
        serving starts at the budget and every change it makes is counted in the metrics)."""
        if self.thread_policy is not None:
            self.thread_policy = ThreadPolicy(self.thread_budget)
        self.num_threads = self.thread_budget
        torch.set_num_threads(self.num_threads)

    def set_threads(self, change: ThreadChange) -> None:
        """Run the next steps with `change.threads` intra-op threads (on the engine thread, between steps: the
        kernels are bitwise independent of the count, so no output and no fingerprint changes)."""
        self.num_threads = max(1, min(self.thread_budget, change.threads))
        torch.set_num_threads(self.num_threads)
        log.info("engine threads changed", extra={"fields": {
            "threads": self.num_threads, "previous": change.previous, "budget": self.thread_budget,
            "reason": change.reason, "wait_fraction": round(change.fraction, 3)}})


def _cheap_rows(model) -> int:  # noqa: ANN001 - a Transformer
    """Rows a step computes for little more than the cost of one (speculation.Speculator): on the native
    path the rows the matrix kernels multiply with weights dequantized in registers (kSmallM of
    kernels/csrc/qmm_scalar.cpp, qmm_avx2.cpp, qmm_avx512.cpp: 1, 4, 8); MKL's and CUDA's kernels are
    memory-bound for a few rows more. A model with sparse MoE layers has none to spare: each row reads the
    weights of its own experts (8 of 128 for Qwen3-30B-A3B, about two thirds of a layer's bytes), so a draft
    row costs about as much as a step, not the 0.2 of one that the speculator assumes."""
    if any(getattr(getattr(model, "spec", None), "moe_layers", ())):
        return 1
    if model.native:
        return register_rows()
    return 16 if model.device.type == "cuda" else 4


def _speculation_mode(cfg: EngineConfig, cheap_rows: int, selftest_passed: bool = True) -> str:
    """The one decision of whether an engine speculates (off | ngram). --speculation auto: ngram where its output
    is exactly off's (batch-invariant numerics, so a verified chunk's rows are bitwise one-token steps' rows) and
    a step has rows to spare (cheap_rows > 1: more than one register row in the matmul kernels); off elsewhere.
    Whatever was asked: off once the batch-invariance self-test failed, since exactness rests on what it checks."""
    if not selftest_passed:
        return "off"
    if cfg.speculation != "auto":
        return cfg.speculation
    return "ngram" if cfg.batch_invariant and cheap_rows > 1 else "off"


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    for src in (loaded.args.hf_config, loaded.tokenizer):
        v = getattr(src, "eos_token_id", None)
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids
