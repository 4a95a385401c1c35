"""A coordinator's loop kept running across calls (`RequestStream`): requests are admitted into
free micro-batch slots as soon as they are submitted, and each result is handed back the moment its
row finishes. A job's replica feeds one stream from every block it is given (raysd.jobs.replica).
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from raysd.engine.requests import GenerationResult, Request
from raysd.engine.verdict import LoopStats


@dataclass(frozen=True)
class StreamedResult:
    result: GenerationResult
    latency_s: float  # from `submit` to the result (0 for a request refused at submission)


class _Deliveries(dict):
    """`SpecCoordinator._take` writes `results[i] = result`; for a stream that hands the result over at once."""

    def __init__(self, stream: "RequestStream"):
        super().__init__()
        self.stream = stream

    def __setitem__(self, i, result) -> None:
        self.stream._deliver(i, result)


class RequestStream:
    """A SpecCoordinator's loop kept running across calls: requests are admitted into free
    micro-batch slots as soon as they are submitted (rows of several callers share the
    micro-batches), and each result is handed back the moment its row finishes.

    - `submit(request)` returns a `concurrent.futures.Future` of a `StreamedResult`. It is
      thread-safe, and blocks while `max_pending` requests are already queued or running
      (backpressure: memory holds at most `max_pending` requests).
    - The loop is `SpecCoordinator._serve` (the same as `generate`) on a daemon thread; it
      waits, without a step in flight, while there is nothing to run.
    - Rows carry their own random streams, so a request gives the same tokens whatever it
      shares its micro-batch with: the stream gives `generate`'s outputs.
    - An actor failure re-runs the rows in flight exactly once (`_recover`); the
      `max_recoveries` budget counts failures without a completed step in between. A failure
      beyond it fails every pending future and every later `submit`.
    - `stats()`: what the loop measured so far (`LoopStats`), its idle time included.
    """

    def __init__(self, coordinator, max_pending: int):
        """`coordinator`: the raysd.actors.coordinator.SpecCoordinator whose loop (`_serve`) this runs."""
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.coordinator = coordinator
        self.max_pending = max_pending
        self._stats = LoopStats()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._room = threading.Semaphore(max_pending)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[Future, float]] = {}
        self._enqueued: dict[int, float] = {}  # loop thread only
        self._next = 0
        self._closed = False
        self._error: BaseException | None = None
        if not coordinator._serving.acquire(blocking=False):
            raise RuntimeError("stream: this coordinator is already running a loop (a stream or a generate call)")
        self._thread = threading.Thread(target=self._run, name="raysd-request-stream", daemon=True)
        self._thread.start()

    def __enter__(self) -> "RequestStream":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def pending(self) -> int:
        """Requests submitted and not yet finished (queued or in a micro-batch)."""
        return len(self._pending)

    def submit(self, request: Request) -> Future:
        future: Future = Future()
        refused = self.coordinator.admission.refusal(request)
        if refused is not None:  # refused before it takes a slot, as in `generate`
            future.set_result(StreamedResult(refused, 0.0))
            return future
        while not self._room.acquire(timeout=0.2):  # backpressure: wait for a request to finish
            self._check()
        try:
            with self._lock:
                self._check()
                i, self._next = self._next, self._next + 1
                now = time.perf_counter()
                self._pending[i] = (future, now)
                self._inbox.put((i, request, now))
        except BaseException:
            self._room.release()
            raise
        return future

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the generation loop failed: {type(self._error).__name__}: {self._error}") from self._error
        if self._closed:
            raise RuntimeError("the request stream is closed")

    def close(self, timeout: float | None = None) -> None:
        """Finish what was submitted, then end the loop."""
        with self._lock:
            self._closed = True
        self._inbox.put(None)  # wakes an idle loop
        self._thread.join(timeout)

    def stats(self) -> LoopStats:
        """A copy of what the loop measured so far: take two, and `since` says what happened between."""
        return LoopStats().add(self._stats)

    # The loop thread.

    def _run(self) -> None:
        try:
            self.coordinator._serve(deque(), _Deliveries(self), self._stats, self._enqueued, refill=self._refill)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            self._error = exc
        finally:
            with self._lock:
                self._closed = True
                left = list(self._pending.values())
                self._pending.clear()
            self.coordinator._serving.release()
            error = self._error or RuntimeError("the request stream was closed before the request finished")
            for future, _ in left:
                if not future.done():
                    future.set_exception(error)

    def _refill(self, waiting: deque, idle: bool) -> None:
        block = idle
        while True:
            try:
                item = self._inbox.get(timeout=0.1) if block else self._inbox.get_nowait()
            except queue.Empty:
                if block and not self._closed:
                    continue
                return
            if item is None:  # close(): end once idle
                block = False
                continue
            i, request, submitted = item
            self._enqueued[i] = submitted
            waiting.append((i, request))
            block = False

    def _deliver(self, i: int, result: GenerationResult) -> None:
        with self._lock:
            future, submitted = self._pending.pop(i)
        self._room.release()
        future.set_result(StreamedResult(result, time.perf_counter() - submitted))
