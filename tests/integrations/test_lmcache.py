"""The fastckpt backend inside the real LMCacheEngine + StorageManager (LMCache 0.5.x, CPU).

Only the GPU connector is replaced, by :class:`CPUConnector` (a CPU tensor stands in for
the paged GPU KV cache). Process A stores the KV of a 1024-token prompt; a fresh process
B (empty CPU tier) retrieves it bit-exactly through our backend.

Needs ``lmcache`` (``pip install lmcache==0.5.6 torch==2.13.0``); skipped without it
unless ``FASTCKPT_REQUIRE_LMCACHE=1``, which turns the skip into a failure (CI).
This file is also the worker script: ``python tests/integrations/test_lmcache.py ROLE PATH ...``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

L, H, D, T, CHUNK = 8, 4, 64, 1024, 256  # 8 KiB of bf16 KV per token, 2 MiB per chunk
CHUNK_FILE_BYTES = 2 * L * CHUNK * H * D * 2 + 4096


def _ref(seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 30000, (T,), generator=g)
    kv = torch.randn(2, L, T, H * D, generator=g).to(torch.bfloat16)
    return tokens, kv


def _extra(path: str, **opts) -> dict:
    d = {"storage_plugin.fastckpt.module_path": "fastckpt.integrations.lmcache.backend",
         "storage_plugin.fastckpt.class_name": "FastCkptKVBackend",
         "storage_plugin.fastckpt.path": path, "storage_plugin.fastckpt.read_threads": 4,
         "storage_plugin.fastckpt.piece_bytes": 512 << 10}
    d.update({f"storage_plugin.fastckpt.{k}": v for k, v in opts.items()})
    return d


# ----- worker side (runs in a fresh process, or in the test process) -------------------------
def _engine(kv, extra=None, instance="fckv"):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface
    from lmcache.v1.metadata import LMCacheMetadata

    class CPUConnector(GPUConnectorInterface):
        """Copies between LMCache's KV_2LTD objects and a CPU [2, L, T, H*D] tensor."""

        def to_gpu(self, m, s, e, **kw):
            kv[:, :, s:e].copy_(m.tensor)

        def from_gpu(self, m, s, e, **kw):
            m.tensor.copy_(kv[:, :, s:e])

        def batched_to_gpu(self, ms, ss, es, **kw):
            for m, s, e in zip(ms, ss, es):
                self.to_gpu(m, s, e)

        def batched_from_gpu(self, ms, ss, es, **kw):
            for m, s, e in zip(ms, ss, es):
                self.from_gpu(m, s, e)

        def get_shape(self, n):
            return torch.Size([2, L, n, H * D])

    if extra is None:  # the documented env form: LMCACHE_STORAGE_PLUGINS + LMCACHE_EXTRA_CONFIG
        cfg = LMCacheEngineConfig.from_env()
    else:
        cfg = LMCacheEngineConfig.from_defaults(chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.25,
                                                storage_plugins=["fastckpt"], extra_config=extra)
    meta = LMCacheMetadata(model_name="org/model", world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=(L, 2, CHUNK, H, D))
    eng = LMCacheEngineBuilder.get_or_create(instance, cfg, meta, CPUConnector(), lambda *a: None,
                                             lambda *a: None)
    eng.post_init()
    return eng


def _close(eng, instance="fckv"):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    be = eng.storage_manager.storage_backends["fastckpt"]
    LMCacheEngineBuilder.destroy(instance)
    return be.stats()


def worker(role: str, path: str, seed: int, opts: dict) -> dict:
    """``store``: store prompt ``seed``; ``load``: retrieve it into zeros and compare."""
    tokens, ref = _ref(seed)
    extra = None if opts.pop("env_form", False) else _extra(path, **opts)
    kv = ref.clone() if role == "store" else torch.zeros_like(ref)
    eng = _engine(kv, extra)
    out = {"backends": list(eng.storage_manager.storage_backends)}
    if role == "store":
        eng.store(tokens)
    else:
        cpu = eng.storage_manager.storage_backends["LocalCPUBackend"]
        out["cpu_tier_hits_before"] = len(cpu.get_keys())
        out["lookup"] = eng.lookup(tokens)
        mask = eng.retrieve(tokens)
        out["retrieved"] = int(mask.sum())
        n = out["retrieved"]
        out["prefix_exact"] = bool(torch.equal(kv[:, :, :n], ref[:, :, :n]))
        out["rest_untouched"] = bool((kv[:, :, n:] == 0).all())
    out["stats"] = _close(eng)
    return out


def _run(role, path, seed=0, env=None, **opts) -> dict:
    e = dict(os.environ, PYTHONHASHSEED="0", **(env or {}))
    r = subprocess.run([sys.executable, __file__, role, str(path), str(seed), json.dumps(opts)],
                       capture_output=True, text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    res = worker(sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4]))
    print(json.dumps(res))
    sys.exit(0)


# ----- tests -------------------------------------------------------------------------------------
if os.environ.get("FASTCKPT_REQUIRE_LMCACHE") == "1":
    import lmcache  # noqa: F401  (an ImportError here fails CI instead of skipping)
