"""How bytes move and become visible: I/O backends, host memory and staging pools, the root lock,
atomic commit, retention.

Public parts (importable from ``fastckpt.storage``; integrations may use these and nothing
else of the layer):

* The seam (:mod:`.store`, :mod:`.locate`, :mod:`.fsspec_store`): :class:`Store` (every file-system
  operation of the library: open for write at offsets, read, list, exists, remove, link, free
  space, temporary folders, the root lock), :class:`LocalStore` / :data:`LOCAL`,
  :class:`FsspecStore` (``s3://...``), :func:`store_for` (the store of a path or URL),
  :class:`StorePath`; the commit strategies :class:`RenameCommit` / :class:`MarkerCommit`
  (:data:`STRATEGIES`, :func:`strategy`).

* Bytes to files (:mod:`.io`): :class:`FileWriter` (one preallocated file, parallel positional
  writes, optional O_DIRECT), :func:`write_all`, :func:`read_exact`, :func:`fsync_dir`,
  :func:`copy_file`, :func:`buffer_address`, :func:`get_backend` / :class:`PosixBackend` /
  :data:`BACKENDS` (the swappable backend), :data:`ALIGN`, :data:`DEFAULT_CHUNK_BYTES`,
  :func:`default_threads`.
* Visibility (:mod:`.commit`): :func:`write_small_file` (create + fsync), :func:`make_temp_dir` +
  :func:`commit_dir` (a hidden temporary folder made visible by one rename),
  :func:`clean_stale_temps` (remove dead writers' temporaries), :func:`is_committed`,
  :func:`read_manifest`, :data:`MANIFEST`, :data:`OWNER`.
* Retention (:mod:`.retention`): :func:`scan_checkpoints`, :func:`step_folders`,
  :func:`select_victims`, :func:`delete_checkpoint`, :func:`prune_checkpoints`.
* The root lock (:mod:`.lock`): :class:`RootLock`.

Host memory (:mod:`.memory`) and the staging pool (:mod:`.staging`) serve the save and load
engines and are not re-exported (they import torch).
"""

from .commit import (MANIFEST, OWNER, clean_stale_temps, commit_dir, is_committed, make_temp_dir, read_manifest,
                     write_small_file)
from .io import (ALIGN, BACKENDS, DEFAULT_CHUNK_BYTES, FileWriter, PosixBackend, buffer_address, copy_file,
                 default_threads, fsync_dir, get_backend, read_exact, write_all)
from .lock import RootLock
from .store import (LOCAL, STRATEGIES, CommitStrategy, LocalStore, MarkerCommit, RenameCommit, Store, StorePath,
                    strategy)
from .locate import store_for
from .fsspec_store import FsspecStore
from .retention import (CheckpointScan, delete_checkpoint, prune_checkpoints, scan_checkpoints, select_victims,
                        step_folders)

__all__ = ["MANIFEST", "OWNER", "clean_stale_temps", "commit_dir", "is_committed", "make_temp_dir", "read_manifest",
           "write_small_file", "ALIGN", "BACKENDS", "DEFAULT_CHUNK_BYTES", "FileWriter", "PosixBackend",
           "buffer_address", "copy_file", "default_threads", "fsync_dir", "get_backend", "read_exact", "write_all",
           "RootLock", "CheckpointScan", "delete_checkpoint", "prune_checkpoints", "scan_checkpoints",
           "select_victims", "step_folders", "LOCAL", "STRATEGIES", "CommitStrategy", "LocalStore", "MarkerCommit",
           "RenameCommit", "Store", "StorePath", "strategy", "store_for", "FsspecStore"]
