"""What one engine step did, for the metrics and the thread policy: StepStats, and the meter that takes it.

The meter reads the engine's running counters (prefix-cache lookups, speculation outcomes, the CPU waits of
engine/threads.py) before and after a step; a step's stats are their differences, plus the batch's sizes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestOutput
from .speculation import Speculator
from .threads import CpuSignals


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


@dataclass
class _Start:
    """The counters as a step found them."""

    time: float  # time.perf_counter()
    waits: tuple[float, float]  # CpuSignals.read(): run delay, throttled seconds
    queried: int  # BlockManager.num_queried_tokens
    hit: int  # BlockManager.num_hit_tokens


class StepMeter:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, speculator: Speculator,
                 cpu_signals: CpuSignals | None) -> None:
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.speculator = speculator  # its counts are taken (and reset) once per step
        self.cpu_signals = cpu_signals  # None: the waits are not read

    def start(self) -> _Start:
        waits = self.cpu_signals.read() if self.cpu_signals is not None else (0.0, 0.0)
        bm = self.block_manager
        return _Start(time.perf_counter(), waits, bm.num_queried_tokens, bm.num_hit_tokens)

    def stop(self, start: _Start, batch: SchedulerOutput, outputs: list[RequestOutput]) -> StepStats:
        """The step's stats; `threads` and `thread_change` are the thread policy's to fill in."""
        run_delay = throttled = 0.0
        if self.cpu_signals is not None and not batch.is_empty:
            waits = self.cpu_signals.read()
            run_delay, throttled = waits[0] - start.waits[0], waits[1] - start.waits[1]
        spec = self.speculator.take_counts()
        bm = self.block_manager
        return StepStats(num_seqs=len(batch.scheduled), num_tokens=batch.num_tokens,
                         num_generated=sum(len(out.new_token_ids) for out in outputs),
                         num_preempted=len(batch.preempted), duration=time.perf_counter() - start.time,
                         num_running=self.scheduler.num_running, num_waiting=self.scheduler.num_waiting,
                         kv_usage=bm.usage, num_cached_blocks=bm.num_cached_blocks,
                         num_prefix_queried_tokens=bm.num_queried_tokens - start.queried,
                         num_prefix_hit_tokens=bm.num_hit_tokens - start.hit, num_drafted_tokens=spec.drafted,
                         num_accepted_tokens=spec.accepted, acceptance_ratios=spec.ratios,
                         run_delay=run_delay, throttled=throttled)
