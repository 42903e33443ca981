"""Which store holds a path: :func:`store_for` (local, fsspec for a URL, or an explicit store object)."""

from __future__ import annotations

import os
import re

from . import commit as cm
from .store import LOCAL, Store


def is_url(path: object) -> bool:
    """True if ``path`` is a URL naming a non-local store (``s3://``, ``gs://``, ``memory://``...)."""
    if not isinstance(path, str) or "://" not in path:
        return False
    scheme = path.split("://", 1)[0]
    return re.fullmatch(r"[A-Za-z][A-Za-z0-9+.-]*", scheme) is not None and scheme != "file"


def store_for(path: "str | os.PathLike | Store | None", store: "Store | None" = None) -> Store:
    """The store of ``path``: ``store`` when given, the store of a :class:`StorePath` (an explicit
    store object's path, :meth:`Store.path`), an fsspec store for a URL (``s3://bucket/prefix``;
    imports fsspec, once, configured from the environment), else :data:`LOCAL`.

    Raises:
        ImportError: a URL was given and fsspec (or its protocol's package, e.g. s3fs) is missing.
    """
    if store is not None:
        return store
    if isinstance(path, Store):
        return path
    if isinstance(getattr(path, "store", None), Store):  # a StorePath from Store.path()
        return path.store
    if is_url(path):
        from .fsspec_store import FsspecStore
        return FsspecStore.for_url(path)
    return LOCAL


def checkpoint_committed(path: "str | os.PathLike", store: Store | None = None) -> bool:
    """True if ``path`` is a committed fastckpt checkpoint folder (visible name + valid manifest);
    public as ``fastckpt.is_committed``.

    Args:
        path: a folder, or a URL of a store (``s3://bucket/prefix``), or a :class:`~fastckpt.storage.store.StorePath`.
        store: the store holding it (default: :func:`store_for` ``(path)``).
    """
    st = store_for(path, store)
    return cm.is_committed(path, None if st.local else st)
