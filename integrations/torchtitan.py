"""torchtitan way in: its ``CheckpointManager`` with fastckpt as DCP's storage.

Usage (torchtitan 0.3; the trainer builds ``config.checkpoint`` with ``.build(...)``)::

    from fastckpt.integrations.torchtitan import FastCkptCheckpointManager

    config.checkpoint = FastCkptCheckpointManager.Config(
        enable=True, folder="checkpoint", interval=500, keep_latest_k=3, async_mode="async")
    # everything else in torchtitan stays as it is: the trainer calls
    # checkpointer.save(step) / load(step) / maybe_wait_for_staging() / close()

What changes against torchtitan's own manager: only the two calls that move bytes.
``dcp_save`` runs the same ``dcp.save`` / ``dcp.async_save`` (same ``process_group``: torchtitan's
dedicated gloo group in the async modes) with ``storage_writer=FastCkptWriter(step folder)`` and
``planner=FastCkptSavePlanner()``; ``dcp_load`` runs ``dcp.load`` with ``FastCkptReader`` /
``FastCkptLoadPlanner``. DCP's planner still places (and reshards) every DTensor chunk; fastckpt
writes one atomic, committed folder per step: the model (torchtitan's flat FQNs, nested here
under ``"model"``) as HF-layout full-tensor ``model.safetensors`` (``model-*`` + index past one shard), optimizer /
lr-scheduler / train state beside it, non-tensor values as JSON, no pickle (no ``.metadata``).

The ranks' dataloader states (torchtitan's ``ParallelAwareDataloader``: a ``dp_rank_<r>`` key each)
are exchanged over a gloo group of the manager's own and saved as one union (:func:`_gathered`):
fastckpt's ranks save one state that must agree, where DCP's writer stores each rank's items.

Also changed, because fastckpt's folders are committed by a rename: the newest step is the newest
*committed* ``step-N`` (a hidden temporary of a save in flight, or one left by a crash, never
counts) and ``keep_latest_k`` deletes only committed steps, never the newest
(:func:`fastckpt.storage.prune_checkpoints`). Step folders torchtitan wrote with DCP's own
writer (``.metadata``) still load, through DCP's reader. ``last_save_in_hf`` / ``initial_load_in_hf``
keep torchtitan's own HF path (its ``sd_adapter``) unchanged.

torchtitan is imported only when ``FastCkptCheckpointManager`` is first used.
Tested: 2 ranks, gloo, CPU, FSDP2 ``fully_shard`` (tests/integrations/test_torchtitan.py).
"""

from __future__ import annotations

import functools
import os
import re
from concurrent.futures import Future
from typing import Any

import fastckpt
from fastckpt.storage import prune_checkpoints

__all__ = ["FastCkptCheckpointManager", "dcp_call"]

MODEL_KEY = "model"  # the subtree that becomes the HF-layout weights of a step folder
_STEP = re.compile(r"^step-(\d+)$")


def dcp_call(fn, *args: Any, **kwargs: Any) -> Any:
    """Run a DCP entry point (``dcp.save`` / ``dcp.load`` / ``dcp.async_save``) with typed errors.

    DCP reports a failure on any rank as ``CheckpointException``, which derives from
    ``BaseException`` (a plain ``except Exception`` in a training loop would miss it). It is
    re-raised, chained, as :class:`fastckpt.DistributedSaveError` for saves and as
    :class:`fastckpt.errors.DCPLoadError` for ``dcp.load`` (``failures``: rank -> error text);
    a ``Future`` returned by ``dcp.async_save`` is wrapped the same way, so its ``result()``
    raises ``DistributedSaveError`` too.

    Returns:
        What ``fn`` returns (a Future or ``AsyncSaveResponse`` for ``async_save``).

    Raises:
        fastckpt.DistributedSaveError: DCP's ``CheckpointException`` during a save, any rank.
        fastckpt.errors.DCPLoadError: the same during ``dcp.load``.
    """
    try:
        out = fn(*args, **kwargs)
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        typed = _typed(e, load=getattr(fn, "__name__", "") == "load")
        if typed is e:
            raise
        raise typed from e
    if isinstance(out, Future):
        return _typed_future(out)
    if hasattr(out, "upload_completion"):  # AsyncSaveResponse
        out.upload_completion = _typed_future(out.upload_completion)
    return out


