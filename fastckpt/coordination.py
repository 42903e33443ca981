"""Process-group coordination for multi-rank operations: a no-op in one process.

Coordination goes through the process group's key-value :class:`torch.distributed.Store`
(the one ``init_process_group`` created: TCPStore, FileStore...), never through
collectives. A background save thread can therefore wait for the other ranks while the
training loop runs its own ``all_reduce`` on the same group without any risk of the two
interleaving differently on different ranks (the deadlock a second collective stream would
cause).

Keys are named by the group (its global ranks) and the operation's target (e.g. the
checkpoint path), never by a process-wide counter, so a save on a subgroup does not shift the
keys of a later save on the world group. A :class:`Session` deletes its keys when every rank
has left it. Waits are bounded: the clock of a session starts when its first rank arrives
(``t0``, kept in the store), and a rank missing at the deadline is named in the error.

Call order of one :class:`Session` (every rank of the group, same order of calls):
``Coordinator.for_group(group)`` -> ``session(name, timeout_s)`` -> ``all_gather`` /
``publish`` / ``wait_for`` any number of times with distinct keys -> ``close()``.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from .errors import DistributedSaveError, SaveConflictError, StoreUnreachableError

#: Pass as ``process_group=`` to make explicit that a call runs in this process alone (the
#: default for saves without ``process_group`` too).
LOCAL = "local"

#: Seconds a multi-rank wait lasts when neither the call nor the process group names a timeout.
DEFAULT_TIMEOUT_S = 1800.0


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # torch built without distributed
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


def group_timeout_s(process_group: Any = None) -> float:
    """The timeout of ``process_group`` (``init_process_group(timeout=...)``) in seconds, or
    :data:`DEFAULT_TIMEOUT_S` when it cannot be read."""
    dist = _dist()
    if dist is None:
        return DEFAULT_TIMEOUT_S
    try:
        import torch
        group = process_group if process_group not in (None, LOCAL) else dist.group.WORLD
        return float(group._get_backend(torch.device("cpu")).options._timeout.total_seconds())
    except Exception:  # no CPU backend on the group, or the private API moved: the default
        return DEFAULT_TIMEOUT_S


def path_tag(path: str | os.PathLike) -> str:
    """16 hex digits naming an absolute path in store keys."""
    return hashlib.sha256(os.path.abspath(os.fspath(path)).encode()).hexdigest()[:16]


#: (group key, kind, tag) -> operations of that kind on that target made so far by this process.
_NUMBERED: dict[tuple[str, str, str], int] = {}
_NUMBERED_LOCK = threading.Lock()


def numbered_session(coord: "Coordinator", kind: str, tag: str) -> str:
    """Session name ``"{kind}/{tag}/{n}"`` for the n-th operation of ``kind`` on ``tag`` (e.g. a
    :func:`path_tag`) in ``coord``'s group. Every rank of the group makes the same calls in the same
    order, so every rank names the same session, whatever other groups and targets did meanwhile;
    a fresh name per operation means a retry never meets the keys of an earlier attempt."""
    key = (coord.group_key, kind, tag)
    with _NUMBERED_LOCK:
        n = _NUMBERED[key] = _NUMBERED.get(key, 0) + 1
    return f"{kind}/{tag}/{n}"


def forget_session(coord: "Coordinator", kind: str, tag: str) -> None:
    """Undo :func:`numbered_session` after an operation some rank never joined: the ranks that did not
    call it never counted it, so every rank's retry names the same session again."""
    key = (coord.group_key, kind, tag)
    with _NUMBERED_LOCK:
        _NUMBERED[key] = max(0, _NUMBERED.get(key, 0) - 1)


#: Session kinds (the part of a store key after the group) -> the operation they agree on.
_KINDS = {"save": "a multi-rank save (process_group=)", "dtensor-call": "a DTensor (FSDP2 / TP) save",
          "common": "a multi-rank load", "plain": "a plain save (no process_group=) claiming its path"}


def innermost_store(store: Any) -> Any:
    """The store under any :class:`GuardedStore` / ``PrefixStore`` wrappers of ``store``."""
    store = store.store if isinstance(store, GuardedStore) else store
    for _ in range(8):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    return store


