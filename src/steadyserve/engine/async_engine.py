"""The engine thread and the asyncio-facing API the front ends use.

One thread owns the LLMEngine and the model (a ModelThread, which also loaded it). Front ends (HTTP, gRPC, on the
event loop) only `submit()` requests and read their outputs from the RequestChannel it returns (channel.py);
they never run model code and never wait on the engine. Admission is decided
here, at once, from counters: running + waiting is bounded, so excess load is
refused (429 / RESOURCE_EXHAUSTED) instead of queued without bound.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable

from ..limits import Refused
from .channel import RequestChannel
from .engine import LLMEngine, StepStats
from .model_thread import ModelThread
from .sequence import Request, RequestOutput

log = logging.getLogger("steadyserve.engine")

SECOND_MODEL_THREAD = ("the engine loop runs on another thread than the one that built the engine: model code on "
                       "two threads keeps two OpenMP worker pools, and small GEMMs run up to 2x slower "
                       "(build the engine on the ModelThread that runs the loop)")


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_queue: int, model_thread: ModelThread | None = None) -> None:
        """`model_thread`: the thread that loaded the model (see model_thread.py); a new one if None."""
        self.engine = engine
        self.max_queue = max_queue
        self.max_num_seqs = engine.cfg.max_num_seqs
        self._inbox: queue.SimpleQueue[tuple[str, object]] = queue.SimpleQueue()
        self._wake = threading.Event()
        # request_id -> (its channel, its choice there); written on loops, read on the engine thread
        self._streams: dict[str, tuple[RequestChannel, int]] = {}
        self._num_in_flight = 0  # admitted and not yet finished; guarded by _count_lock
        self._count_lock = threading.Lock()  # a counter lock, never held around model code
        self._model_thread = model_thread
        self._loop_done: Future[None] | None = None  # the engine loop, once started
        self._stop = threading.Event()
        self.dead: str | None = None  # why the engine loop died
        self.step_observers: list[Callable[[StepStats], None]] = []
        # Called with (num_running, num_waiting, kv_usage) when admissions or aborts change them between steps.
        self.state_observers: list[Callable[[int, int, float], None]] = []
        self.finish_observers: list[Callable[[RequestOutput], None]] = []
        self.death_observers: list[Callable[[str], None]] = []
        self._finish_times: deque[float] = deque(maxlen=256)  # for Retry-After estimates
        self.last_stats: StepStats | None = None

    # ---- lifecycle -------------------------------------------------------
    def start(self) -> None:
        if self._model_thread is None:
            self._model_thread = ModelThread()
        self._loop_done = self._model_thread.submit(self._run)

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._model_thread is not None:
            self._model_thread.close(timeout)

    @property
    def alive(self) -> bool:
        return self.dead is None and self._loop_done is not None and not self._loop_done.done()

    @property
    def num_in_flight(self) -> int:
        return self._num_in_flight

    @property
    def capacity(self) -> int:
        return self.max_num_seqs + self.max_queue

    # ---- front-end API ---------------------------------------------------
    def submit(self, request: Request) -> RequestChannel:
        """Admit a request or raise Refused at once. Call from an event loop."""
        return self.submit_all([request])

    def submit_all(self, requests: list[Request]) -> RequestChannel:
        """Admit all of `requests` (one client call: batched prompts) or none: Refused at once.

        Only counts capacity: each request was checked against the engine's ModelLimits by whoever built it
        (api/requests.py for the server; engine/admission.py has the checks), once, off the event loop."""
        if self.dead is not None:
            raise Refused("dead", f"the engine is not running: {self.dead}")
        ids = [r.request_id for r in requests]
        with self._count_lock:
            if self._num_in_flight + len(requests) > self.capacity:
                asked = f", {len(requests)} asked for at once" if len(requests) > 1 else ""
                raise Refused("overloaded", f"server at capacity ({self._num_in_flight} requests in "
                              f"flight{asked}); retry later", retry_after=self.retry_after())
            taken = next((i for i in ids if i in self._streams), None)
            if taken is not None or len(set(ids)) < len(ids):
                raise Refused("invalid", f"request id {taken or ids[0]!r} is already in flight",
                              "request_id")
            self._num_in_flight += len(requests)
        channel = RequestChannel([r.request_id for r in requests], self.abort, asyncio.get_running_loop())
        for i, request in enumerate(requests):
            self._streams[request.request_id] = (channel, i)
            self._inbox.put(("add", request))
        self._wake.set()
        return channel

    def abort(self, request_id: str) -> None:
        """Abort a request; its slot is freed at the start of the next step. Front ends abort through their
        channel (RequestChannel.cut), which calls this once per engine request."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def retry_after(self) -> float:
        """Seconds until a slot is likely free, from the recent finish rate."""
        now = time.monotonic()
        recent = [t for t in self._finish_times if now - t < 30]
        if len(recent) < 2:
            return 1.0
        rate = len(recent) / max(now - recent[0], 1e-3)
        return min(60.0, max(1.0, (self._num_in_flight - self.capacity + 1) / rate))

    # ---- engine thread ---------------------------------------------------
    def _run(self) -> None:
        built_here = threading.get_ident() == self.engine.owner_thread_id
        log.info("engine loop started", extra={"fields": {"thread": threading.current_thread().name,
                                                          "built_on_this_thread": built_here}})
        if not built_here:
            log.warning(SECOND_MODEL_THREAD)
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if not self.engine.has_work():
                    self._wake.wait(0.5)
                    self._wake.clear()
                    continue
                outputs, stats = self.engine.step()
                self.last_stats = stats
                self._deliver(outputs)
                for fn in self.step_observers:
                    fn(stats)
        except BaseException as e:  # the loop itself failed: say so, never hang
            self.dead = f"{type(e).__name__}: {e}"
            log.exception("engine loop died")
            self._fail_all(self.dead)
            for fn in self.death_observers:
                fn(self.dead)

    def _drain_inbox(self) -> None:
        outputs = []
        changed = False
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                break
            changed = True
            if kind == "add":
                req = item  # type: ignore[assignment]
                try:
                    self.engine.add_checked(req)  # type: ignore[arg-type]  # its builder checked it
                except Exception as e:  # a bad request fails alone; it must never stop the loop
                    outputs.append(RequestOutput(req.request_id, [], "", [], finished=True,  # type: ignore[attr-defined]
                                                 finish_reason="error", error=str(e)))
            else:
                out = self.engine.abort_request(item)  # type: ignore[arg-type]
                if out is not None:
                    outputs.append(out)
        if outputs:
            self._deliver(outputs)
        if changed:
            sched = self.engine.scheduler
            for fn in self.state_observers:
                fn(sched.num_running, sched.num_waiting, self.engine.block_manager.usage)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestChannel, int, RequestOutput]]] = {}
        for out in outputs:
            entry = self._streams.get(out.request_id)
            if out.finished:
                self._streams.pop(out.request_id, None)
                with self._count_lock:
                    self._num_in_flight -= 1
                self._finish_times.append(time.monotonic())
                for fn in self.finish_observers:
                    fn(out)
            if entry is not None:
                channel, index = entry
                by_loop.setdefault(channel.loop, []).append((channel, index, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:  # that loop is closed; its consumers are gone
                pass

    def _fail_all(self, why: str) -> None:
        outs = [RequestOutput(rid, [], "", [], finished=True, finish_reason="error", error=f"engine failed: {why}")
                for rid in list(self._streams)]
        self._deliver(outs)


def _deliver_all(items: list[tuple[RequestChannel, int, RequestOutput]]) -> None:
    """On the channels' loop: each output to its channel's choice."""
    for channel, index, out in items:
        channel.deliver(index, out)
