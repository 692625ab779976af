"""Bound every poll: read each GPU on its own worker thread, each read under a deadline.

A ctypes call into NVML cannot be interrupted. A driver that hangs in one call
(seen with GPUs in a bad state, or an NVML lock held by a crashed process) would
stall a poll forever. So each device gets a long-lived worker thread, and the poll
hands the workers their reads one after another, waiting at most ``timeout`` seconds
for each. A device whose read is late is reported as timed out, and while its worker
is still stuck it is skipped rather than given a second thread: a hang costs one
thread and one timeout, once, and later polls read the other GPUs at full speed.

One read at a time, not all at once: the calls are microseconds each on a real driver,
and running eight Python threads together only adds GIL hand-offs (measured in
bench/agent.py). The worst case for a single poll is ``timeout`` per GPU that newly
hangs in it; a GPU that is still stuck costs nothing.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from gpuwatch.nvml.library import DeviceReading, NvmlSession


@dataclass(frozen=True)
class DeviceTimeout:
    """A device whose read did not finish within the poll deadline."""

    index: int
    # True when the previous read is still stuck and this poll did not even start one.
    still_stuck: bool


class _Worker:
    def __init__(self, index: int) -> None:
        self._inbox: queue.SimpleQueue[tuple[Callable[[], DeviceReading], Future[DeviceReading]]]
        self._inbox = queue.SimpleQueue()
        self.pending: Future[DeviceReading] | None = None
        self._thread = threading.Thread(
            target=self._run, name=f"gpuwatch-nvml-{index}", daemon=True
        )
        self._thread.start()

    def submit(self, read: Callable[[], DeviceReading]) -> Future[DeviceReading]:
        future: Future[DeviceReading] = Future()
        self.pending = future
        self._inbox.put((read, future))
        return future

    def _run(self) -> None:
        while True:
            read, future = self._inbox.get()
            try:
                future.set_result(read())
            except BaseException as err:  # delivered to the poller, which re-raises
                future.set_exception(err)


class BoundedReader:
    """Read the devices of ``session``, each read bounded by ``timeout`` seconds."""

    def __init__(self, session: NvmlSession, *, timeout: float) -> None:
        self._session = session
        self._timeout = timeout
        self._workers: dict[int, _Worker] = {}

    def read_all(self, count: int) -> list[DeviceReading | DeviceTimeout]:
        results: list[DeviceReading | DeviceTimeout] = []
        for index in range(count):
            worker = self._workers.get(index)
            if worker is None:
                worker = self._workers[index] = _Worker(index)
            if worker.pending is not None and not worker.pending.done():
                results.append(DeviceTimeout(index=index, still_stuck=True))
                continue
            future = worker.submit(lambda i=index: self._session.read_device(i))  # type: ignore[misc]
            try:
                results.append(future.result(timeout=self._timeout))
            except TimeoutError:
                results.append(DeviceTimeout(index=index, still_stuck=False))
        return results