def _store_address(store: Any) -> str:
    """``host:port`` of a TCPStore (under any PrefixStores), a FileStore's file, else the type's name."""
    store = innermost_store(store)
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    if host is not None and port is not None:
        return f"{host}:{port}"
    return getattr(store, "path", None) or type(store).__name__


class GuardedStore:
    """A ``torch.distributed.Store`` whose connection failures (torch's ``DistNetworkError``: the
    process hosting the store is gone) raise :class:`~fastckpt.errors.StoreUnreachableError` naming
    this rank, the store's address, the operation being agreed and what to check. Every other
    call and error passes through unchanged.

    Args:
        store: the process group's store.
        rank: this process's rank in the group.
        what: the operation, when the caller knows it better than the key does (e.g. with the path).
    """

    def __init__(self, store: Any, rank: int, what: str | None = None):
        self.store, self.rank, self.what = store, rank, what

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return attr(*args, **kwargs)
            except Exception as e:
                if type(e).__name__ != "DistNetworkError":
                    raise
                key = args[0] if args and isinstance(args[0], str) else \
                    (args[0][0] if args and isinstance(args[0], list) and args[0] else "")
                raise self.error(str(key), e) from e

        return call

    def error(self, key: str, e: BaseException) -> StoreUnreachableError:
        """The typed error of a failed store call on ``key``."""
        parts = key.split("/")
        kind = parts[2] if len(parts) > 2 and parts[0] == "fastckpt" else ""
        what = self.what or ("a DCP save (FastCkptWriter)" if len(parts) > 1 and parts[1].startswith("dcp-")
                             else _KINDS.get(kind, f"a multi-rank operation ({kind or 'unknown'})"))
        address = _store_address(self.store)
        return StoreUnreachableError(
            f"rank {self.rank}: the process group's store at {address} stopped answering ({type(e).__name__}: "
            f"{e}) while agreeing on {what} (store key {key!r}). The process hosting it is gone: under torchrun, "
            f"the torchrun agent (or rank 0) died or the job is shutting down. Check the other ranks' and the "
            f"agent's logs for the first failure, and that MASTER_ADDR:MASTER_PORT ({address}) is reachable "
            "from this node. Nothing was committed by this rank", rank=self.rank, address=address, what=what,
            key=key)


