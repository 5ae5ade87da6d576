"""Forked worker pools that always end, whatever signal reaches a worker while it is still being forked.

A stage's SIGTERM handler (`workflow.cli.run`) raises SystemExit. A worker that gets `Pool.terminate()`'s SIGTERM
between its fork and the at-fork hook that restores the default action runs that handler inside the at-fork
callbacks, where Python reports the SystemExit as "Exception ignored" and drops it; the worker then blocks on the
task queue and `join()` waits forever. So SIGTERM stays blocked across the fork, and each worker unblocks it only
after restoring the default action: a pending signal then ends it. A block that completes ends its pool with
`close()` + `join()` (the workers leave on their own), and only a block that raises terminates it.
"""
from __future__ import annotations  # also runs on PyPy 3.9 (the extract rule)

import multiprocessing
import signal
from contextlib import contextmanager
from typing import Callable, Iterator


def _start_worker(initializer: Callable | None, initargs: tuple) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # die on terminate(), as Pool expects, never unwind
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # a terminate() sent during the fork lands now
    if initializer is not None:
        initializer(*initargs)


@contextmanager
def forked_pool(processes: int, initializer: Callable | None = None, initargs: tuple = ()) -> Iterator:
    """A `multiprocessing` Pool of `processes` forked workers (they inherit the parent's imports; spawn would
    re-import in each), each running `initializer(*initargs)` first. Ended when the block is left: closed and
    joined after a block that completes, terminated and joined after one that raises."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:  # the workers and the pool's own threads start with SIGTERM blocked; the parent gets it back at once
        pool = multiprocessing.get_context("fork").Pool(processes, _start_worker, (initializer, initargs))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    try:
        yield pool
    except BaseException:
        pool.terminate()
        raise
    else:
        pool.close()
    finally:
        pool.join()
