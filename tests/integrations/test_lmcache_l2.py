"""The fastckpt L2 adapter in LMCache's multiprocess (server) mode (LMCache 0.5.6, CPU).

* LMCache's own L2 adapter tests from its sdist (the ``L2AdapterInterface`` contract, the
  file-system adapter's tests, the StorageManager's L2 store/prefetch), re-pointed at ours
  through its plugin adapter by ``tests/integrations/lmcache_l2_suite/conftest.py``;
* the plugin JSON of ``docs/KV.md`` builds our adapter through LMCache's own parser and factory;
* end to end through LMCache's StorageManager: L1 -> our L2 -> a fresh server prefetches the
  same bytes (restart reuse);
* faults: a chunk failing its checksum is a miss (and is deleted), a full tier fails the store
  with the typed error while chunks are locked and evicts otherwise, a dead writer's temp file
  is never a hit, one capacity shared with the in-process plugin's store.

Runs inside the LMCache venv (``tests/integrations/test_lmcache_venv.py``); skipped without
LMCache unless ``FASTCKPT_REQUIRE_LMCACHE=1``. The sdist (9.4 MB) is read from
``$FASTCKPT_LMCACHE_SDIST`` or ``~/.cache/fastckpt/lmcache-sdist/``, else downloaded once from
the package index and checked against its sha256 (``pip download`` cannot fetch it: pip builds
the sdist's metadata, which needs CUDA).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import select
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import torch

if os.environ.get("FASTCKPT_REQUIRE_LMCACHE") == "1":
    import lmcache  # noqa: F401  (an ImportError here fails CI instead of skipping)
else:
    pytest.importorskip("lmcache.v1.distributed.l2_adapters")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.l2_adapters import create_l2_adapter  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config  # noqa: E402
from lmcache.v1.platform import consume_fd  # noqa: E402

from fastckpt.kv import audit  # noqa: E402
from fastckpt.kv.folder_index import TMP_RE  # noqa: E402
from fastckpt.storage.commit import host_tag  # noqa: E402
from fastckpt.integrations.lmcache.l2 import FastCkptL2Adapter  # noqa: E402
from fastckpt.kv import KVFileStore, KVStoreOptions, chunk_name  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SDIST = "lmcache-0.5.6.tar.gz"
SDIST_SHA256 = "d6951e60ce8818a76aa42d0866a4ba85f1c95cd919355fff30ff24dcc3243f1e"
SUITE = ["tests/__init__.py", "tests/v1/__init__.py", "tests/v1/distributed/__init__.py",
         "tests/v1/distributed/conftest.py", "tests/v1/distributed/utils.py",
         "tests/v1/distributed/test_mock_l2_adapter.py", "tests/v1/distributed/test_fs_l2_adapter_delete.py",
         "tests/v1/distributed/test_distributed_storage_manager.py"]
#: the mock's bandwidth simulation (a delay it injects on purpose) is not part of the contract
DESELECT = ["test_store_completion_is_delayed_by_bandwidth"]
#: tests of those files with LMCache 0.5.6, minus DESELECT: all must pass with our adapter
SUITE_PASSED = 81


def _sdist() -> Path:
    given = os.environ.get("FASTCKPT_LMCACHE_SDIST")
    if given:
        return Path(given)
    cache = Path(os.environ.get("FASTCKPT_LMCACHE_SDIST_DIR", Path.home() / ".cache/fastckpt/lmcache-sdist"))
    path = cache / SDIST
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        index = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple").rstrip("/") + "/lmcache/"
        page = urllib.request.urlopen(index, timeout=120).read().decode()
        href = next(h for h in re.findall(r'href="([^"]+)"', page) if SDIST in h)
        tmp = path.with_suffix(".part")
        urllib.request.urlretrieve(urllib.parse.urljoin(index, href.split("#")[0]), tmp)
        tmp.rename(path)
    got = hashlib.sha256(path.read_bytes()).hexdigest()
    assert got == SDIST_SHA256, f"{path}: sha256 {got}, expected {SDIST_SHA256} (LMCache 0.5.6's sdist)"
    return path


# ----- LMCache's own tests, re-pointed at ours -------------------------------------------------
def test_lmcache_l2_adapter_suite_passes_with_ours(tmp_path):
    work = tmp_path / "suite"
    with tarfile.open(_sdist()) as tf:
        for rel in SUITE:
            src = tf.extractfile(f"lmcache-0.5.6/{rel}")
            (work / rel).parent.mkdir(parents=True, exist_ok=True)
            (work / rel).write_bytes(src.read())
    shutil.copy(REPO / "tests/integrations/lmcache_l2_suite/conftest.py", work / "conftest.py")
    env = dict(os.environ, FASTCKPT_L2_SUITE_TMP=str(tmp_path))
    env.pop("PYTEST_ADDOPTS", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(work),
                        "--basetemp", str(tmp_path / "pt"), "-k", " and ".join(f"not {d}" for d in DESELECT),
                        *SUITE[5:]], cwd=work, env=env, capture_output=True, text=True, timeout=1200)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-6000:]
    assert f"{SUITE_PASSED} passed" in out and "failed" not in out and "skipped" not in out, out[-3000:]
    built = int(re.search(r"L2 adapters built through LMCache's plugin factory: (\d+)", out).group(1))
    assert built >= 50, out[-3000:]  # every adapter of the suite was ours


# ----- helpers ---------------------------------------------------------------------------------
class _Listener:
    def __init__(self):
        self.stored, self.accessed, self.deleted = [], [], []

    def on_l2_keys_stored(self, keys, sizes):
        self.stored.extend(zip(keys, sizes))

    def on_l2_keys_accessed(self, keys):
        self.accessed.extend(keys)

    def on_l2_keys_deleted(self, keys):
        self.deleted.extend(keys)


class _Buf:
    """A buffer like L1's: page-aligned (an mmap) unless ``aligned`` is False (a bytearray)."""

    def __init__(self, data: bytes, aligned: bool = True):
        if aligned:
            self.data = mmap.mmap(-1, max(1, len(data)))
            self.data[:len(data)] = data
            self.n = len(data)
        else:
            self.data, self.n = bytearray(data), len(data)

    @property
    def byte_array(self):
        return memoryview(self.data)[:self.n]


