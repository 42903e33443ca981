"""A reusable pool of spawned rank processes for multi-rank tests (gloo over a FileStore).

One :class:`RankPool` per test module (a module-scoped fixture) spawns ``world_size``
processes once; each runs ``dist.init_process_group("gloo", init_method="file://...")`` and then
serves tasks. A test sends the name of a top-level function (it must live in an importable
module, e.g. the test module itself: spawned processes import it by name) plus keyword
arguments to every rank or to a subset of ranks, and gets back each rank's return value or a
:class:`RankError` (type name, message, MRO, ``failures``/``errno`` where present, traceback).

Every call has a bounded wait (``timeout_s``). When a rank does not answer in time, or dies,
the pool is killed and :class:`RankTimeout` names the ranks; the next call starts a fresh pool
(new processes, new store file). ``distributed=False`` gives a pool of plain processes (no
process group): single-process saves that might hang run there, so a hang fails the test
instead of blocking pytest.

Example::

    pool = RankPool(str(tmp), world_size=3)
    out = pool.run(my_rank_fn, folder=str(tmp), timeout_s=30)   # {0: ..., 1: ..., 2: ...}
    raw = pool.call(my_rank_fn, ranks=[0, 1], folder=str(tmp))  # values or RankError
    pool.close()
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import queue
import time
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Iterable

_READY = -1


@dataclass
class RankError:
    """An exception raised by a rank function, described in plain data.

    Attributes:
        type: the exception's class name.
        message: ``str(exception)``.
        mro: class names of the exception's MRO (``"RuntimeError"`` in it for subclasses).
        failures: ``e.failures`` with int keys where the exception has one, else ``None``.
        errno: ``e.errno`` where present.
        cause: ``"Type: message"`` of ``e.__cause__``, or ``None``.
        traceback: formatted traceback, for failure messages.
    """

    type: str
    message: str
    mro: tuple[str, ...] = ()
    failures: dict | None = None
    errno: int | None = None
    cause: str | None = None
    traceback: str = field(default="", repr=False)

    def isa(self, name: str) -> bool:
        """True when the exception's class or one of its bases is called ``name``."""
        return name in self.mro

    def __str__(self) -> str:
        return f"{self.type}: {self.message}"