def _typed(e: BaseException, load: bool = False) -> BaseException:
    failures = getattr(e, "failures", None)
    if not _is_dcp_exception(e) or not isinstance(failures, dict):
        return e
    text = {int(r): f"{type(f[0] if isinstance(f, tuple) else f).__name__}: "
                    f"{f[0] if isinstance(f, tuple) else f}" for r, f in failures.items()}
    if load:
        from fastckpt.errors import DCPLoadError
        return DCPLoadError("torch.distributed.checkpoint.load failed on ranks " + ", ".join(map(str, sorted(text)))
                            + ": " + "; ".join(f"rank {r}: {t}" for r, t in sorted(text.items())), text)
    return fastckpt.DistributedSaveError(
        "torch.distributed.checkpoint failed on ranks " + ", ".join(map(str, sorted(text))) + ": "
        + "; ".join(f"rank {r}: {t}" for r, t in sorted(text.items()))
        + ". Nothing was committed for this step; fix the cause named for each rank and save again.",
        text)


def _is_dcp_exception(e: BaseException) -> bool:
    return type(e).__name__ == "CheckpointException"


def _typed_future(fut: Future) -> Future:
    out: Future = Future()

    def done(f: Future) -> None:
        try:
            out.set_result(f.result())
        except BaseException as e:  # noqa: BLE001 - handed over, typed
            out.set_exception(_typed(e) if _is_dcp_exception(e) else e)

    fut.add_done_callback(done)
    return out


def _fast_stager_type():
    from fastckpt.dcp import FastCkptStager
    return FastCkptStager