@dataclass(frozen=True)
class Coordinator:
    """This process's place in a group and the store used to coordinate it.

    Attributes:
        rank: rank inside the group (0-based).
        world_size: ranks in the group.
        store: a ``torch.distributed.Store`` shared by the group (``None`` in one process); from
            :meth:`for_group`, a :class:`GuardedStore` (a dead store raises ``StoreUnreachableError``).
        group_key: text naming the group's global ranks (keeps keys of two groups apart).
        node: node name of this rank (``FASTCKPT_NODE`` env var, else the host name).
        global_rank: rank in the world group (0 in one process).
    """

    rank: int
    world_size: int
    store: Any
    group_key: str
    node: str
    global_rank: int = 0

    @staticmethod
    def single() -> "Coordinator":
        """The coordinator of this process alone (rank 0 of 1, no store)."""
        return Coordinator(0, 1, None, "local", os.environ.get("FASTCKPT_NODE") or socket.gethostname())

    @staticmethod
    def for_group(process_group: Any = None) -> "Coordinator":
        """Coordinator of ``process_group`` (``None``: the world group when initialized).

        Returns :meth:`single` when torch.distributed is not initialized or ``process_group``
        is :data:`LOCAL`.
        """
        dist = _dist()
        if dist is None or (isinstance(process_group, str) and process_group == LOCAL):
            return Coordinator.single()
        from torch.distributed import distributed_c10d as c10d
        group = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        key = "w" if len(ranks) == dist.get_world_size() else "g" + "-".join(map(str, ranks))
        node = os.environ.get("FASTCKPT_NODE") or socket.gethostname()
        rank = dist.get_rank(group)
        return Coordinator(rank, dist.get_world_size(group), GuardedStore(c10d._get_default_store(), rank), key,
                           node, dist.get_rank())

    @property
    def is_single(self) -> bool:
        """True when this is a one-process group (everything here is a no-op)."""
        return self.world_size == 1

    def session(self, name: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Session":
        """Key space of one operation; ``name`` must be equal on all ranks and new per operation."""
        return Session(self, f"fastckpt/{self.group_key}/{name}/", timeout_s)


def is_file_store(store: Any) -> bool:
    """True when ``store`` (under any :class:`GuardedStore` / ``PrefixStore``) is a ``FileStore``
    (``init_method="file://..."``)."""
    return type(innermost_store(store)).__name__ == "FileStore"


#: Seconds between two looks at a ``FileStore`` while waiting for keys: the first, then doubling up to
#: the second. A ``FileStore``'s own ``wait`` looks every 10 ms: a key set 3 ms after the wait began was
#: seen 6.9 ms later at the median (one process waiting, another setting; 20 tries), 1.6 ms polled so.
FILE_STORE_POLL_S = (0.0002, 0.001)


def store_wait(store: Any, keys: list[str], timeout: timedelta, polled: bool) -> None:
    """``store.wait(keys, timeout)``; with ``polled`` (a ``FileStore``, see :func:`is_file_store`) by
    ``store.check`` every :data:`FILE_STORE_POLL_S` instead of the store's own 10 ms polling.

    Raises:
        TimeoutError: (polled) the keys are not all there after ``timeout``; the store's own
            timeout error otherwise. Connection errors pass through as the store raises them.
    """
    if not polled:
        store.wait(keys, timeout)
        return
    end = time.monotonic() + timeout.total_seconds()
    pause, most = FILE_STORE_POLL_S
    while not store.check(keys):
        if time.monotonic() >= end:
            raise TimeoutError(f"keys {keys} not set within {timeout.total_seconds():g} s")
        time.sleep(pause)
        pause = min(2 * pause, most)


class Session:
    """Store keys of one operation: JSON values published and awaited by rank.

    The clock starts when the first rank creates the session (its wall time is kept in the
    store, so a rank arriving late waits only what is left); :meth:`restart_clock` starts a
    new phase (e.g. after this rank's own writes).
    """

    def __init__(self, coord: Coordinator, prefix: str, timeout_s: float):
        self.coord, self.prefix, self.timeout_s = coord, prefix, float(timeout_s)
        self._local: dict[str, str] = {}  # the "store" of a one-process group
        self._keys: set[str] = {"t0", "left"}  # keys this rank touched (the last rank to leave deletes them)
        self._gathers: set[str] = set()  # all_gather names: key/{r} for every rank
        self._published: set[str] = set()  # keys this rank set
        self.incomplete = False  # an all_gather ended with ranks missing (see abandon)
        self.deadline = time.monotonic() + self.timeout_s
        self._polled = coord.store is not None and is_file_store(coord.store)
        if coord.store is not None:
            t0 = float(coord.store.compare_set(prefix + "t0", "", repr(time.time())).decode())
            self.deadline = time.monotonic() + max(0.0, t0 + self.timeout_s - time.time())

    def restart_clock(self) -> None:
        """Give the next waits ``timeout_s`` from now (a new phase of the operation)."""
        self.deadline = time.monotonic() + self.timeout_s

    def publish(self, key: str, value: Any) -> None:
        """Set ``key`` to the JSON of ``value`` (visible to every rank)."""
        if self.coord.store is None:
            self._local[key] = json.dumps(value)
            return
        self.coord.store.set(self.prefix + key, json.dumps(value))
        self._keys.add(key)
        self._published.add(key)

    def publish_bytes(self, key: str, data: bytes) -> None:
        """Set ``key`` to raw ``data`` (e.g. the edge bytes one rank hands another)."""
        if self.coord.store is None:
            self._local[key] = data  # type: ignore[assignment]
            return
        self.coord.store.set(self.prefix + key, data)
        self._keys.add(key)
        self._published.add(key)

    def wait_bytes(self, key: str, what: str) -> bytes:
        """Wait (until the session's deadline) for ``key`` set by :meth:`publish_bytes`; return its bytes.

        Raises:
            TimeoutError: at the deadline; names the key and ``what``.
        """
        if self.coord.store is None:
            if key not in self._local:
                raise TimeoutError(f"fastckpt: {key!r} never published in this process while {what}")
            return self._local[key]  # type: ignore[return-value]
        self.wait_for_keys([key], what)
        return bytes(self.coord.store.get(self.prefix + key))

    def wait_for(self, keys: list[str], what: str) -> list[Any]:
        """Wait until all ``keys`` exist (at most until the session's deadline) and return their values.

        Raises:
            TimeoutError: at the deadline; names the keys that never appeared and ``what``.
        """
        store = self.coord.store
        self._keys.update(keys)
        if store is None:
            missing = [k for k in keys if k not in self._local]
            if missing:
                raise TimeoutError(f"fastckpt: {missing} never published in this process while {what}")
            return [json.loads(self._local[k]) for k in keys]
        self.wait_for_keys(keys, what)
        return [json.loads(store.get(self.prefix + k).decode()) for k in keys]

    def wait_for_keys(self, keys: list[str], what: str) -> None:
        """Wait until all ``keys`` exist in the store (at most until the session's deadline).

        Raises:
            TimeoutError: at the deadline; names the keys that never appeared and ``what``.
        """
        store = self.coord.store
        self._keys.update(keys)
        full = [self.prefix + k for k in keys]
        while True:
            left = self.deadline - time.monotonic()
            try:
                store_wait(store, full, timedelta(seconds=min(5.0, max(0.01, left))), self._polled)
                return
            except StoreUnreachableError:
                raise
            except Exception as e:  # the store raises a DistStoreError/RuntimeError on timeout
                if time.monotonic() >= self.deadline:
                    missing = [k for k, f in zip(keys, full) if not store.check([f])]
                    raise TimeoutError(f"fastckpt: no report after {self.timeout_s:.0f} s while {what}: "
                                       f"missing {missing}") from e

    def wait_until(self, keys: list[str], stop: Any) -> tuple[dict[str, Any], list[str]]:
        """Read ``keys`` as they appear until all are there, ``stop(values so far)`` is true, or
        the deadline passes. Returns ``(values by key, keys still missing)``."""
        self._keys.update(keys)
        store = self.coord.store
        if store is None:
            got = {k: json.loads(self._local[k]) for k in keys if k in self._local}
            return got, [k for k in keys if k not in got]
        got: dict[str, Any] = {}
        while True:
            for k in keys:
                if k not in got and store.check([self.prefix + k]):
                    got[k] = json.loads(store.get(self.prefix + k).decode())
            missing = [k for k in keys if k not in got]
            if not missing or stop(got) or time.monotonic() >= self.deadline:
                return got, missing
            try:
                store_wait(store, [self.prefix + k for k in missing],
                           timedelta(seconds=min(0.2, max(0.01, self.deadline - time.monotonic()))), self._polled)
            except StoreUnreachableError:
                raise
            except Exception:  # timeout of this slice: look again
                pass

    def settle(self, key: str, value: str) -> str:
        """First writer wins: set ``key`` to ``value`` unless a rank set it already; returns the
        value that holds (e.g. rank 0's "commit" against a waiting rank's "abort")."""
        self._keys.add(key)
        if self.coord.store is None:
            return self._local.setdefault(key, value)
        return self.coord.store.compare_set(self.prefix + key, "", value).decode()

    def all_gather(self, key: str, value: Any, what: str) -> list[Any]:
        """Publish ``value`` as ``key/{rank}`` and return every rank's value (rank order).

        Raises:
            DistributedSaveError: a rank did not publish before the deadline; ``failures``
                names each missing rank.
        """
        if self.coord.is_single:
            return [json.loads(json.dumps(value))]
        self._gathers.add(key)
        self.publish(f"{key}/{self.coord.rank}", value)
        keys = [f"{key}/{r}" for r in range(self.coord.world_size)]
        try:
            return self.wait_for(keys, what)
        except TimeoutError as e:
            self.incomplete = True
            store = self.coord.store
            missing = [r for r, k in enumerate(keys) if not store.check([self.prefix + k])]
            failures = {r: f"no report within {self.timeout_s:g} s while {what}: did rank {r} call the same "
                           "operation with the same process_group and path?" for r in missing}
            names = ", ".join(f"rank {r}" for r in missing)
            raise DistributedSaveError(
                f"fastckpt: {names} of the group did not arrive (or gave up) within {self.timeout_s:g} s while "
                f"{what} (every rank of process_group must make the same call; timeout_s= sets the wait)",
                failures) from e

    def abandon(self) -> None:
        """Leave a session that some rank never joined: delete what this rank set (its reports and
        the clock), so that a later retry of the same operation by every rank starts clean."""
        store = self.coord.store
        if store is None:
            return
        try:
            for k in self._published | {"t0"}:
                store.delete_key(self.prefix + k)
        except Exception:
            pass

    def close(self) -> None:
        """Leave the session; the last rank to leave deletes every key of it (each rank leaves
        the names of the keys it touched under ``keys/{rank}`` first). Keys of a session that
        some rank never joined stay (a few bytes)."""
        store = self.coord.store
        if store is None:
            return
        world, rank = self.coord.world_size, self.coord.rank
        mine = self._keys | {f"{g}/{r}" for g in self._gathers for r in range(world)}
        try:
            store.set(self.prefix + f"keys/{rank}", json.dumps(sorted(mine)))
            if store.add(self.prefix + "left", 1) < world:
                return
            names: set[str] = set()
            for r in range(world):
                names.update(json.loads(store.get(self.prefix + f"keys/{r}").decode()))
                names.add(f"keys/{r}")
            for k in sorted(names - {"left"}) + ["left"]:
                store.delete_key(self.prefix + k)
        except Exception:  # the store is gone (job shutting down): nothing left to clean
            pass


class PathClaim:
    """Marks, in the world store, that this process is saving ``path`` alone (a plain call
    under an initialized process group), so that plain calls from several ranks for one path
    fail at once instead of writing over each other.

    Call order: :meth:`acquire` (at the call) -> :meth:`check` (before the commit) -> :meth:`release`.
    """

    def __init__(self, path: str | os.PathLike):
        dist = _dist()
        self.path = os.fspath(path)
        self.store = None
        if dist is None:
            return
        from torch.distributed import distributed_c10d as c10d
        self.rank = dist.get_rank()
        self.store = GuardedStore(c10d._get_default_store(), self.rank,
                                  f"{_KINDS['plain']} {self.path} (that no other rank saves it at once)")
        self.key = f"fastckpt/plain/{path_tag(path)}"
        self.me = f"{self.rank}:{os.getpid()}:{time.time()!r}"

    def _error(self, holder: str) -> SaveConflictError:
        return SaveConflictError(
            f"{self.path}: several ranks are saving this checkpoint at once with plain calls (rank {self.rank} "
            f"and {holder}); without process_group= a save is written by the calling "
            "process alone. If every rank saves this checkpoint together, pass process_group= (e.g. "
            "torch.distributed.group.WORLD) on every rank; to save from one rank, call it on that rank only "
            "(if rank == 0: ...). Nothing was committed")

    def acquire(self) -> None:
        """Claim the path; raises :class:`SaveConflictError` if another process holds it."""
        if self.store is None:
            return
        got = self.store.compare_set(self.key, "", self.me).decode()
        if got != self.me:
            self.store.add(self.key + "/contenders", 1)
            self.store = None
            raise self._error("rank " + got.split(":")[0])

    def check(self) -> None:
        """Raise :class:`SaveConflictError` if another rank tried to save the path meanwhile."""
        if self.store is not None and self.store.add(self.key + "/contenders", 0) > 0:
            raise self._error("another rank")

    def release(self) -> None:
        """Give the claim back (safe to call twice)."""
        store, self.store = self.store, None
        if store is None:
            return
        try:
            store.delete_key(self.key + "/contenders")
            store.delete_key(self.key)
        except Exception:
            pass
