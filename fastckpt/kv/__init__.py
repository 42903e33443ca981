"""The KV-cache chunk store: a folder of chunk files on the storage tier, shared by processes.

No LMCache import: :mod:`fastckpt.integrations.lmcache.backend` adapts it to LMCache.
:mod:`.chunk` holds the options, counters, open-chunk handle, names and checksums;
:mod:`.folder_index` the shared lock, counters, index and eviction; :mod:`.file_store` writes
and reads chunk files (its folder layout and rules). Bytes move through :mod:`fastckpt.storage`.
"""

from .chunk import ChunkHandle, KVStats, KVStoreOptions, chunk_name
from .file_store import KVFileStore
from .folder_index import audit

__all__ = ["ChunkHandle", "KVFileStore", "KVStats", "KVStoreOptions", "audit", "chunk_name"]