@functools.lru_cache(maxsize=None)
def _build_manager_class():
    """Define the subclass (imports torchtitan; called once, on first use)."""
    from dataclasses import dataclass

    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
    import torch.distributed as dist
    from torchtitan.components.checkpoint import DATALOADER, MODEL, AsyncMode, CheckpointManager

    class FastCkptCheckpointManager(CheckpointManager):
        """torchtitan's ``CheckpointManager`` writing and reading fastckpt folders through DCP.

        Build it exactly like torchtitan's (``FastCkptCheckpointManager.Config(...).build(
        dataloader=..., model_parts=..., optimizers=..., lr_schedulers=..., states=...,
        sd_adapter=..., base_folder=...)``); every option of torchtitan's ``Config`` keeps its
        meaning. Override :meth:`storage_writer` / :meth:`storage_reader` / :meth:`save_planner` /
        :meth:`load_planner` to pass fastckpt options (threads, ``o_direct``...).

        Folder layout of ``step-N``: the model state under ``"model"`` (HF-layout
        ``model.safetensors``, or ``model-*.safetensors`` + ``model.safetensors.index.json`` past one
        shard, full tensors, loadable by
        ``safetensors`` / ``transformers``), the rest (optimizer, lr_scheduler, dataloader, train
        state, extra ``states``) under their torchtitan keys, ``manifest.json`` last.

        Raises (from ``save`` / ``load`` / the async future):
            fastckpt.DistributedSaveError: a rank failed (DCP's ``CheckpointException``, typed).
            fastckpt errors of the writer / reader (see :mod:`fastckpt.dcp`).
        """

        @dataclass(kw_only=True, slots=True)
        class Config(CheckpointManager.Config):
            """torchtitan's checkpoint ``Config``; ``build()`` makes a FastCkptCheckpointManager."""

        # -- the pieces a subclass may change --------------------------------------------------
        def storage_writer(self, checkpoint_id: str):
            """The DCP ``StorageWriter`` for one step folder (default ``FastCkptWriter(path)``)."""
            from fastckpt.dcp import FastCkptWriter
            return FastCkptWriter(checkpoint_id)

        def save_planner(self):
            """The DCP ``SavePlanner`` (default ``FastCkptSavePlanner()``: JSON, no pickle)."""
            from fastckpt.dcp import FastCkptSavePlanner
            return FastCkptSavePlanner()

        def __init__(self, config, **kwargs: Any) -> None:
            super().__init__(config, **kwargs)
            if self.enable and self.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                # set before torchtitan's _save would make its DefaultStager (shared + pinned memory)
                self.stager = self.async_stager()
            self._gather_pg = None  # gloo group of its own for the per-rank dataloader states: torchtitan's
            if self.enable and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
                self._gather_pg = dist.new_group(backend="gloo")  # self.pg may carry an async save's collectives

        def async_stager(self):
            """The stager of ``async_mode="async_with_pinned_mem"``: one ``FastCkptStager`` for the
            run (made at construction), so its host buffer is reused step after step."""
            if not isinstance(getattr(self, "stager", None), _fast_stager_type()):
                self.stager = _fast_stager_type()()
            return self.stager

        def storage_reader(self, checkpoint_id: str):
            """The DCP ``StorageReader`` for one step folder (default ``FastCkptReader(path)``)."""
            from fastckpt.dcp import FastCkptReader
            return FastCkptReader(checkpoint_id)

        def load_planner(self):
            """The DCP ``LoadPlanner`` (default ``FastCkptLoadPlanner()``: JSON, no unpickling)."""
            from fastckpt.dcp import FastCkptLoadPlanner
            return FastCkptLoadPlanner()

        # -- torchtitan's two byte-moving calls -------------------------------------------------
        @torch.no_grad()
        def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode,
                     enable_garbage_collection: bool = False, to_hf: bool = False):
            """torchtitan's ``dcp_save`` with fastckpt as storage (``to_hf``: torchtitan's own path).

            Returns ``None`` (sync), a ``Future`` (``"async"``) or an ``AsyncSaveResponse``
            (``"async_with_pinned_mem"``), as torchtitan expects.
            """
            if to_hf:
                return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                        enable_garbage_collection, to_hf)
            state = self._nest(state_dict)
            if state.get(DATALOADER) is not None and self._gather_pg is not None:
                state[DATALOADER] = _gathered(state[DATALOADER], self._gather_pg)
            kw = {"storage_writer": self.storage_writer(checkpoint_id), "planner": self.save_planner()}
            if async_mode == AsyncMode.DISABLED:
                ret = dcp_call(dcp.save, state, **kw)
            elif async_mode == AsyncMode.ASYNC:
                ret = dcp_call(dcp.async_save, state, process_group=self.pg, **kw)
            else:  # pinned memory: our stager (threads, not DCP's process executor: nothing pickled)
                ret = dcp_call(dcp.async_save, state, process_group=self.pg,
                               async_stager=self.async_stager(), **kw)
                if isinstance(ret, Future):  # a stager that stages synchronously
                    staged: Future = Future()
                    staged.set_result(None)
                    ret = AsyncSaveResponse(staging_completion=staged, upload_completion=ret)
            if enable_garbage_collection:
                import gc
                gc.collect()
            return ret

        def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                     from_quantized: bool) -> None:
            """torchtitan's ``dcp_load`` reading a fastckpt folder in place (DCP places/reshards).

            HF sources (``from_hf``) and step folders written by DCP's own writer (no
            ``manifest.json``) go through torchtitan's own code.
            """
            if from_hf or not fastckpt.is_committed(checkpoint_id):
                return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
            state = self._nest(state_dict)
            dcp_call(dcp.load, state, storage_reader=self.storage_reader(checkpoint_id),
                     planner=self.load_planner())
            if MODEL in self.states:
                self.states[MODEL].load_state_dict(state[MODEL_KEY])

        # -- which folders count ----------------------------------------------------------------
        def _find_load_step(self, folder: str = "") -> int:
            """Newest ``step-N`` that is committed (fastckpt manifest) or a DCP folder (``.metadata``);
            -1 when none. Hidden temporaries of saves in flight or crashed never count."""
            folder = folder or self.folder
            if not os.path.isdir(folder):
                return -1
            steps = [int(m.group(1)) for n in os.listdir(folder) if (m := _STEP.match(n))
                     and (fastckpt.is_committed(os.path.join(folder, n))
                          or os.path.isfile(os.path.join(folder, n, ".metadata")))]
            return max(steps, default=-1)

        def _purge_stale_checkpoints(self) -> None:
            """``keep_latest_k``: rank 0 deletes committed steps beyond the newest k (atomically,
            never the newest, dead writers' temporaries too); uncommitted folders are left."""
            if self._should_purge():
                prune_checkpoints(self.folder, "step-", keep=self.keep_latest_k)

        def _nest(self, flat: dict[str, Any]) -> dict[str, Any]:
            """torchtitan's flat dict (model FQNs beside ``optimizer``...) -> ``{"model": {...}, ...}``."""
            names = set(self.states[MODEL].state_dict()) if MODEL in self.states else set()
            model = {k: v for k, v in flat.items() if k in names}
            rest = {k: v for k, v in flat.items() if k not in names}
            if MODEL_KEY in rest:
                raise ValueError(f"torchtitan state has a non-model entry named {MODEL_KEY!r}; "
                                 "rename it in `states` (the fastckpt folder keeps the model there)")
            return {MODEL_KEY: model, **rest}

    FastCkptCheckpointManager.__module__ = __name__
    return FastCkptCheckpointManager


