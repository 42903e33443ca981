"""Saves into a non-local store (:class:`fastckpt.storage.fsspec_store.FsspecStore`, ``s3://...``).

The engine writes into a local spool folder (its ``pwrite``/O_DIRECT path: a file's pieces
arrive at any offset, which an object store cannot take), then, in the save's background thread,
:func:`fastckpt.storage.fsspec_store.upload_checkpoint` commits it to the store with the store's
strategy (``marker``: every file, then ``manifest.json`` last), removes the spool and runs the
caller's ``on_commit`` with the store path. ``fut.result()`` returns that path once the manifest is
uploaded. One process per save (no ``process_group``); ``link_from`` is refused (no hard links
across stores).
"""

from __future__ import annotations

import os
from typing import Any

from ..storage.fsspec_store import make_spool, upload_checkpoint
from ..storage.locate import store_for
from ..storage.store import LOCAL, Store
from .committer import check_target
from .future import SaveFuture


def wants_store(path: Any, options: dict) -> bool:
    """True when a save of ``path`` with ``options`` goes to a non-local store (a URL or ``store=``)."""
    st = options.get("store")
    return (st is not None and not st.local) or (st is None and not store_for(path).local)


def start_remote_save(saver: Any, state: Any, path: str, pg: Any, options: dict) -> SaveFuture:
    """Start a save of ``state`` into ``path`` of a non-local store (see the module docstring).

    Raises:
        ValueError: ``process_group`` (multi-rank), ``link_from`` or a ``commit`` the store lacks.
        CheckpointExistsError: ``path`` exists and ``overwrite`` is false, or holds objects that are
            not a checkpoint (never deleted, as a local save never deletes other files).
    """
    options = dict(options)
    store: Store = store_for(path, options.pop("store", None))
    url = store.normalize(path)
    commit = options.pop("commit", None) or store.commits[0]
    if commit not in store.commits:
        raise ValueError(f"{url}: the {store.name} store supports commit={list(store.commits)}, not {commit!r} "
                         "(an object store has no atomic rename)")
    if pg is not None and not (isinstance(pg, str) and pg == "local"):
        raise ValueError(f"{url}: multi-rank saves (process_group=) into the {store.name} store are not "
                         "supported; save to a shared file system, or save from one process")
    if (options.get("consistency") is not None and getattr(options["consistency"], "link_from", None)) \
            or options.get("link_from"):
        raise ValueError(f"{url}: link_from= needs hard links on one file system; not with the {store.name} store")
    overwrite = bool(options.get("overwrite", False))
    check_target(url, overwrite, store)  # a checkpoint or an empty prefix only: never someone else's objects
    user_hook = options.pop("on_commit", None)
    top = make_spool()
    local = os.path.join(top, store.basename(url) or "checkpoint")

    def commit_remote(_local_path) -> None:  # the save's background thread, after the local commit
        try:
            check_target(url, overwrite, store)  # again: objects may have appeared at url since the call
            upload_checkpoint(local, store, url, overwrite=overwrite, commit=commit)
        finally:
            LOCAL.remove(top)
        if user_hook is not None:
            user_hook(url)

    try:
        fut = saver.async_save(state, local, process_group=pg, on_commit=commit_remote, **options)
    except BaseException:
        LOCAL.remove(top)
        raise
    fut.path = url
    fut.add_done_callback(lambda _f: LOCAL.remove(top))
    return fut
