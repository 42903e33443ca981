"""The handle of one asynchronous save, and what happens to pending saves at interpreter exit.

A pending save is never dropped silently: at exit the interpreter waits for its writer thread
(one line on stderr says so), and a save that failed without anyone collecting its error is
reported on stderr and makes the process exit with status 1.
"""

from __future__ import annotations

import atexit
import concurrent.futures.thread  # noqa: F401,I001  (its exit hook is registered first, so _finish_pending runs before it)
import os
import sys
import threading
import warnings
from pathlib import Path
from typing import Callable

#: Failed saves whose error nobody collected yet (warned about at interpreter exit).
_UNCOLLECTED: "set[SaveFuture]" = set()


class SaveFuture:
    """Handle of one asynchronous save.

    Attributes:
        path: the checkpoint folder it commits (``pathlib.Path``).
        blocking_s: seconds the ``async_save`` call blocked (validation + staging).
        total_s: seconds from the call until the commit (``None`` while pending).
        bytes_written: bytes of all files of the checkpoint (set when committed, on every rank),
            linked ones included (marker mode: rank 0's node folder).
        bytes_linked: the part of ``bytes_written`` hard-linked from ``link_from`` instead of
            written (0 without ``link_from``).
        bytes_by_rank: bytes each rank wrote itself, hard links excluded (``{rank: bytes}``;
            ``{0: ...}`` for one process).
    """

    def __init__(self, path: Path):
        self.path = path
        self.bytes_by_rank: dict[int, int] = {}
        self.blocking_s = 0.0
        self.total_s: float | None = None
        self.bytes_written = 0
        self.bytes_linked = 0
        self._event = threading.Event()
        self._exc: BaseException | None = None
        self._collected = False
        self._callbacks: list[Callable[["SaveFuture"], None]] | None = []
        self._cb_lock = threading.Lock()
        self._staged = threading.Event()  # every tensor copied out of the caller's memory

    def wait_staged(self, timeout_s: float | None = None) -> bool:
        """Wait until every tensor of the state is copied into staging memory (at once unless
        :class:`SaveOptions` ``defer``/``defer_frozen`` left copies to the background; also
        true once the save failed). After that the caller may write the state's tensors.

        Args:
            timeout_s: seconds to wait (default: forever).

        Returns:
            True when staged, False on timeout.
        """
        return self._staged.wait(timeout_s)

    def done(self) -> bool:
        """True once the save committed or failed."""
        return self._event.is_set()

    def result(self, timeout_s: float | None = None) -> Path:
        """Wait for the commit and return the checkpoint path.

        Args:
            timeout_s: seconds to wait (default: forever).

        Raises:
            TimeoutError: not done within ``timeout_s``.
            BaseException: the background failure itself (same object, errno kept), on every call.
        """
        if not self._event.wait(timeout_s):
            raise TimeoutError(f"save of {self.path} not finished after {timeout_s} s")
        if self._exc is not None:
            self._collected = True
            _UNCOLLECTED.discard(self)
            raise self._exc
        return self.path

    def exception(self) -> BaseException | None:
        """The background failure, or ``None`` (waits for completion)."""
        self._event.wait()
        return self._exc

    def add_done_callback(self, fn: Callable[["SaveFuture"], None]) -> None:
        """Call ``fn(self)`` once the save committed or failed, before ``result()`` returns.

        Runs in the writer thread (or at once in the caller's thread if already done);
        an exception from ``fn`` is reported as a warning, never replacing the save's outcome.
        """
        with self._cb_lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def _start(self) -> None:
        self._pid = os.getpid()  # a forked child (DataLoader worker) has no writer thread for it
        with _PENDING_LOCK:
            _PENDING.add(self)

    def _finish(self, exc: BaseException | None) -> None:
        with _PENDING_LOCK:
            _PENDING.discard(self)
        self._exc = exc
        if exc is not None:
            _UNCOLLECTED.add(self)
        with self._cb_lock:
            callbacks, self._callbacks = self._callbacks or [], None
        for fn in callbacks:
            _run_callback(fn, self)
        self._staged.set()  # done or failed: nothing of the caller's memory is needed any more
        self._event.set()


def _run_callback(fn: Callable[[SaveFuture], None], fut: SaveFuture) -> None:
    try:
        fn(fut)
    except Exception as e:  # a callback must not hide the save's own outcome
        warnings.warn(f"fastckpt: done-callback of the save of {fut.path} failed: {type(e).__name__}: {e}",
                      RuntimeWarning, stacklevel=1)


#: Saves whose writer thread is still running (announced at interpreter exit).
_PENDING: "set[SaveFuture]" = set()
_PENDING_LOCK = threading.Lock()


def _finish_pending() -> None:
    """At interpreter exit, before thread pools refuse new work: say which saves are pending
    and wait for them (their writer threads still submit I/O). A ``KeyboardInterrupt`` while
    waiting (Ctrl-C again) exits at once with status 130, saying so: letting the interpreter shut
    down under the running writer threads aborted the process (``terminate called without an
    active exception``, SIGABRT)."""
    with _PENDING_LOCK:
        pending = sorted((f for f in _PENDING if not f.done() and getattr(f, "_pid", None) == os.getpid()),
                         key=lambda f: str(f.path))
    for fut in pending:
        try:
            print(f"fastckpt: finishing the pending save of {fut.path} before exit (Ctrl-C: leave it unfinished)",
                  file=sys.stderr, flush=True)
            fut._event.wait()
        except KeyboardInterrupt:  # asked again: exit now, not through a shutdown under running writers
            print(f"fastckpt: interrupted: the save of {fut.path} was left unfinished (its commit is atomic: "
                  "it is there whole or not at all; a leftover temporary folder is removed by the next "
                  "CheckpointManager save or `fastckpt prune`)", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(130)  # 128 + SIGINT, as the shell reports an interrupted command


def _report_uncollected() -> None:
    """At exit (writer threads joined): a failed save nobody collected is an error, not a warning."""
    lost = [f for f in list(_UNCOLLECTED) if not f._collected and getattr(f, "_pid", os.getpid()) == os.getpid()]
    for fut in lost:
        print(f"fastckpt: the background save of {fut.path} FAILED and nobody called result(): "
              f"{type(fut._exc).__name__}: {fut._exc}; that checkpoint was not written", file=sys.stderr, flush=True)
    if lost:
        sys.stdout.flush()
        os._exit(1)  # atexit cannot change the exit status otherwise


atexit.register(_report_uncollected)
try:  # runs before non-daemon threads are joined and before thread pools shut down (CPython >= 3.9)
    threading._register_atexit(_finish_pending)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):  # pragma: no cover - other interpreters
    pass
