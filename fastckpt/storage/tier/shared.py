"""The shared state of one tier: a small file mapped by every process that uses the tier.

Layout (little-endian, fixed size :data:`STATE_BYTES`)::

    header   magic "FCKTIER2", version, slot count, budget bytes (0: none), created (unix ns)
    roots    ROOTS x (path hash, class, used bytes, updated unix ns, path)   what is stored, per folder
    slots    SLOTS x one participant: pid, host, process start, heartbeat, claims per class,
             active reads / writes / background jobs, byte counters, recent rates, pacing counters

Rules:

* A process writes only its own slot (under its in-process lock); anyone reads any slot without
  a lock (fields are 8-byte aligned words: a read sees the old or the new value).
* Taking or freeing a slot, claiming capacity and changing a root's usage happen under
  ``flock(2)`` on the file; the section computes sums and writes a few words, never does I/O on
  the tier (no lock is held across I/O).
* A slot counts only while its owner lives: its heartbeat is younger than :data:`TTL_S`, and on
  this host its pid exists with the same start time. A SIGKILLed process's claims, readers and
  writers stop counting within ``TTL_S`` (at once on this host, where its pid is gone).

The file lives under ``$FASTCKPT_TIER_DIR`` (default ``/dev/shm``), named after the tier:
``$FASTCKPT_TIER`` when set (one tier spanning several mounts), else the device of the path.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import socket
import struct
import time
import zlib
from dataclasses import dataclass, field

#: Storage classes sharing one capacity budget, in the order KV yields to the others.
CLASSES = ("checkpoints", "models", "kv")
MAGIC = b"FCKTIER2"  # 2: KV gets counted apart (kv_readers)
VERSION = 2
ROOTS = 64
SLOTS = 128
#: A participant whose heartbeat is older than this no longer counts, in seconds.
TTL_S = 3.0
#: How often a participant refreshes its heartbeat, in seconds.
HEARTBEAT_S = 0.25
#: Window of the "recent bandwidth" figures, seconds.
RATE_WINDOW_S = 1.0

_HDR = struct.Struct("<8sIIQQ")
_ROOT = struct.Struct("<QIIQQ216s")  # hash, class, pad, used, updated ns, path (utf-8, truncated)
_SLOT = struct.Struct("<IIQQQ3QIIIIQQddQQQQQQQII")
_KV_WORD = _SLOT.size // 4 - 1  # kv_readers, the slot's last 4-byte word (SharedState.kv_gets reads it alone)
assert _SLOT.size % 4 == 0  # slots() reads every pid through a 4-byte view
_HDR_OFF = 0
_ROOTS_OFF = 4096
_SLOTS_OFF = _ROOTS_OFF + ROOTS * _ROOT.size
STATE_BYTES = _SLOTS_OFF + SLOTS * _SLOT.size
_HOST = zlib.crc32(socket.gethostname().encode()) or 1


@dataclass
class Slot:
    """One participant's words in the shared state (see the module docstring).

    Attributes:
        pid: process id (0: free slot). host: crc32 of the host name. start: the process's start
        time in clock ticks (``/proc/PID/stat``; 0 where unknown). heartbeat_ns: last refresh
        (``time.time_ns()``). claims: bytes claimed and not yet stored, per class of
        :data:`CLASSES`. readers / writers / background: latency-critical reads, checkpoint
        writes and background jobs running now. evictor: 1 if the process can evict KV chunks.
        read_bytes / write_bytes: bytes read / written since the process joined.
        read_bps / write_bps: rate over the last window, bytes per second.
        win_t0_ns / win_read / win_write: the current window. paced_ns: time checkpoint writes
        were held back for readers. pace_waits: how many times. bg_waited_ns: time background
        work yielded. last_read_ns: when the last latency-critical read ended (``time.time_ns()``).
        pacing: 1 while a write is held back now.
        kv_readers: the KV gets among ``readers`` (weight loads yield to them).
    """

    pid: int = 0
    host: int = 0
    start: int = 0
    heartbeat_ns: int = 0
    created_ns: int = 0
    claims: list = field(default_factory=lambda: [0, 0, 0])
    readers: int = 0
    writers: int = 0
    background: int = 0
    evictor: int = 0
    read_bytes: int = 0
    write_bytes: int = 0
    read_bps: float = 0.0
    write_bps: float = 0.0
    win_t0_ns: int = 0
    win_read: int = 0
    win_write: int = 0
    paced_ns: int = 0
    pace_waits: int = 0
    bg_waited_ns: int = 0
    last_read_ns: int = 0
    pacing: int = 0
    kv_readers: int = 0

    def pack(self) -> bytes:
        """The slot's bytes."""
        return _SLOT.pack(self.pid, self.host, self.start, self.heartbeat_ns, self.created_ns, *self.claims,
                          self.readers, self.writers, self.background, self.evictor, self.read_bytes,
                          self.write_bytes, self.read_bps, self.write_bps, self.win_t0_ns, self.win_read,
                          self.win_write, self.paced_ns, self.pace_waits, self.bg_waited_ns, self.last_read_ns,
                          self.pacing, self.kv_readers)

    @classmethod
    def unpack(cls, raw: bytes | memoryview) -> "Slot":
        """A slot from its bytes."""
        return cls.of(_SLOT.unpack(raw))

    @classmethod
    def of(cls, v: tuple) -> "Slot":
        """A slot from its unpacked values (``_SLOT`` order)."""
        return cls(v[0], v[1], v[2], v[3], v[4], list(v[5:8]), *v[8:])


