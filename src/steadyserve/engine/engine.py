"""The synchronous engine core: one `step()` = schedule, execute, update, emit.

`LLMEngine` is owned by exactly one thread (see async_engine.py); nothing in it
is locked because nothing else touches it.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..config import ConfigError, EngineConfig
from ..kernels.build import NATIVE_KERNEL_ID
from ..models.loader import LoadedModel
from .admission import ModelLimits
from .block_manager import BlockManager
from .detokenizer import IncrementalDetokenizer
from .kv_cache import allocate_kv_cache, check_kv_dtype, resolve_kv_dtype
from .model_runner import ModelRunner, SeqResult
from .pooler import PoolState
from .sampler import NumericalError, make_generator, process_row, sample, token_logprob
from .scheduler import ScheduledSeq, Scheduler
from .speculation import SeqDrafter, Speculator, TokenKeys
from .stop import end_token_ids, final_reason, stop_reason
from .sequence import Request, RequestOutput, RequestTimings, Sequence, TokenLogprob
from .structured import Grammars
from .threads import CpuSignals, ThreadChange, ThreadPolicy
from ..cpu_budget import read_cpu_quota

log = logging.getLogger("steadyserve.engine")

@dataclass
class StepStats:
    num_seqs: int  # sequences in the step
    num_tokens: int  # tokens computed (prefill + decode)
    num_generated: int  # tokens sampled
    num_preempted: int
    duration: float  # seconds of schedule + execute + update
    num_running: int  # after the step
    num_waiting: int
    kv_usage: float  # 0..1
    num_cached_blocks: int = 0  # KV blocks holding a cached prefix, after the step
    num_prefix_queried_tokens: int = 0  # prompt tokens of the sequences admitted this step
    num_prefix_hit_tokens: int = 0  # of which taken from the prefix cache
    num_drafted_tokens: int = 0  # speculative draft tokens verified this step (speculation.py)
    num_accepted_tokens: int = 0  # of which accepted
    acceptance_ratios: list[float] = field(default_factory=list)  # accepted / drafted of each verification
    threads: int = 0  # intra-op threads the next step runs with (engine/threads.py may change them); 0 = unknown
    thread_change: str = ""  # why this step changed them (threads.CHANGE_REASONS); "" = unchanged
    run_delay: float = 0.0  # seconds the engine thread waited on a CPU run queue during the step (0 = not read)
    throttled: float = 0.0  # seconds the cgroup's CPU quota throttled it during the step (summed over CPUs)


class _SeqState:
    """Per-request sampling and text state, owned by the engine thread."""

    def __init__(self, seq: Sequence, tokenizer, device: torch.device, grammars: Grammars,
                 eos_ids: set[int], drafter: SeqDrafter | None, pooling: str = "last") -> None:
        # The tokens that end this sequence, fixed at admission (stop_reason and min_tokens both use them).
        self.end_ids = end_token_ids(eos_ids, seq.params.ignore_eos, set(seq.params.stop_token_ids))
        self.generator = make_generator(seq.params.seed, device)
        self.matcher = grammars.matcher(seq.params.grammar) if seq.params.grammar is not None else None
        self.detok = IncrementalDetokenizer(tokenizer, seq.params.stop)
        self.prompt_logprobs: list[TokenLogprob] = []  # for prompt tokens 1.. in order
        self.first_output = True
        self.drafter = drafter  # speculative drafting state (speculation.py); None with --speculation off
        # An embedding's fold of its hidden rows (pooler.py); None for a generation.
        self.pool = PoolState(pooling, seq.num_prompt_tokens) if seq.embed else None


@dataclass
class _Emitted:
    """What one step emits for one sequence so far: one token, or several when a draft is accepted."""

    tokens: list[int] = field(default_factory=list)  # token ids, in order
    text: str = ""  # their text delta
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token, if asked


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
        self.cpu_signals: CpuSignals | None = CpuSignals(quota_dir / "cpu.stat" if quota_dir else None)
        # The thread that built the engine (and, in the server, loaded the model): stepping it from
        # another one costs a second OpenMP worker pool (see model_thread.py). AsyncEngine checks.
        self.owner_thread_id = threading.get_ident()
        self.loaded = loaded
        self.cfg = cfg
        self.tokenizer = loaded.tokenizer
        self.grammars = Grammars(loaded.tokenizer, loaded.args.vocab_size)  # structured output
        self.max_model_len = loaded.max_model_len
        if loaded.model.kernel_id == NATIVE_KERNEL_ID and cfg.block_size % 16:
            raise ConfigError("--block-size must be a multiple of 16 for the native attention kernel "
                              "(or use --attention python)")
        kv_fmt = resolve_kv_dtype(cfg.kv_cache_dtype, loaded.dtype)
        check_kv_dtype(kv_fmt, loaded.args, loaded.model.kernel_id == NATIVE_KERNEL_ID)
        self.kv = allocate_kv_cache(loaded.args, cfg.kv_cache_memory, cfg.block_size, kv_fmt, loaded.device)
        # The prefix cache's hashes start from what determines a block's contents besides its tokens.
        root = f"{loaded.weights_hash}-{loaded.dtype}-{loaded.model.kernel_id}-{cfg.batch_invariant}-{kv_fmt}"
        # Blocks leave every layer's window only when every layer has one (block_manager.py).
        windows = [loaded.args.window(i) for i in range(loaded.args.num_layers)]
        window = max(windows) if all(windows) else 0
        self.block_manager = BlockManager(self.kv.num_blocks, cfg.block_size, cfg.prefix_caching, root, window)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.runner = ModelRunner(loaded.model, self.kv)
        cheap_rows = _cheap_rows(loaded.model)
        self.speculator = Speculator(_speculation_mode(cfg, cheap_rows), cheap_rows, keys=TokenKeys(self._token_text))
        self.eos_token_ids = _eos_ids(loaded)
        # What a request must fit, built once here and handed to the request builders (engine/admission.py).
        self.limits = ModelLimits(vocab_size=loaded.args.vocab_size, context=self.max_model_len,
                                  kv_blocks=self.kv.num_blocks, block_size=cfg.block_size, grammars=self.grammars,
                                  eos_token_ids=frozenset(self.eos_token_ids))
        self._seq_ids = itertools.count()
        # Test-only fault injection: called with each sequence in update; may raise.
        self.fault_hook: Callable[[Sequence], None] | None = None

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
        seq.state = _SeqState(seq, self.tokenizer, torch.device("cpu"), self.grammars, self.eos_token_ids,
                              None if request.embed else self.speculator.new_drafter(), pooling)
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
        return self._output(seq, [], "", [], finish_reason="abort")

    def _token_text(self, token_id: int) -> str:
        """A token's own text, for the n-gram lookup's keys (speculation.TokenKeys); an id without text (past
        the tokenizer's vocabulary, in the model's padding) is its own."""
        return self.tokenizer.decode([token_id]) or f"\0{token_id}"

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # ---- the step --------------------------------------------------------
    def step(self) -> tuple[list[RequestOutput], StepStats]:
        t0 = time.perf_counter()
        waits0 = self.cpu_signals.read() if self.cpu_signals is not None else (0.0, 0.0)
        bm = self.block_manager
        queried0, hit0 = bm.num_queried_tokens, bm.num_hit_tokens
        if self.speculator.enabled:  # drafts first: the scheduler sizes each sequence's step with its draft
            self.speculator.draft([(s, s.state.drafter) for s in self.scheduler.running])
        sched = self.scheduler.schedule()  # 1. schedule
        now = time.monotonic()
        for item in sched.scheduled:  # queue wait ends when a request is first scheduled, not computed
            if item.seq.first_scheduled_time is None:
                item.seq.first_scheduled_time = now
        for seq in sched.preempted:  # the step's time, kept for the request's trace (RequestTimings)
            seq.preempted_times.append(now)
        outputs: list[RequestOutput] = []
        num_generated = 0
        if not sched.is_empty:
            results = self.runner.execute(sched)  # 2. execute
            for item, result in zip(sched.scheduled, results):  # 3. update
                out = self._update(item, result, len(sched.scheduled))
                if out is not None:
                    num_generated += len(out.new_token_ids)
                    outputs.append(out)
        spec = self.speculator.take_counts()
        change: ThreadChange | None = None
        run_delay = throttled = 0.0
        if self.cpu_signals is not None and not sched.is_empty:
            waits1 = self.cpu_signals.read()
            run_delay, throttled = waits1[0] - waits0[0], waits1[1] - waits0[1]
            if self.thread_policy is not None:
                change = self.thread_policy.observe(time.perf_counter() - t0, run_delay, throttled)
                if change is not None:
                    self.set_threads(change)
        stats = StepStats(num_seqs=len(sched.scheduled), num_tokens=sched.num_tokens, num_generated=num_generated,
                          num_preempted=len(sched.preempted), duration=time.perf_counter() - t0,
                          num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                          kv_usage=bm.usage, num_cached_blocks=bm.num_cached_blocks,
                          num_prefix_queried_tokens=bm.num_queried_tokens - queried0,
                          num_prefix_hit_tokens=bm.num_hit_tokens - hit0, num_drafted_tokens=spec.drafted,
                          num_accepted_tokens=spec.accepted, acceptance_ratios=spec.ratios,
                          threads=self.num_threads, thread_change=change.reason if change else "",
                          run_delay=run_delay, throttled=throttled)
        return outputs, stats  # 4. emit (the caller delivers)

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

    def _update(self, item: ScheduledSeq, result: SeqResult, num_batch_seqs: int) -> RequestOutput | None:
        out = self._update_seq(item, result, num_batch_seqs)
        if out is not None and item.seq.state.first_output:
            item.seq.state.first_output = False
            out.queue_wait = item.seq.first_scheduled_time - item.seq.request.arrival_time  # type: ignore[operator]
        return out

    def _update_seq(self, item: ScheduledSeq, result: SeqResult, num_batch_seqs: int) -> RequestOutput | None:
        """count -> sample -> stop -> output; one request's failure fails that request only."""
        seq = item.seq
        draft, seq.draft_token_ids = seq.draft_token_ids, []  # this step's draft, if any, is verified now
        if not draft:  # a verification counts only what it accepts (_verify)
            self._count(seq, item.num_new_tokens)
        now = time.monotonic()
        if seq.prefill_done_time is None and result.sample_row is not None:  # the prompt's last token computed
            seq.prefill_done_time = now
        emitted = _Emitted()
        try:
            if self.fault_hook is not None:
                self.fault_hook(seq)
            if seq.embed:
                return self._pool(seq, result, num_batch_seqs)
            prompt_lps = self._collect_prompt_logprobs(seq, result)
            if result.sample_row is None:  # a prefill chunk: nothing sampled yet
                if prompt_lps is None:
                    return None
                return self._output(seq, [], "", [], prompt_lps, num_batch_seqs=num_batch_seqs)
            if seq.params.max_tokens == 0:  # scoring only
                return self._finish(seq, [], "", [], prompt_lps, "length", num_batch_seqs)
            if draft:
                reason = self._verify(seq, draft, result, emitted)
            else:
                row, argmax, has_nan = result.choice_rows()[0]
                reason = self._emit(seq, self._sample(seq, row, argmax, has_nan), row, emitted)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if reason:
                return self._finish(seq, emitted.tokens, emitted.text, emitted.logprobs, prompt_lps, reason,
                                    num_batch_seqs)
            return self._output(seq, emitted.tokens, emitted.text, emitted.logprobs, prompt_lps,
                                num_batch_seqs=num_batch_seqs)
        except Exception as e:  # NaN, tokenizer, hook
            self.scheduler.retire(seq)
            # Tokens a verification emitted before the failing position are the output's, as they would
            # have been in the steps before it without speculation.
            return self._output(seq, emitted.tokens, emitted.text, emitted.logprobs, finish_reason="error",
                                error=f"{type(e).__name__}: {e}", num_batch_seqs=num_batch_seqs)

    def _pool(self, seq: Sequence, result: SeqResult, num_batch_seqs: int) -> RequestOutput | None:
        """An embedding's step: fold the chunk's hidden rows; once the prompt is computed, finish with the vector."""
        pool: PoolState = seq.state.pool
        assert result.hidden_rows is not None
        pool.add(result.hidden_rows, result.hidden_pos)
        if not pool.done:
            return None
        self.scheduler.retire(seq)
        out = self._output(seq, [], "", [], finish_reason="length", num_batch_seqs=num_batch_seqs)
        out.embedding = pool.vector()
        return out

    def _count(self, seq: Sequence, num_new_tokens: int) -> None:
        """The tokens just computed, the full blocks they complete published to the prefix cache, and the
        blocks they leave behind every layer's window released."""
        seq.num_computed_tokens += num_new_tokens
        self.block_manager.cache_full_blocks(seq, num_new_tokens)
        self.block_manager.release_out_of_window(seq)

    def _verify(self, seq: Sequence, draft: list[int], result: SeqResult, emitted: _Emitted) -> str | None:
        """A speculative step: sample each position in turn exactly as a plain decode step would (the same
        row bits, the same generator draws, logits processors and grammar over the tokens emitted so far),
        keep going while the token sampled equals the draft token computed there, and stop at the first
        that differs, at a stop, or after the last draft token's row. Returns the stop reason, if any.

        Then only what was accepted counts as computed: the sequence's last token and the accepted draft
        tokens (the row after the last of them picked the final token). Blocks past that hold rejected
        tokens' K/V only and are released unhashed (BlockManager.truncate)."""
        reason = None
        accepted = 0
        try:
            for j, (row, argmax, has_nan) in enumerate(result.choice_rows()):
                tok = self._sample(seq, row, argmax, has_nan)
                reason = self._emit(seq, tok, row, emitted)
                if j == len(draft) or tok != draft[j]:
                    break
                accepted += 1
                if reason:
                    break
        finally:  # also when a position fails: what was emitted before it stays exact
            self._count(seq, len(emitted.tokens))
            self.block_manager.truncate(seq)
            self.speculator.record(seq.state.drafter, len(draft), accepted)
        return reason

    def _sample(self, seq: Sequence, row: torch.Tensor, argmax: int, has_nan: bool) -> int:
        """The token a position picks from its (V,) row: the model's, or after the logits processors."""
        st: _SeqState = seq.state
        if not seq.params.processes_row:
            return sample(row, seq.params, st.generator, argmax, has_nan)
        # Logits processors work on their own row; the reported logprobs stay the model's.
        if has_nan:
            raise NumericalError("the model produced NaN log-probabilities")
        row = process_row(row, seq.params, seq.token_ids, seq.num_prompt_tokens, st.end_ids)
        if st.matcher is not None:
            st.matcher.mask_(row)  # only what the grammar allows next
        tok = sample(row, seq.params, st.generator, has_nan=False)
        if st.matcher is not None:
            st.matcher.advance(tok)
        return tok

    def _emit(self, seq: Sequence, tok: int, row: torch.Tensor, emitted: _Emitted) -> str | None:
        """Append one chosen token to the sequence and to `emitted`; returns why it stops there, if it does."""
        st: _SeqState = seq.state
        seq.token_ids.append(tok)
        lp = token_logprob(row, tok, seq.params.logprobs) if seq.params.logprobs is not None else None
        text = "" if tok in st.end_ids else st.detok.add(tok)  # an end token never becomes text
        emitted.tokens.append(tok)  # only once nothing about it can fail: an error output carries what came before
        emitted.text += text
        if lp is not None:
            emitted.logprobs.append(lp)
        return stop_reason(tok, st.end_ids, st.detok.stopped, seq.num_generated_tokens, seq.params.max_tokens,
                           seq.num_tokens, self.max_model_len)

    def _collect_prompt_logprobs(self, seq: Sequence, result: SeqResult) -> list[TokenLogprob | None] | None:
        st: _SeqState = seq.state
        if seq.prompt_logprobs_done:
            return None
        for i, lp in enumerate(result.prompt_logprobs):
            pos = result.first_prompt_pos + i
            if pos == len(st.prompt_logprobs) + 1:  # skip rows recomputed after a preemption
                st.prompt_logprobs.append(lp)
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            return None
        seq.prompt_logprobs_done = True
        return [None, *st.prompt_logprobs]

    def _finish(self, seq: Sequence, toks: list[int], delta: str, lps: list[TokenLogprob],
                prompt_lps: list[TokenLogprob | None] | None, reason: str, num_batch_seqs: int) -> RequestOutput:
        delta += seq.state.detok.finish()
        reason = final_reason(reason, seq.state.detok.stopped)  # type: ignore[arg-type]
        self.scheduler.retire(seq)
        return self._output(seq, toks, delta, lps, prompt_lps, reason, num_batch_seqs=num_batch_seqs)

    def _output(self, seq: Sequence, toks: list[int], delta: str, lps: list[TokenLogprob],
                prompt_lps: list[TokenLogprob | None] | None = None, finish_reason: str | None = None,
                error: str | None = None, num_batch_seqs: int = 0) -> RequestOutput:
        out = RequestOutput(request_id=seq.request_id, new_token_ids=toks, text_delta=delta, logprobs=lps,
                            prompt_logprobs=prompt_lps, finished=finish_reason is not None,
                            finish_reason=finish_reason, error=error, num_prompt_tokens=seq.num_prompt_tokens,
                            num_generated_tokens=seq.num_generated_tokens, num_batch_seqs=num_batch_seqs,
                            num_cached_tokens=min(seq.num_cached_tokens, seq.num_prompt_tokens),
                            timings=None if finish_reason is None else _timings(seq))
        if finish_reason is not None and seq.request.receipt:
            # The seed the generator was made with: the request's, or the one make_generator drew for it.
            out.seed = seq.state.generator.initial_seed()
        return out


def _timings(seq: Sequence) -> RequestTimings:
    """The times the engine kept for `seq`, copied for its final output (the engine thread calls no tracer)."""
    return RequestTimings(seq.request.arrival_time, seq.first_scheduled_time, seq.prefill_done_time,
                          seq.first_token_time, list(seq.preempted_times), time.monotonic())


def _cheap_rows(model) -> int:  # noqa: ANN001 - a Transformer
    """Rows a step computes for little more than the cost of one (speculation.Speculator): on the native
    path the rows the matrix kernels multiply with weights dequantized in registers (kSmallM of
    kernels/csrc/qmm_scalar.cpp, qmm_avx2.cpp, qmm_avx512.cpp: 1, 4, 8); MKL's and CUDA's kernels are
    memory-bound for a few rows more."""
    if model.native:
        return int(torch.ops.steadyserve.qmm_register_rows())
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