def _key(i: int) -> ObjectKey:
    return ObjectKey(chunk_hash=ObjectKey.IntHash2Bytes(i), model_name="org/model", kv_rank=0)


def _payload(i: int, n: int = 64 << 10) -> bytes:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i)).numpy().tobytes()


def _wait(fd: int, timeout: float = 10.0) -> None:
    p = select.poll()
    p.register(fd, select.POLLIN)
    assert p.poll(timeout * 1000), "task did not complete"
    try:
        consume_fd(fd)
    except BlockingIOError:
        pass


def _store(a, keys, bufs):
    tid = a.submit_store_task(keys, bufs)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done = a.pop_completed_store_tasks()
        if tid in done:
            return done[tid]
        time.sleep(0.01)
    raise AssertionError("store task did not complete")


def _poll(query, tid):
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        bm = query(tid)
        if bm is not None:
            return bm
        time.sleep(0.01)
    raise AssertionError("task did not complete")


def _lookup(a, keys):
    bm = _poll(a.query_lookup_and_lock_result, a.submit_lookup_and_lock_task(keys, {}))
    return [bm.test(i) for i in range(len(keys))]


def _load(a, keys, n, aligned=True):
    bufs = [_Buf(b"\0" * n, aligned) for _ in keys]
    bm = _poll(a.query_load_result, a.submit_load_task(keys, bufs))
    return [bytes(b.byte_array) if bm.test(i) else None for i, b in enumerate(bufs)]


def _adapter(path, **params) -> FastCkptL2Adapter:
    a = FastCkptL2Adapter({"path": str(path), **params})
    a.register_listener(_Listener())
    return a


# ----- configuration ---------------------------------------------------------------------------
def test_docs_plugin_json_builds_our_adapter(tmp_path):
    """The ``--l2-adapter`` JSON of docs/KV.md, through LMCache's own parser and plugin factory."""
    doc = (REPO / "docs/KV.md").read_text()
    raw = re.search(r"--l2-adapter '(\{.*?\})'", doc, re.S).group(1)
    spec = json.loads(raw)
    assert spec["type"] == "plugin" and spec["class_name"] == "FastCkptL2Adapter"
    spec["adapter_params"]["path"] = str(tmp_path / "kv")
    import argparse

    cfg = parse_args_to_l2_adapters_config(argparse.Namespace(l2_adapter=[json.dumps(spec)]))
    a = create_l2_adapter(cfg.adapters[0])
    try:
        assert isinstance(a, FastCkptL2Adapter)
        assert a.config.store.max_bytes == spec["adapter_params"]["max_bytes"]
        assert a.get_usage().total_capacity_bytes == spec["adapter_params"]["max_bytes"]
        assert a.report_status()["is_healthy"]
    finally:
        a.close()


