"""One drafting thread for Talon's asynchronous mode, with split torch threads and a guaranteed shutdown."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

THREAD_PREFIX = "hf-spec-talon"


class DraftWorker:
    """Runs drafting jobs on one background thread while the caller's thread verifies.

    torch ops release the GIL, so the two threads really run in parallel; the cores are split by giving the
    worker `draft_threads` torch threads and the caller `verify_threads` while a job is in flight
    (`overlapped()`), and restoring the caller's thread count afterwards. `close()` asks the running job to
    stop (it checks `stop` between tokens) and joins the thread: nothing outlives the `generate` call, also on
    errors and interrupts.
    """

    def __init__(self, draft_threads: int = 1, verify_threads: int = 0) -> None:
        cores = os.cpu_count() or 1
        self.draft_threads = draft_threads
        self.verify_threads = verify_threads or max(1, cores - draft_threads)
        self.stop = threading.Event()
        self._pool = ThreadPoolExecutor(
            max_workers=1,
            thread_name_prefix=THREAD_PREFIX,
            initializer=torch.set_num_threads,
            initargs=(draft_threads,),
        )
        self._job: Future | None = None
        self._saved_threads: int | None = None

    def submit(self, fn: Callable[[threading.Event], object]) -> None:
        """Start `fn(stop)` on the worker and give the caller `verify_threads` until `result()`."""
        if self._job is not None:
            raise RuntimeError("a drafting job is already running")
        self._job = self._pool.submit(fn, self.stop)
        self._saved_threads = torch.get_num_threads()
        torch.set_num_threads(self.verify_threads)

    @property
    def busy(self) -> bool:
        return self._job is not None

    def result(self) -> object:
        """Wait for the running job (re-raising its error) and give the caller its threads back."""
        job, self._job = self._job, None
        self._restore_threads()
        return job.result() if job is not None else None

    def close(self) -> None:
        self.stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._job = None
        self._restore_threads()

    def _restore_threads(self) -> None:
        if self._saved_threads is not None:
            torch.set_num_threads(self._saved_threads)
            self._saved_threads = None
