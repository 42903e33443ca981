"""fastckpt on ``torch.distributed.checkpoint`` (DCP): write and read fastckpt checkpoints through DCP.

Save::

    import torch.distributed.checkpoint as dcp
    from fastckpt.dcp import FastCkptSavePlanner, FastCkptStager, FastCkptWriter, background_group

    dcp.save(state, storage_writer=FastCkptWriter(path))     # DCP's default planner (or a subclass)
    dcp.save(state, storage_writer=FastCkptWriter(path), planner=FastCkptSavePlanner())
    fut = dcp.async_save(state, storage_writer=FastCkptWriter(path2), planner=FastCkptSavePlanner(),
                         async_stager=FastCkptStager(), process_group=background_group())

The folder holds HF-layout safetensors files of full tensors (readable by ``safetensors`` and
``transformers``), written in parallel by the ranks that own the bytes; see docs/FORMAT.md.
Non-tensor values are stored as JSON whatever the planner (DCP's default one would pickle them);
a value JSON cannot hold is refused naming its key (docs/DISTRIBUTED.md, "DCP").
Pass ``process_group=background_group()`` to ``dcp.async_save`` so its collectives never share
the training group.

Load::

    dcp.load(state, storage_reader=FastCkptReader(path))     # DCP's default planner (or a subclass)
    dcp.load(state, storage_reader=FastCkptReader(path), planner=FastCkptLoadPlanner())
    fastckpt.dcp.load(state, path)      # the same; a missing/invalid checkpoint raises its typed error
                                        # (CheckpointNotFoundError...), other DCP failures DCPLoadError

reads a fastckpt checkpoint (format 1 or 2, any saving world size) or an HF folder with DCP's
planner doing placement and resharding, never unpickling; a dtype difference is cast as DCP's
``FileSystemReader`` casts it. A thin layer: the code lives in
:mod:`fastckpt.saving.dcp_writer` (over the engine of :mod:`fastckpt.saving.saver`), :mod:`fastckpt.saving.dtensor`
and :mod:`fastckpt.loading.dcp_reader`.
"""

from __future__ import annotations

import os
from typing import Any

from .errors import DCPLoadError, FastCkptError, InvalidArgumentError
from .loading.dcp_reader import FastCkptLoadPlanner, FastCkptReader, FastCkptStorageData, build_metadata
from .saving.dcp_writer import FastCkptSavePlanner, FastCkptStager, FastCkptWriter
from .saving.dtensor import background_group


def load(state: dict, path: str | os.PathLike, *, process_group: Any = None, verify: bool = True,
         threads: int | None = None, allow_partial_load: bool = False) -> dict:
    """``torch.distributed.checkpoint.load`` of ``path`` into ``state`` (in place) with
    :class:`FastCkptReader` and :class:`FastCkptLoadPlanner`.

    Args:
        state: DCP state dict (plain tensors or DTensors; e.g. ``{"model": sd, "optim": osd}`` from
            ``torch.distributed.checkpoint.state_dict.get_state_dict``); every rank of the group calls.
        path: checkpoint folder, HF folder or safetensors file.
        process_group: DCP's ``process_group`` (default: the world group when initialized).
        verify: check the xxh3 checksums of what is read (default ``True``). threads: reads in flight.
        allow_partial_load: DCP's: state keys missing from the checkpoint are skipped.

    Returns:
        ``state`` (tensors filled in place, non-tensor values set from the checkpoint).

    Raises:
        CheckpointNotFoundError: nothing loadable at ``path`` (names it); HeaderError,
            CorruptCheckpointError, NotSafetensorsError...: the checkpoint's files fail validation. Each is
            raised as the reader met it on this rank, before any tensor is read.
        InvalidArgumentError: ``path`` is not a ``str`` / ``os.PathLike``.
        DCPLoadError: DCP reported a failure on any rank (``failures``: rank -> error text; a
            :class:`~fastckpt.errors.DCPPlannerError`, a checksum or a missing key is named there).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    path = InvalidArgumentError.check_path(path)
    reader = FastCkptReader(path, verify=verify, threads=threads)
    try:
        dcp.load(state, storage_reader=reader,
                 planner=FastCkptLoadPlanner(allow_partial_load=allow_partial_load), process_group=process_group)
    except CheckpointException as e:  # a BaseException: never let it through as is
        if isinstance(reader.metadata_error, FastCkptError):  # this rank's own read of the checkpoint failed:
            raise reader.metadata_error from e  # its typed error, not "metadata is None"
        failures = {}
        for r, x in getattr(e, "failures", {}).items():
            exc = x[0] if isinstance(x, tuple) else x  # DCP's WRAPPED_EXCEPTION: (exception, traceback)
            failures[int(r)] = f"{type(exc).__name__}: {exc}"
        raise DCPLoadError(f"{os.fspath(path)}: torch.distributed.checkpoint.load failed on ranks "
                           f"{sorted(failures)}: {failures}", failures) from e
    return state


__all__ = ["FastCkptWriter", "FastCkptSavePlanner", "FastCkptStager", "background_group",
           "FastCkptReader", "FastCkptLoadPlanner", "FastCkptStorageData", "build_metadata", "load"]