def _gathered(dataloader: Any, group: Any) -> dict:
    """Every rank's dataloader state merged into one dict, the same on every rank.

    torchtitan's ``ParallelAwareDataloader.state_dict()`` is ``{"dp_rank_<r>": bytes, "world_size": n}``:
    a key per data-parallel rank. DCP's own writer stores each rank's items; fastckpt's ranks save
    one state that must agree, so the ranks exchange theirs (JSON of fastckpt's value encoding over
    ``group``, a gloo group; never pickled) and each saves the union (a key that several ranks hold,
    e.g. ``world_size`` or a tensor-parallel peer's copy, keeps the lowest rank's value, as DCP's
    deduplication keeps one rank's). On load each rank's own ``state_dict()`` names the keys it reads.

    Raises:
        fastckpt.errors.UnsupportedValueError: the state holds a tensor or a value fastckpt does not store.
    """
    import json

    import torch
    import torch.distributed as dist

    from fastckpt.errors import UnsupportedValueError
    from fastckpt.format.tree import flatten, unflatten

    sd = dataloader.state_dict() if hasattr(dataloader, "state_dict") else dataloader

    def no_tensor(key: str, v: Any) -> None:
        raise UnsupportedValueError(f"torchtitan dataloader state: a {type(v).__name__} at {key!r}; the per-rank "
                                    "dataloader states are exchanged as JSON values (bytes, numbers, strings)")

    raw = torch.frombuffer(bytearray(json.dumps(flatten(sd, no_tensor)).encode()), dtype=torch.uint8)
    n = torch.tensor([raw.numel()], dtype=torch.int64)
    world = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, n, group=group)
    most = int(max(int(x) for x in sizes))
    mine = torch.zeros(most, dtype=torch.uint8)
    mine[:raw.numel()] = raw
    bufs = [torch.zeros(most, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(bufs, mine, group=group)
    merged: dict = {}
    for b, size in zip(bufs, sizes):
        theirs = unflatten(json.loads(bytes(b[:int(size)].numpy())), lambda k, kind: None)
        if isinstance(theirs, dict):
            for k, v in theirs.items():
                merged.setdefault(k, v)
    return merged


def __getattr__(name: str) -> Any:
    """Lazy ``FastCkptCheckpointManager`` (imports torchtitan on first access)."""
    if name == "FastCkptCheckpointManager":
        return _build_manager_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
