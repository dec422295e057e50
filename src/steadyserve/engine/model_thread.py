"""The one thread that runs model code, from loading to shutdown.

Why one thread for the whole process lifetime, not just "one thread at a
time": GNU OpenMP (libgomp, which PyTorch and MKL use for intra-op threads)
gives every thread that opens a parallel region its own pool of worker
threads, kept until that thread exits. Once the process manages more OpenMP
threads than there are CPUs, libgomp cuts the spin-wait of idle workers from
about 300,000 iterations to about 1,000, so every parallel region pays a
futex wake-up. On a 2-core machine a server that loaded the model on the main
thread and decoded on an engine thread therefore ran each small GEMM about
2x slower (M=4 x 576 x 1536: 93 us vs 200 us) and served one stream at 13
tok/s where the engine alone does 20. Keeping load, self-test and the engine
loop on one long-lived thread keeps exactly one pool.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from typing import Callable, TypeVar

T = TypeVar("T")


class ModelThread:
    """A daemon thread that runs submitted callables in order (a daemon, so a hung model never blocks exit)."""

    def __init__(self, name: str = "steadyserve-engine") -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], T]) -> "Future[T]":
        """Queue `fn`; its result (or exception) arrives in the returned future."""
        fut: Future[T] = Future()
        self._jobs.put((fn, fut))  # type: ignore[arg-type]
        return fut

    def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the model thread and wait for it; exceptions are re-raised here."""
        return self.submit(fn).result()

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def close(self, timeout: float | None = None) -> None:
        """Let queued work finish, then end the thread (waits up to `timeout` seconds)."""
        self._jobs.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _work(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn())
            except BaseException as e:  # handed to the caller, who decides what dies
                fut.set_exception(e)
