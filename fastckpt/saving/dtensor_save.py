"""``fastckpt.save`` / ``async_save`` / ``CheckpointManager.save`` of states holding DTensors: the DCP route.

At the call, on every rank of the group: validate (key path and type of anything unsupported,
before any file exists), snapshot the state with :class:`FastCkptStager` (host copies of the
local shards in a reused buffer) and return. In the background: ``dcp.save`` of the snapshot
with :class:`~fastckpt.saving.dcp_writer.FastCkptWriter` and
:class:`~fastckpt.saving.dcp_writer.FastCkptSavePlanner`, its collectives on a dedicated gloo
group (:func:`~fastckpt.saving.dtensor.background_group`), never the training group. DCP's
``CheckpointException`` (a ``BaseException``) becomes :class:`~fastckpt.errors.DistributedSaveError`
naming each failed rank; nothing is committed and the process stays usable.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.staging import AsyncStager

from ..coordination import LOCAL, Coordinator, forget_session, group_timeout_s, numbered_session, path_tag
from ..errors import CheckpointExistsError, DistributedSaveError, RankValuesDifferError, UnsupportedValueError
from ..format.tree import join
from ..storage.memory import host_buffer, pin_if_possible
from ..storage.staging import copy_into
from .agree import array_digest, check_agreement, combined, json_leaves
from .collect import collect
from .committer import fmt, remove_uncommitted
from .dcp_writer import FastCkptSavePlanner, FastCkptWriter, read_manifest_bytes
from .dtensor import background_group, check_state, mesh_ranks, view_key, walk, with_stand_ins
from .future import SaveFuture
from .options import SaveOptions
from .ranks import split_state

_ALIGN = 64


class FastCkptStager(AsyncStager):
    """DCP ``AsyncStager``: snapshots a state at the call into one reused host buffer.

    ``stage(state)`` returns the same nesting with every tensor copied into the buffer and
    every DTensor rebuilt on its copied local shard (same mesh, placements, global shape); other
    values are shared. The same view under two key paths (tied weights) stays one copy;
    different views of one storage are copied apart. The buffer grows as needed and is reused
    by the next ``stage``: start the next save only after the previous one finished
    (``dcp.async_save(...).result()``; fastckpt's own saves do).
    """

    _synchronize_after_execute = False

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None

    def stage(self, state_dict: Any) -> Any:
        """A snapshot of ``state_dict`` (see the class docstring); blocks until copied."""
        from torch.distributed.tensor import DTensor
        leaves: list[torch.Tensor] = []
        seen: dict[int, int] = {}

        def local(v: torch.Tensor) -> torch.Tensor:
            return v.to_local() if isinstance(v, DTensor) else v

        def ident(v: torch.Tensor) -> Any:
            return id(v) if isinstance(v, DTensor) else view_key(v)

        def find(_: str, v: Any) -> None:
            if isinstance(v, torch.Tensor) and ident(v) not in seen:
                seen[ident(v)] = len(leaves)
                leaves.append(v)
        walk(state_dict, "", find)
        offs, total = [], 0
        for v in leaves:
            t = local(v)
            offs.append(total)
            total += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        if self._buf is None or self._buf.numel() < total:
            # page-locked when CUDA is present: device -> host copies of CUDA DTensors run at full speed
            self._buf = pin_if_possible(host_buffer(max(total, 1))[0])
        copies: list[torch.Tensor] = []
        for v, off in zip(leaves, offs):
            t = local(v)
            n = t.numel() * t.element_size()
            dst = self._buf[off:off + n]
            copy_into(dst, t)
            c = dst.view(t.dtype).view(t.shape) if t.numel() else torch.empty(t.shape, dtype=t.dtype)
            if isinstance(v, DTensor):
                c = _host_dtensor(c, v)
            copies.append(c)

        def rebuild(v: Any) -> Any:
            if isinstance(v, torch.Tensor):
                return copies[seen[ident(v)]]
            if isinstance(v, dict):
                return {k: rebuild(x) for k, x in v.items()}
            if isinstance(v, list):
                return [rebuild(x) for x in v]
            if isinstance(v, tuple):
                return tuple(rebuild(x) for x in v)
            return v
        return rebuild(state_dict)

    def synchronize_staging(self) -> None:
        """No-op: :meth:`stage` blocks until the copy is done."""

    def close(self) -> None:
        """Drop the buffer."""
        self._buf = None


def _host_dtensor(local: torch.Tensor, like: Any) -> Any:
    """A DTensor with ``like``'s mesh, placements and global shape on the host tensor ``local``
    (``DTensor.from_local`` would move it back to the mesh's device, e.g. CUDA)."""
    from torch.distributed.tensor import DTensor
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
        spec = DTensorSpec(like.device_mesh, tuple(like.placements),
                           tensor_meta=TensorMeta(like.shape, like.stride(), like.dtype))
        return DTensor(local, spec, requires_grad=False)
    except (ImportError, TypeError):  # torch moved the spec: the public constructor (CPU meshes stay on the host)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                                  stride=like.stride())


def _failure_text(v: Any) -> str:
    exc = v[0] if isinstance(v, tuple) and v and isinstance(v[0], BaseException) else v
    return fmt(exc) if isinstance(exc, BaseException) else str(exc)


def plain_values(staged: Any, skeleton: Any, local_keys: tuple[str, ...]) -> dict[str, str]:
    """Digests of the values a DTensor save stores once (:mod:`fastckpt.saving.agree`): every JSON leaf
    of ``skeleton`` and every plain tensor / NumPy array of ``staged`` (the host snapshot: no read of
    device memory), outside the top-level ``local_keys`` subtrees (saved per rank)."""
    from torch.distributed.tensor import DTensor
    local = {join("", k) for k in local_keys}
    out = {k: v for k, v in json_leaves(skeleton).items() if k.split("/", 1)[0] not in local}

    def visit(p: str, v: Any) -> None:
        if isinstance(v, (torch.Tensor, np.ndarray)) and not isinstance(v, DTensor) \
                and p.split("/", 1)[0] not in local:
            out[p] = array_digest(v)
    walk(staged, "", visit)
    return out


def _split_local(staged: Any, local_keys: tuple[str, ...], rank: int) -> tuple[Any, tuple[int, Any] | None]:
    """``staged`` without its ``local_keys`` subtrees (placeholders in their place, as a ``process_group=``
    save stores them) and ``(rank, collected rank-local state)`` for :class:`FastCkptSavePlanner`, or
    ``None`` when the state holds none of ``local_keys``.

    Raises:
        UnsupportedValueError: a DTensor under a ``local_keys`` subtree (a DTensor is one global tensor:
            save it outside ``local_keys``).
    """
    if not local_keys or not isinstance(staged, dict) or not any(k in staged for k in local_keys):
        return staged, None
    split = split_state(staged, local_keys)
    dts = [p for p, v in with_stand_ins(split.local)[1].items() if hasattr(v, "placements")]
    if dts:
        raise UnsupportedValueError(
            f"local_keys subtree holds DTensors at key paths {dts[:5]}; a DTensor is one global tensor saved by every "
            "rank together: keep it out of local_keys (put only per-rank plain values there). Nothing was written")
    return split.replicated, (rank, collect(split.local, {}))


def _vote_call(group: Any, path: Path, opts: SaveOptions, own: BaseException | None,
               values: dict[str, str] | None = None) -> None:
    """Every rank of ``group`` learns whether every rank's call succeeded (validation, staging) and
    whether the values stored once agree (``values``: :func:`plain_values`), through the store with a
    bounded wait, before any rank enters DCP's collectives: a rank whose call failed would otherwise
    leave the others waiting in them until the group's timeout.

    Raises:
        ``own`` itself on the rank whose call failed (its type, as in one process);
        DistributedSaveError: on the other ranks, naming each failed rank and its error; also when a
            rank did not arrive within ``timeout_s`` (it failed before, or made another call).
        RankValuesDifferError: on every rank, when values stored once differ between ranks (names the
            key paths and the ranks); nothing written.
    """
    coord = Coordinator.for_group(group)
    timeout = opts.timeout_s if opts.timeout_s is not None else group_timeout_s(None)
    tag = path_tag(path)
    sess = coord.session(numbered_session(coord, "dtensor-call", tag), timeout)
    values = values or {}
    try:
        got = sess.all_gather("call", {"error": None if own is None else fmt(own), "values": combined(values)},
                              f"starting the DTensor save of {path}")
    except DistributedSaveError:
        sess.abandon()
        forget_session(coord, "dtensor-call", tag)
        if own is not None:
            raise own from None
        raise
    if own is not None:
        sess.close()
        raise own
    failures = {r: g["error"] for r, g in enumerate(got) if g["error"] is not None}
    if failures:
        sess.close()
        lines = "; ".join(f"rank {r}: {t}" for r, t in sorted(failures.items()))
        raise DistributedSaveError(f"multi-rank save of {path} not started: {lines}. Nothing was written; the "
                                   "failed rank raised its own error (fix that cause and save again)", failures)
    try:
        check_agreement(sess, values, [g["values"] for g in got], path, "comparing the values stored once")
    except DistributedSaveError as e:
        if not isinstance(e, RankValuesDifferError):
            sess.abandon()
            forget_session(coord, "dtensor-call", tag)
            raise
        sess.close()
        raise
    sess.close()


def start_dtensor_save(saver: Any, state: Any, path: Path, opts: SaveOptions, pg: Any) -> SaveFuture:
    """The DCP route of :meth:`fastckpt.Saver.async_save` for a state holding DTensors (module docstring).

    Args:
        saver: the :class:`~fastckpt.saving.saver.Saver` (its staging pool and pending save).
        state: the state (every rank of the group, same structure, DTensors by global shape).
        path: absolute checkpoint folder. ``opts``: the checked options.
        pg: ``process_group`` of the call: its ranks save together; ``None``: every rank of the
            DTensors' device meshes.

    Raises:
        UnsupportedValueError: a value that cannot be saved (key path and type), before any file exists.
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false.
        ValueError: an option not supported for DTensor states.
        DistributedSaveError: another rank's call failed (its rank and error named); nothing written.
        Any error of this rank's validation or staging (e.g. ``MemoryError``), after every rank learned of it.
    """
    import torch.distributed as dist
    t0 = time.perf_counter()
    meshes = check_state(state)  # the state's structure: alike on every rank
    ranks = (dist.get_process_group_ranks(pg) if pg is not None and not (isinstance(pg, str) and pg == LOCAL)
             else mesh_ranks(meshes))
    group = background_group(ranks)
    own: BaseException | None = None
    values: dict[str, str] = {}
    try:
        col = collect(with_stand_ins(state)[0], opts.stems)  # every other value error, at the call
        if path.exists() and not opts.overwrite:
            raise CheckpointExistsError(f"{path} already exists; pass overwrite=True to replace it atomically")
        if not hasattr(saver, "stager"):
            saver.stager = FastCkptStager()
        staged = saver.stager.stage(state)
        staged, local = _split_local(staged, opts.local_keys, dist.get_rank(group))
        values = plain_values(staged, col.skeleton, opts.local_keys)
    except Exception as e:  # still vote: the other ranks must not enter DCP's collectives alone
        own = e
    _vote_call(group, path, opts, own, values)
    fut = SaveFuture(path)
    fut._staged.set()
    fut.blocking_s = time.perf_counter() - t0
    writer = FastCkptWriter(path, pool=saver.pool, options=opts)
    planner = FastCkptSavePlanner(opts.stems, local=local)
    rank = dist.get_rank(group)

    def run() -> None:
        from torch.distributed.checkpoint import save as dcp_save
        from torch.distributed.checkpoint.api import CheckpointException
        exc: BaseException | None = None
        try:
            dcp_save(staged, storage_writer=writer, planner=planner, process_group=group)
            info = read_manifest_bytes(path)
            fut.bytes_written, fut.bytes_by_rank = info["bytes_total"], info["bytes_by_rank"]
            fut.total_s = time.perf_counter() - t0
            if rank == 0 and opts.on_commit is not None:
                opts.on_commit(path)
        except CheckpointException as e:
            failures = {int(r): _failure_text(v) for r, v in e.failures.items()}
            lines = "; ".join(f"rank {r}: {t}" for r, t in sorted(failures.items()))
            exc = DistributedSaveError(f"multi-rank save of {path} failed, nothing was committed: {lines}", failures)
        except BaseException as e:
            exc = e
        if exc is not None and writer.folder and not writer.committed:
            remove_uncommitted(writer.folder, opts)
        fut._finish(exc)

    saver._pending = fut
    fut._start()
    threading.Thread(target=run, name="fastckpt-dcp-save", daemon=False).start()
    return fut