def test_bad_adapter_params_name_the_key(tmp_path):
    with pytest.raises(ValueError, match=r"adapter_params\.max_bytes: expected an integer number of bytes.*'5GB'"):
        FastCkptL2Adapter({"path": str(tmp_path), "max_bytes": "5GB"})
    with pytest.raises(ValueError, match=r"adapter_params\.path is required"):
        FastCkptL2Adapter({})


# ----- end to end through LMCache's server storage manager --------------------------------------
def _storage_manager(path):
    from lmcache.v1.distributed.config import (
        EvictionConfig, L1ManagerConfig, L1MemoryManagerConfig, StorageManagerConfig,
    )
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
    from lmcache.v1.distributed.l2_adapters.plugin_l2_adapter import PluginL2AdapterConfig
    from lmcache.v1.distributed.storage_manager import StorageManager

    plugin = PluginL2AdapterConfig.from_dict({"module_path": "fastckpt.integrations.lmcache.l2",
                                              "class_name": "FastCkptL2Adapter",
                                              "adapter_params": {"path": str(path), "max_bytes": 64 << 20}})
    mem = L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20, align_bytes=4096)
    return StorageManager(StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(memory_config=mem, write_ttl_seconds=600, read_ttl_seconds=300),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=L2AdaptersConfig(adapters=[plugin])))


def _until(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return False


def _prefetch(sm, keys, layout) -> int:
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    h = sm.submit_prefetch_task(PrefetchTaskSpec(
        key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]))
    got = []
    assert _until(lambda: got.append(sm.query_prefetch_status(h)) or got[-1] is not None)
    return got[-1].hit_cells[0].count_leading_ones()


