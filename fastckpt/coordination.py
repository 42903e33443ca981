"""torch.distributed wrapper for multi-rank saves: a no-op in one process.

Coordination goes through the process group's key-value :class:`torch.distributed.Store`
(the one ``init_process_group`` created: TCPStore, FileStore...), never through
collectives. A background save thread can therefore wait for the other ranks while the
training loop runs its own ``all_reduce`` on the same group without any risk of the two
interleaving differently on different ranks (the deadlock a second collective stream would
cause). Every wait has a timeout that names the ranks that did not report.

Call order of one :class:`Coordinator` (every rank of the group, same order of calls):
``Coordinator.for_group(group)`` -> ``session(tag)`` -> ``all_gather`` / ``publish`` /
``wait_for`` any number of times with distinct keys.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

#: Pass as ``process_group=`` to save from this process alone even when torch.distributed is
#: initialized (e.g. the usual ``if rank == 0: fastckpt.save(...)``).
LOCAL = "local"

DEFAULT_TIMEOUT_S = 1800.0


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:  # torch built without distributed
        return None
    return dist if dist.is_available() and dist.is_initialized() else None


@dataclass(frozen=True)
class Coordinator:
    """This process's place in a group and the store used to coordinate it.

    Attributes:
        rank: rank inside the group (0-based).
        world_size: ranks in the group.
        store: a ``torch.distributed.Store`` shared by the group (``None`` in one process).
        group_key: text naming the group's global ranks (keeps keys of two groups apart).
        node: node name of this rank (``FASTCKPT_NODE`` env var, else the host name).
    """

    rank: int
    world_size: int
    store: Any
    group_key: str
    node: str

    @staticmethod
    def for_group(process_group: Any = None) -> "Coordinator":
        """Coordinator of ``process_group`` (``None``: the world group when initialized).

        Returns a single-process coordinator (rank 0 of 1) when torch.distributed is not
        initialized or ``process_group`` is :data:`LOCAL`.
        """
        node = os.environ.get("FASTCKPT_NODE") or socket.gethostname()
        dist = _dist()
        if dist is None or (isinstance(process_group, str) and process_group == LOCAL):
            return Coordinator(0, 1, None, "local", node)
        from torch.distributed import distributed_c10d as c10d
        group = process_group if process_group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(group)
        key = "w" if len(ranks) == dist.get_world_size() else "g" + "-".join(map(str, ranks))
        return Coordinator(dist.get_rank(group), dist.get_world_size(group), c10d._get_default_store(), key, node)

    @property
    def is_single(self) -> bool:
        """True when this is a one-process group (everything here is a no-op)."""
        return self.world_size == 1

    def session(self, tag: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> "Session":
        """Key space for one operation; ``tag`` must be equal on all ranks and new per operation."""
        return Session(self, f"fastckpt/{self.group_key}/{tag}/", timeout_s)


class Session:
    """Store keys of one operation: JSON values published and awaited by rank."""

    def __init__(self, coord: Coordinator, prefix: str, timeout_s: float):
        self.coord, self.prefix, self.timeout_s = coord, prefix, timeout_s
        self._local: dict[str, str] = {}  # the "store" of a one-process group

    def publish(self, key: str, value: Any) -> None:
        """Set ``key`` to the JSON of ``value`` (visible to every rank)."""
        if self.coord.store is None:
            self._local[key] = json.dumps(value)
        else:
            self.coord.store.set(self.prefix + key, json.dumps(value))

    def wait_for(self, keys: list[str], what: str) -> list[Any]:
        """Wait until all ``keys`` exist and return their values.

        Raises:
            TimeoutError: after ``timeout_s``; names the keys that never appeared and ``what``.
        """
        store = self.coord.store
        if store is None:
            missing = [k for k in keys if k not in self._local]
            if missing:
                raise TimeoutError(f"fastckpt: {missing} never published in this process while {what}")
            return [json.loads(self._local[k]) for k in keys]
        full = [self.prefix + k for k in keys]
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                store.wait(full, timedelta(seconds=min(5.0, max(0.01, deadline - time.monotonic()))))
                break
            except Exception as e:  # the store raises a DistStoreError/RuntimeError on timeout
                if time.monotonic() >= deadline:
                    missing = [k for k, f in zip(keys, full) if not store.check([f])]
                    raise TimeoutError(f"fastckpt: no report after {self.timeout_s:.0f} s while {what}: "
                                       f"missing {missing}; did every rank of the group call the same "
                                       "save? (for a save from one rank pass process_group="
                                       "fastckpt.coordination.LOCAL)") from e
        return [json.loads(store.get(f).decode()) for f in full]

    def all_gather(self, key: str, value: Any, what: str) -> list[Any]:
        """Publish ``value`` as ``key/{rank}`` and return every rank's value (rank order)."""
        if self.coord.is_single:
            return [json.loads(json.dumps(value))]
        self.publish(f"{key}/{self.coord.rank}", value)
        return self.wait_for([f"{key}/{r}" for r in range(self.coord.world_size)], what)

    def barrier(self, key: str, what: str) -> None:
        """Return once every rank reached ``key``."""
        self.all_gather(key, None, what)