def process_start(pid: int) -> int:
    """Start time of process ``pid`` in clock ticks since boot (0 if unknown or gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        return int(raw[raw.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def alive(s: Slot, now_ns: int | None = None, strict: bool = False) -> bool:
    """True while slot ``s``'s owner counts: fresh heartbeat and, on this host, its pid exists
    (``strict``: and has the same start time, i.e. was not reused)."""
    if s.pid == 0:
        return False
    now_ns = time.time_ns() if now_ns is None else now_ns
    if now_ns - s.heartbeat_ns > TTL_S * 1e9:
        return False
    if s.host == _HOST:
        if s.pid == os.getpid():
            return True
        try:
            os.kill(s.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        if strict and s.start and process_start(s.pid) not in (0, s.start):
            return False  # the pid was reused by another process
    return True


def arbitration_off() -> bool:
    """True when ``$FASTCKPT_TIER`` switches arbitration off (``off``, ``0``, ``none`` or ``false``)."""
    return os.environ.get("FASTCKPT_TIER", "").strip().lower() in ("off", "0", "none", "false")


def tier_name(path: str | os.PathLike) -> str:
    """The name of the tier ``path`` lies on: ``$FASTCKPT_TIER`` if set, else ``dev-MAJOR-MINOR``
    of the nearest existing folder of ``path``."""
    env = os.environ.get("FASTCKPT_TIER", "").strip()
    if env and not arbitration_off():
        return re.sub(r"[^A-Za-z0-9_.-]", "_", env)[:64]
    p = os.path.abspath(os.fspath(path))
    while True:
        try:
            st = os.stat(p)
            break
        except (FileNotFoundError, NotADirectoryError):
            parent = os.path.dirname(p)
            if parent == p:
                raise
            p = parent
    return f"dev-{os.major(st.st_dev)}-{os.minor(st.st_dev)}"


def state_path(name: str) -> str:
    """Where the shared state of tier ``name`` lives (``$FASTCKPT_TIER_DIR``, default ``/dev/shm``)."""
    base = os.environ.get("FASTCKPT_TIER_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    return os.path.join(base, f"fastckpt-tier-{name}")


def root_hash(path: str) -> int:
    """64-bit key of a folder path in the roots table (0 is never returned)."""
    import xxhash
    return xxhash.xxh3_64_intdigest(os.path.abspath(path).encode()) or 1


class SharedState:
    """The mapped state file of one tier.

    Args:
        path: the state file (created with ``0o666`` permissions, so every user of the host can
            join, if missing).
        writable: open for writing (a participant); False: read-only (``fastckpt tier``).

    Raises:
        OSError: the file cannot be created, opened or mapped (the caller falls back to no
            arbitration).
    """

    def __init__(self, path: str, writable: bool = True):
        self.path = path
        self.writable = writable
        flags = os.O_RDWR | os.O_CREAT if writable else os.O_RDONLY
        if writable:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)  # $FASTCKPT_TIER_DIR may be new
        old = os.umask(0) if writable else None
        try:
            self.fd = os.open(path, flags, 0o666)
        finally:
            if old is not None:
                os.umask(old)
        try:
            if writable:
                with self.locked():
                    if os.fstat(self.fd).st_size < STATE_BYTES:
                        os.ftruncate(self.fd, STATE_BYTES)
                    self.mm = mmap.mmap(self.fd, STATE_BYTES)
                    magic = bytes(self.mm[:8])
                    if magic != MAGIC:
                        self.mm[:STATE_BYTES] = bytes(STATE_BYTES)
                        _HDR.pack_into(self.mm, _HDR_OFF, MAGIC, VERSION, SLOTS, 0, time.time_ns())
            else:
                if os.fstat(self.fd).st_size < STATE_BYTES:
                    raise OSError(f"{path}: not a tier state ({os.fstat(self.fd).st_size} bytes)")
                self.mm = mmap.mmap(self.fd, STATE_BYTES, prot=mmap.PROT_READ)
                if bytes(self.mm[:8]) != MAGIC:
                    raise OSError(f"{path}: not a tier state (magic {bytes(self.mm[:8])!r})")
        except BaseException:
            os.close(self.fd)
            raise

    def locked(self):
        """``flock`` on the state file as a context manager (short sections only, never across I/O)."""
        fd = self.fd

        class _Ctx:
            def __enter__(self):
                fcntl.flock(fd, fcntl.LOCK_EX)

            def __exit__(self, *exc):
                fcntl.flock(fd, fcntl.LOCK_UN)

        return _Ctx()

    # ----- header --------------------------------------------------------------------
    def budget(self) -> int:
        """The shared capacity budget in bytes (0: none set)."""
        return _HDR.unpack_from(self.mm, _HDR_OFF)[3]

    def set_budget(self, nbytes: int) -> None:
        """Set the shared budget (bytes, 0 = none); caller holds the lock."""
        magic, ver, n, _, created = _HDR.unpack_from(self.mm, _HDR_OFF)
        _HDR.pack_into(self.mm, _HDR_OFF, magic, ver, n, int(nbytes), created)

    # ----- slots ---------------------------------------------------------------------
    def slot(self, i: int) -> Slot:
        """Slot ``i`` as it is now (no lock)."""
        off = _SLOTS_OFF + i * _SLOT.size
        return Slot.unpack(self.mm[off:off + _SLOT.size])

    def write_slot(self, i: int, s: Slot) -> None:
        """Write slot ``i`` (its owner, or under the lock when taking or freeing it)."""
        if not 0 <= i < SLOTS:
            raise IndexError(f"{self.path}: no slot {i} (0..{SLOTS - 1})")
        _SLOT.pack_into(self.mm, _SLOTS_OFF + i * _SLOT.size, *_SLOT.unpack(s.pack()))

    def slots(self) -> list[tuple[int, Slot]]:
        """Every used slot ``(index, slot)``, live or not."""
        region = memoryview(self.mm)[_SLOTS_OFF:_SLOTS_OFF + SLOTS * _SLOT.size]
        try:  # every slot's pid (its first 4 bytes) in one step: a paced writer asks before every write
            pids = region.cast("I")[::_SLOT.size // 4]
            used = [i for i, pid in enumerate(pids.tolist()) if pid]
            pids.release()
        finally:
            region.release()
        return [(i, self.slot(i)) for i in used]

    def kv_gets(self) -> int:
        """KV gets running now over the live slots. Cheap when none runs (a weight load asks before
        every read request): one 4-byte word per slot is read; only slots with a get are unpacked."""
        region = memoryview(self.mm)[_SLOTS_OFF:_SLOTS_OFF + SLOTS * _SLOT.size]
        try:
            words = region.cast("I")[_KV_WORD::_SLOT.size // 4]
            busy = [i for i, n in enumerate(words.tolist()) if n]
            words.release()
        finally:
            region.release()
        if not busy:
            return 0
        now_ns = time.time_ns()
        return sum(s.kv_readers for s in map(self.slot, busy) if alive(s, now_ns))

    def live(self, now_ns: int | None = None) -> list[tuple[int, Slot]]:
        """The slots whose owners count now (:func:`alive`)."""
        now_ns = time.time_ns() if now_ns is None else now_ns
        return [(i, s) for i, s in self.slots() if alive(s, now_ns)]

    def take_slot(self) -> int:
        """Take a slot for this process (caller holds the lock); frees dead ones first.

        Raises:
            OSError: every slot is held by a live process.
        """
        now = time.time_ns()
        free = None
        for i in range(SLOTS):
            s = self.slot(i)
            if s.pid and not alive(s, now, strict=True):
                self.write_slot(i, Slot())
                s = Slot()
            if not s.pid and free is None:
                free = i
        if free is None:
            raise OSError(f"{self.path}: all {SLOTS} participant slots are held by live processes")
        self.write_slot(free, Slot(pid=os.getpid(), host=_HOST, start=process_start(os.getpid()),
                                   heartbeat_ns=now, created_ns=now, win_t0_ns=now))
        return free

    # ----- roots ---------------------------------------------------------------------
    def roots(self) -> list[tuple[int, int, str, int, int]]:
        """Every root ``(index, class index, path, used bytes, updated unix ns)``."""
        out = []
        for i in range(ROOTS):
            h, c, _, used, upd, raw = _ROOT.unpack_from(self.mm, _ROOTS_OFF + i * _ROOT.size)
            if h:
                out.append((i, c, raw.rstrip(b"\0").decode("utf-8", "replace"), used, upd))
        return out

    def used_by_class(self) -> list[int]:
        """Stored bytes per class of :data:`CLASSES`, summed over the roots."""
        used = [0, 0, 0]
        for _, c, _, u, _ in self.roots():
            if 0 <= c < len(CLASSES):
                used[c] += u
        return used

    def set_root(self, cls: int, path: str, used: int | None = None, delta: int = 0) -> None:
        """Set (``used``) or change (``delta``) the stored bytes of folder ``path`` of class ``cls``
        (caller holds the lock). A full table drops the least recently updated root."""
        h = root_hash(path)
        slot, oldest, oldest_t = None, 0, None
        for i in range(ROOTS):
            rh, c, _, u, upd, _ = _ROOT.unpack_from(self.mm, _ROOTS_OFF + i * _ROOT.size)
            if rh == h and c == cls:
                slot = i
                break
            if rh == 0 and slot is None:
                slot = i
            if oldest_t is None or upd < oldest_t:
                oldest, oldest_t = i, upd
        if slot is None:
            slot = oldest
        rh, c, _, u, _, _ = _ROOT.unpack_from(self.mm, _ROOTS_OFF + slot * _ROOT.size)
        cur = u if (rh == h and c == cls) else 0
        new = max(0, used if used is not None else cur + delta)
        _ROOT.pack_into(self.mm, _ROOTS_OFF + slot * _ROOT.size, h, cls, 0, new, time.time_ns(),
                        os.path.abspath(path).encode()[:216])

    def close(self) -> None:
        """Unmap and close."""
        try:
            self.mm.close()
        finally:
            os.close(self.fd)