def describe(e: BaseException) -> RankError:
    """A picklable :class:`RankError` for ``e``."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict):
        try:
            failures = {int(k): str(v) for k, v in failures.items()}
        except (TypeError, ValueError):
            failures = {str(k): str(v) for k, v in failures.items()}
    else:
        failures = None
    code = getattr(e, "errno", None)
    cause = e.__cause__
    return RankError(type(e).__name__, str(e), tuple(c.__name__ for c in type(e).__mro__), failures,
                     code if isinstance(code, int) else None,
                     f"{type(cause).__name__}: {cause}" if cause is not None else None,
                     "".join(traceback.format_exception(type(e), e, e.__traceback__)))


class RankTimeout(AssertionError):
    """A rank did not answer a call in time (or died); the pool was killed."""


def _serve(rank: int, world_size: int, store_path: str, distributed: bool, tasks, results) -> None:
    """Body of one pool process: join the group once, then run tasks until ``None``."""
    dist = None
    import faulthandler
    faulthandler.enable()  # a native abort (SIGABRT, SIGSEGV) prints every thread's Python stack
    try:
        if distributed:
            import torch.distributed as dist
            dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank,
                                    world_size=world_size, timeout=timedelta(seconds=120))
        results.put((_READY, rank, True, os.getpid()))
    except BaseException as e:  # reported to the parent, which fails the start
        results.put((_READY, rank, False, describe(e)))
        return
    while True:
        msg = tasks.get()
        if msg is None:
            break
        call_id, module, name, kwargs = msg
        try:
            value = getattr(importlib.import_module(module), name)(**kwargs)
            pickle.dumps(value)
            ok = True
        except BaseException as e:  # everything goes back to the test
            ok, value = False, describe(e)
        results.put((call_id, rank, ok, value))
    if dist is not None and dist.is_initialized():
        dist.destroy_process_group()


class RankPool:
    """``world_size`` spawned processes serving test functions (see the module docstring).

    Args:
        folder: a folder for the store files (one per start of the pool).
        world_size: processes (= ranks) in the pool.
        distributed: join a gloo process group (default) or stay plain processes.
        start_timeout_s: seconds to wait for every process to be ready.

    The pool starts on the first call and after a kill; :meth:`close` ends it.
    """

    def __init__(self, folder: str, world_size: int = 3, *, distributed: bool = True,
                 start_timeout_s: float = 180.0):
        self.folder, self.world_size, self.distributed = folder, world_size, distributed
        self.start_timeout_s = start_timeout_s
        self.generation = 0  # starts so far (each start spawns fresh processes)
        self.pids: dict[int, int] = {}
        self._procs: list = []
        self._tasks: list = []
        self._results = None
        self._call_id = 0
        self._exit_codes: dict[int, int | None] = {}  # of the last killed pool

    @property
    def started(self) -> bool:
        return bool(self._procs)

    def start(self) -> None:
        """Spawn the processes and wait until each joined the group (no-op when running)."""
        if self._procs:
            return
        ctx = mp.get_context("spawn")
        self.generation += 1
        store = os.path.join(self.folder, f"store-{os.getpid()}-{self.generation}")
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        self._procs = [ctx.Process(target=_serve, name=f"rank{r}", daemon=True,
                                   args=(r, self.world_size, store, self.distributed, self._tasks[r], self._results))
                       for r in range(self.world_size)]
        for p in self._procs:
            p.start()
        ready, deadline = {}, time.monotonic() + self.start_timeout_s
        while len(ready) < self.world_size and time.monotonic() < deadline:
            try:
                cid, rank, ok, value = self._results.get(timeout=0.5)
            except queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    break
                continue
            if cid == _READY:
                ready[rank] = (ok, value)
        bad = {r: v for r, (ok, v) in ready.items() if not ok}
        missing = [r for r in range(self.world_size) if r not in ready]
        if bad or missing:
            self.kill()
            raise RankTimeout(f"rank pool did not start: missing ranks {missing}, errors "
                              + "; ".join(f"rank {r}: {v}\n{v.traceback}" for r, v in bad.items()))
        self.pids = {r: v for r, (ok, v) in ready.items()}

    def call(self, fn: Callable, *, ranks: Iterable[int] | None = None, timeout_s: float = 60.0,
             **kwargs: Any) -> dict[int, Any]:
        """Run ``fn(**kwargs)`` on ``ranks`` (default: all) and return ``{rank: value or RankError}``.

        Args:
            fn: a top-level function of an importable module (looked up by name in each process).
            ranks: the ranks that run it; the others stay idle.
            timeout_s: seconds to wait for every answer.
            **kwargs: picklable keyword arguments (the same for every rank); ``ranks`` and
                ``timeout_s`` are this method's own, so a rank function takes neither name.

        Raises:
            RankTimeout: a rank did not answer within ``timeout_s`` or died; names the ranks.
                The pool is killed and restarts on the next call.
        """
        if fn.__qualname__ != fn.__name__ or fn.__name__ == "<lambda>":
            raise ValueError(f"{fn.__qualname__} is not a top-level function: the ranks look it up by name")
        targets = sorted(set(range(self.world_size) if ranks is None else ranks))
        if not targets or any(not 0 <= r < self.world_size for r in targets):
            raise ValueError(f"ranks must be a non-empty subset of 0..{self.world_size - 1}, got {targets}")
        self.start()
        self._call_id += 1
        cid = self._call_id
        for r in targets:
            self._tasks[r].put((cid, fn.__module__, fn.__name__, kwargs))
        got: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        dead: list[int] = []
        while len(got) < len(targets):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            try:
                rcid, rank, _ok, value = self._results.get(timeout=min(left, 0.5))
            except queue.Empty:
                dead = [r for r in targets if r not in got and not self._procs[r].is_alive()]
                if dead:
                    break
                continue
            if rcid == cid:  # an answer of an earlier call cannot arrive: a timeout kills the pool
                got[rank] = value  # the return value, or a RankError when ok is False
        missing = [r for r in targets if r not in got]
        if missing:
            self.kill()
            names = ", ".join(f"rank {r}" for r in missing)
            why = f"died (exit codes { {r: self._exit_codes.get(r) for r in dead} })" if dead else \
                f"did not answer within {timeout_s:g} s"
            raise RankTimeout(f"{names} {why} running {fn.__name__}; the rank pool was killed "
                              f"(it restarts for the next call). Answers so far: {got}")
        return {r: got[r] for r in targets}

    def run(self, fn: Callable, *, ranks: Iterable[int] | None = None, timeout_s: float = 60.0,
            **kwargs: Any) -> dict[int, Any]:
        """As :meth:`call`, but fail (``AssertionError`` with every rank's traceback) when any rank raised."""
        out = self.call(fn, ranks=ranks, timeout_s=timeout_s, **kwargs)
        errs = {r: v for r, v in out.items() if isinstance(v, RankError)}
        if errs:
            lines, seen = [], set()
            for r, e in sorted(errs.items()):  # one traceback per distinct error
                lines.append(f"rank {r}: {e}" + ("" if str(e) in seen else f"\n{e.traceback}"))
                seen.add(str(e))
            raise AssertionError(f"{fn.__name__} raised on " + "\n".join(lines))
        return out

    def restart(self) -> None:
        """Replace the processes by fresh ones (e.g. for a test of a process's first save)."""
        self.kill()
        self.start()

    def kill(self) -> None:
        """Stop every process at once (SIGTERM, then SIGKILL); the next call starts a fresh pool."""
        procs, self._procs = self._procs, []
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
        self._exit_codes = {r: p.exitcode for r, p in enumerate(procs)}
        self._drop_queues()

    def close(self, timeout_s: float = 15.0) -> None:
        """Ask every process to leave the group and exit; kill what is left after ``timeout_s``."""
        if not self._procs:
            return
        for q in self._tasks:
            try:
                q.put(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.1, deadline - time.monotonic()))
        self.kill()

    def _drop_queues(self) -> None:
        for q in self._tasks + ([self._results] if self._results is not None else []):
            q.cancel_join_thread()
            q.close()
        self._tasks, self._results = [], None


def full_values(v):
    """A rank's state with every DTensor gathered to its full tensor (``full_tensor()``, a collective: every
    rank calls) and every plain tensor cloned, nesting kept: what the state holds, comparable across ranks."""
    import torch

    if hasattr(v, "full_tensor"):
        return v.full_tensor()
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, dict):
        return {k: full_values(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return type(v)(full_values(x) for x in v)
    return v
