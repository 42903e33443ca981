"""LMCache glue: :mod:`.backend` (the storage plugin ``FastCkptKVBackend``) and :mod:`.config`
(its options and the config check, ``python -m fastckpt.integrations.lmcache.config``); the chunk
files themselves are :mod:`fastckpt.kv`."""