else:
    pytest.importorskip("lmcache")


def _chunk_files(path):
    return sorted(os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".kv.safetensors"))


def test_process_b_retrieves_process_a_kv_bit_exact(tmp_path):
    kvdir = tmp_path / "kv"
    env = {"LMCACHE_CHUNK_SIZE": str(CHUNK), "LMCACHE_LOCAL_CPU": "true", "LMCACHE_MAX_LOCAL_CPU_SIZE": "0.25",
           "LMCACHE_STORAGE_PLUGINS": "fastckpt", "LMCACHE_EXTRA_CONFIG": json.dumps(_extra(str(kvdir)))}
    a = _run("store", kvdir, env=env, env_form=True)  # env form of the config
    assert "fastckpt" in a["backends"]
    assert a["stats"]["puts"] == T // CHUNK and a["stats"]["put_failures"] == 0
    files = _chunk_files(kvdir)
    assert len(files) == T // CHUNK
    assert a["stats"]["used_bytes"] == sum(os.path.getsize(f) for f in files) == 4 * CHUNK_FILE_BYTES

    b = _run("load", kvdir)  # fresh process, empty CPU tier, dict form of the config
    assert b["cpu_tier_hits_before"] == 0
    assert b["lookup"] == T and b["retrieved"] == T and b["prefix_exact"]
    assert b["stats"]["hits"] == T // CHUNK and b["stats"]["misses"] == 0
    assert b["stats"]["get_bytes"] == 4 * (CHUNK_FILE_BYTES - 4096)

    from safetensors.torch import load_file  # each chunk file is plain safetensors

    _, ref = _ref(0)
    chunks = [ref[:, :, s:s + CHUNK] for s in range(0, T, CHUNK)]
    for f in files:
        t = load_file(f)["kv.0"]
        assert sum(torch.equal(t, c) for c in chunks) == 1


def test_truncated_chunk_is_a_miss_and_the_prefix_before_it_still_loads(tmp_path):
    kvdir = tmp_path / "kv"
    _run("store", kvdir, seed=1)
    # The chunk holding tokens [512, 768): find it by content, then cut it short.
    from safetensors.torch import load_file

    _, ref = _ref(1)
    third = next(f for f in _chunk_files(kvdir) if torch.equal(load_file(f)["kv.0"], ref[:, :, 512:768]))
    with open(third, "r+b") as fh:
        fh.truncate(os.path.getsize(third) - 4096)
    b = _run("load", kvdir, seed=1)
    assert b["retrieved"] == 512 and b["prefix_exact"] and b["rest_untouched"]
    assert b["stats"]["corrupt_dropped"] == 1 and not os.path.exists(third)
    assert b["stats"]["used_bytes"] == sum(os.path.getsize(f) for f in _chunk_files(kvdir))


def test_restart_reuses_the_folder_and_evicts_within_a_shared_capacity(tmp_path):
    kvdir = tmp_path / "kv"
    cap = 6 * CHUNK_FILE_BYTES
    a = _run("store", kvdir, seed=2, max_bytes=cap)
    assert a["stats"]["puts"] == 4
    b = _run("store", kvdir, seed=3, max_bytes=cap, min_rescan_interval_s=0)  # restarted server
    assert b["stats"]["puts"] == 4 and b["stats"]["evictions"] == 2
    assert b["stats"]["used_bytes"] == sum(os.path.getsize(f) for f in _chunk_files(kvdir)) == cap
    c = _run("load", kvdir, seed=3, max_bytes=cap)
    assert c["retrieved"] == T and c["prefix_exact"]
    d = _run("load", kvdir, seed=2, max_bytes=cap)  # two of A's chunks were evicted
    assert d["retrieved"] < T and d["prefix_exact"] and d["stats"]["lookup_misses"] >= 1


def test_reads_run_in_parallel_and_refcounts_balance(tmp_path):
    import threading

    from fastckpt.kv.file_store import KVFileStore

    kvdir = str(tmp_path / "kv")
    tokens, ref = _ref(4)
    eng = _engine(ref.clone(), _extra(kvdir), instance="a")
    eng.store(tokens)
    _close(eng, "a")

    threads, real = set(), KVFileStore.read_piece

    def spy(self, *a, **k):
        threads.add(threading.get_ident())
        return real(self, *a, **k)

    KVFileStore.read_piece = spy
    try:
        kv = torch.zeros_like(ref)
        eng = _engine(kv, _extra(kvdir), instance="b")
        be = eng.storage_manager.storage_backends["fastckpt"]
        mask = eng.retrieve(tokens)
        assert int(mask.sum()) == T and torch.equal(kv, ref)
        assert len(threads) > 1 and threading.get_ident() not in threads
        # Every buffer we handed out went to the CPU tier (write-back) with one ref each.
        cpu = eng.storage_manager.storage_backends["LocalCPUBackend"]
        objs = [cpu.hot_cache[k] for k in cpu.get_keys()]
        assert len(objs) == T // CHUNK and all(o.get_ref_count() == 1 for o in objs)
        s = _close(eng, "b")
        assert s["hits"] == 4 and be.flush(1)
    finally:
        KVFileStore.read_piece = real
