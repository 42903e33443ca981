"""The tier arbiter: processes on one storage tier share its bandwidth and one capacity budget.

Every process that saves, loads or serves KV chunks on a tier joins its shared state
(:mod:`.state`) on first use, with no configuration, and then:

* **Bandwidth.** A latency-critical read (a KV get, a weight load) runs inside
  :meth:`Tier.reading`, which counts it as a waiting reader for every process; each read
  request of a weight load runs inside its :class:`LoadPacer` (:meth:`Tier.loader`), which holds
  it while a KV get runs (bounded). Each write of a checkpoint runs inside :meth:`WritePacer.write`: while any reader waits the write is held back,
  while reads are frequent the save keeps one write in flight, both only until the save reaches
  ``factor`` x its unhindered time (``factor`` default 1.3, ``$FASTCKPT_TIER_FACTOR``; see
  :class:`WritePacer`); when no reader is about it writes at full speed (it catches up).
  Background work (deferred copies, verification, prune) calls :meth:`BackgroundPacer.pace` and
  yields while readers or writers are active, at most ``max_wait_s`` per call.
* **Capacity.** One budget (``$FASTCKPT_TIER_BUDGET_BYTES`` or ``fastckpt tier PATH --budget``;
  none by default) covers checkpoints, exported models and KV chunks. A checkpoint or model
  claims its bytes before writing (:meth:`Tier.claim`): if they do not fit, KV chunks are evicted
  for it (every KV store process evicts while the tier is over budget), never the reverse; it
  fails with :class:`~fastckpt.errors.TierFullError` only when checkpoints and models alone
  leave no room. A KV put reserves its bytes (:meth:`Tier.reserve_kv`) and evicts its own
  chunks first when the tier is full. Stored bytes are kept per folder and class.

Nothing is lost to arbitration: it only delays. No lock is held across I/O. A tier whose state
cannot be created is not arbitrated (:class:`NullTier`), with one warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Callable, Iterator

from ...errors import InvalidArgumentError, TierFullError
from .shared import CLASSES, HEARTBEAT_S, RATE_WINDOW_S, SharedState, Slot, arbitration_off, state_path, tier_name

logger = logging.getLogger(__name__)

KV = CLASSES.index("kv")
#: Default bound on a checkpoint's time under pacing, as a factor of its time spent writing.
DEFAULT_FACTOR = 1.3
#: Longest step a paced writer or a yielding background job sleeps before looking again, seconds.
STEP_S = 0.002
#: Reads count as frequent while one ended less than this ago, seconds.
RECENT_S = 0.25
#: Writes one save keeps in flight while reads are frequent.
READ_CAP = 1
#: Time a weight load may be stalled for KV gets before it has read for long, seconds (x
#: ``factor - 1``: 30 ms at the default, about one 16 MiB get).
LOAD_GRACE_S = 0.1
#: Share of a save's allowance (``factor - 1``) the pacer uses; the rest is for the slowdown the
#: reads themselves cause.
AIM = 0.5
#: Seconds of unpaced writing a process's first save uses to measure its unhindered rate.
PROBE_S = 0.3
#: How long a checkpoint's claim waits for KV stores to evict for it, seconds.
EVICT_WAIT_S = 10.0


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, "") or default)
    except ValueError:
        return default


class Claim:
    """Bytes claimed from the tier's budget and not yet stored (see :meth:`Tier.claim`).

    ``settle`` turns them into stored bytes of the folder ``root``; ``release`` returns them
    (a failed write). Either may be called once; later calls do nothing.
    """

    def __init__(self, tier: "Tier | None", cls: int, nbytes: int, root: str):
        self.tier, self.cls, self.nbytes, self.root = tier, cls, nbytes, root
        self.open = tier is not None

    def settle(self, nbytes: int | None = None) -> None:
        """Count ``nbytes`` (default: the claimed bytes) as stored under ``root`` and drop the claim."""
        if self.open:
            self.open = False
            self.tier._settle(self, self.nbytes if nbytes is None else nbytes)

    def release(self) -> None:
        """Drop the claim without storing anything."""
        if self.open:
            self.open = False
            self.tier._settle(self, None)

    def __enter__(self) -> "Claim":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


class CheckpointWrites:
    """One save's writes on the tier: its capacity claim and its pacer (:meth:`Tier.checkpoint`).

    Call order: ``pace(nbytes)`` before each write (any thread), then ``done(stored)`` once the
    files are complete (``True``: their bytes now count as stored) or abandoned (``False``).
    """

    def __init__(self, claim: Claim | None, pacer: "WritePacer | NullTier._Pacer"):
        self.claim, self.pacer = claim, pacer

    def pace(self, nbytes: int) -> None:
        """Before writing ``nbytes``: see :meth:`WritePacer.pace`."""
        self.pacer.pace(nbytes)

    def write(self, nbytes: int):
        """A context around one write of ``nbytes``: see :meth:`WritePacer.write`."""
        return self.pacer.write(nbytes)

    def done(self, stored: bool) -> None:
        """The writes ended (idempotent): settle the claim if ``stored``, else release it."""
        self.pacer.close()
        if self.claim is not None:
            self.claim.settle() if stored else self.claim.release()


def overcounted(roots: list[tuple[int, str, int]]) -> dict[tuple[int, str], int]:
    """``{(class, folder): bytes}`` counted beyond what the folder holds on disk now (:func:`on_disk`),
    for the checkpoints / models folders among ``roots`` (``(class index, folder, counted bytes)``, as
    the tier's state records them) that are over; a counted folder nested in another (``run/`` under
    ``ckpt/``) is measured in itself only. What :meth:`Tier.recount` removes; walks the folders."""
    paths = {os.path.abspath(path) for _, path, _ in roots}

    def nested(path: str) -> frozenset:  # other counted folders under path: counted there, not here
        top = os.path.abspath(path) + os.sep
        return frozenset(r for r in paths if r.startswith(top))
    cut = {(c, path): used - on_disk(path, nested(path)) for c, path, used in roots if c != KV and used > 0}
    return {k: v for k, v in cut.items() if v > 0}


def on_disk(root: str, skip: frozenset = frozenset()) -> int:
    """Bytes of the ``*.safetensors`` files (each inode once) in the non-hidden sub-folders of ``root``
    and one level below them (a checkpoint's adapter folders): what the tier counts as stored under a
    checkpoints / models folder (0 if it is gone). Bounded: two levels, whatever else ``root`` holds.
    Folders in ``skip`` (absolute paths: other counted folders nested in ``root``) are not entered."""
    seen: dict[tuple[int, int], int] = {}

    def scan(folder: str, depth: int) -> None:
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return
        for e in entries:
            if e.name.startswith("."):
                continue
            try:
                if e.is_dir(follow_symlinks=False):
                    if depth < 2 and e.path not in skip:
                        scan(e.path, depth + 1)
                elif depth and e.name.endswith(".safetensors") and e.is_file(follow_symlinks=False):
                    st = e.stat(follow_symlinks=False)
                    seen[(st.st_dev, st.st_ino)] = st.st_size
            except OSError:
                continue
    scan(root, 0)
    return sum(seen.values())


class WritePacer:
    """Paces one checkpoint's writes for latency-critical readers, within its bound.

    Before each write (:meth:`write`, a context around it, or :meth:`pace` just before it):

    * while a reader of any process waits, the write is held back (2 ms steps);
    * while reads are frequent (one ended within :data:`RECENT_S`), this save keeps at most
      :data:`READ_CAP` writes in flight, so a read that starts queues behind little;
    * neither happens once the save is at its bound (:meth:`_slack`): part of ``factor - 1``
      times the time its bytes so far take at its unhindered rate, for its time held back and for
      its time in all. The rate is measured while no reader is about; the first save of a
      process that finds readers about from its start writes its first :data:`PROBE_S` seconds
      unpaced to measure it, later saves start from the rate of the previous one. Past the bound
      it writes at full speed: it catches up.

    Thread-safe: the writer threads of one save share it. Attributes: ``delayed_s`` (time held
    back), ``waits`` (how many times), ``written`` (bytes).
    """

    def __init__(self, tier: "Tier", factor: float):
        self.tier, self.factor = tier, factor
        self.t0 = 0.0
        self.delayed_s = 0.0
        self.waits = 0
        self.written = 0  # bytes whose write started, and finished
        self.done = 0
        self.cond = threading.Condition()
        self.inflight = 0
        self.free_bytes = 0  # bytes written, and wall time, while no reader was about: the unhindered rate
        self.free_s = 0.0
        self.last = 0.0  # time of the previous write's start, and whether readers were about since
        self.last_free = False
        self.free_mark = 0
        self.holding = 0  # writes of this save held now, since hold_t0
        self.hold_t0 = 0.0
        self.closed = False
        tier._bump(writers=1)

    def rate(self) -> float:
        """The unhindered write rate, bytes per second (0: not known yet): this process's fastest
        save so far (its sync included), else what this save measured while unhindered."""
        if self.tier.write_rate:
            return self.tier.write_rate
        if self.free_s >= min(self.tier.probe_s, 0.2) and self.free_bytes:
            return self.free_bytes / self.free_s
        return 0.0

    def _slack(self, now: float) -> float:
        """Seconds the save may still be held back now (<= 0: at its bound): with ``T`` the time its
        bytes so far take at the unhindered rate, its time so far stays under
        ``(1 + (factor - 1) x AIM) T`` (AIM: the readers slow the writes too, beyond what is held
        back) and the time held back under ``(factor - 1) T`` (a bound of its own for when the writes
        go faster than the rate measured, e.g. into the page cache)."""
        rate = self.rate()
        if not rate:
            return 0.0
        unhindered = self.written / rate
        held = self.delayed_s + (now - self.hold_t0 if self.holding else 0.0)
        return min((1.0 + (self.factor - 1.0) * AIM) * unhindered - (now - self.t0),
                   (self.factor - 1.0) * unhindered - held)

    def _enter(self, nbytes: int) -> None:
        t = self.tier
        t.note(write=nbytes)
        now_ns = time.time_ns()
        readers, last_read = t.read_state()
        recent = readers > 0 or now_ns - last_read < RECENT_S * 1e9
        with self.cond:
            now = time.monotonic()
            if not self.t0:
                self.t0 = self.last = now
            probing = not self.tier.write_rate and (self.free_s < self.tier.probe_s or not self.free_bytes)
            free = not recent or probing
            if self.last_free and free:  # bytes completed over time while unhindered: the rate
                self.free_s += now - self.last
                self.free_bytes += self.done - self.free_mark
            self.last, self.last_free, self.free_mark = now, free, self.done
            self.written += nbytes
            if not free:
                start = now
                while True:
                    readers, _ = t.read_state() if now > start else (readers, 0)
                    busy = readers > 0 or self.inflight >= READ_CAP
                    left = self._slack(now)
                    if not busy or left <= 0:
                        break
                    if now == start:  # held from here: wall time while any write of this save is held
                        if not self.holding:
                            self.hold_t0 = now
                            t._bump(pacing=1)
                        self.holding += 1
                    self.cond.wait(min(STEP_S, left))
                    now = time.monotonic()
                if now > start:
                    self.waits += 1
                    self.holding -= 1
                    if not self.holding:
                        held = now - self.hold_t0
                        self.delayed_s += held
                        t._bump(pacing=-1, paced_ns=int(held * 1e9), pace_waits=1)
            self.inflight += 1

    def _exit(self, nbytes: int) -> None:
        with self.cond:
            self.inflight -= 1
            self.done += nbytes
            self.cond.notify()

    @contextmanager
    def write(self, nbytes: int) -> Iterator[None]:
        """Around one write of ``nbytes``: held back first when readers wait (see the class doc).

        The write is not flushed on its own: an ``fdatasync`` after each paced write (to keep a
        device's write-back cache from burying reads at the final fsync) was measured to hurt the
        reads it meant to help (KV get p99 during a flush 1.61x idle with it, 1.10x without, and the
        save 1.44x its idle time instead of 1.22x; ``benchmarks/bench_tier.py``, docs/TIER.md)."""
        self._enter(nbytes)
        try:
            yield
        finally:
            self._exit(nbytes)

    def pace(self, nbytes: int) -> None:
        """Just before a write of ``nbytes`` (no in-flight cap: the write's end is not seen)."""
        self._enter(nbytes)
        self._exit(nbytes)

    def close(self) -> None:
        """The save's writes are done (idempotent)."""
        if not self.closed:
            self.closed = True
            took = time.monotonic() - self.t0 if self.t0 else 0.0
            if took > 0.01 and self.written:  # the next save starts from the fastest save's rate, sync included
                self.tier.write_rate = max(self.tier.write_rate, self.written / took)
            self.tier._bump(writers=-1)


class LoadPacer:
    """Paces one weight load's reads for KV gets, within its bound (:meth:`Tier.loader`).

    A KV get is the serving side's time to first token; a weight load is latency-critical too
    (checkpoint writes yield to both), but a get goes first. Before each read of the load
    (:meth:`read`, a context around it), while a KV get of any process runs, the read is held back
    (2 ms steps); the load's reads already in flight go on, so the device stays busy with the
    load while the get's requests pass the queue. The load is slowed only while it has nothing in
    flight and a read held (*stalled*); the stalled time is bounded by ``factor - 1`` times its
    time not stalled plus :data:`LOAD_GRACE_S` (``factor`` default 1.3): past it, the load reads
    at full speed. No rate needs to be known, so a process's first load is paced from its first
    read; the grace lets a short load wait out a get already running.

    Measured on the reference VM (mq-deadline, 8 MiB readahead): a 16 MiB KV get that starts
    during a cold 1 GiB load waited 0.3-0.5 s behind the load's sequential stream (the
    scheduler's read expiry); with this pacing the gets' p99 during the load is 75-126 ms, the
    load no slower (``benchmarks/bench_tier.py``, docs/TIER.md).

    While no KV get runs, a read costs one word per slot of the shared state and no lock: its
    ``inflight`` is not counted, so a later hold may count the load as stalled while such reads
    are still in flight (the bound is then reached sooner, never later).

    Thread-safe: the reader threads of one load share it. Attributes: ``delayed_s`` (wall
    seconds the load was stalled), ``waits`` (reads held), ``nread`` (bytes of the reads that
    were paced).
    """

    def __init__(self, tier: "Tier", factor: float):
        self.tier, self.factor = tier, factor
        self.t0 = 0.0
        self.delayed_s = 0.0
        self.waits = 0
        self.nread = 0
        self.inflight = 0
        self.holding = 0  # reads held now
        self.stall_t0 = 0.0  # since when the load is stalled (reads held, none in flight); 0: not
        self.cond = threading.Condition()

    def _mark(self, now: float) -> None:
        """Start or end the stalled interval after a change of ``holding`` / ``inflight``."""
        stalled = self.holding > 0 and self.inflight == 0
        if stalled and not self.stall_t0:
            self.stall_t0 = now
        elif not stalled and self.stall_t0:
            self.delayed_s += now - self.stall_t0
            self.stall_t0 = 0.0

    def _slack(self, now: float) -> float:
        """Seconds the load may still be stalled now (<= 0: at its bound)."""
        stalled = self.delayed_s + (now - self.stall_t0 if self.stall_t0 else 0.0)
        return (self.factor - 1.0) * (now - self.t0 - stalled + LOAD_GRACE_S) - stalled

    def _enter(self, nbytes: int) -> bool:
        """Before a read; False: no KV get runs and none of this load's reads is held, so the read
        goes at once without bookkeeping (the common case: one word per slot read, no lock)."""
        kv = self.tier.state.kv_gets()
        if not kv and not self.holding:
            return False
        with self.cond:
            now = time.monotonic()
            if not self.t0:
                self.t0 = now
            self.nread += nbytes
            if kv and self._slack(now) > 0:
                self.waits += 1
                self.holding += 1
                self._mark(now)
                while kv and self._slack(now) > 0:
                    self.cond.wait(min(STEP_S, max(self._slack(now), 0.0005)))
                    now = time.monotonic()
                    kv = self.tier.state.kv_gets()
                self.holding -= 1
            self.inflight += 1
            self._mark(now)
        return True

    def _exit(self) -> None:
        with self.cond:
            self.inflight -= 1
            self._mark(time.monotonic())
            self.cond.notify_all()

    @contextmanager
    def read(self, nbytes: int) -> Iterator[None]:
        """Around one read of ``nbytes`` of the load: held back first while KV gets run (see the class doc)."""
        counted = self._enter(nbytes)
        try:
            yield
        finally:
            if counted:
                self._exit()

    def run(self, nbytes: int, fn: Callable, *args, **kw) -> None:
        """``fn(*args, **kw)``, a read of ``nbytes``, inside :meth:`read` (what a reader thread runs)."""
        with self.read(nbytes):
            fn(*args, **kw)

    def close(self) -> None:
        """The load's reads are done (nothing to release; for symmetry with the other pacers)."""


class BackgroundPacer:
    """Lets background work yield to readers and checkpoint writers (see :meth:`Tier.background`)."""

    def __init__(self, tier: "Tier", max_wait_s: float):
        self.tier, self.max_wait_s = tier, max_wait_s
        self.waited_s = 0.0
        tier._bump(background=1)

    def pace(self, nbytes: int = 0) -> None:
        """Call before each piece of background I/O: waits while others read or write (bounded)."""
        t = self.tier
        if nbytes:
            t.note(read=nbytes)
        start = time.monotonic()
        while t.busy() and time.monotonic() - start < self.max_wait_s:
            time.sleep(STEP_S * 5)
        cur = time.monotonic() - start
        if cur > 0.0005:
            self.waited_s += cur
            t._bump(bg_waited_ns=int(cur * 1e9))

    def close(self) -> None:
        """The background job is done."""
        self.tier._bump(background=-1)


class Tier:
    """This process's membership of one tier (one per tier and process: use :func:`tier_for`).

    Args:
        name: the tier's name (:func:`~.state.tier_name`).
        path: its shared state file.

    Raises:
        OSError: the shared state cannot be created or mapped, or has no free slot.
    """

    enabled = True

    def __init__(self, name: str, path: str):
        self.name, self.path = name, path
        self.state = SharedState(path)
        self.factor = _env_float("FASTCKPT_TIER_FACTOR", DEFAULT_FACTOR)
        self.evict_wait_s = _env_float("FASTCKPT_TIER_EVICT_WAIT_S", EVICT_WAIT_S)
        self.probe_s = _env_float("FASTCKPT_TIER_PROBE_S", PROBE_S)
        self.lock = threading.RLock()
        self.evictors: list[Callable[[int], int]] = []
        self.write_rate = 0.0  # unhindered write rate of this process's last save, bytes/s (0: unknown)
        self.pid = -1
        self.idx = -1
        self.slot = Slot()
        self._stop = threading.Event()
        self._join()
        env_budget = os.environ.get("FASTCKPT_TIER_BUDGET_BYTES")
        if env_budget:
            self.set_budget(int(env_budget))
        atexit.register(self.leave)

    # ----- membership --------------------------------------------------------------------
    def _join(self) -> None:
        self._stop.set()  # the heartbeat of an earlier membership (before a fork or leave) ends
        with self.lock:
            with self.state.locked():
                self.idx = self.state.take_slot()
            self.pid = os.getpid()
            self.slot = self.state.slot(self.idx)
            if self.evictors:
                self.slot.evictor = 1
                self.state.write_slot(self.idx, self.slot)
            self._stop = threading.Event()
            threading.Thread(target=self._heartbeat, args=(self._stop,), name="fastckpt-tier", daemon=True).start()

    def _own(self) -> Slot:
        """This process's slot (rejoins after a fork or after :meth:`leave`)."""
        if self.pid != os.getpid() or self.idx < 0:
            self._join()
        return self.slot

    def _bump(self, **deltas: int) -> None:
        """Add ``deltas`` to fields of this process's slot."""
        with self.lock:
            s = self._own()
            for k, v in deltas.items():
                setattr(s, k, max(0, getattr(s, k) + v))
            self.state.write_slot(self.idx, s)

    def _heartbeat(self, stop: threading.Event) -> None:
        while not stop.wait(HEARTBEAT_S):
            try:
                with self.lock:
                    if self.pid != os.getpid():
                        return
                    s = self.slot
                    if self.state.slot(self.idx).pid != self.pid:  # freed as dead (we were stopped too long)
                        with self.state.locked():
                            self.idx = self.state.take_slot()
                        claims = s.claims
                        self.slot = s = self.state.slot(self.idx)
                        s.claims, s.evictor = claims, int(bool(self.evictors))
                    s.heartbeat_ns = time.time_ns()
                    self._roll(s, s.heartbeat_ns)
                    self.state.write_slot(self.idx, s)
                if self.evictors and self.over() > 0:
                    self._evict(self.over())
            except Exception as e:  # never let the heartbeat die silently
                logger.warning("fastckpt tier %s: heartbeat: %s", self.name, e)

    def leave(self) -> None:
        """Free this process's slot (at exit; claims and counters stop counting at once)."""
        self._stop.set()
        with self.lock:
            if self.pid == os.getpid() and self.idx >= 0:
                try:
                    with self.state.locked():
                        if self.state.slot(self.idx).pid == self.pid:
                            self.state.write_slot(self.idx, Slot())
                except (OSError, ValueError):
                    pass
                self.idx = -1

    # ----- bandwidth ---------------------------------------------------------------------
    @staticmethod
    def _roll(s: Slot, now_ns: int) -> None:
        dt = (now_ns - s.win_t0_ns) / 1e9
        if dt >= RATE_WINDOW_S:
            s.read_bps, s.write_bps = s.win_read / dt, s.win_write / dt
            s.win_read = s.win_write = 0
            s.win_t0_ns = now_ns

    def note(self, read: int = 0, write: int = 0) -> None:
        """Count bytes read / written on the tier (for the recent-bandwidth figures)."""
        with self.lock:
            s = self._own()
            s.read_bytes += read
            s.write_bytes += write
            s.win_read += read
            s.win_write += write
            self._roll(s, time.time_ns())
            self.state.write_slot(self.idx, s)

    def readers_waiting(self) -> int:
        """Latency-critical reads running now, in every live process of the tier."""
        return sum(s.readers for _, s in self.state.live())

    def read_state(self) -> tuple[int, int]:
        """``(reads running now, time.time_ns() when the last one ended)`` over the tier's live processes."""
        live = self.state.live()
        return sum(s.readers for _, s in live), max((s.last_read_ns for _, s in live), default=0)

    def busy(self) -> bool:
        """True while any live process reads latency-critically or writes a checkpoint."""
        return any(s.readers or s.writers for _, s in self.state.live())

    @contextmanager
    def reading(self, nbytes: int = 0, kv: bool = False) -> Iterator[None]:
        """A latency-critical read: checkpoint writes are paced while it runs; with ``kv`` (a KV
        get) weight loads are paced too (:class:`LoadPacer`)."""
        self.begin_read(kv)
        try:
            yield
        finally:
            self.end_read(nbytes, kv)

    def begin_read(self, kv: bool = False) -> None:
        """Start a latency-critical read, a KV get if ``kv`` (pair with :meth:`end_read`; :meth:`reading` does both)."""
        self._bump(readers=1, kv_readers=int(kv))

    def end_read(self, nbytes: int = 0, kv: bool = False) -> None:
        """End a read started by :meth:`begin_read` (same ``kv``), which read ``nbytes``."""
        with self.lock:
            self._own().last_read_ns = time.time_ns()
            self._bump(readers=-1, kv_readers=-int(kv))
        if nbytes:
            self.note(read=nbytes)

    def writer(self) -> WritePacer:
        """A pacer for one checkpoint's writes; call its ``close`` when the writes are done."""
        return WritePacer(self, self.factor)

    def loader(self) -> "LoadPacer":
        """A pacer for one weight load's reads (:class:`LoadPacer`); call its ``close`` when they are done."""
        return LoadPacer(self, self.factor)

    def checkpoint(self, folder: str, nbytes: int, cls: str = "checkpoints") -> CheckpointWrites:
        """Claim ``nbytes`` for a save into ``folder`` (stored under its parent) and pace its writes.

        Raises:
            TierFullError: see :meth:`claim`.
        """
        claim = self.claim(cls, nbytes, os.path.dirname(os.path.abspath(folder))) if nbytes else None
        return CheckpointWrites(claim, self.writer())

    def background(self, max_wait_s: float = 5.0) -> BackgroundPacer:
        """A pacer for background work (deferred copies, verification, prune); ``close`` it when done.

        Args:
            max_wait_s: the longest one ``pace`` call yields, in seconds (default 5).
        """
        return BackgroundPacer(self, max_wait_s)

    # ----- capacity ----------------------------------------------------------------------
    def set_budget(self, nbytes: int) -> None:
        """Set the tier's shared capacity budget in bytes (0: none) for every process.

        Raises:
            InvalidArgumentError: ``nbytes`` is not an int in ``[0, 2**63)``.
        """
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes < 1 << 63:
            raise InvalidArgumentError(f"tier {self.name}: budget {nbytes!r} is not a byte count >= 0 "
                                       "(0: no budget; e.g. 2000000000000 or, on the command line, 2TB)")
        with self.state.locked():
            self.state.set_budget(nbytes)

    def _totals(self) -> tuple[int, list[int], list[int]]:
        """``(budget, stored per class, claimed per class)`` now (live claims only)."""
        claims = [0, 0, 0]
        for _, s in self.state.live():
            for c in range(3):
                claims[c] += s.claims[c]
        return self.state.budget(), self.state.used_by_class(), claims

    def over(self) -> int:
        """Bytes by which stored plus claimed bytes exceed the budget now (0 if within or no budget)."""
        budget, used, claims = self._totals()
        return max(0, sum(used) + sum(claims) - budget) if budget else 0

    def _full(self, cls: int, need: int, budget: int, used: list[int], claims: list[int], why: str,
              root: str = "") -> TierFullError:
        parts = ", ".join(f"{c} {used[i]} stored + {claims[i]} claimed" for i, c in enumerate(CLASSES))
        where = f" (writing under {root})" if root else ""
        return TierFullError(
            f"tier {self.name}: {need} more bytes of {CLASSES[cls]}{where} do not fit its budget of {budget} bytes "
            f"({parts}; {why}); raise the budget (`fastckpt tier PATH --budget BYTES` or "
            "FASTCKPT_TIER_BUDGET_BYTES), prune checkpoints or remove exported models",
            cls=CLASSES[cls], need=need, budget=budget, used=dict(zip(CLASSES, used)),
            claimed=dict(zip(CLASSES, claims)))

    def claim(self, cls: str, nbytes: int, root: str) -> Claim:
        """Claim ``nbytes`` of the budget for a checkpoint or model written under folder ``root``.

        If they do not fit, KV stores evict chunks for them (this call waits up to
        ``$FASTCKPT_TIER_EVICT_WAIT_S``, default 10 s, for that; a KV tier nobody evicts then is
        passed over with a warning: a checkpoint never fails because KV filled the tier).

        Args:
            cls: ``"checkpoints"`` or ``"models"``.
            nbytes: bytes the write will add.
            root: the folder whose stored bytes the claim becomes (:meth:`Claim.settle`).

        Raises:
            TierFullError: checkpoints and models (stored and claimed) leave less than ``nbytes``
                of the budget, whatever KV holds.
        """
        c = CLASSES.index(cls)
        if c == KV:
            raise ValueError("KV puts reserve through reserve_kv(), which evicts their own chunks first")
        for attempt in range(2):
            with self.lock:
                self._own()
                with self.state.locked():
                    budget, used, claims = self._totals()
                    others = sum(used) + sum(claims) - used[KV] - claims[KV]
                    fits = not budget or others + nbytes <= budget
                    if fits:
                        self.slot.claims[c] += nbytes
                        self.state.write_slot(self.idx, self.slot)
            if fits:
                break
            if attempt or not self.recount():  # what the counts say is on disk: a folder removed by hand
                why = ("the write alone is larger than the whole budget" if nbytes > budget else
                       "checkpoints and models alone exceed it, counted from disk, so evicting KV chunks cannot "
                       "make room")
                raise self._full(c, nbytes, budget, used, claims, why, root=root)
        if self.over() > 0:
            self._make_room()
        return Claim(self, c, nbytes, root)

    def recount(self) -> int:
        """Lower the stored bytes of every checkpoints / models folder to what is on disk now (a
        checkpoint or export removed by hand, not by retention or ``fastckpt prune``, stays counted
        otherwise); returns the bytes no longer counted. What a folder holds: the
        ``*.safetensors`` files (each inode once) in its sub-folders but hidden ones (uncommitted
        saves are counted by their claims); a folder gone holds nothing. Counts are only lowered,
        never raised (files another tool wrote there were never counted), and by the difference
        measured, so bytes a commit adds meanwhile stay counted. A counted folder nested in another
        (``run/`` under ``ckpt/``) is counted in itself only. The walk holds no lock."""
        cut = overcounted([(c, path, used) for _, c, path, used, _ in self.state.roots()])
        if cut:
            with self.state.locked():
                for (c, path), d in cut.items():
                    self.state.set_root(c, path, delta=-d)
        return sum(cut.values())

    def _make_room(self) -> None:
        """Wait (bounded) while KV stores evict for a claim; evict with this process's stores first."""
        self._evict(self.over())
        deadline = time.monotonic() + self.evict_wait_s
        while self.over() > 0 and time.monotonic() < deadline:
            if not any(s.evictor for _, s in self.state.live()):
                break
            time.sleep(0.02)
        over = self.over()
        if over > 0:
            logger.warning("fastckpt tier %s: over its budget by %d bytes: no KV store evicted for the checkpoint "
                           "within %.0f s; the checkpoint goes ahead (the next KV put evicts)", self.name, over,
                           self.evict_wait_s)

    def _evict(self, nbytes: int) -> int:
        freed = 0
        for fn in list(self.evictors):
            if freed >= nbytes:
                break
            try:
                freed += fn(nbytes - freed)
            except Exception as e:
                logger.warning("fastckpt tier %s: KV eviction failed: %s", self.name, e)
        return freed

    def reserve_kv(self, nbytes: int, evict: Callable[[int], int]) -> Claim:
        """Reserve ``nbytes`` for a KV put, evicting with ``evict(bytes) -> freed bytes`` while they do not fit.

        Raises:
            TierFullError: the KV chunks ``evict`` can remove do not make room (checkpoints and
                models hold the rest of the budget).
        """
        while True:
            with self.lock:
                self._own()
                with self.state.locked():
                    budget, used, claims = self._totals()
                    short = sum(used) + sum(claims) + nbytes - budget if budget else 0
                    if short > 0 and sum(used) + sum(claims) - used[KV] - claims[KV] + nbytes > budget:
                        raise self._full(KV, nbytes, budget, used, claims,
                                         "checkpoints and models hold the rest; they are never evicted for KV")
                    if short <= 0:
                        self.slot.claims[KV] += nbytes
                        self.state.write_slot(self.idx, self.slot)
                        return Claim(self, KV, nbytes, "")
            if evict(short) <= 0:
                raise self._full(KV, nbytes, budget, used, claims, "no KV chunk of this store can be evicted")

    def _settle(self, claim: Claim, stored: int | None) -> None:
        with self.lock:
            self._own()
            with self.state.locked():
                self.slot.claims[claim.cls] = max(0, self.slot.claims[claim.cls] - claim.nbytes)
                self.state.write_slot(self.idx, self.slot)
                if stored and claim.root:
                    self.state.set_root(claim.cls, claim.root, delta=stored)

    def publish(self, cls: str, root: str, used: int) -> None:
        """Record that folder ``root`` of class ``cls`` holds ``used`` bytes now (a KV store's counter)."""
        with self.state.locked():
            self.state.set_root(CLASSES.index(cls), root, used=used)

    def add_stored(self, cls: str, root: str, delta: int) -> None:
        """Add ``delta`` bytes (negative: removed) to what folder ``root`` of class ``cls`` holds."""
        with self.state.locked():
            self.state.set_root(CLASSES.index(cls), root, delta=delta)

    def add_evictor(self, fn: Callable[[int], int]) -> None:
        """Register ``fn(bytes) -> freed bytes``, which evicts KV chunks while the tier is over budget."""
        with self.lock:
            self.evictors.append(fn)
            self._bump(evictor=1 - self._own().evictor)

    def remove_evictor(self, fn: Callable[[int], int]) -> None:
        """Undo :meth:`add_evictor`."""
        with self.lock:
            if fn in self.evictors:
                self.evictors.remove(fn)
            if not self.evictors:
                self._bump(evictor=-self._own().evictor)


class NullTier:
    """No arbitration (the shared state could not be created, or ``FASTCKPT_TIER=off``): same calls, no effect."""

    enabled = False
    name = "off"

    class _Pacer:
        delayed_s = waited_s = 0.0
        waits = 0

        def pace(self, nbytes: int = 0) -> None:
            """No pacing."""

        @contextmanager
        def write(self, nbytes: int = 0) -> Iterator[None]:
            """No pacing."""
            yield

        def close(self) -> None:
            """Nothing to close."""

        @contextmanager
        def read(self, nbytes: int = 0) -> Iterator[None]:
            """No pacing."""
            yield

        def run(self, nbytes: int, fn: Callable, *args, **kw) -> None:
            """``fn(*args, **kw)``, unpaced."""
            fn(*args, **kw)

    @contextmanager
    def reading(self, nbytes: int = 0, kv: bool = False) -> Iterator[None]:
        """No announcement."""
        yield

    def begin_read(self, kv: bool = False) -> None:
        """No announcement."""

    def end_read(self, nbytes: int = 0, kv: bool = False) -> None:
        """No announcement."""

    def loader(self) -> "NullTier._Pacer":
        """A pacer that never waits."""
        return NullTier._Pacer()

    def checkpoint(self, folder: str, nbytes: int, cls: str = "checkpoints") -> CheckpointWrites:
        """Writes that are neither claimed nor paced."""
        return CheckpointWrites(None, NullTier._Pacer())

    def writer(self) -> "NullTier._Pacer":
        """A pacer that never waits."""
        return NullTier._Pacer()

    def background(self, max_wait_s: float = 5.0) -> "NullTier._Pacer":
        """A pacer that never waits."""
        return NullTier._Pacer()

    def note(self, read: int = 0, write: int = 0) -> None:
        """Nothing counted."""

    def claim(self, cls: str, nbytes: int, root: str) -> Claim:
        """A claim that counts nothing."""
        return Claim(None, CLASSES.index(cls), nbytes, root)

    def reserve_kv(self, nbytes: int, evict: Callable[[int], int]) -> Claim:
        """A claim that counts nothing."""
        return Claim(None, KV, nbytes, "")

    def publish(self, cls: str, root: str, used: int) -> None:
        """Nothing recorded."""

    def add_stored(self, cls: str, root: str, delta: int) -> None:
        """Nothing recorded."""

    def add_evictor(self, fn: Callable[[int], int]) -> None:
        """Nothing registered."""

    def remove_evictor(self, fn: Callable[[int], int]) -> None:
        """Nothing registered."""

    def over(self) -> int:
        """Never over a budget."""
        return 0


NULL = NullTier()
#: What a save holds before it knows its folder (no claim, no pacing).
NO_WRITES = CheckpointWrites(None, NullTier._Pacer())
#: One membership per (process, state file); a process-wide registry by necessity: every save,
#: load and KV store of the process on one tier must share one slot and one heartbeat.
_TIERS: dict[str, Tier | NullTier] = {}
_TIERS_LOCK = threading.Lock()


def tier_for(path: str | os.PathLike) -> Tier | NullTier:
    """This process's membership of the tier that ``path`` lies on (joined on first use).

    The tier is named by ``$FASTCKPT_TIER`` when set (one tier spanning several mounts;
    ``off`` switches arbitration off), else by the device of ``path``. Its state lives under
    ``$FASTCKPT_TIER_DIR`` (default ``/dev/shm``). A state that cannot be created gives
    :class:`NullTier` (no arbitration) and one warning per process and state file; never an error.
    """
    if arbitration_off():
        return NULL
    try:
        name = tier_name(path)
    except OSError:
        return NULL
    sp = state_path(name)
    t = _TIERS.get(sp)
    if t is not None:
        return t
    with _TIERS_LOCK:
        t = _TIERS.get(sp)
        if t is None:
            try:
                t = Tier(name, sp)
            except OSError as e:
                msg = (f"fastckpt: tier {name}: its shared state {sp} cannot be created or opened ({e}); "
                       "this process does not arbitrate bandwidth or capacity with others on the tier. Set "
                       "FASTCKPT_TIER_DIR to a writable folder shared by them (default /dev/shm)")
                warnings.warn(msg, RuntimeWarning, stacklevel=2)  # the one warning (printed once per place)
                t = NULL
            _TIERS[sp] = t
    return t