def test_storage_manager_stores_to_ours_and_a_fresh_server_prefetches_it(tmp_path):
    """L1 -> our L2 through LMCache's StorageManager; a second StorageManager (a restarted
    server: empty L1, a new adapter on the same folder) prefetches the same bytes from it."""
    layout = MemoryLayoutDesc(shapes=[torch.Size([2, 4, 256, 64])], dtypes=[torch.bfloat16])  # 256 KiB
    keys = [_key(i) for i in range(6)]
    want = {}
    sm = _storage_manager(tmp_path / "kv")
    try:
        objs = sm.reserve_write(keys, layout)
        assert len(objs) == len(keys)
        for i, k in enumerate(keys):
            t = torch.randn(layout.shapes[0], generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
            objs[k].tensor.copy_(t)
            want[k] = t
        sm.finish_write(keys)
        adapter = sm._l2_adapters[0]
        assert isinstance(adapter, FastCkptL2Adapter)
        assert _until(lambda: all(adapter.debug_has_key(k) and sm._l1_manager.is_key_evictable(k) for k in keys))
    finally:
        sm.close()
    files = [f for _, _, fs in os.walk(tmp_path / "kv") for f in fs if f.endswith(".kv.safetensors")]
    assert len(files) == len(keys)

    sm = _storage_manager(tmp_path / "kv")  # restart: nothing in L1
    try:
        assert _prefetch(sm, keys + [_key(99)], layout) == len(keys)
        with sm.read_prefetched_results(keys) as objs:
            assert objs is not None and len(objs) == len(keys)
            for k, o in zip(keys, objs):
                assert torch.equal(o.tensor.view(torch.bfloat16).view(layout.shapes[0]), want[k]), k
        sm.finish_read_prefetched(keys)
    finally:
        sm.close()


# ----- faults ----------------------------------------------------------------------------------
def _data_file(path, key):
    name = chunk_name(FastCkptL2Adapter._key_string(key))
    return Path(path) / name[:2] / f"{name}.kv.safetensors"


@pytest.mark.parametrize("piece_bytes,piece,aligned", [(4 << 20, 0, True), (4096, 5, True), (4096, 5, False)])
def test_checksum_failed_chunk_is_a_miss_and_is_dropped(tmp_path, piece_bytes, piece, aligned):
    """One flipped data byte: in the only piece, or in piece 5 of 16; loads of one chunk into an
    aligned buffer (header and data in one O_DIRECT read) and of two chunks or into an unaligned
    buffer (header, then spans of 8 pieces)."""
    a = _adapter(tmp_path, piece_bytes=piece_bytes)
    try:
        k1, k2 = _key(1), _key(2)
        assert _store(a, [k1, k2], [_Buf(_payload(1)), _Buf(_payload(2))]).is_successful()
        f = _data_file(tmp_path, k1)
        raw = bytearray(f.read_bytes())
        raw[4096 + piece * min(piece_bytes, 64 << 10) + 7] ^= 0xFF  # one byte of the data region (after the header)
        f.write_bytes(raw)
        assert _load(a, [k2], 64 << 10, aligned) == [_payload(2)]
        got = _load(a, [k1], 64 << 10, aligned) + _load(a, [k1, k2], 64 << 10, aligned)
        assert got[0] is None and got[1] is None and got[2] == _payload(2)  # a miss; the good one loads
        assert a.report_status()["corrupt_dropped"] == 1
        assert not f.exists() and a.report_status()["corrupt_dropped"] == 1
        assert _lookup(a, [k1, k2]) == [False, True]
        assert audit(str(tmp_path))["counter"] == audit(str(tmp_path))["disk"]
        # LMCache's listeners learn of the dropped chunk: its usage counted it forever (a KV-tier probe)
        assert a._listeners[0].deleted == [k1] and a.get_usage().total_bytes_used == 64 << 10
    finally:
        a.close()


def test_full_tier_fails_the_store_with_the_typed_error_then_evicts(tmp_path):
    n = 64 << 10
    per_file = n + 4096  # data + the 4096-byte header
    a = _adapter(tmp_path, max_bytes=2 * per_file)
    listener = a._listeners[0]
    try:
        k1, k2, k3 = _key(1), _key(2), _key(3)
        assert _store(a, [k1], [_Buf(_payload(1))]).is_successful()  # one by one: k1 is the LRU
        assert _store(a, [k2], [_Buf(_payload(2))]).is_successful()
        assert _lookup(a, [k1, k2]) == [True, True]  # locked: not evictable
        res = _store(a, [k3], [_Buf(_payload(3))])
        assert not res.is_successful()
        err = a.report_status()["last_store_error"]
        assert err.startswith("InsufficientSpaceError") and str(2 * per_file) in err, err
        assert _lookup(a, [k3]) == [False]
        a.submit_unlock([k1, k2])
        assert _store(a, [k3], [_Buf(_payload(3))]).is_successful()  # evicts the least recently used
        assert [k for k in (k1, k2) if k in listener.deleted] == [k1]
        assert _lookup(a, [k1, k2, k3]) == [False, True, True]
        assert _load(a, [k3], n) == [_payload(3)]
        st = audit(str(tmp_path))
        assert st["counter"] == st["disk"] <= 2 * per_file
        assert a.get_usage().total_bytes_used == 2 * n
    finally:
        a.close()


def test_restart_reuse_dead_writer_and_capacity_shared_with_the_in_process_store(tmp_path):
    n = 64 << 10
    per_file = n + 4096
    a = _adapter(tmp_path, max_bytes=3 * per_file)
    assert _store(a, [_key(1)], [_Buf(_payload(1))]).is_successful()
    a.close()
    # a writer killed mid-chunk: its temp file (a pid that is gone) is never a hit
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    stale = Path(tmp_path) / "ab" / f".tmp.{'ab' * 16}.{host_tag()}.{child.pid}.00"
    assert TMP_RE.match(stale.name)
    stale.parent.mkdir(exist_ok=True)
    stale.write_bytes(b"x" * 1000)
    # the in-process plugin's store puts a chunk of its own into the same folder
    other = KVFileStore(KVStoreOptions(path=str(tmp_path), max_bytes=3 * per_file))
    key = "vllm@1@0@abc@bfloat16"
    other.write(chunk_name(key), key, "KV_2LTD", [("U8", (n,), n)], memoryview(_payload(7)))
    other.close()

    a = _adapter(tmp_path, max_bytes=3 * per_file)  # restart
    try:
        assert not stale.exists()  # the dead writer's temp file was removed by the start scan
        assert _lookup(a, [_key(1)]) == [True] and _load(a, [_key(1)], n) == [_payload(1)]
        a.submit_unlock([_key(1)])
        assert a.report_status()["used_bytes"] == 2 * per_file  # ours + the in-process store's chunk
        # two more chunks: the capacity (3 files) is shared, so the least recently used one goes
        assert _store(a, [_key(2), _key(3)], [_Buf(_payload(2)), _Buf(_payload(3))]).is_successful()
        st = audit(str(tmp_path))
        assert st["counter"] == st["disk"] == 3 * per_file and st["temps"] == 0
        assert not os.path.exists(other.path_for(chunk_name(key)))  # the older, never-read chunk was evicted
        assert _lookup(a, [_key(1), _key(2), _key(3)]) == [True, True, True]
    finally:
        a.close()


def test_evictions_for_the_tier_budget_are_reported_to_lmcache(tmp_path, monkeypatch):
    """Chunks evicted to fit the tier's shared budget (a put over it, or a checkpoint needing room)
    were never reported: get_usage() showed 3 chunks while 2 were on disk (an LMCache KV-tier probe)."""
    n = 64 << 10
    (tmp_path / "tier").mkdir()
    monkeypatch.setenv("FASTCKPT_TIER_DIR", str(tmp_path / "tier"))  # a tier of this test's own
    monkeypatch.delenv("FASTCKPT_TIER", raising=False)
    monkeypatch.setenv("FASTCKPT_TIER_BUDGET_BYTES", str(2 * (n + 4096)))
    a = _adapter(tmp_path / "kv")
    listener = a._listeners[0]
    try:
        keys = [_key(i) for i in (1, 2, 3)]
        for i, k in enumerate(keys):
            assert _store(a, [k], [_Buf(_payload(i + 1))]).is_successful()
        present = _lookup(a, keys)
        a.submit_unlock([k for k, p in zip(keys, present) if p])
        assert present.count(True) == 2
        gone = [k for k, p in zip(keys, present) if not p]
        assert listener.deleted == gone
        assert a.get_usage().total_bytes_used == 2 * n
    finally:
        a.close()


def test_eviction_for_a_checkpoint_reaches_lmcache_at_once(tmp_path):
    """The tier arbiter calls the store's evictor (from its heartbeat thread) when a checkpoint needs room:
    LMCache's listeners heard of those chunks only at the adapter's next task, get_usage() meanwhile
    counting chunks gone from disk (a fresh-user trial: 20 chunks reported, 11 on disk)."""
    n = 64 << 10
    a = _adapter(tmp_path / "kv")
    listener = a._listeners[0]
    try:
        keys = [_key(i) for i in (1, 2, 3)]
        for i, k in enumerate(keys):
            assert _store(a, [k], [_Buf(_payload(i + 1, n))]).is_successful()
        assert a.get_usage().total_bytes_used == 3 * n
        freed = a.store.evict_for_tier(2 * n)  # what the tier's heartbeat calls; no adapter task after it
        assert freed >= 2 * n
        on_disk = [k for k in keys if a.store.contains(a._name(k))]
        assert len(on_disk) == 1 and sorted(map(str, listener.deleted)) == sorted(str(k) for k in keys if k not in on_disk)
        assert a.get_usage().total_bytes_used == n
    finally:
        a.close()


def test_lookup_counters_count_the_l2_lookups(tmp_path):
    """report_status() gave lookup_hits = lookup_misses = 0 after L2 lookups (a fresh-user trial)."""
    a = _adapter(tmp_path / "kv")
    try:
        assert _store(a, [_key(1)], [_Buf(_payload(1))]).is_successful()
        present = _lookup(a, [_key(1), _key(2), _key(3)])
        a.submit_unlock([_key(1)])
        assert present == [True, False, False]
        st = a.report_status()
        assert (st["lookup_hits"], st["lookup_misses"]) == (1, 2), st
    finally:
        a.close()


# ----- what LMCache is told: its listeners and get_usage() follow the chunks on disk (an L2 probe) ------
class _Ordered:
    """A listener keeping every notice in order: ('stored' | 'deleted', ObjectKey)."""

    def __init__(self):
        self.events = []

    def on_l2_keys_stored(self, keys, sizes):
        self.events += [("stored", k) for k in keys]

    def on_l2_keys_accessed(self, keys):
        pass

    def on_l2_keys_deleted(self, keys):
        self.events += [("deleted", k) for k in keys]

    def present(self) -> set:
        out = set()
        for ev, k in self.events:
            (out.add if ev == "stored" else out.discard)(k)
        return out


def _told_matches_disk(a, listener, keys, n) -> None:
    """What the listener was told (before any lookup, which may repair it) is what the folder holds."""
    told = listener.present()
    on_disk = {k for k in keys if a.debug_has_key(k)}
    assert told == on_disk, (f"told stored but gone: {len(told - on_disk)}, on disk but not told: "
                             f"{len(on_disk - told)}", listener.events)
    assert a.get_usage().total_bytes_used == len(on_disk) * n


def test_a_task_evicting_its_own_earlier_key_never_reports_it_stored(tmp_path):
    """One task of 3 keys, room for 2: the third evicts the first. LMCache was told 'deleted k0' then
    'stored k0, k1, k2' (k0 a ghost: usage 3 chunks, 2 on disk)."""
    n = 256 << 10
    a = FastCkptL2Adapter({"path": str(tmp_path / "kv"), "max_bytes": 2 * (n + 4096), "write_threads": 1,
                           "read_threads": 1})  # one write at a time: the third evicts the first
    lis = _Ordered()
    a.register_listener(lis)
    try:
        keys = [_key(i) for i in range(3)]
        assert _store(a, keys, [_Buf(_payload(i, n)) for i in range(3)]).is_successful()
        _told_matches_disk(a, lis, keys, n)
        assert lis.present() == set(keys[1:])
    finally:
        a.close()


def test_concurrent_store_tasks_under_a_full_folder_report_every_eviction(tmp_path):
    """40 one-key tasks, 4 writers, room for 3: a chunk evicted by another task before its own task
    ended was never reported deleted (16-25 ghost keys a round before the fix)."""
    n = 256 << 10
    for r in range(2):
        a = FastCkptL2Adapter({"path": str(tmp_path / f"kv{r}"), "max_bytes": 3 * (n + 4096), "write_threads": 4,
                               "read_threads": 4, "durable": False})
        lis = _Ordered()
        a.register_listener(lis)
        try:
            keys = [_key(1000 * r + i) for i in range(40)]
            bufs = [_Buf(_payload(i, n)) for i in range(40)]
            tids = {a.submit_store_task([k], [b]) for k, b in zip(keys, bufs)}
            deadline = time.monotonic() + 60
            while tids and time.monotonic() < deadline:
                tids -= set(a.pop_completed_store_tasks())
                time.sleep(0.005)
            assert not tids, "store tasks did not complete"
            _told_matches_disk(a, lis, keys, n)
        finally:
            a.close()


def test_chunks_another_server_evicted_are_reported_by_lookup_and_delete(tmp_path):
    """Two servers on one folder and one max_bytes (docs/KV.md): B's stores evict A's chunks. A was
    never told and its usage stayed 'full' for good; A.delete() of those keys notified nothing."""
    n = 256 << 10
    opts = {"path": str(tmp_path / "kv"), "max_bytes": 4 * (n + 4096)}
    a, b = FastCkptL2Adapter(opts), FastCkptL2Adapter(opts)
    la = _Ordered()
    a.register_listener(la)
    try:
        mine = [_key(i) for i in range(4)]
        assert _store(a, mine, [_Buf(_payload(i, n)) for i in range(4)]).is_successful()
        assert _store(b, [_key(100 + i) for i in range(4)], [_Buf(_payload(i, n)) for i in range(4)]).is_successful()
        assert not any(a.debug_has_key(k) for k in mine)
        assert _lookup(a, mine[:2]) == [False, False]  # a lookup finds two of them gone
        assert la.present() == set(mine[2:]) and a.get_usage().total_bytes_used == 2 * n
        a.delete(mine[2:])  # LMCache's eviction deletes the others: reported although B removed the files
        assert la.present() == set() and a.get_usage().total_bytes_used == 0
    finally:
        a.close()
        b.close()
